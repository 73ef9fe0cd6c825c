"""clip_and_step: global-norm clipping, the optimizer update, and the step counters."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import numpy as np
import torch

from ftrain._compiled import compiled_update, skip_flag
from ftrain.grads import Grads, Stats
from ftrain.optim import ema_swapped
from ftrain.precision import update_loss_scale
from ftrain.state import ScalerState, TrainState, snapshot

__all__ = ["StepInfo", "clip_and_step"]


class StepInfo(NamedTuple):
    """What one `clip_and_step` did: `grad_norm` (pre-clip, device tensor), `skipped` (device
    bool: the update was skipped because the gradient was not finite) and the `lr` used."""

    grad_norm: torch.Tensor
    skipped: torch.Tensor
    lr: float


def _validate(lr: float, max_norm: float | None, compile: bool, **flags: bool) -> None:
    if isinstance(lr, (bool, torch.Tensor)) or not isinstance(lr, (int, float)):
        raise TypeError(f"lr must be a Python number (e.g. schedule(state.step)), got {lr!r}")
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be finite and >= 0, got {lr!r}")
    if max_norm is not None and (
        isinstance(max_norm, bool) or not (isinstance(max_norm, (int, float)) and max_norm > 0)
    ):
        raise ValueError(f"max_norm must be a number > 0 or None, got {max_norm!r}")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")


def _check_types(state: Any, grads: Any, stats: Any) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    if not isinstance(grads, dict) and not isinstance(grads, Mapping):  # dict: no ABC check
        raise TypeError(
            f"grads must be the mapping accumulate_grads returned, got {type(grads).__name__}"
        )
    if stats is not None and not isinstance(stats, Stats):
        raise TypeError(
            f"stats must be the Stats accumulate_grads returned or None, got {type(stats).__name__}"
        )
    if stats is not None and type(stats.skip_empty) is not bool:  # 0/None would apply 0/0
        raise TypeError(f"stats.skip_empty must be True or False, got {stats.skip_empty!r}")


def _check_grads(
    grads: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """Names, shapes, dtypes and devices of `grads` against the parameters: metadata only.
    Returns the gradients to apply: `grads` itself, or a dict where one of yours was laid out
    otherwise than its parameter (copied into the parameter's layout).

    The fused kernels trust their inputs; a gradient of another shape gave NaNs or a segfault
    (issue 20), and one of other strides (a transpose, an `expand`) was read as if laid out
    like the parameter: wrong elements, or memory past an expanded tensor's end (NaNs in the
    weights, unreported). A `.grad` tensor itself already matches (autograd enforces it on
    assignment and lays it out like its parameter).
    """
    if grads and grads.keys() <= params.keys():  # the usual case, checked in C (issue 30)
        got = itemgetter(*grads)(params)
        if all(map(operator.is_, grads.values(), map(_GRAD, got if len(grads) > 1 else [got]))):
            return grads
    relaid: dict[str, torch.Tensor] = {}
    for name, g in grads.items():
        p = params.get(name)
        if p is None:
            raise ValueError(
                f"grads has {name!r}, which is not a trainable parameter of the state "
                f"(trainable: {_preview(params)}); pass the mapping accumulate_grads returned"
            )
        if g is p.grad:
            continue
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"grads[{name!r}] must be a tensor, got {type(g).__name__}")
        if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise ValueError(
                f"grads[{name!r}] does not match its parameter: gradient {tuple(g.shape)} "
                f"{g.dtype} on {g.device}, parameter {tuple(p.shape)} {p.dtype} on {p.device}"
            )
        if g.stride() != p.stride():
            relaid[name] = torch.empty_like(p).copy_(g)
    return {**grads, **relaid} if relaid else grads


_GRAD = attrgetter("grad")


def _preview(names: Mapping[str, object]) -> str:
    shown = list(names)[:5]
    return ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")


def _release(
    grads: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], step: int
) -> None:
    """Free the consumed gradients: the parameters' `.grad` and a `Grads` mapping's tensors."""
    for p in params.values():
        p.grad = None
    if isinstance(grads, Grads):
        grads.consume("clip_and_step", step)


def clip_and_step(
    state: TrainState,
    grads: Mapping[str, torch.Tensor],
    *,
    lr: float,
    max_norm: float | None = None,
    stats: Stats | None = None,
    skip_nonfinite: bool = True,
    donate: bool = True,
    compile: bool = False,
) -> tuple[TrainState, StepInfo]:
    """Clip `grads` to a global norm, apply the optimizer, and advance the counters.

    Clipping equals `torch.nn.utils.clip_grad_norm_` (coefficient `max_norm / (norm + 1e-6)`,
    at most 1) with the norm taken across shards and ranks by the strategy. A non-finite norm
    skips the update on the device, without a host sync; `step` still advances (as in HF
    Trainer) and `info.skipped` says so. `state.data` (cursor, tokens and samples
    seen, and the data position, `stats.position`: docs/data.md) advances by `stats` when
    given (a `stats.position` of None keeps the state's); a step whose `stats` counted no item
    is skipped like a
    non-finite one (nothing was learned: no weight decay either). With float16 loss scaling,
    an overflow always skips the update and `state.scaler` advances by
    `torch.amp.GradScaler`'s rule (`ft.precision`); a step that counted no item leaves it as it
    is (it measured nothing).

    Args:
        state: consumed unless `donate=False`.
        grads: from `accumulate_grads` (any mapping name -> tensor works); modified in place
            by clipping (a tensor of yours laid out otherwise than its parameter, e.g. a
            transpose or an `expand`, is copied into the parameter's layout first). Donated
            with the state: the parameters' `.grad` are released and a `Grads` mapping is
            emptied (reading it raises `ConsumedStateError`); a plain dict of yours is left as
            it is.
        lr: learning rate of this update, e.g. `schedule(state.step)`.
        max_norm: clip threshold; None measures the norm without clipping.
        stats: the `Stats` of this step, to advance the data counters and record the loss
            it trained on (`state.loss_fn`).
        skip_nonfinite: skip the update when the gradient norm is inf or NaN (always on with
            loss scaling).
        donate: update in place and consume `state` and `grads`; False snapshots the state
            first so it stays valid, and keeps the gradients.
        compile: run the norm, skip, clip and optimizer update as one `torch.compile`d call
            (opt-in; `adamw`, `adam` and `sgd`, unsharded strategies). Same results as eager
            up to float rounding, same state and checkpoints; the first step compiles (seconds
            to a minute), a changing `lr` does not recompile (docs/optimizers.md).

    Returns:
        `(new_state, StepInfo)`.

    Raises:
        TypeError, ValueError: for a bad `lr`, `max_norm` or `compile` (an optimizer or
            strategy it does not support, more compiled variants than dynamo's recompile
            limit), a state whose loss scale does not match its strategy's precision, a
            `stats.num_items` that is neither a tensor nor a number, or a gradient whose name,
            shape, dtype or device does not match its parameter (checked on the host, no sync).
        ConsumedStateError: if `state` or `grads` was already consumed.
        ValueError: inside `ft.optim.swap_ema(state)` (the model holds the average there), or
            for gradients `accumulate_grads` took inside it (the average's gradients).
        ValueError: for `max_norm` with an `ft.func.Ensemble` model (one norm over all the
            members; `ft.func.clip_members` clips each by its own).
    """
    _validate(lr, max_norm, compile, skip_nonfinite=skip_nonfinite, donate=donate)
    _check_types(state, grads, stats)
    held = state.tensors_  # one lease check for the model, parameters and optimizer state
    held.lease.check()
    if max_norm is not None and getattr(
        type(state.strategy.unwrap(held.model)), "per_member_gradients", False
    ):
        # ft.func.Ensemble: one global norm would clip each member by all members' gradients.
        raise ValueError(
            f"clip_and_step(max_norm={max_norm}) on an ft.func.Ensemble would clip every member "
            "by the norm of all the members' gradients together, "
            "unlike separate runs: clip each member with ft.func.clip_members(grads, max_norm) "
            "and pass max_norm=None"
        )
    if ema_swapped(state):  # the update would train the average and pull the live weights in
        raise ValueError(
            "clip_and_step(state) inside ft.optim.swap_ema(state): the model holds the EMA "
            "average until the block ends; step outside the block"
        )
    given: Mapping[str, torch.Tensor] = grads
    if isinstance(grads, Grads):
        grads.check()
        if grads.of_ema_average:  # taken at the average: applied to the live weights after it
            raise ValueError(
                "clip_and_step got gradients accumulate_grads took inside "
                "ft.optim.swap_ema(state), where the model held the EMA average: they are the "
                "average's, not the live weights'; compute them outside the block"
            )
        # Checked once: a plain dict of the same tensors from here on (each read of a `Grads`
        # checks its lease again, a dozen Python calls a step: issue 30).
        given = dict.copy(grads)
    if not donate:
        state = snapshot(state)
        held = state.tensors_
    params, strategy = held.params, state.strategy
    scaling = strategy.precision.loss_scaling
    if (scaling is None) != (state.scaler.scale is None):
        raise ValueError(
            "the strategy's loss scaling and state.scaler disagree: create the state with "
            "the strategy that trains it (TrainState.create(..., strategy=...))"
        )
    applied = _check_grads(given, params)
    # With loss scaling an overflow is expected now and then: always skip it.
    check_finite = skip_nonfinite or scaling is not None
    # A step that counted no item is skipped (its gradient is 0/0), unless its Stats says it
    # applies anyway (a private step's noise: ft.func.private_grads).
    num_items = None
    if stats is not None and stats.skip_empty:
        num_items = _count(stats.num_items, strategy.device)
    with torch.no_grad():
        if compile:
            norm, overflow, skip = compiled_update(
                state, applied, lr=float(lr), max_norm=max_norm, check_finite=check_finite,
                num_items=num_items,
            )  # fmt: skip
            opt_state = held.opt_state
        else:
            norm = _eager_norm_and_clip(state, applied, max_norm)
            if scaling is not None:  # the loss scale's rule reads the overflow on its own
                overflow = ~torch.isfinite(norm)
                skip = skip_flag(overflow, num_items)
            else:
                overflow, skip = None, _skip(norm, num_items, check_finite)
            found_inf = None if skip is None else skip.float()  # the fused kernels' form
            opt_state = state.optimizer.update(
                applied, held.opt_state, params, lr=float(lr), step=state.step, found_inf=found_inf
            )
    # The shards changed in place: whole copies that a forward without a backward gathered
    # (an evaluation between accumulate_grads and this step; FSDP2 keeps the root's) go, or
    # the next forward computes with the weights from before the step.
    strategy.drop_gathered(held.model)
    if donate:
        _release(grads, params, state.step)
    changes: dict[str, object] = {"opt_state": opt_state, "step": state.step + 1}
    if scaling is not None:
        scaler = state.scaler
        assert scaler.scale is not None and scaler.growth_tracker is not None
        assert overflow is not None
        scale, growth = update_loss_scale(scaler.scale, scaler.growth_tracker, overflow, scaling)
        if num_items is not None:  # a step that counted nothing measured nothing: kept as is
            empty = (num_items == 0).to(scaler.scale.device, non_blocking=True)  # a host count
            scale = torch.where(empty, scaler.scale, scale)
            growth = torch.where(empty, scaler.growth_tracker, growth)
        changes["scaler"] = ScalerState(scale=scale, growth_tracker=growth)
    if stats is not None:
        d = state.data
        seen, step_counts = [d.tokens_seen, d.samples_seen], [stats.num_tokens, stats.num_samples]
        if all(isinstance(t, torch.Tensor) for t in step_counts):
            # Both counters in one (out-of-place) call: the old state keeps its tensors.
            tokens, samples = torch._foreach_add(seen, step_counts)
        else:  # a Stats of your own with host numbers
            tokens, samples = (a + b for a, b in zip(seen, step_counts, strict=True))
        changes["data"] = d.replace(
            cursor=d.cursor + stats.num_micro,
            # Where the data stands after these micro-batches. Batches of no known position
            # (built by hand, a list of a group no longer alive) keep the state's: a map
            # position counts the cursor from its row at its global batch (dropped, a resume
            # with another batch size recounted the cursor from the epoch's first row).
            position=d.position if stats.position is None else stats.position,
            tokens_seen=tokens,
            samples_seen=samples,
        )
        if stats.loss_fn is not None and stats.loss_fn is not state.loss_fn:
            changes["loss_fn"] = stats.loss_fn  # what evaluate reports by default from now on
    skipped = skip if skip is not None else torch.zeros((), dtype=torch.bool, device=norm.device)
    return state.consume("clip_and_step", **changes), StepInfo(
        grad_norm=norm, skipped=skipped, lr=float(lr)
    )


def _count(num_items: Any, device: torch.device) -> torch.Tensor:
    """`stats.num_items` as a tensor: a `Stats` of your own may count on the host (a Python
    number made the skip test a bool, which the update cannot take). A tensor is kept as is."""
    if isinstance(num_items, torch.Tensor):
        return num_items
    if isinstance(num_items, (bool, np.bool_)) or not isinstance(num_items, numbers.Real):
        raise TypeError(
            f"stats.num_items must be a tensor or a number, got {type(num_items).__name__}"
        )
    # A fill kernel with a scalar argument: no host-to-device copy, no sync.
    return torch.full((), float(num_items), dtype=torch.float64, device=device)


def _eager_norm_and_clip(
    state: TrainState, grads: Mapping[str, torch.Tensor], max_norm: float | None
) -> torch.Tensor:
    """The pre-clip norm; clips `grads` in place."""
    g = list(grads.values())
    norm = state.strategy.grad_norm(g)
    if max_norm is not None and g:
        # clip_grad_norm_'s coefficient, clamp(max_norm / (norm + 1e-6), max=1), op for op
        # (its `/` is a reciprocal and a multiply), in place on the temporary.
        coef = (norm + 1e-6).reciprocal_().mul_(max_norm).clamp_(max=1.0)
        torch._foreach_mul_(g, coef)
    return norm


def _skip(
    norm: torch.Tensor, num_items: torch.Tensor | None, check_finite: bool
) -> torch.Tensor | None:
    """`skip_flag(~isfinite(norm), num_items)` in fewer, cheaper device ops (issue 30).

    `norm * 0` is 0 for a finite norm and NaN for inf or NaN; dividing it by the item count
    makes it NaN for a step that counted nothing too (0 / 0). `addcdiv` adds that to the
    norm in one op: `norm + 0 * norm / items` is NaN exactly when the step is skipped.
    `isfinite` alone is a composite of several kernels.
    """
    if not check_finite:
        return None if num_items is None else num_items == 0
    if isinstance(num_items, torch.Tensor) and num_items.device == norm.device:
        return torch.addcdiv(norm, norm, num_items, value=0).isnan()
    # A count on another device (a CPU count with CUDA gradients, or no gradient at all and so
    # a CPU norm): a ternary op refuses the mix, a division takes a CPU 0-dim operand.
    zero = norm * 0
    return (zero if num_items is None else zero / num_items).isnan()
