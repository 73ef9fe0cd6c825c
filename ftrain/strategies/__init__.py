"""Strategies (`ft.strategies`): how a step is placed on devices and data-parallel ranks."""

from ftrain.strategies._base import SingleDevice as SingleDevice
from ftrain.strategies._base import Strategy as Strategy
from ftrain.strategies._base import bare_module as bare_module
from ftrain.strategies._base import default_device as default_device
from ftrain.strategies._base import local_grad_norm as local_grad_norm
from ftrain.strategies._ddp import DDP as DDP
from ftrain.strategies._env import from_env as from_env
from ftrain.strategies._env import refuse_lone_process as refuse_lone_process
from ftrain.strategies._fsdp import FSDP as FSDP
from ftrain.strategies._group import await_collective as await_collective
from ftrain.strategies._group import collective_seconds as collective_seconds
from ftrain.strategies._placement import gather_whole as gather_whole
from ftrain.strategies._placement import is_distributed as is_distributed
from ftrain.strategies._placement import local_part as local_part
from ftrain.strategies._placement import local_view as local_view
from ftrain.strategies._placement import local_views as local_views
from ftrain.strategies._preempt import Preemption as Preemption
from ftrain.strategies._preempt import active as active_preemption
from ftrain.strategies._preempt import on_preemption as on_preemption
from ftrain.strategies._tp import TP as TP

__all__ = [
    "DDP",
    "FSDP",
    "TP",
    "Preemption",
    "SingleDevice",
    "Strategy",
    "active_preemption",
    "bare_module",
    "await_collective",
    "collective_seconds",
    "default_device",
    "from_env",
    "gather_whole",
    "is_distributed",
    "local_part",
    "local_view",
    "local_views",
    "local_grad_norm",
    "on_preemption",
    "refuse_lone_process",
]
