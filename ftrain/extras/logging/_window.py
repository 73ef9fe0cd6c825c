"""Log windows: what happened between two log records, kept on the device until one is emitted.

`window(state)` opens one, `update(window, stats, info)` folds a step in (device arithmetic only,
no host sync), `emit(window, state)` reads everything back in one sync and returns the record
and a fresh window (`ft.logging.Logger` does all three, and the sinks, in one call per step).
Definitions follow HF's Trainer so that curves compare:

- `loss`: mean of the per-step losses since the last log (each step's loss is the global
  per-item mean of that step). A non-finite step loss is replaced, as HF's
  `logging_nan_inf_filter` does, by the window's sum so far divided by the steps so far + 1.
- `learning_rate`: the lr the last step used (as transformers 5's Trainer logs it: it reads the
  scheduler's lr before stepping the scheduler).
- `grad_norm`: the last step's pre-clip global norm.
- `epoch`: fractional, `epoch + cursor / epoch_size` when `epoch_size` (micro-batches per epoch,
  `ft.data.num_micro_batches`) is given.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ftrain.extras.logging._perf import peak_memory_mb
from ftrain.grads import Stats
from ftrain.state import TrainState
from ftrain.step import StepInfo
from ftrain.strategies import SingleDevice

__all__ = ["LogWindow", "emit", "update", "window"]


class LogWindow(NamedTuple):
    """Steps folded in since the last record. Tensors stay on the training device."""

    loss_sum: torch.Tensor
    steps: int
    skipped: torch.Tensor
    grad_norm: torch.Tensor | None
    lr: float | None
    start_time: float
    start_tokens: torch.Tensor
    start_samples: torch.Tensor


def window(state: TrainState) -> LogWindow:
    """Open an empty window at `state` (call it where training starts or resumes).

    Example:
        >>> import torch, ftrain as ft
        >>> w = ft.logging.window(ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()))
        >>> w.steps
        0
    """
    device = state.data.tokens_seen.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return LogWindow(
        loss_sum=zero,
        steps=0,
        skipped=torch.zeros((), dtype=torch.int64, device=device),
        grad_norm=None,
        lr=None,
        start_time=time.perf_counter(),
        start_tokens=state.data.tokens_seen,
        start_samples=state.data.samples_seen,
    )


def update(w: LogWindow, stats: Stats, info: StepInfo) -> LogWindow:
    """Fold one step into the window; device arithmetic only (no host sync)."""
    loss = stats.loss.detach().to(torch.float64)
    # HF's logging_nan_inf_filter, computed on the device.
    filtered = torch.where(torch.isfinite(loss), loss, w.loss_sum / (w.steps + 1))
    return w._replace(
        loss_sum=w.loss_sum + filtered,
        steps=w.steps + 1,
        skipped=w.skipped + info.skipped,  # int64 + bool stays int64: no cast op
        grad_norm=info.grad_norm.detach(),
        lr=info.lr,
    )


def emit(
    w: LogWindow,
    state: TrainState,
    *,
    epoch_size: int | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
) -> tuple[dict[str, Any], LogWindow]:
    """Read the window back (one host sync) as a log record; return it and a fresh window.

    Args:
        w: the window since the last record.
        state: the state after the last step folded in.
        epoch_size: micro-batches per epoch, for a fractional `epoch`.
        flops_per_token: e.g. `ft.logging.flops_per_token(model)`; adds `flops_per_second`.
        peak_flops: one device's peak FLOP/s; adds `mfu` (needs `flops_per_token`): the
            run's FLOP/s over the peak of all its devices, `peak_flops` times the job's
            processes (one device each) under a distributed strategy, since `tokens_seen`
            counts every rank's tokens.

    Returns:
        `(record, new_window)`. The record holds `step`, `epoch`, `loss`, `learning_rate`,
        `grad_norm`, `tokens_per_second`, `samples_per_second`, `tokens_seen`,
        `samples_seen`, `skipped_steps`, `peak_memory_mb`, and the FLOP figures when asked.

    Raises:
        ValueError: if the window holds no step, for an `epoch_size` < 1, or for `peak_flops`
            without `flops_per_token` (it would be ignored).
    """
    if w.steps == 0:
        raise ValueError("emit needs at least one update since the window was opened")
    _check_emit_args(epoch_size, flops_per_token, peak_flops)
    norm = w.grad_norm if w.grad_norm is not None else torch.full_like(w.loss_sum, math.nan)
    parts = [w.loss_sum, w.skipped, norm, state.data.tokens_seen, state.data.samples_seen]
    parts += [w.start_tokens, w.start_samples]
    loss_sum, skipped, grad_norm, tokens, samples, tokens0, samples0 = torch.stack(
        [p.to(torch.float64) for p in parts]
    ).tolist()  # the one host sync of a log step
    elapsed = max(time.perf_counter() - w.start_time, 1e-9)
    epoch = float(state.epoch)
    if epoch_size is not None:
        epoch += state.data.cursor / epoch_size
    record: dict[str, Any] = {
        "step": state.step,
        "epoch": round(epoch, 4),
        "loss": loss_sum / w.steps,
        "learning_rate": w.lr,
        "grad_norm": grad_norm,
        "tokens_per_second": (tokens - tokens0) / elapsed,
        "samples_per_second": (samples - samples0) / elapsed,
        "tokens_seen": int(tokens),
        "samples_seen": int(samples),
        "skipped_steps": int(skipped),
        "peak_memory_mb": peak_memory_mb(state.data.tokens_seen.device),
    }
    if flops_per_token is not None:
        record["flops_per_second"] = flops_per_token * record["tokens_per_second"]
        if peak_flops is not None:
            record["mfu"] = record["flops_per_second"] / (peak_flops * _devices(state.strategy))
    return record, window(state)


def _devices(strategy: Any) -> int:
    """The devices that train together: every process of the job under a distributed
    strategy (the tokens counted are all of theirs), one under `SingleDevice` (a process group
    of independent runs counts its own tokens)."""
    if isinstance(strategy, SingleDevice) or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _check_emit_args(
    epoch_size: int | None, flops_per_token: float | None, peak_flops: float | None
) -> None:
    if epoch_size is not None and (
        isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or epoch_size < 1
    ):
        raise ValueError(f"epoch_size must be an int >= 1 or None, got {epoch_size!r}")
    # A negative, NaN or boolean figure made every flops_per_second and mfu meaningless.
    if flops_per_token is not None and not _positive(flops_per_token):
        raise ValueError(
            f"flops_per_token must be a finite number > 0 or None, got {flops_per_token!r}"
        )
    if peak_flops is not None and (flops_per_token is None or not _positive(peak_flops)):
        raise ValueError(
            f"peak_flops={peak_flops!r} needs flops_per_token and a finite value > 0 (mfu is "
            "flops_per_token * tokens_per_second / peak_flops)"
        )


def _positive(value: Any) -> bool:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return real and math.isfinite(value) and value > 0
