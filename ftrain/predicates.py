"""Cadence predicates (log/eval/save) and early stopping, as pure functions of the state."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

import torch

from ftrain.losses import default_loss, loss_name
from ftrain.state import TrainState
from ftrain.strategies import active_preemption

__all__ = ["should_eval", "should_log", "should_save", "should_stop", "track_best"]


def _check_state(state: Any) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an ft.TrainState, got {type(state).__name__}")


def _check_total(total_steps: int | None) -> None:
    if total_steps is not None and (
        isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
    ):
        raise ValueError(f"total_steps must be an int >= 1 or None, got {total_steps!r}")


def _interval(every: int | float, total_steps: int | None) -> int:
    total_ok = total_steps is None or (type(total_steps) is int and total_steps >= 1)
    if type(every) is int and every >= 1 and total_ok:
        return every  # the common case
    _check_total(total_steps)
    if isinstance(every, bool) or not isinstance(every, (int, float)):
        raise TypeError(f"every must be an int or a float in (0, 1), got {every!r}")
    if isinstance(every, float) and not every.is_integer():
        if not 0 < every < 1:
            raise ValueError(f"a float every must be in (0, 1) (a fraction), got {every!r}")
        if total_steps is None:
            raise ValueError(f"every={every} is a fraction of total_steps; pass total_steps")
        return math.ceil(total_steps * every)  # HF rounds a ratio up
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every!r}")
    return int(every)


def should_log(
    state: TrainState, *, every: int | float, total_steps: int | None = None, first: bool = False
) -> bool:
    """True when `state.step` is a positive multiple of `every` (or is 1 and `first`).

    A float `0 < every < 1` is a fraction of `total_steps`, rounded up (HF's `logging_steps`).

    Example:
        >>> import torch, ftrain as ft
        >>> s = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
        >>> [ft.should_log(s.replace(step=k), every=2) for k in range(5)]
        [False, False, True, False, True]
    """
    return _due(state, every, total_steps, first)


def _due(state: TrainState, every: int | float, total_steps: int | None, first: bool) -> bool:
    """`should_log`, its arguments checked once (the three predicates run every step)."""
    _check_state(state)
    n = _interval(every, total_steps)
    if not isinstance(first, bool):
        raise TypeError(f"first must be True or False, got {first!r}")
    step = state.step
    return (step > 0 and step % n == 0) or (first and step == 1)


def should_eval(
    state: TrainState, *, every: int | float, total_steps: int | None = None, first: bool = False
) -> bool:
    """Like `should_log`, and also true at `total_steps` (so the final model is evaluated)."""
    return _due(state, every, total_steps, first) or (
        total_steps is not None and state.step == total_steps
    )


def should_save(
    state: TrainState, *, every: int | float, total_steps: int | None = None, first: bool = False
) -> bool:
    """Like `should_log`, and also true at `total_steps` (so the final model is saved), and
    once every rank agreed on a preemption signal (`ft.strategies.on_preemption`).

    A yes only because of the preemption (a step the cadence skips) is noted on the handler:
    the `save_checkpoint` that follows marks its checkpoint preemption-only, and the spike
    guard's rollback passes over it to the newest checkpoint the cadence wrote, as the run
    that was never stopped does (`ft.checkpoint.latest_cadence_checkpoint`).
    """
    due = should_eval(state, every=every, total_steps=total_steps, first=first)
    preempt = active_preemption()
    if preempt is None or not (due or preempt.requested):
        return due
    preempt.note_save(state.step, on_cadence=due)
    return True


def track_best(
    state: TrainState,
    metrics: Mapping[str, float] | float,
    *,
    metric: str = "eval_loss",
    mode: str | None = None,
    threshold: float = 0.0,
) -> TrainState:
    """Fold one evaluation into `state.early_stopping` (best metric, its step, patience).

    HF's rule (`EarlyStoppingCallback`): the counter resets when the value beats the best by
    more than `threshold`, and grows by one otherwise; the best is kept as HF's Trainer keeps
    it (any strict improvement). A NaN value is never the best and counts as no improvement
    (HF starts from +-inf, and no comparison with NaN is true).

    Ranked by the loss the state trains on: `evaluate(state, batches)` reports
    `state.loss_fn` as `eval_loss`, and a record of `evaluate` whose loss is another one
    (its `eval_loss_fn` is not the state's, e.g. `evaluate(..., loss_fn=other)`) is refused
    when ranking by `eval_loss`; `save_checkpoint(best_metric=...)` refuses to rank
    checkpoints whose recorded loss functions differ.

    Args:
        state: the state after the step that was evaluated.
        metrics: a dict holding `metric`, or the value itself.
        metric: which entry of `metrics`.
        mode: "min" or "max". None (default): "min" for a metric whose name ends in "loss"
            (HF's `greater_is_better` rule); for a score that is better higher (accuracy, F1,
            ...) it raises instead of ranking the worst score best: pass the mode.
        threshold: minimum absolute improvement that resets the patience counter.

    Raises:
        TypeError: for a `state` that is not a `TrainState`, a `metric` that is not a str, or
            a value that is not a number.
        ValueError: for a bad `mode` or `threshold`, and for no `mode` with a `metric`
            named like a score that is better higher (`accuracy`, `f1`, `auc`, ...).
        KeyError: when `metrics` does not hold `metric`.
        ValueError: for a `metric` or `mode` other than the ones the state ranks already
            (`state.early_stopping.metric`/`.mode`, recorded by the first call).
        ValueError: when ranking by `eval_loss` a record whose `eval_loss_fn` is not the loss
            the state trains on (`state.loss_fn`, when that is a loss of your own), or not the
            one the best so far was computed with (`state.early_stopping.loss`).
    """
    _check_state(state)
    if mode is not None and mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if not isinstance(metric, str):
        raise TypeError(f"metric must be a str (a key of metrics), got {metric!r}")
    if not (_real(threshold) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    if isinstance(metrics, Mapping):
        if metric not in metrics:
            raise KeyError(f"metric {metric!r} not in metrics (have {sorted(metrics)})")
        value = metrics[metric]
        _check_loss(state, metrics, metric)
    else:
        value = metrics
    mode = best_mode(metric) if mode is None else mode
    if not (_real(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)):
        raise TypeError(
            f"metrics must be a number or a dict holding metric={metric!r} as a number, "
            f"got {value!r}"
        )
    value = float(value)
    es = state.early_stopping
    if es.metric is not None and (es.metric, es.mode) != (metric, mode):
        raise ValueError(
            f"track_best(metric={metric!r}, mode={mode!r}) on a state that ranks "
            f"metric={es.metric!r}, mode={es.mode!r} (best {es.best_metric} at step "
            f"{es.best_step}): the best and the patience would compare two rankings; pass the "
            "same, or start over with state.replace(early_stopping=ft.state.EarlyStoppingState())"
        )
    loss = (
        metrics.get("eval_loss_fn")
        if metric == "eval_loss" and isinstance(metrics, Mapping)
        else None
    )
    if es.loss is not None and loss is not None and loss != es.loss:
        raise ValueError(
            f"track_best: this eval_loss was computed with {loss} (eval_loss_fn), but the "
            f"best so far ({es.best_metric} at step {es.best_step}) with {es.loss}: the two do "
            "not compare. Evaluate with the loss you train on (after a resume, before the "
            "first step, the state knows it only from TrainState.create(..., loss_fn=) or "
            "evaluate(..., loss_fn=))"
        )
    if es.metric is None:  # the first evaluation (or a checkpoint from before they were kept)
        state = _stopping(state, metric=metric, mode=mode)
        es = state.early_stopping
    if es.loss is None and loss is not None:
        state = _stopping(state, loss=loss)
        es = state.early_stopping
    if math.isnan(value):  # HF never stores NaN as the best: it is no improvement
        return _stopping(state, patience_counter=es.patience_counter + 1)
    best = es.best_metric
    if best is not None and math.isnan(best):  # a NaN best from an older run counts as none
        best = None
    better = best is None or (value < best if mode == "min" else value > best)
    if better and (best is None or abs(value - best) > threshold):
        counter = 0
    else:
        counter = es.patience_counter + 1
    if better:
        return _stopping(state, best_metric=value, best_step=state.step, patience_counter=counter)
    return _stopping(state, patience_counter=counter)


# Names of scores that are better higher. HF's Trainer takes greater_is_better=True for any
# metric whose name does not end in "loss"; ftrain's default was "min" for every metric, so
# track_best(state, m, metric="eval_accuracy") kept the worst accuracy as the best.
_NOT_SCORES = ("accum", "accel")  # accum_steps, accelerator_time: no "acc"uracy

_HIGHER = (
    "acc",
    "f1",
    "precision",
    "recall",
    "auc",
    "bleu",
    "rouge",
    "match",
    "mcc",
    "matthews",
    "score",
    "map",
    "ndcg",
    "r2",
    "iou",
    "dice",
    "kappa",
    "spearman",
    "pearson",
    "reward",
    "win",
)


def best_mode(metric: Any, caller: str = "track_best", name: str = "metric") -> str:
    """The mode a metric is ranked by when none is given (`track_best`, `save_checkpoint`):
    "min", unless the name looks like a score that is better higher, which raises.

    Raises:
        ValueError: for a `metric` named like a score (`accuracy`, `f1`, `auc`, ...): the
            default "min" would keep the worst as the best; the caller must pass its mode.
    """
    if not isinstance(metric, str) or metric.endswith("loss"):
        return "min"
    # Words split at any character that is no letter or digit, and at a camelCase hump:
    # "val/acc", "eval/accuracy" (a nested record's key), "val.f1", "valAcc" were one word
    # each, ranked "min", and the worst score was kept as the best.
    humps = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", metric)
    words = re.split(r"[^a-z0-9]+", humps.lower()) + re.split(r"[^a-z0-9]+", metric.lower())
    if any(w in ("loss", "losses") for w in words):  # rewardLoss, eval/dice_loss_mean
        return "min"
    if any(w.startswith(h) and not w.startswith(_NOT_SCORES) for w in words for h in _HIGHER):
        raise ValueError(
            f"{caller}({name}={metric!r}) needs mode: {metric!r} looks like a score that is "
            "better higher, and the default mode='min' would keep the worst as the best; pass "
            "mode='max' (or mode='min' if lower is better)"
        )
    return "min"


def _check_loss(state: TrainState, metrics: Mapping[str, Any], metric: str) -> None:
    """Refuse to rank by an `eval_loss` computed with another loss than the training one."""
    recorded = metrics.get("eval_loss_fn")
    # A state on the default loss may rank any evaluation: a metrics_fn's own loss (e.g.
    # classification_metrics' cross-entropy) is the default loss under another name.
    if metric != "eval_loss" or recorded is None or state.loss_fn in (None, default_loss):
        return
    trained = loss_name(state.loss_fn)
    if recorded != trained:
        raise ValueError(
            f"track_best: metrics' eval_loss is {recorded} (eval_loss_fn) but the state trains "
            f"on {trained} (state.loss_fn): ranking checkpoints by it picks by a loss you do "
            "not train on. Evaluate with the training loss (evaluate(state, batches) uses it), "
            "or rank by another key (metric=...)"
        )


def _real(value: Any) -> bool:
    # numpy scalars are Real too; True is not a metric.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _stopping(state: TrainState, **changes: Any) -> TrainState:
    return state.replace(early_stopping=state.early_stopping.replace(**changes))


def should_stop(state: TrainState, *, patience: int) -> bool:
    """True once `patience` evaluations in a row failed to improve (see `track_best`).

    Example:
        >>> import torch, ftrain as ft
        >>> s = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
        >>> stops = []
        >>> for loss in [1.0, 0.9, 0.95, 0.93]:
        ...     s = ft.track_best(s, {"eval_loss": loss})
        ...     stops.append(ft.should_stop(s, patience=2))
        >>> stops
        [False, False, False, True]
    """
    _check_state(state)
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        raise ValueError(f"patience must be an int >= 1, got {patience!r}")
    return state.early_stopping.patience_counter >= patience
