"""clip_and_step: global-norm clipping, the optimizer update, and the step counters."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from ftrain.checkpoint._save import raise_pending_save_error
from ftrain.grads import Stats
from ftrain.precision import update_loss_scale
from ftrain.state import TrainState, snapshot

__all__ = ["StepInfo", "clip_and_step"]


class StepInfo(NamedTuple):
    """What one `clip_and_step` did: `grad_norm` (pre-clip, device tensor), `skipped` (device
    bool: the update was skipped because the gradient was not finite) and the `lr` used."""

    grad_norm: torch.Tensor
    skipped: torch.Tensor
    lr: float


def _validate(lr: float, max_norm: float | None) -> None:
    if isinstance(lr, torch.Tensor) or not isinstance(lr, (int, float)):
        raise TypeError(f"lr must be a Python number (e.g. schedule(state.step)), got {lr!r}")
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be finite and >= 0, got {lr!r}")
    if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"max_norm must be a number > 0 or None, got {max_norm!r}")


def clip_and_step(
    state: TrainState,
    grads: Mapping[str, torch.Tensor],
    *,
    lr: float,
    max_norm: float | None = None,
    stats: Stats | None = None,
    skip_nonfinite: bool = True,
    donate: bool = True,
) -> tuple[TrainState, StepInfo]:
    """Clip `grads` to a global norm, apply the optimizer, and advance the counters.

    Clipping equals `torch.nn.utils.clip_grad_norm_` (coefficient `max_norm / (norm + 1e-6)`,
    at most 1) with the norm taken across shards and ranks by the strategy. A non-finite norm
    skips the update on the device, without a host sync; `step` still advances (as in HF
    Trainer) and `info.skipped` says so. `cursor`, `tokens_seen` and `samples_seen` advance by
    `stats` when given (a stream's `stats.position` goes to `state.data_position`, which rides
    on `state.cursor`: docs/data.md). With float16 loss scaling, an overflow always skips the
    update and `loss_scale`/`growth_tracker` advance by `torch.amp.GradScaler`'s rule
    (`ft.precision`).

    Args:
        state: consumed unless `donate=False`.
        grads: from `accumulate_grads`; modified in place by clipping.
        lr: learning rate of this update, e.g. `schedule(state.step)`.
        max_norm: clip threshold; None measures the norm without clipping.
        stats: the `Stats` of this step, to advance the data counters.
        skip_nonfinite: skip the update when the gradient norm is inf or NaN (always on with
            loss scaling).
        donate: update in place and consume `state`; False snapshots it first so it stays valid.

    Returns:
        `(new_state, StepInfo)`.

    Raises:
        TypeError, ValueError: for a bad `lr` or `max_norm`, or a state whose loss scale does
            not match its strategy's precision.
        ConsumedStateError: if `state` was already consumed.
        CheckpointError: if a background (`blocking=False`) save has failed since the last call.
    """
    _validate(lr, max_norm)
    raise_pending_save_error()  # a failed background save surfaces here, one step later
    if not donate:
        state = snapshot(state)
    params, strategy = state.params, state.strategy
    scaling = strategy.precision.loss_scaling
    if (scaling is None) != (state.loss_scale is None):
        raise ValueError(
            "the strategy's loss scaling and state.loss_scale disagree: create the state with "
            "the strategy that trains it (TrainState.create(..., strategy=...))"
        )
    g = list(grads.values())
    with torch.no_grad():
        norm = strategy.grad_norm(g)
        # With loss scaling an overflow is expected now and then: always skip it.
        check = skip_nonfinite or scaling is not None
        found_inf = (~torch.isfinite(norm)).float() if check else None
        if max_norm is not None and g:
            torch._foreach_mul_(g, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        opt_state = state.optimizer.update(
            grads, state.opt_state, params, lr=float(lr), step=state.step, found_inf=found_inf
        )
    changes: dict[str, object] = {"opt_state": opt_state, "step": state.step + 1}
    if scaling is not None:
        assert state.loss_scale is not None and state.growth_tracker is not None
        assert found_inf is not None
        changes["loss_scale"], changes["growth_tracker"] = update_loss_scale(
            state.loss_scale, state.growth_tracker, found_inf, scaling
        )
    if stats is not None:
        cursor = state.cursor + stats.num_micro
        if stats.position is not None:  # a stream: the position rides on the cursor
            changes["data_position"] = stats.position
        changes.update(
            cursor=cursor,
            tokens_seen=state.tokens_seen + stats.num_tokens,
            samples_seen=state.samples_seen + stats.num_samples,
        )
    skipped = (
        found_inf.bool()
        if found_inf is not None
        else torch.zeros((), dtype=torch.bool, device=norm.device)
    )
    return state.consume("clip_and_step", **changes), StepInfo(
        grad_norm=norm, skipped=skipped, lr=float(lr)
    )
