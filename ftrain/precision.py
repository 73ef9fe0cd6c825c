"""Mixed precision: an autocast dtype, and dynamic loss scaling for float16.

Parameters, gradients and optimizer state stay float32 (the "master weights"); only the
forward pass runs in the lower precision, under `torch.autocast`. For float16, whose range is
small, the loss is multiplied by a scale before backward so that small gradients do not flush
to zero; the gradients are divided by it again in `accumulate_grads`, and a non-finite gradient
skips the update and halves the scale. The scale and its growth counter are 0-dim tensors in
`TrainState` (`loss_scale`, `growth_tracker`), so they are checkpointed with the counters and
updated on the device without a host sync, the way `torch.amp.GradScaler` does it.

A strategy carries the policy: `SingleDevice(precision="bf16")`, `DDP(precision="fp16")`, ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["LossScaling", "Precision", "update_loss_scale"]

# The context of a step part that needs none (full precision, no gradient sync to skip): one
# shared instance, stateless and reentrant (a new one per micro-batch was a Python call a
# context, issue 30).
NO_CONTEXT: contextlib.nullcontext[None] = contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling with `torch.amp.GradScaler`'s rule and defaults.

    The scale starts at `init_scale`; a step whose gradient is not finite is skipped and
    multiplies the scale by `backoff_factor`; after `growth_interval` finite steps in a row the
    scale is multiplied by `growth_factor`.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        # Finite numbers, and True is not 1: an infinite scale (or growth to one) makes every
        # gradient overflow, so every step would be skipped.
        _finite("init_scale", self.init_scale, lambda v: v > 0, "> 0")
        # The scale is a float32 tensor: beyond its range it is inf (every step overflows and
        # is skipped, and inf * backoff stays inf) or 0 (every gradient is 0 / 0): training
        # would stop while the loop runs on.
        if not _F32.tiny <= self.init_scale <= _F32.max:
            raise ValueError(
                f"init_scale must be within float32's normal range [{_F32.tiny:.3g}, "
                f"{_F32.max:.3g}] (the scale is a float32 tensor), got {self.init_scale!r}"
            )
        _finite("growth_factor", self.growth_factor, lambda v: v > 1, "> 1")
        _finite("backoff_factor", self.backoff_factor, lambda v: 0 < v < 1, "in (0, 1)")
        if type(self.growth_interval) is not int or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {self.growth_interval!r}")


_F32 = torch.finfo(torch.float32)


def _finite(name: str, value: Any, ok: Callable[[float], bool], want: str) -> None:
    """Refuse `value` unless it is a finite Python number (not a bool) satisfying `ok`."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and ok(value)):
        raise ValueError(f"{name} must be a finite number {want}, got {value!r}")


_NAMES: Mapping[str, torch.dtype | None] = MappingProxyType(
    {
        "fp32": None,
        "no": None,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }
)


# `Precision`'s default loss scaling: LossScaling() for float16, None otherwise (typed Any: the
# field holds a LossScaling or None once built).
_AUTO: Any = "auto"


@dataclasses.dataclass(frozen=True)
class Precision:
    """What a strategy's forward pass computes in, and whether the loss is scaled.

    Build it from a name with `Precision.of`: "fp32" (or "no", or None) is full precision,
    "bf16" autocasts to bfloat16, "fp16" autocasts to float16 with `LossScaling()`.
    `loss_scaling="auto"` (the default) is `LossScaling()` for float16 and None otherwise, so
    `Precision(torch.float16)` scales its loss as "fp16" does (without, small gradients flush
    to zero in float16); pass `loss_scaling=None` to train float16 without it.

    Example:
        >>> import torch, ftrain as ft
        >>> ft.precision.Precision.of("bf16")
        Precision(dtype=torch.bfloat16, loss_scaling=None)
        >>> ft.precision.Precision(torch.float16) == ft.precision.Precision.of("fp16")
        True
    """

    dtype: torch.dtype | None = None
    loss_scaling: LossScaling | None = _AUTO  # replaced in __post_init__

    def __post_init__(self) -> None:
        if self.dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be None, bfloat16 or float16, got {self.dtype}")
        if isinstance(self.loss_scaling, str) and self.loss_scaling == _AUTO:
            auto = LossScaling() if self.dtype == torch.float16 else None
            object.__setattr__(self, "loss_scaling", auto)
        if self.loss_scaling is not None and not isinstance(self.loss_scaling, LossScaling):
            raise TypeError(
                f"loss_scaling must be 'auto', None or a LossScaling, got {self.loss_scaling!r}"
            )

    @classmethod
    def of(cls, value: str | Precision | None) -> Precision:
        """The policy named by `value` ("fp32", "bf16", "fp16"; a `Precision` is returned as is).

        Raises:
            ValueError: for an unknown name.
        """
        if isinstance(value, Precision):
            return value
        if value is None:
            return cls()
        if not isinstance(value, str) or value not in _NAMES:
            raise ValueError(
                f"precision must be one of {sorted(_NAMES)} or a Precision, got {value!r}"
            )
        dtype = _NAMES[value]
        return cls(dtype, LossScaling() if dtype == torch.float16 else None)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """`torch.autocast` to `dtype` on `device`'s type, or a no-op at full precision."""
        if self.dtype is None:
            return NO_CONTEXT
        return torch.autocast(device.type, dtype=self.dtype)


def update_loss_scale(
    scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor, rule: LossScaling
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next `(scale, growth_tracker)` after a step; `found_inf` is 1.0 when it overflowed.

    Pure (the inputs are not modified) and on the device: no host sync. Same rule as
    `torch.amp.GradScaler.update`.
    """
    scale, growth_tracker = scale.clone(), growth_tracker.clone()
    torch._amp_update_scale_(
        scale,
        growth_tracker,
        found_inf.to(scale.dtype),
        rule.growth_factor,
        rule.backoff_factor,
        rule.growth_interval,
    )
    return scale, growth_tracker
