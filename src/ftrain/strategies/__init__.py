"""Strategies (`ft.strategies`): how a step is placed on devices and data-parallel ranks."""

from ftrain.strategies._base import SingleDevice as SingleDevice
from ftrain.strategies._base import Strategy as Strategy
from ftrain.strategies._base import default_device as default_device

__all__ = ["SingleDevice", "Strategy", "default_device"]
