"""What the modules of `ft.func` share: the error type, the model check, the loss as a module,
and the checks of numeric arguments."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ftrain.losses import LossFn

__all__ = [
    "FuncError",
    "check_int",
    "check_model",
    "check_number",
    "check_per_example",
    "is_number",
]


class FuncError(RuntimeError):
    """A model or loss that `torch.func` cannot transform over examples (see docs/research.md)."""


class _LossModule(nn.Module):
    """`loss_fn(model, batch)` as a module, so `functional_call` swaps the model's parameters for
    the whole loss, whatever submodules or attributes the loss reaches."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss_fn(self.model, batch)


def check_model(model: nn.Module) -> None:
    """Raise `FuncError` for modules whose per-example gradients are not defined.

    Batch norm in training mode normalises with the statistics of the whole batch (so one
    example's loss depends on the others) and writes running statistics in place.
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            raise FuncError(
                f"{name or 'the model'} is {type(m).__name__} in training mode: it mixes the "
                "examples of a batch, so per-example gradients are not defined. Put it alone "
                f"in eval mode (model.train(); model.get_submodule({name!r}).eval(): "
                "private_grads, like accumulate_grads, puts a model in eval mode as a whole in "
                "training mode) or replace it by GroupNorm/LayerNorm "
                "(opacus.validators.ModuleValidator.fix does that)"
            )


def check_per_example(model: nn.Module) -> None:
    """`check_model`, and refuse batch norm that normalises with the batch's statistics in eval
    mode too (`track_running_stats=False`): one example alone is then normalised by its own
    statistics, so its gradient is not its part of the batch's (nor what Opacus refuses)."""
    check_model(model)
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is None:
            raise FuncError(
                f"{name or 'the model'} is {type(m).__name__} without running statistics "
                "(track_running_stats=False): it normalises with the batch's statistics in eval "
                "mode too, so it mixes the examples of a batch and per-example gradients are "
                "not defined. Replace it by GroupNorm/LayerNorm "
                "(opacus.validators.ModuleValidator.fix does that)"
            )


def is_number(value: Any) -> bool:
    """A finite real number; a bool is not one (`True` is not 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(name: str, value: Any, *, positive: bool = False, below: float = math.inf) -> None:
    """Raise naming `name` unless `value` is a finite number >= 0 (> 0 if `positive`), < `below`."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    if not (is_number(value) and (value > 0 if positive else value >= 0) and value < below):
        bound = "> 0" if positive else ">= 0"
        bound += "" if below == math.inf else f" and < {below}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def check_int(name: str, value: Any, *, low: int) -> None:
    """Raise naming `name` unless `value` is an int (not a bool) >= `low`."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
