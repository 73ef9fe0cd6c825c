"""An opt-in loss-spike guard: roll back to the newest checkpoint and skip the offending data.

A spike (a loss that rises far above its moving average, for losses of either sign) or a run
of non-finite losses makes the guard load the newest checkpoint (passing over a preemption save
off the save cadence, which the run never stopped does not have) and move the data cursor past
the micro-batches that caused it, as PaLM did by hand (Chowdhery et al. 2022, section 5.1:
restart from a checkpoint before the spike and skip the batches around it). Peers only skip
the update or warn.

The guard's memory (the loss average and spread, counts) lives in `GuardedState`, a
`TrainState` with five more plain fields that checkpoints save and restore, and every decision
is a pure function of that state and the observed loss: a resumed run makes the same
decisions. A run that keeps spiking stops with `GuardError` after `max_rollbacks` rollbacks
instead of rolling back forever.

    guard = ft.guard.SpikeGuard(factor=3.0, warmup=20)
    state = ft.guard.GuardedState.create(model, opt, seed=0)
    ...
        for micro in ft.make_batches(..., state):
            grads, stats = ft.accumulate_grads(state, micro)
            state, verdict = guard.observe(state, stats)     # reads the loss: a host sync
            if verdict.rollback:
                state = guard.rollback(state, "runs/x", skip=micro)
                break                                        # restart the data past `micro`
            state, info = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from ftrain.checkpoint import (
    latest_cadence_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    step_dirs,
    wait_for_checkpoint,
)
from ftrain.data import MicroBatches
from ftrain.grads import Stats
from ftrain.state import TrainState

__all__ = ["GuardError", "GuardedState", "SpikeGuard", "Verdict"]

log = logging.getLogger("ftrain.extras.guard")


class GuardError(RuntimeError):
    """Raised by `SpikeGuard.rollback` when the run has rolled back `max_rollbacks` times."""


@dataclasses.dataclass(frozen=True, eq=False)
class GuardedState(TrainState):
    """A `TrainState` with the guard's memory as plain values (saved in checkpoints).

    `loss_avg`: moving average of the accepted losses (None before the first); `loss_var`:
    their moving variance about it; `loss_count`: losses averaged so far; `nonfinite_run`:
    consecutive non-finite losses; `rollbacks`: rollbacks done.
    """

    loss_avg: float | None = None
    loss_var: float = 0.0
    loss_count: int = 0
    nonfinite_run: int = 0
    rollbacks: int = 0


def _real(value: Any) -> bool:
    # A finite int or float, not a bool: `factor=inf` would turn the guard off unseen, and a
    # string would fail deep inside a comparison.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _set(state: GuardedState, **changes: Any) -> GuardedState:
    return cast(GuardedState, state.replace(**changes))  # replace keeps the subclass


class Verdict(NamedTuple):
    """What `SpikeGuard.observe` decided: `rollback` and a human-readable `reason`."""

    rollback: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class SpikeGuard:
    """Detect a loss spike or a run of non-finite losses.

    A finite loss is a spike when at least `warmup` losses have been averaged and it rises
    above their moving average by more than `factor - 1` times the loss's scale:

        loss - avg > (factor - 1) * max(|avg|, 3 * std)

    where `std = sqrt(var)` is the moving standard deviation of the accepted losses. For a
    positive average above three standard deviations (the usual training loss) this is
    `loss > factor * avg`. It never depends on the loss's sign: only a rise is a spike, and a
    negative or near-zero average (a log-likelihood, a DPO-style margin, a loss minus a
    baseline) is measured against the loss's own noise, `3 * (factor - 1)` standard deviations,
    rather than against a ratio that would call every step a spike. Accepted losses update
    `d = loss - avg; avg = beta * avg + (1 - beta) * loss; var = beta * (var + (1 - beta) * d**2)`
    (the first one sets `avg`, with `var = 0`). Spikes and non-finite losses enter neither.

    Args:
        factor: spike threshold, > 1: how many times its scale the loss must rise by, plus 1.
        beta: decay of the moving average and variance, in [0, 1).
        warmup: accepted losses before spikes are detected, >= 1.
        max_nonfinite: consecutive non-finite losses that trigger a rollback, >= 1
            (`clip_and_step` already skips each such update on its own).
        max_rollbacks: rollbacks allowed in the run, >= 1 (20: PaLM met about 20 spikes in a
            whole run); `rollback` raises `GuardError` when asked for one more.
    """

    factor: float = 3.0
    beta: float = 0.98
    warmup: int = 20
    max_nonfinite: int = 3
    max_rollbacks: int = 20

    def __post_init__(self) -> None:
        checks = [
            ("factor", self.factor, _real(self.factor) and self.factor > 1, "a finite number > 1"),
            ("beta", self.beta, _real(self.beta) and 0 <= self.beta < 1, "a number in [0, 1)"),
            ("warmup", self.warmup, _count(self.warmup), ">= 1"),
            ("max_nonfinite", self.max_nonfinite, _count(self.max_nonfinite), "an int >= 1"),
            ("max_rollbacks", self.max_rollbacks, _count(self.max_rollbacks), "an int >= 1"),
        ]  # fmt: skip
        for name, value, ok, want in checks:
            if not ok:
                raise ValueError(f"SpikeGuard {name} must be {want}, got {value!r}")

    def observe(self, state: GuardedState, stats: Stats | float) -> tuple[GuardedState, Verdict]:
        """Record this step's loss (before `clip_and_step`); say whether to roll back.

        Reading the loss is a host sync (as logging every step would be). A step whose
        micro-batches hold no item (`stats.num_items == 0`, every label -100) has no loss to
        judge: it is neither a spike nor a non-finite loss, and leaves the guard's memory as
        it was (`clip_and_step` skips its update, or applies a private step's noise: see
        `Stats.skip_empty`).

        Raises:
            TypeError: when `state` is not a `GuardedState`.
        """
        if not isinstance(state, GuardedState):
            raise TypeError(
                "SpikeGuard needs a GuardedState (ft.guard.GuardedState.create(...)), got "
                f"{type(state).__name__}"
            )
        loss, items = _read(stats)  # host sync
        if not math.isfinite(loss) and items == 0:
            # A step without items (every label -100: a completion-only batch whose responses
            # were all masked) has the undefined mean NaN by contract; clip_and_step skips it.
            # It is no sign of divergence: it neither counts as non-finite nor enters the average.
            return state, Verdict(False, "no items: the micro-batches had no label to score")
        if not math.isfinite(loss):
            run = state.nonfinite_run + 1
            state = _set(state, nonfinite_run=run)
            if run >= self.max_nonfinite:
                return state, Verdict(True, f"{run} non-finite losses in a row")
            return state, Verdict(False, "non-finite loss")
        avg = state.loss_avg
        if avg is not None and state.loss_count >= self.warmup:
            scale = max(abs(avg), 3 * math.sqrt(state.loss_var))
            if loss - avg > (self.factor - 1) * scale:
                return _set(state, nonfinite_run=0), Verdict(
                    True,
                    f"loss {loss:.4g} > its average {avg:.4g} + {self.factor - 1:g} x its "
                    f"scale {scale:.4g}",
                )
        return _set(state, **self._accept(state, loss), nonfinite_run=0), Verdict(False, "ok")

    def _accept(self, state: GuardedState, loss: float) -> dict[str, Any]:
        """The average, variance and count with `loss` taken in."""
        avg, b = state.loss_avg, self.beta
        if avg is None:
            return {"loss_avg": loss, "loss_var": 0.0, "loss_count": state.loss_count + 1}
        d = loss - avg
        return {
            "loss_avg": b * avg + (1 - b) * loss,
            "loss_var": b * (state.loss_var + (1 - b) * d * d),
            "loss_count": state.loss_count + 1,
        }

    def rollback(
        self,
        state: GuardedState,
        root: str | os.PathLike[str],
        *,
        skip: MicroBatches | int,
        allow_other_base: bool = False,
    ) -> GuardedState:
        """Load the newest checkpoint under `root` and move the data past `skip`, the
        micro-batches just observed (they start at `state.data.cursor`).

        The newest checkpoint the save cadence wrote, that is: a preemption-only save (one
        `should_save` asked for at a step its cadence skips) is passed over, so that a run
        resumed from it rolls back where the run never stopped did
        (`ft.checkpoint.latest_cadence_checkpoint`).

        The weights, optimizer state and counters return to the checkpoint's; the data moves
        on past the spike, so the micro-batches between the checkpoint and the spike are not
        replayed either (PaLM skipped a few hundred batches the same way). Without a checkpoint
        the state is kept and only the skipped micro-batches are skipped. Each rollback is
        logged on the `ftrain.extras.guard` logger. `state` is consumed.

        Args:
            state: the state that observed the spike (before `clip_and_step`).
            root: the run's checkpoint directory.
            skip: the group `make_batches` yielded (`micro`): the cursor moves past its
                micro-batches, and a stream resumes at the position the group carries, right
                after its last row, without reading anything again. For map-style data the
                number of micro-batches (`len(micro)`) does as well: the state's map position
                is kept, so the data resumes at the row after the skipped micro-batches even
                when the batch size changed earlier in the epoch.
            allow_other_base: as `ft.load_checkpoint`'s: for a run resumed onto another base
                model on purpose (`load_checkpoint(..., allow_other_base=True)`), whose newest
                checkpoint may still be one written on the first base.

        Raises:
            ValueError: for `skip < 1`, or an int `skip` on a stream (whose position after the
                skipped micro-batches only the group knows).
            GuardError: when `max_rollbacks` rollbacks were done already, or when the newest
                checkpoint is past the state's step (one of a run this one branched from, before
                this run saved its first): the state is then not consumed.
        """
        skip, position = _skipped(state, skip)
        if state.rollbacks >= self.max_rollbacks:
            raise GuardError(
                f"loss guard: {state.rollbacks} rollbacks done, max_rollbacks="
                f"{self.max_rollbacks} reached at step {state.step} (epoch {state.epoch}, "
                f"micro-batch {state.data.cursor}): the loss keeps spiking after rolling back. "
                "Look at the data and the learning rate, or raise SpikeGuard(max_rollbacks=...)"
            )
        epoch, start, step = state.epoch, state.data.cursor, state.step
        rollbacks = state.rollbacks + 1
        wait_for_checkpoint()  # a background save in flight may be the newest checkpoint
        # With DDP only rank 0 writes: the others' wait returns at once, and they would list
        # the folder before rank 0's save in flight committed (another target: a hang or a
        # refused load). Every rank lists it once every rank is past its wait.
        state.strategy.barrier()
        path, passed = _target(root)
        _check_not_ahead(path, root, step)
        if path is not None:
            state = cast(  # keeps the class
                GuardedState, load_checkpoint(path, state, allow_other_base=allow_other_base)
            )
        log.warning(
            "loss guard: rollback %d at step %d (epoch %d): %s%s; skipping micro-batches [%d, %d)",
            rollbacks, step, epoch,
            f"resumed from {path} (step {state.step})" if path else "no checkpoint to load",
            f", passing over the preemption-only {passed}" if passed else "", start, start + skip,
        )  # fmt: skip
        data = state.data.replace(cursor=start + skip, position=position)
        return _set(state, epoch=epoch, data=data, nonfinite_run=0, rollbacks=rollbacks)


def _target(root: str | os.PathLike[str]) -> tuple[Path | None, Path | None]:
    """(the checkpoint to roll back to, the newer preemption-only save passed over or None).

    A preemption save off the save cadence is one the run never stopped does not have: rolling
    back to it would make the resumed run differ from that run (docs/guarantees.md).
    """
    path, newest = latest_cadence_checkpoint(root), latest_checkpoint(root)
    return path, (newest if newest != path else None)


def _check_not_ahead(path: Path | None, root: str | os.PathLike[str], step: int) -> None:
    """Refuse a rollback target past `step`: within one run every checkpoint is at or before
    the step observing the spike, so a newer one belongs to another branch (a run resumed from
    an earlier checkpoint of this folder), and loading it would jump forward into weights this
    run never trained. (It is refused until this run's step passes the other branch's newest
    checkpoint, even after this run saved: the target is the folder's newest checkpoint.)"""
    if path is None:
        return
    saved = next((s for s, p in step_dirs(root) if p.name == path.name), None)
    if saved is not None and saved > step:
        raise GuardError(
            f"loss guard: the checkpoint to roll back to, {path} (step {saved}) is past this "
            f"state's step {step}: it belongs to another run in the folder (this one resumed "
            "from an earlier checkpoint). Rolling back to it would move forward; train a "
            "resumed branch in its own folder (copy the checkpoint it starts from there)"
        )


def _read(stats: Stats | float) -> tuple[float, float | None]:
    """(loss, item count or None for a bare number), read in one host sync."""
    if not isinstance(stats, Stats):
        return float(stats), None
    loss, items = torch.stack((stats.loss.float(), stats.num_items.float())).tolist()
    return loss, items


def _skipped(state: GuardedState, skip: MicroBatches | int) -> tuple[int, str | None]:
    """(micro-batches to skip, the stream position after them or None), validated."""
    if isinstance(skip, MicroBatches):
        return len(skip), skip.position
    if isinstance(skip, bool) or not (isinstance(skip, int) and skip >= 1):
        raise ValueError(
            f"skip must be the micro-batches observed (the group, or their number >= 1), got "
            f"{skip!r}"
        )
    if _on_stream(state):
        raise ValueError(
            f"skip={skip} on a stream: where the stream stands after the skipped micro-batches "
            "is known only to the group make_batches yielded. Pass skip=micro (the group just "
            "observed) instead of skip=len(micro)"
        )
    # Map-style data: the position counts micro-batches from its cursor at its global batch,
    # the size of the micro-batches just observed, so it stays valid at cursor start + skip
    # (without it, a run resumed at another batch size would recount from row 0).
    return skip, state.data.position if _kind(state) == "map" else None


def _on_stream(state: GuardedState) -> bool:
    """Whether the state's data position is a stream's (map-style data has one too)."""
    return _kind(state) == "stream"


def _kind(state: GuardedState) -> Any:
    """The kind of the state's data position ("map", "stream"), or None."""
    try:
        return json.loads(state.data.position or "{}").get("kind")
    except (ValueError, AttributeError):
        return None
