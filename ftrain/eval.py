"""evaluate and predict: global item-weighted loss and metrics, per-sample outputs as numpy."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, NoReturn

import numpy as np
import torch
from torch import nn

from ftrain.data import MicroBatches, resumed_at, step_data, weighted
from ftrain.grads import _check_micro_count
from ftrain.losses import (
    _CAUSAL,
    _CLASSIFY,
    _SEQ2SEQ,
    IGNORE_INDEX,
    LossFn,
    _base_model,
    _decoder_inputs,
    _defaults,
    _encoder_right_aligned,
    _no_labels,
    default_loss,
    loss_for,
    loss_name,
    model_logits,
    padded_as_model,
    upcast,
)
from ftrain.state import TrainState
from ftrain.strategies import Strategy

__all__ = [
    "MetricsFn",
    "OutputFn",
    "classification_metrics",
    "evaluate",
    "eval_mode",
    "flatten_batches",
    "loss_name",
    "predict",
]

MetricsFn = Callable[[nn.Module, Any], Mapping[str, tuple[torch.Tensor, torch.Tensor]]]
OutputFn = Callable[[nn.Module, Any], Mapping[str, torch.Tensor]]


def flatten_batches(batches: Iterable[Any]) -> Iterator[Any]:
    """Yield one batch at a time from `make_batches`' groups (`MicroBatches`, or lists of
    batches), or from a plain iterable of batches, as `evaluate` and `predict` read them.

    A list is a group when each of its items is a batch (a dict, list, tuple or `MicroBatches`);
    any other list is one batch: a DataLoader over a `TensorDataset` yields `[x, y]`, which was
    read as two batches (x, then y, each unpacked into two of its rows by a `loss_fn`). A list
    of exactly two dicts that share no key, where a batch was expected, is refused: it is one
    batch split into parts (a DataLoader's default collate turns `(inputs, labels)` rows into
    `[inputs, labels]`), not a group. Batches of tasks whose keys differ, given one by one,
    are read one by one.

    Raises:
        TypeError: for a list of two dicts that share no key in place of a batch (see above).

    Example:
        >>> import torch
        >>> from ftrain.eval import flatten_batches
        >>> list(flatten_batches([[{"a": 1}, {"a": 2}], {"a": 3}]))
        [{'a': 1}, {'a': 2}, {'a': 3}]
        >>> len(list(flatten_batches([[torch.zeros(2, 3), torch.ones(2)]])))  # one [x, y] batch
        1
    """
    for item in batches:
        if isinstance(item, MicroBatches) or (isinstance(item, list) and _is_group(item)):
            _check_parts(item, "a batch")
            yield from item
        else:
            yield item


def _is_group(items: list[Any]) -> bool:
    return all(isinstance(x, (Mapping, list, tuple, MicroBatches)) for x in items)


def _check_parts(items: Any, what: str) -> None:
    """Refuse `items` if it is exactly two dicts that share no key: the parts of one batch,
    `(inputs, labels)`, each of which would be read as a batch of its own (metrics of the
    inputs alone, then of the labels alone), as `accumulate_grads` refuses an `[x, y]` batch of
    tensors passed as its micro-batches."""
    # Only a pair: a DataLoader's default collate turns each (inputs, labels) row's tuple into
    # one list of its two fields, so its parts always come as two. Batches of several tasks
    # (keys that differ from task to task) are a list of any length, which is read batch by
    # batch as an iterator of them is: refusing those too (any dict disjoint from the first)
    # broke multi-task evaluation that accumulate_grads accepts.
    if len(items) != 2 or not all(isinstance(x, Mapping) and x for x in items):
        return
    first, second = items
    if set(first).isdisjoint(second):
        raise TypeError(
            f"{what} is a {type(items).__name__} of 2 dicts that share no key "
            f"({sorted(first)} and {sorted(second)}): the parts of one batch, e.g. "
            "(inputs, labels), which would be read as 2 batches (a DataLoader's default collate "
            "turns a dataset's (inputs, labels) rows into [inputs, labels]). Merge them into one "
            "dict ({**inputs, **labels}, in a collate_fn), or return a tuple from the collate_fn "
            "for a loss_fn or output_fn that takes (inputs, labels); wrap a single batch: "
            "[batch]. Two batches of tasks whose keys differ: give them in a flat list of "
            "batches ([task_a, task_b, ...])"
        )


def prediction_batches(
    batches: Iterable[Any],
    caller: str,
    state: TrainState | None = None,
    lock: Lockstep | None = None,
    *,
    check: Callable[[Any], Any] | None = None,
    strategy: Strategy | None = None,
    end: Callable[[], Any] | None = None,
) -> Iterator[Any]:
    """`flatten_batches` for `predict` and `generate`, whose outputs come in batch order, read
    as `read_batches` reads them (with `lock`, `check`, `strategy` and `end`).

    Raises:
        ValueError: for groups that `make_batches` shuffled (its default, for training): the
            outputs would not line up with the dataset's rows, as the Trainer's `predict`
            (which never shuffles) gives them; and, at the end, if there were no batches (an
            eval set smaller than the batch size with drop_last=True: metrics over no outputs
            read 0 or NaN), as `evaluate` raises (with several processes in lockstep, on every
            one, as `Lockstep` raises where only some had none).
    """
    empty = True
    for batch in read_batches(
        batches, caller, state, lock, ordered=True, check=check, strategy=strategy, end=end
    ):
        empty = False
        yield batch
    if empty:  # (on every process alike, where the processes agreed that none had a batch)
        error = _no_batches(caller)
        raise _everywhere(error) if lock is not None or end is not None else error


def _no_batches(caller: str) -> ValueError:
    return ValueError(
        f"{caller} got no batches (an eval set smaller than the batch size, with drop_last=True?)"
    )


def read_batches(
    batches: Iterable[Any],
    caller: str,
    state: TrainState | None = None,
    lock: Lockstep | None = None,
    *,
    ordered: bool = False,
    check: Callable[[Any], Any] | None = None,
    strategy: Strategy | None = None,
    end: Callable[[], Any] | None = None,
) -> Iterator[Any]:
    """`batches` one batch at a time (`flatten_batches`), refused if they are the training
    loop's (`_from_the_start`) or, when `ordered`, shuffled by `make_batches`.

    With `lock`, the processes agree before a batch that every one has one (see `Lockstep`),
    `check(batch)` having run (its error, and an error reading the batch, raised on every
    process), and after the last that none has more. The batches of a group `make_batches`
    yielded with `strategy` (the lock's), whose count every process agreed on, are let
    through (unless `lock.every`). `end` runs after the last batch unless that was of such a
    group: the agreement of a caller that agrees after each batch's forward instead. Without
    a lock, or where it does not agree, `check` runs as it comes."""
    strategy = lock.strategy if lock is not None else strategy
    agreed = False  # whether the last item was a group every process has as many batches of
    items = _from_the_start(batches, caller, state)
    while True:
        try:
            item = next(items, _NOTHING)
        except Exception as e:  # reading this process's batches failed: every process raises
            if lock is not None and lock.wanted(False):  # (the others wait in the agreement)
                lock.agree(True, e)
            raise
        if item is _NOTHING:
            break
        if ordered and isinstance(item, MicroBatches) and _shuffled(item.position):
            raise ValueError(
                f"{caller}: make_batches shuffled these rows (shuffle=True, its default), so the "
                "outputs would come in another order than the dataset's rows; pass "
                "make_batches(..., shuffle=False)"
            )
        agreed = strategy is not None and _agreed_group(item, strategy)
        if lock is None or not lock.wanted(agreed):
            for batch in flatten_batches([item]):
                if check is not None:
                    check(batch)
                yield batch
            continue
        try:
            group = list(flatten_batches([item]))
        except Exception as e:  # this process's batches refused: every process raises
            lock.agree(True, e)
            raise
        for batch in group:
            if lock.wanted(agreed):
                error = None
                if check is not None:
                    try:
                        check(batch)
                    except Exception as e:
                        error = e
                lock.agree(True, error)
            elif check is not None:
                check(batch)
            yield batch
    if lock is not None and lock.wanted(agreed):
        lock.agree(False)
    if end is not None and not agreed:
        end()


def _agreed_group(item: Any, strategy: Strategy) -> bool:
    """Whether `item` is a group `make_batches` yielded with `strategy`: every process got as
    many of its groups and as many batches in each (make_batches agreed on its settings)."""
    if not isinstance(item, MicroBatches):
        return False
    made_by = step_data(item).made_by
    return made_by is not None and made_by.strategy is strategy


def _from_the_start(
    batches: Iterable[Any], caller: str, state: TrainState | None = None
) -> Iterator[Any]:
    """`batches`, refusing the iterator of a `make_batches(data, state, ...)` call that starts
    past the epoch's first micro-batch (`ft.data.resumed_at`), or an iterable whose first group
    is that call's first, standing where `state` stands (an `islice` or a generator over it):
    it starts at the training state's cursor, so the rows before it would not be evaluated (the
    loss of a part of the data, without a word). At the epoch's start (cursor 0) such a call
    is the training loop's own iterator as far as anything can tell (evaluation data is read
    without the state: `make_batches(val, batch_size=..., shuffle=False)`): evaluating over it
    read the epoch the loop was about to train on, and the loop then trained on nothing.
    Groups collected as such (a list, a deque or another container of recent training groups,
    the step's own group) are what they are meant to be."""
    first = resumed_at(batches)
    # A container (a list, a deque of recent groups) holds groups collected as such; anything
    # else (make_batches' iterator, an islice or a generator over it, an iterable whose
    # __iter__ returns it) may be the loop's.
    if first is None and not isinstance(batches, Collection):
        it = iter(batches)
        head: Any = next(it, _NOTHING)
        if isinstance(head, MicroBatches) and _at_the_cursor(head, state):
            first = step_data(head).first
        batches = it if head is _NOTHING else itertools.chain([head], it)
    if first == 0:
        raise ValueError(
            f"{caller} got the groups of make_batches(data, state, ...) at the start of an "
            "epoch (state.data.cursor 0): that call reads the epoch the training loop stands "
            f"at, so over the loop's own iterator {caller} would read the epoch the loop is "
            "about to train on, and the loop would then train on nothing. Pass "
            "make_batches(data, batch_size=..., shuffle=False) without the state (with "
            "strategy=state.strategy for several processes)"
        )
    if first is not None:
        raise ValueError(
            f"{caller} got micro-batches of make_batches(data, state, ...) starting at "
            f"micro-batch {first}: that call starts where the state's training stands "
            f"(state.data.cursor), so the {first} micro-batch(es) before it would not "
            f"be read. Pass make_batches(data, batch_size=..., shuffle=False) without "
            "the state (with strategy=state.strategy for several processes)"
        )
    yield from batches


_NOTHING = object()


def _at_the_cursor(item: MicroBatches, state: TrainState | None) -> bool:
    """Whether `item` is the first group of a `make_batches(data, state, ...)` call, at the
    cursor `state` still stands at (not yet trained on: a group the loop trained on has moved
    the cursor past it): past its epoch's first micro-batch (a resumed epoch), or the epoch's
    first (the loop's iterator at the epoch's start)."""
    if state is None:
        return False
    data = step_data(item)
    call = data.made_by
    return (
        call is not None
        and call.stateful
        and data.first == call.start == state.data.cursor
        and call.epoch == state.epoch
    )


def _shuffled(position: str | None) -> bool:
    try:
        return position is not None and json.loads(position).get("shuffle") is True
    except (ValueError, AttributeError):  # not a position make_batches wrote
        return False


def evaluate(
    state: TrainState,
    batches: Iterable[Any],
    loss_fn: LossFn | None = None,
    *,
    metrics_fn: MetricsFn | None = None,
    perplexity: bool | None = None,
    strategy: Strategy | None = None,
) -> dict[str, Any]:
    """Return the loss over all `batches` as sum of item losses / number of items, over ranks.

    This is not a mean of batch means, so it does not depend on batch size or padding. The
    model runs in eval mode without gradients and gets its previous mode back afterwards.
    Reading the totals at the end is the one host sync.

    `eval_loss` is the loss the state trains on: without `loss_fn`, `state.loss_fn` (declared
    at `TrainState.create(..., loss_fn=...)`, or the loss the last `clip_and_step` applied),
    the default loss only when the state has none. So after training with a focal loss,
    `evaluate(state, batches)` reports the focal loss, and `track_best` and
    `save_checkpoint(best_metric=...)` rank by it. The record names the loss it computed:
    `eval_loss_fn` is the qualified name of the function behind `eval_loss` (`loss_name`);
    `track_best` refuses a record whose loss is not the state's, and checkpoint retention
    refuses to rank checkpoints whose `eval_loss_fn` differ.

    Args:
        state: the state to evaluate (not consumed).
        batches: e.g. `make_batches(val, batch_size=16, shuffle=False)`.
        loss_fn: `(model, batch) -> (loss_sum, num_items)`; if None, `state.loss_fn`, else
            `default_loss`.
        metrics_fn: `(model, batch) -> {name: (sum, count)}`; each metric is reported as its
            global sum / count (accuracy: `(correct, n)`), in bounded memory. When it returns
            `"loss"` too (from the same forward pass, e.g. `classification_metrics`), that is
            `eval_loss` and each batch runs through the model once, unless the state trains on
            a loss of its own (`state.loss_fn` other than the default loss): then `eval_loss`
            is that loss and the metrics' loss is reported as `eval_metrics_loss`. Giving
            `loss_fn` as well is an error (one of them would be ignored).
        perplexity: report `eval_ppl = exp(eval_loss)`. None (default): only where it is a
            perplexity, i.e. the default loss of a causal LM or seq2seq model; pass True for
            your own per-token loss.
        strategy: overrides `state.strategy`.

    Returns:
        `{"eval_loss", "eval_loss_fn", "eval_items"}`, `eval_ppl` (see `perplexity`), and
        `eval_<name>` per metric. Every value is a float except `eval_loss_fn`, a string.

    Raises:
        TypeError: for an argument of the wrong type (named in the message); for the parts
            of one batch given as batches (two dicts that share no key, e.g. the
            `[inputs, labels]` a DataLoader yields for `(inputs, labels)` rows: see
            `flatten_batches`), as `accumulate_grads` refuses an `[x, y]` batch of tensors.
            Batches of several tasks whose keys differ, in a list, are read one by one.
        ValueError: with no batches; when both `loss_fn` and a `metrics_fn` returning
            `"loss"` are given; when `metrics_fn` returns a name evaluate reports itself
            (`items`, `loss_fn`, `ppl`, and `metrics_loss` where that holds its loss); or, with
            several ranks, when `metrics_fn` returns other names on one rank than on another;
            when `metrics_fn` returns `"loss"` on some batches and not on others; under FSDP
            or TP, on every process, when the processes were given lists of different numbers
            of batches (checked with one small all-reduce and a host sync for a list or tuple
            that is not a group `make_batches` yielded with this strategy: unlike collectives
            would pair up and hang), or iterators that run out at different batches (checked
            with one small all-reduce before each batch that is not of such a group, and one
            at the end); with several ranks, on every rank, when one got no batches (checked
            before the first batch under DDP, whose first forward broadcasts the module's
            buffers: one small all-reduce, none for `make_batches`' groups), and when a batch
            failed on one rank without collectives in its forwards (DDP, after a first batch:
            that rank raises its error at the end, the others one that names it);
            when `batches` is the iterator of `make_batches(data, state, ...)`: it starts at
            the training cursor (`state.data.cursor`), and at an epoch's start it is the
            training loop's own (evaluating over it would read the epoch the loop is about
            to train on): read evaluation data without the state.
    """
    _check_args(state, batches, loss_fn, metrics_fn, perplexity, strategy)
    strategy = state.strategy if strategy is None else strategy
    counted = _check_batch_count(batches, strategy, "evaluate")
    lock = Lockstep.for_forwards(batches, strategy, "evaluate", counted=counted, model=state.model)
    # Without collectives in the forwards (DDP: but its first, which the rank has run once it
    # has read a batch), a rank that fails on a batch joins the others' one collective at the
    # end with its error, and every rank raises.
    joins = strategy.world_size > 1 and not forward_collectives(strategy)
    # (until a rank has run a forward, it may join only if that forward is no collective)
    open_first = joins and not first_forward_collective(strategy, state.model)
    done = 0
    own = None if loss_fn is not None or state.loss_fn is default_loss else state.loss_fn
    sums: dict[str, torch.Tensor] = {}
    scorer: Callable[..., Any] | None = None  # the function whose loss is eval_loss
    tokens = True  # every batch has a label per token
    failure: Exception | None = None
    try:
        with eval_mode(state.model), strategy.autocast():
            for batch in read_batches(batches, "evaluate", state, lock):
                batch, weight = weighted(batch)  # a ZeroWeight stand-in runs and counts nothing
                batch = strategy.to_device(batch)
                tokens = tokens and _token_labels(batch)
                parts, fn = _batch_sums(state.model, batch, loss_fn, metrics_fn, own)
                if scorer is not None and fn is not scorer:
                    raise ValueError(_LOSS_CHANGED.format(now=loss_name(fn), was=loss_name(scorer)))
                scorer = fn
                for name, (s, n) in parts.items():
                    pair = torch.stack(
                        [torch.as_tensor(x, device=strategy.device).double() for x in (s, n)]
                    )
                    # zeros, not 0 * pair: a stand-in's NaN (a mean over its 0 items, times 0)
                    # made the global sum NaN on several ranks, where one process was finite.
                    pair = pair if weight else torch.zeros_like(pair)
                    sums[name] = sums[name] + pair if name in sums else pair
                done += 1
    except Exception as e:
        if not (joins and (done or open_first)) or raised_everywhere(e):
            raise
        failure = e
    names = sorted(sums)
    why = "each name is summed over the ranks, so every rank must report every one"
    if not _agree_over_ranks(
        strategy, "evaluate", names, _METRICS_DIFFER, present=bool(sums), error=failure, why=why
    ):
        raise ValueError("evaluate got no batches")
    totals = strategy.all_reduce_sum(torch.stack([sums[n] for n in names])).tolist()  # host sync
    out = {f"eval_{n}": s / c if c else math.nan for n, (s, c) in zip(names, totals, strict=True)}
    if _is_perplexity(state.model, scorer, tokens) if perplexity is None else perplexity:
        out["eval_ppl"] = _perplexity(out["eval_loss"])
    out["eval_items"] = totals[names.index("loss")][1]
    return {**out, "eval_loss_fn": loss_name(scorer)}


def _check_batch_count(
    batches: Iterable[Any], strategy: Strategy, caller: str, *, paired: bool | None = None
) -> bool:
    """Raise on every process unless each one got as many batches, for a list or tuple of them
    that is not a group `make_batches` yielded with this strategy (whose counts every process
    agreed on): under FSDP and TP each forward runs collectives, which another count pairs up
    unlike (they hung until the backend's timeout). One small all-reduce and a host sync; none
    for an iterator (`make_batches(...)` itself), whose length is not known before it runs
    (`Lockstep` agrees batch by batch instead).

    Returns whether every process is known to have as many batches (counted, or such a group)."""
    if not isinstance(batches, (list, tuple, MicroBatches)):
        return False
    if isinstance(batches, MicroBatches) and _agreed_group(batches, strategy):
        return True
    if paired is None:  # forwards alone (no backward): DDP's run no collective
        paired = forward_collectives(strategy)
    if not paired:
        return False
    n = sum(1 for _ in flatten_batches(batches))
    _check_micro_count(strategy, n, caller, paired=paired)
    return True


def _is_perplexity(model: nn.Module, scorer: Any, tokens: bool) -> bool:
    """Whether `eval_loss` is the log of a perplexity: the default loss (a per-token LM loss)
    of a causal LM or seq2seq model, however it was chosen (no `loss_fn`, `loss_fn=default_loss`,
    or a `metrics_fn` that returns no loss: such an extra metric dropped `eval_ppl` before)."""
    return tokens and scorer is default_loss and loss_for(model) in (_CAUSAL, _SEQ2SEQ)


def _perplexity(loss: float) -> float:
    # exp overflows past ~709.78; a NaN loss is a NaN perplexity, not an infinite one.
    return math.nan if math.isnan(loss) else math.exp(loss) if loss < 700 else math.inf


def _agree_over_ranks(
    strategy: Strategy,
    caller: str,
    names: list[str],
    problem: str,
    *,
    present: bool = True,
    error: BaseException | None = None,
    done: int = 0,
    why: str = "",
) -> bool:
    """Raise on every data-parallel rank when one rank failed (`error`: raised there, and an
    error naming it on the others), when some ranks are `present` (have a batch, or any
    batches) and others not (after `done` batches each; `why` it matters), or when the present
    ones report other `names` (`problem`): the totals are summed over ranks row by row, so a
    name only some ranks return would be added to another name's row (or the collective would
    get tensors of different shapes). False when no rank is present (each is at its end).

    One all-reduce of 7 float64 over the ranks and a host sync, the collective the other
    ranks run anyway (`evaluate`'s at the end, `predict`'s per gathered batch): a rank that
    raised before it left them waiting in it until the backend's timeout."""
    if strategy.world_size == 1:
        if error is not None:
            raise error
        return present
    here = present and error is None
    key = hashlib.blake2b("\0".join(names).encode(), digest_size=4).digest()
    # Two 16-bit digests and their squares: the sums stay exact in float64 for any world size
    # up to 2^21, and n * sum(d^2) == sum(d)^2 holds only if every rank has the same d.
    digests = [int.from_bytes(key[:2], "little"), int.from_bytes(key[2:], "little")]
    sums = [float(x) if here else 0.0 for d in digests for x in (d, d * d)]
    mine = [1.0, float(here), float(error is not None), *sums]
    got = strategy.all_reduce_sum(
        torch.tensor(mine, dtype=torch.float64, device=strategy.device)
    ).tolist()  # host sync
    n, have, failed = (int(x) for x in got[:3])
    if failed:
        _raise_everywhere(error, caller, failed, n, "ranks", strategy.rank)
    if have == 0:
        return False
    if have < n:
        raise _everywhere(_ran_out(caller, here, have, n, "ranks", strategy.rank, done, why))
    totals = [int(x) for x in got[3:]]
    if any(n * totals[i + 1] != totals[i] ** 2 for i in (0, 2)):
        raise ValueError(problem.format(names=[name for name in names if name != "loss"]))
    return True


class Lockstep:
    """The processes' agreement, before a batch, that every one has a batch: where batches run
    collectives over the processes (FSDP's and TP's forwards, a generation synced over the
    ranks, DDP's first forward), a process without one, or one whose batch was refused, left
    the others waiting in them until the backend's timeout. `agree` is one all-reduce of three
    integers over every process and a host sync: before each batch (`read_batches` lets the
    batches of a group every process has as many of through, unless `every`), or only before
    the first (`first`), and once at the end (`first`: only where a process had none).

    `why`: what pairs the processes up, for the message."""

    def __init__(
        self, strategy: Strategy, caller: str, why: str, *, every: bool = False, first: bool = False
    ):
        self.strategy, self.caller, self.why = strategy, caller, why
        self.every, self.first = every, first
        self.done = 0  # batches every process has had, as far as they agreed

    @classmethod
    def for_forwards(
        cls,
        batches: Iterable[Any],
        strategy: Strategy,
        caller: str,
        *,
        counted: bool,
        model: nn.Module,
    ) -> Lockstep | None:
        """The lockstep `evaluate` and `predict` need, unless every process is known to have
        as many batches (`counted`: `_check_batch_count`) or there is one process.

        Under FSDP and TP (forwards with collectives), before each batch of an iterator, whose
        length is not known before it runs. Under DDP, before the first batch only: its first
        forward after a training step broadcasts the module's buffers from rank 0 (a rank that
        had no batch never joined it); after that its forwards run no collective, and the
        ranks may read other numbers of batches; none where its next forward runs no
        collective (`next_forward_collective`: a module without buffers, or a forward since
        the last training step), so that a rank predicting alone (`gather=False` on rank 0)
        does not wait for the others."""
        if counted or not several_processes():
            return None
        if forward_collectives(strategy):
            why = (
                f"under {type(strategy).__name__} every batch's forward runs collectives over "
                "the processes, which would pair up unlike and hang until the backend's timeout"
            )
            return cls(strategy, caller, why)
        if strategy.world_size == 1 or not first_forward_collective(strategy, model):
            return None
        why = (
            "the ranks' first forward is a collective (DDP broadcasts the module's buffers from "
            "rank 0 then), and their sums or gathers too"
        )
        return cls(strategy, caller, why, first=True)

    def wanted(self, agreed: bool) -> bool:
        """Whether the processes agree before the next batch (`agreed`: of a group every
        process has as many batches of)."""
        return not (agreed and not self.every) and not (self.first and self.done)

    def agree(self, present: bool, error: BaseException | None = None) -> bool:
        """True when every process has a batch, False when none has; raise on every process
        when some have and others not, or when a process's batch was refused (`error`: raised
        here, and an error naming it on the others)."""
        here = present and error is None
        mine = torch.tensor([1, int(here), int(error is not None)], dtype=torch.int64)
        total, have, failed = self.strategy.sum_over_processes(
            mine.to(self.strategy.device)
        ).tolist()  # host sync
        rank = torch.distributed.get_rank()
        if failed:
            _raise_everywhere(error, self.caller, failed, total, "processes", rank)
        if have == total:
            self.done += 1
            return True
        if have == 0:
            return False
        raise _everywhere(
            _ran_out(self.caller, here, have, total, "processes", rank, self.done, self.why)
        )


def first_forward_collective(strategy: Strategy, model: nn.Module) -> bool:
    """Whether `model`'s next forward under `strategy` is a collective where its forwards are
    otherwise none (DDP's buffer broadcast: `next_forward_collective`); a strategy of one's
    own without the method: taken as one."""
    ask = getattr(strategy, "next_forward_collective", None)
    return bool(ask(model)) if callable(ask) else True


def forward_collectives(strategy: Strategy) -> bool:
    """Whether each forward of `strategy` runs collectives (FSDP, TP); a strategy of one's own
    without the attribute: its micro-batch rule."""
    if hasattr(strategy, "forward_collectives"):
        return bool(strategy.forward_collectives)
    return bool(getattr(strategy, "micro_counts_must_match", False))


def several_processes() -> bool:
    """Whether this process is one of an initialised process group of several."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _everywhere(error: BaseException) -> BaseException:
    """Mark `error` as raised on every process alike: a caller that joins the others'
    collective with its error (`evaluate`, `predict`) lets it through."""
    error._ftrain_everywhere = True  # type: ignore[attr-defined]
    return error


def raised_everywhere(error: BaseException) -> bool:
    return getattr(error, "_ftrain_everywhere", False) is True


def _raise_everywhere(
    error: BaseException | None, caller: str, failed: int, total: int, who: str, rank: int
) -> NoReturn:
    """`error` where it was raised; on the other processes, an error that names it."""
    if error is not None:
        raise _everywhere(error)
    raise _everywhere(
        ValueError(
            f"{caller}: {failed} of the {total} {who} failed on their batch (their error is "
            f"raised there; this is rank {rank}), so this one stops too rather than wait for "
            "them in a collective until the backend's timeout"
        )
    )


def _ran_out(
    caller: str, mine: bool, have: int, total: int, who: str, rank: int, done: int, why: str
) -> ValueError:
    here = f"this process (rank {rank})"
    if done == 0 and mine:
        head = (
            f"{caller} got no batches on {total - have} of the {total} {who}, while {here} had some"
        )
    elif done == 0:
        head = f"{caller} got no batches on {here}, while {have} of the {total} {who} had some"
    elif mine:
        head = (
            f"{caller}: {total - have} of the {total} {who} ran out of batches after {done}, "
            f"while {here} had more"
        )
    else:
        head = (
            f"{caller}: {here} ran out of batches after {done}, while {have} of the {total} "
            f"{who} had more"
        )
    return ValueError(
        f"{head}: {why}. Give every process as many batches: make_batches(data, "
        "batch_size=..., shuffle=False, strategy=state.strategy) does (a process without rows "
        "for the last batch gets an ft.data.ZeroWeight stand-in, which runs and counts nothing)"
    )


_LOSS_CHANGED = (
    "evaluate: metrics_fn returned 'loss' on some batches and not on others, so eval_loss would "
    "sum {was} on some batches with {now} on others; return 'loss' from metrics_fn on every "
    "batch (with (0, 0) where a batch has no items), or on none"
)
_METRICS_DIFFER = (
    "evaluate: metrics_fn returned other names on this rank ({names}) than on another rank; "
    "each name is summed over the ranks, so every rank must return every name, with (0, 0) "
    "where it has no rows for it (as ft.generation.multiple_choice_metrics does for its "
    "subjects)"
)
_OUTPUTS_DIFFER = (
    "predict: output_fn returned other names on this rank ({names}) than on another rank; each "
    "output is gathered over the ranks by name, so every rank must return the same names"
)


def _check_args(
    state: Any, batches: Any, loss_fn: Any, metrics_fn: Any, perplexity: Any, strategy: Any
) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an ft.TrainState, got {type(state).__name__}")
    _check_batches(batches)
    for name, fn in (("loss_fn", loss_fn), ("metrics_fn", metrics_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function (model, batch) -> ..., got {fn!r}")
    if perplexity is not None and not isinstance(perplexity, bool):
        raise TypeError(f"perplexity must be True, False or None, got {perplexity!r}")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an ft.strategies.Strategy, got {strategy!r}")


def _check_batches(batches: Any) -> None:
    # A tensor is iterable too: its rows were read as batches, one output per row.
    if isinstance(batches, (str, bytes, Mapping, torch.Tensor)) or not isinstance(
        batches, Iterable
    ):
        raise TypeError(
            f"batches must be an iterable of batches (make_batches(val, batch_size=...) or a "
            f"list), got {type(batches).__name__}; wrap a single batch: [batch]"
        )
    # evaluate(state, (inputs, labels)): one row's or batch's parts. A list of two tasks'
    # batches is a list of batches, as an iterator of them is, so only a tuple is refused here.
    if isinstance(batches, tuple):
        _check_parts(batches, "batches")


def check_prediction_args(
    state: Any, batches: Any, *, gather: Any, strategy: Any, output_fn: Any = None
) -> None:
    """Check `predict`'s and `generate`'s arguments as `evaluate` checks its own.

    Raises:
        TypeError: for an argument of the wrong type (named in the message).
    """
    _check_args(state, batches, None, None, None, strategy)
    if output_fn is not None and not callable(output_fn):
        raise TypeError(f"output_fn must be a function (model, batch) -> dict, got {output_fn!r}")
    if not isinstance(gather, bool):
        raise TypeError(f"gather must be True or False, got {gather!r}")


def _batch_sums(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    metrics_fn: MetricsFn | None,
    own: LossFn | None,
) -> tuple[dict[str, Any], Callable[..., Any]]:
    """One batch's (sum, count) per reported name, and the function behind "loss". `own` is
    the state's training loss when it is not the default one (and no `loss_fn` was given)."""
    parts = dict(metrics_fn(model, batch)) if metrics_fn is not None else {}
    taken = sorted(_RESERVED & set(parts))
    if own is not None and "loss" in parts and "metrics_loss" in parts:
        taken.append("metrics_loss")  # where the metrics' own "loss" goes
    if taken:
        raise ValueError(
            f"evaluate: metrics_fn returned {taken}, which evaluate reports itself "
            f"({', '.join('eval_' + n for n in taken)}); one would overwrite the other: rename "
            "them in metrics_fn"
        )
    if own is not None and "loss" in parts:  # the training loss is eval_loss; keep theirs too
        parts["metrics_loss"] = parts.pop("loss")
    if metrics_fn is None or "loss" not in parts:
        scorer = loss_fn if loss_fn is not None else own if own is not None else default_loss
        parts["loss"] = scorer(model, batch)
        return parts, scorer
    if loss_fn is not None:
        raise ValueError(
            "evaluate got loss_fn and a metrics_fn that returns 'loss' too; one would be "
            "ignored: drop loss_fn to report the metrics' loss, or return no 'loss' from "
            "metrics_fn to report loss_fn's"
        )
    return parts, metrics_fn


# Keys of evaluate's record that are not a metrics_fn's sums: eval_items, eval_loss_fn, eval_ppl.
_RESERVED = frozenset({"items", "loss_fn", "ppl"})


def _token_labels(batch: Any) -> bool:
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    return isinstance(labels, torch.Tensor) and labels.dim() > 1


@contextlib.contextmanager
def eval_mode(model: nn.Module, *, no_grad: bool = True) -> Iterator[None]:
    """Run the block with `model` in eval mode and without gradients; each submodule's previous
    mode comes back afterwards, even on error (a submodule the caller keeps in eval mode inside
    a training model, such as a frozen BatchNorm, stays in eval mode). `no_grad=False` leaves
    the grad mode alone: a generator that yields inside the block would otherwise turn the
    caller's gradients off too (grad mode is thread-wide); it holds `torch.no_grad()` around
    its own work instead.

    Example:
        >>> import torch
        >>> from ftrain.eval import eval_mode
        >>> model = torch.nn.Dropout(0.5)
        >>> with eval_mode(model):
        ...     model.training, torch.is_grad_enabled()
        (False, False)
        >>> model.training
        True
    """
    with _in_eval(model), torch.no_grad() if no_grad else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _in_eval(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode for the block; each submodule's own previous mode afterwards."""
    # Each module's own flag: model.train(True) afterwards would also switch a submodule the
    # caller froze with .eval() (a BatchNorm whose running statistics must stay) back to
    # training, and the next steps would silently update it.
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        model.train(modes[0][1])
        for m, training in modes:  # in pre-order: a parent before its children
            if m.training != training:
                m.train(training)


def classification_metrics(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """A `metrics_fn` for classifiers: summed cross-entropy and accuracy from one forward pass.

    One label per row (sequence classification) or per token (token classification: logits
    `(batch, seq, classes)`, labels `(batch, seq)`, no shift). Labels of -100 are ignored.
    `evaluate(state, batches, metrics_fn=ft.classification_metrics)` reports `eval_loss` and
    `eval_accuracy`.

    Raises:
        ValueError: for a causal LM or an encoder-decoder (labels shifted or fed to a decoder:
            scored unshifted, the loss would be wrong), and for regression or multi-label
            batches (float labels, one output).
    """
    _check_classifier(model)
    # The padding the mask declares, in the model's pad id (padded_as_model: a decoder's
    # sequence classifier finds each row's end by it).
    if "labels" not in batch:
        raise _no_labels(batch, "classification_metrics needs 'labels' in the batch")
    logits, labels = upcast(model_logits(model, padded_as_model(model, batch))), batch["labels"]
    if logits.shape[-1] == 1 or labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(
            "classification_metrics needs integer class labels and a head of several classes; "
            f"got logits {tuple(logits.shape)} and {labels.dtype} labels (regression or "
            "multi-label): pass a metrics_fn of your own"
        )
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)  # token labels too
    keep = labels != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(
        logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    correct = ((logits.argmax(-1) == labels) & keep).sum()
    n = keep.sum()
    return {"loss": (loss, n), "accuracy": (correct, n)}


def _check_classifier(model: nn.Module) -> None:
    """Refuse a model whose loss shifts its labels or runs a decoder on them (causal LMs,
    encoder-decoders): scored unshifted, its `eval_loss` would be silently wrong."""
    try:
        fn = _defaults(model)[0]  # looked up once per model
    except TypeError:  # a module of your own: its logits are taken as they come
        return
    if fn is _CAUSAL or fn is _SEQ2SEQ:
        raise ValueError(
            f"classification_metrics scores logits[t] against labels[t], unshifted, but "
            f"{type(_base_model(model)).__name__} is a causal LM or an encoder-decoder (its "
            "labels are shifted, or feed its decoder): use evaluate's default loss, or a "
            "metrics_fn of your own"
        )


def _default_outputs(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    if not isinstance(batch, Mapping):
        raise TypeError("predict needs output_fn for batches that are not dicts")
    try:
        kind = _defaults(model)[0]
    except TypeError:  # a module of your own: run as it comes
        kind = None
    if kind is _SEQ2SEQ:  # (the encoder's input as the loss reads it)
        batch = _with_decoder_inputs(model, _encoder_right_aligned(model, batch))
    out = {
        "logits": model_logits(model, padded_as_model(model, batch) if kind is _CLASSIFY else batch)
    }
    if "labels" in batch:
        out["labels"] = batch["labels"]
    return out


def _with_decoder_inputs(model: nn.Module, batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """An encoder-decoder's batch with the decoder inputs its labels give (as the loss builds
    them): `model_logits` leaves the labels out of the call, and without decoder inputs BART
    decodes its own `input_ids` shifted (logits of another sequence) and T5 raises."""
    if batch.get("decoder_input_ids") is not None or batch.get("decoder_inputs_embeds") is not None:
        return batch
    if batch.get("labels") is None:
        raise ValueError(
            f"predict: {type(_base_model(model)).__name__} is an encoder-decoder, and the batch "
            "has no labels or decoder_input_ids to feed its decoder (without them BART decodes "
            "its own input_ids); put labels in the batch for the logits of the labels, or use "
            "ft.generate for completions"
        )
    return {**batch, "decoder_input_ids": _decoder_inputs(model, batch["labels"])}


def predict(
    state: TrainState,
    batches: Iterable[Any],
    output_fn: OutputFn | None = None,
    *,
    gather: bool = True,
    strategy: Strategy | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Stream per-sample outputs as numpy arrays, one dict per batch, in batch order.

    Nothing accumulates: consume the iterator batch by batch (e.g. update a running
    accuracy) and memory stays bounded however large the dataset. Each yielded array has the
    batch's samples as its first axis, so counts are exact (no padding samples). With several
    data-parallel ranks, every rank yields the whole global batch: the ranks' rows in rank
    order, which is the order one process yields with the global batch size (`make_batches`
    gives every sample to exactly one rank, and a rank without rows adds none). Axes beyond the
    first that differ between ranks (each rank pads its own sequences) are padded with -100,
    as HF's Trainer does. `gather=False` yields only this rank's rows instead. The model is in
    eval mode while the iterator runs (each batch's forward in eval mode even if the loop body
    switched it to training mode, e.g. by a training step), and in its previous mode once it is
    exhausted or closed;
    each batch's forward runs without gradients and under the strategy's autocast, but the
    code between batches (the loop body) runs with the caller's grad mode and precision.

    Args:
        state: the state to predict with (not consumed).
        batches: e.g. `make_batches(test, batch_size=64, shuffle=False)`.
        output_fn: `(model, batch) -> {name: tensor}`; by default the model's logits plus the
            batch's labels when it has them (an encoder-decoder's decoder reads its labels as
            the loss feeds them; a batch with neither labels nor `decoder_input_ids` raises).
            Return only what you need (`argmax` rather than logits) to move less to the host.
        gather: gather every rank's rows (a collective: all ranks must iterate together).
            `False` under DDP: each rank predicts alone, through the module inside DDP's
            wrapper (its first forward after training broadcasts buffers, a collective), which
            `output_fn` is given.
        strategy: overrides `state.strategy`.

    Yields:
        `{name: np.ndarray}` per batch (a host sync per batch, by nature).

    Raises:
        TypeError: for an argument of the wrong type (named in the message), or the parts
            of one batch given as batches (as `evaluate`).
        ValueError: with no batches, or batches `make_batches` shuffled (the outputs would
            not line up with the dataset); if the outputs of one batch disagree on the number of
            samples, or (when gathering) `output_fn` returns other names on one rank than on
            another; when gathering, or under FSDP or TP, on every process, when the processes
            were given lists of different numbers of batches, or iterators that run out at
            different batches, or one got none (as `evaluate`); when gathering without
            collectives in the forwards (DDP), on every rank, when a batch failed on one rank
            after a first one (that rank raises its error, the others one that names it); for
            `make_batches(data, state, ...)`'s iterator (as `evaluate`).
    """
    check_prediction_args(state, batches, gather=gather, strategy=strategy, output_fn=output_fn)
    strategy = state.strategy if strategy is None else strategy
    output_fn = _default_outputs if output_fn is None else output_fn
    model = state.model
    # The model stays in eval mode across the yields; no_grad and autocast hold only around
    # each batch's forward: entered across a yield, they were the caller's too, so the loop
    # body ran without gradients and its float32 matmuls in bf16 (grad mode and autocast are
    # thread-wide, not the generator's).
    # Gathering is a collective per batch, as FSDP's and TP's forwards are: lists of other
    # lengths on other processes paired one call's batches with the next call's, then hung.
    gathering = gather and strategy.world_size > 1
    owner = state.strategy  # (what wrapped the model; `strategy` may be SingleDevice())
    if not gathering and owner.world_size > 1 and not forward_collectives(owner):
        # Each rank predicts alone (a rank-0 predict, docs/data.md): through the module inside
        # the wrapper, whose first forward after training broadcasts buffers (a collective the
        # other ranks never join). Its outputs are the same: the forward runs no other.
        model = owner.unwrap(model)
    counted = _check_batch_count(batches, strategy, "predict", paired=True if gathering else None)
    lock = Lockstep.for_forwards(batches, strategy, "predict", counted=counted, model=model)
    # Gathering without collectives in the forward (DDP, after its first): the names check of
    # each batch's gather is where the ranks agree that each has a batch and none failed on
    # its own (a rank that raised, or ran out, left the others waiting in it), and once more at
    # the end of an iterator, whose length is not known.
    joins = gathering and not forward_collectives(strategy)
    open_first = joins and not first_forward_collective(strategy, model)
    why = "each batch's outputs are gathered over the ranks, a collective per batch"
    done = [0]  # batches every rank has had

    def end() -> None:
        _agree_over_ranks(strategy, "predict", [], "", present=False, done=done[0], why=why)

    reader = prediction_batches(
        batches,
        "predict",
        state,
        lock,
        strategy=strategy,
        end=end if joins and not counted else None,
    )
    with _in_eval(model):
        while True:
            failure: Exception | None = None
            outputs: dict[str, torch.Tensor] = {}
            try:
                batch = next(reader, _NOTHING)
                if batch is _NOTHING:
                    return
                batch, weight = weighted(batch)
                # The loop body may have put the model back in training mode (accumulate_grads
                # does): this batch's forward still runs in eval mode, the body keeps its mode.
                again = _in_eval(model) if model.training else contextlib.nullcontext()
                with again, torch.no_grad(), strategy.autocast():
                    outputs = dict(output_fn(model, strategy.to_device(batch)))
            except Exception as e:
                # (a rank that has not run a batch yet may have failed before DDP's first
                # forward, a collective the others are in: it cannot join them)
                if not (joins and (done[0] or open_first)) or raised_everywhere(e):
                    raise
                failure = e
            if gathering:
                # Gathered name by name: names that differ would pair one rank's rows with
                # another's of another output, or leave a rank waiting in a gather.
                names = sorted(outputs)
                _agree_over_ranks(
                    strategy,
                    "predict",
                    names,
                    _OUTPUTS_DIFFER,
                    error=failure,
                    done=done[0],
                    why=why,
                )
                # A ZeroWeight stand-in joins the gathers with no rows.
                outputs = {
                    k: strategy.gather_rows(_rows(v)[: None if weight else 0])
                    for k, v in sorted(outputs.items())
                }
            done[0] += 1
            if not (gathering or weight):  # a stand-in ran for the collectives; it yields nothing
                continue
            arrays = {k: _to_numpy(v) for k, v in outputs.items()}
            sizes = {k: a.shape[0] if a.ndim else 1 for k, a in arrays.items()}
            if len(set(sizes.values())) > 1:
                raise ValueError(f"outputs disagree on the number of samples: {sizes}")
            yield arrays


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(1) if t.dim() == 0 else t.detach()


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()  # numpy has no bfloat16
    return t.cpu().numpy()
