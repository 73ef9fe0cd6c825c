"""What the map-style and the stream paths of `make_batches` share: orders, seeding, loading,
and the group of micro-batches one step consumes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import random
import signal
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import numpy as np
import torch

from ftrain.process_state import STATE
from ftrain.rng import dropout_seed
from ftrain.strategies import Strategy, active_preemption, await_collective, collective_seconds

__all__ = [
    "MadeBy",
    "MicroBatches",
    "Source",
    "StepSpan",
    "ZeroWeight",
    "epoch_order",
    "is_stream",
    "length_grouped_order",
    "num_micro_batches",
    "run_loader",
    "record_resumed",
    "resumed_at",
    "saved_generators",
    "seed_generators",
    "seeded",
    "step_data",
    "step_span",
    "weighted",
    "yielded_group",
]

Batch = Any
Collate = Callable[[list[Any]], Batch]
Pos = Any  # a JSON value
Items = Iterator[tuple[Any, Pos]]

# Key of the per-(seed, epoch) generator: a fixed odd multiplier keeps nearby seeds apart.
_EPOCH_STRIDE = 0x9E3779B97F4A7C15


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * _EPOCH_STRIDE + epoch) % (2**63))


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Return the shuffled row order of one epoch: a pure function of `(n, seed, epoch)`.

    Example:
        >>> from ftrain.data import epoch_order
        >>> sorted(epoch_order(5, 0, 0).tolist())
        [0, 1, 2, 3, 4]
    """
    order = torch.randperm(n, generator=_generator(seed, epoch)).numpy()
    order.setflags(write=False)
    return order


def length_grouped_order(
    lengths: Sequence[int],
    batch_size: int,
    seed: int,
    epoch: int,
    mega_batch_mult: int | None = None,
) -> np.ndarray:
    """Order rows like HF's `LengthGroupedSampler`: shuffle, cut into mega-batches of
    `mega_batch_mult * batch_size`, sort each by length (longest first), and put the longest
    mega-batch head at the very front so that an out-of-memory error happens at once.

    Given the same generator it returns exactly HF's `get_length_grouped_indices`.
    """
    n = len(lengths)
    if mega_batch_mult is None:
        mega_batch_mult = max(min(n // (batch_size * 4), 50), 1)
    perm = torch.randperm(n, generator=_generator(seed, epoch)).tolist()
    size = mega_batch_mult * batch_size
    megas = [
        sorted(perm[i : i + size], key=lambda j: lengths[j], reverse=True)
        for i in range(0, n, size)
    ]
    heads = [lengths[m[0]] for m in megas]
    top = int(np.argmax(heads))  # first maximum, as torch.argmax
    megas[0][0], megas[top][0] = megas[top][0], megas[0][0]
    return np.fromiter((i for m in megas for i in m), dtype=np.int64, count=n)


def num_micro_batches(
    n: int, batch_size: int, *, world_size: int = 1, drop_last: bool = False
) -> int:
    """Micro-batches in one epoch of `n` rows with `batch_size` rows per rank."""
    rows = batch_size * world_size
    return n // rows if drop_last else -(-n // rows)


class ZeroWeight(NamedTuple):
    """A micro-batch that counts for nothing: a rank's stand-in when the final, short global
    micro-batch has no rows for it.

    It holds a real row (the global micro-batch's first), so the forward and backward run and
    the rank joins the same collectives as the others, but `accumulate_grads` and `evaluate`
    give it weight zero and count none of its items, tokens or samples.
    """

    batch: Batch


def weighted(batch: Any) -> tuple[Batch, float]:
    """`(batch, 1.0)`, or `(stand-in row, 0.0)` for a `ZeroWeight`: run it, count nothing."""
    return (batch.batch, 0.0) if isinstance(batch, ZeroWeight) else (batch, 1.0)


def several_processes(strategy: Strategy | None) -> bool:
    """Whether `make_batches` runs with a strategy in a process group of several processes
    (where `agree_over_ranks` checks)."""
    dist = torch.distributed
    ready = strategy is not None and dist.is_available() and dist.is_initialized()
    return ready and dist.get_world_size() > 1


def agree_over_ranks(strategy: Strategy | None, given: dict[str, Any]) -> None:
    """Raise unless every process of the job was given the same `given` (data and settings).

    Each data-parallel rank takes its own part of one global order, and the ranks of a
    tensor-parallel group the same part: ranks given other data (a per-rank split), another
    batch size, accum, start, drop_last, ... read the same rows, leave rows unread, or run
    other numbers of micro-batches, which DDP trains on without a word. One small collective
    over every process (a host sync once per `make_batches` call, never per step); nothing
    outside an initialised process group of several processes.
    """
    if strategy is None or not several_processes(strategy):
        return
    # Two 16-bit digests per value and their squares: sums exact in float64 up to 2^21
    # processes, and n * sum(d^2) == sum(d)^2 only if every process has the same d.
    mine = [1.0]
    for value in given.values():
        text = json.dumps(value, sort_keys=True, default=repr)
        key = hashlib.blake2b(text.encode(), digest_size=4).digest()
        for d in (int.from_bytes(key[:2], "little"), int.from_bytes(key[2:], "little")):
            mine += [float(d), float(d * d)]
    total = torch.tensor(mine, dtype=torch.float64, device=strategy.device)
    try:
        summed = strategy.sum_over_processes(total)
        await_collective(summed.device, collective_seconds())
        got = summed.tolist()  # host sync, once per make_batches call
    except (RuntimeError, TimeoutError) as e:  # gloo's timeout or a peer gone; ours below
        raise RuntimeError(_ALONE.format(why=e)) from e
    n = got[0]
    differ = [
        name
        for i, name in enumerate(given)
        if any(n * got[4 * i + j + 2] != got[4 * i + j + 1] ** 2 for j in (0, 2))
    ]
    if differ:
        shown = ", ".join(f"{k}={_short(given[k])}" for k in differ)
        raise ValueError(
            f"make_batches was given other {', '.join(differ)} on this rank ({shown}) than on "
            "another: the data and settings must be the same on every rank, which each take "
            "their own part of one global order (else ranks read the same rows, leave rows "
            "unread, or run different numbers of micro-batches). Pass every rank the whole "
            "dataset (not a per-rank split such as split_dataset_by_node) and the same "
            "settings; make_batches(data, state, ...) with strategy=state.strategy splits it"
        )


_ALONE = (
    "make_batches checks, in one collective over every process of the job, that each was given "
    "the same data and settings, and the other processes did not join it ({why}): every "
    "process must call make_batches together (not under `if rank == 0:`, nor on the ranks "
    "that have data only). A process that failed, exited or waits in another collective "
    "leaves it waiting too; it waits for the collective timeout (ft.strategies.from_env("
    "timeout=...), or FTRAIN_COLLECTIVE_TIMEOUT seconds)"
)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Spec(NamedTuple):
    """What make_batches was asked for, as passed to the loaders."""

    batch_size: int
    accum: int
    seed: int
    epoch: int
    shuffle: bool
    drop_last: bool
    collate: Collate
    rank: int
    world: int


# Keeps data-path seeds apart from the dropout seeds of the same numbers (grads.dropout_seed).
_DATA_STREAM = 0xDA7A
_LOADER_STREAM = 0x10AD


@contextlib.contextmanager
def seeded(seed: int, epoch: int, micro: int, rank: int) -> Iterator[None]:
    """Seed torch's default generator, `random` and numpy's global generator from the
    micro-batch's position for the block, and restore them afterwards.

    Example:
        >>> import torch
        >>> from ftrain.data import seeded
        >>> with seeded(0, 1, 2, 0):
        ...     a = torch.rand(2)
        >>> with seeded(0, 1, 2, 0):
        ...     b = torch.rand(2)
        >>> bool((a == b).all())
        True
    """
    with saved_generators():
        seed_generators(seed, epoch, micro, rank)
        yield


def seed_generators(seed: int, epoch: int, micro: int, rank: int) -> None:
    """Seed torch's default generator, `random` and numpy's global generator as `seeded` does,
    without saving them: for a run of micro-batches collated one after the other inside one
    `saved_generators()` block (a group), each from its own seeds."""
    s = dropout_seed(seed ^ _DATA_STREAM, epoch, micro, rank)
    torch.default_generator.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)


@contextlib.contextmanager
def saved_generators() -> Iterator[None]:
    """Put torch's default generator, `random` and numpy's global generator back as they were
    when the block began. (Saving and restoring numpy's state is ~0.1 ms, most of what seeding
    a micro-batch costs: a group saves them once, not once per micro-batch.)"""
    saved = torch.default_generator.get_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


class Loading(NamedTuple):
    """How micro-batches are loaded: in-process, or by DataLoader workers."""

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool

    @classmethod
    def check(cls, num_workers: int, prefetch_factor: int | None, pin_memory: bool) -> Loading:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if prefetch_factor is not None:
            if num_workers == 0:
                raise ValueError(
                    f"prefetch_factor={prefetch_factor!r} needs num_workers > 0 (the loop's "
                    "own process loads one micro-batch at a time); drop it or add workers"
                )
            if type(prefetch_factor) is not int or prefetch_factor < 1:
                raise ValueError(f"prefetch_factor must be an int >= 1, got {prefetch_factor!r}")
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be True or False, got {pin_memory!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs a CUDA device; pass pin_memory=False on CPU")
        return cls(num_workers, prefetch_factor, bool(pin_memory))

    def loader(self, dataset: Any, spec: Spec, **kw: Any) -> torch.utils.data.DataLoader[Batch]:
        """A DataLoader over `dataset` whose workers ignore the preemption signals (if any),
        its base seed drawn from a generator seeded from `spec`'s `(seed, epoch, rank)`."""
        preemption = active_preemption()
        signals = () if preemption is None else preemption.signals
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            collate_fn=_identity,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            worker_init_fn=functools.partial(_ignore_signals, signals) if signals else None,
            # Its base seed (workers' own seeds: `get_worker_info().seed`, which a dataset may
            # seed a generator of its own from) from a generator of its own, seeded from the
            # run's seed, the epoch and the rank: drawn from the default generator, it moved the
            # loop's random stream with num_workers and pin_memory.
            generator=torch.Generator().manual_seed(
                dropout_seed(spec.seed ^ _LOADER_STREAM, spec.epoch, spec.rank, 0)
            ),
            **kw,
        )


def _ignore_signals(signals: tuple[signal.Signals, ...], worker_id: int) -> None:
    """In a DataLoader worker: ignore the signals that ask the loop to save and stop.

    A scheduler signals the whole process group (SLURM, `kill -TERM -<pgid>`), workers
    included, and torch's worker handler ends a worker on a SIGTERM its parent did not send:
    the loop would then fail instead of saving. The loop's own process handles the signal,
    saves, and ends its workers by closing the loader.
    """
    for s in signals:
        signal.signal(s, signal.SIG_IGN)


def _identity(batch: Batch) -> Batch:
    return batch


def run_loader(loader: torch.utils.data.DataLoader[Batch]) -> Iterator[Batch]:
    """Iterate `loader`, ending its workers when the generator is exhausted, closed (a loop
    that `break`s drops it) or garbage-collected."""
    it = iter(loader)
    try:
        yield from it
    finally:
        # torch's own __del__ path; called here so that no reference cycle delays it.
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


@dataclasses.dataclass(frozen=True)
class MicroBatches(Sequence[Batch]):
    """The `accum` micro-batches of one optimizer step, as `make_batches` yields them.

    A read-only sequence of collated batches (iterate, index or `len` it like a list), plus
    `position`: where the epoch stands after these micro-batches (JSON: a stream's position,
    or for map-style data the row and global batch the cursor counts from), which
    `accumulate_grads` reports in `stats.position` and `clip_and_step` keeps in
    `state.data.position`; None for groups built by hand.

    While a group `make_batches` yielded lives, `accumulate_grads` knows where the data stands
    after a plain list, tuple or slice of its micro-batches too (`list(micro)`, `micro[:2]`
    then `micro[2:]`): consecutive ones, in the order they were yielded (`step_data`).
    """

    batches: tuple[Batch, ...]
    position: str | None = None

    @overload
    def __getitem__(self, i: int) -> Batch: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Batch]: ...
    def __getitem__(self, i: int | slice) -> Any:
        return self.batches[i]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def __getstate__(self) -> dict[str, Any]:
        # Where make_batches yielded it (`_origin`, which holds the strategy) stays behind: a
        # copy or an unpickled group is one built by hand, with its position.
        return {"batches": self.batches, "position": self.position}


class MadeBy(NamedTuple):
    """The `make_batches` call a group came from: its strategy (which every process agreed on
    the data and settings over, so that each yields groups of the same sizes), its epoch, and
    whether it read the epoch, cursor and position from a state (`stateful`)."""

    strategy: Strategy | None
    epoch: int
    stateful: bool
    start: int = 0  # the micro-batch of the epoch the call started at
    keyed: bool = False  # given start= without a state (the loop of start=state.data.cursor)


class _Origin(NamedTuple):
    """Where a group sits in its epoch: micro-batch `first` is its first, and `after[i]` is the
    data position after its micro-batch i."""

    call: MadeBy
    first: int
    after: tuple[str | None, ...]


def yielded_group(
    batches: tuple[Batch, ...], after: tuple[str | None, ...], call: MadeBy, first: int
) -> MicroBatches:
    """The group `make_batches` yields: micro-batches `first, first + 1, ...` of the epoch, each
    followed by the position in `after`, recorded (`STATE.micro_groups`) for as long as the group
    lives, so that a list or slice of its micro-batches is traced back to it (`step_data`)."""
    group = MicroBatches(batches, after[-1])
    object.__setattr__(group, "_origin", _Origin(call, first, after))
    keys = tuple(map(id, batches))
    ref = weakref.ref(group, functools.partial(_forget, keys))
    STATE.micro_groups.update(dict.fromkeys(keys, ref))
    return group


def _forget(keys: tuple[int, ...], ref: weakref.ref[MicroBatches]) -> None:
    """A group is gone: drop its batches' entries (those a later group did not take over)."""
    table = STATE.micro_groups
    for key in keys:
        if table.get(key) is ref:
            del table[key]


def resumed_at(batches: Any) -> int | None:
    """The micro-batch a `make_batches(data, state, ...)` iterator starts at when that is past
    its epoch's first (the state's cursor: a resumed epoch); None for any other iterable, such
    an iterator that starts at 0, or its groups collected in a list or a deque.

    `evaluate` and `predict` refuse such an iterator: evaluation data given the training state
    would be read from the training cursor on, the rows before it left out.
    """
    try:
        return STATE.resumed_iterators.get(batches)
    except TypeError:  # an unhashable iterable: no make_batches iterator
        return None


def record_resumed(iterator: Iterator[MicroBatches], start: int) -> Iterator[MicroBatches]:
    """Record a `make_batches(data, state, ...)` iterator that starts at micro-batch `start`
    (`resumed_at`); return it."""
    if start > 0:
        STATE.resumed_iterators[iterator] = start
    return iterator


class StepData(NamedTuple):
    """Where a step's micro-batches come from: the data `position` after them (None: not
    known), and for micro-batches `make_batches` yielded, its call (`made_by`), the epoch's
    micro-batch index of the first of them (`first`), and whether they are a whole group in
    its order (`whole`: every process has as many, as make_batches agreed over the processes)."""

    position: str | None
    made_by: MadeBy | None = None
    first: int = 0
    whole: bool = False


_UNKNOWN = StepData(None)


class StepSpan(NamedTuple):
    """`step_data` of a step's micro-batches, and which of them `make_batches(data, state, ...)`
    yielded: `made` of them (consecutive in the epoch from `data.first`), after `lead` batches
    of other origin (built by hand, or of groups already freed). Where `made` is less than the
    step's micro-batch count, the others are of other origin: the cursor counts `made`, and the
    `lead` ones only as far as they fill the gap from the state's cursor to `data.first` (the
    earlier groups of a step gathered from several: a token budget). (`made` is the step's
    count, and `lead` 0, for anything else.) `replay`: micro-batches of earlier steps that
    `make_batches` yielded, mixed in (a replay buffer holding its groups), which the cursor
    does not count (`step_span(micro, since=...)`)."""

    data: StepData
    made: int
    lead: int = 0
    replay: int = 0


def step_data(micro: Sequence[Batch]) -> StepData:
    """Where the data stands after `micro`, the micro-batches of one step (`StepData`).

    A group `make_batches` yielded carries its position, and one built by hand its own. A
    list, tuple or slice of a group's micro-batches has the position after its last one, while
    the group lives: consecutive micro-batches in their order (`list(micro)`, `micro[:k]`, then
    `micro[k:]`; a group's `ZeroWeight(batch)` wrapping counts as the batch). Batches
    `make_batches` did not yield (built by hand, or of a group no longer alive) have none;
    mixed with those of a `make_batches(data, state, ...)` call (a replay buffer), the
    position is the one after the last of the call's (`step_span` says which they are).

    Raises:
        ValueError: for micro-batches of a group that are not consecutive in their order (one
            left out, repeated or moved), or of two `make_batches` calls, where a
            `make_batches(data, state, ...)` call yielded some: the cursor would count other
            micro-batches than the data went over, and a resume would repeat or skip rows.
            (Those of calls without a state then have no position; mixed with a state's call's,
            they count as batches built by hand: an auxiliary stream.)
    """
    if isinstance(micro, MicroBatches):
        origin = micro.__dict__.get("_origin")
        if origin is None:  # built by hand (or copied): its own position
            return StepData(micro.position)
        return StepData(micro.position, origin.call, origin.first, True)
    return step_span(micro).data


def step_span(micro: Sequence[Batch], *, since: tuple[int, int] | None = None) -> StepSpan:
    """`step_data(micro)`, and which of `micro` a `make_batches(data, state, ...)` call yielded
    (`StepSpan`): what `accumulate_grads` advances the cursor by. A `MicroBatches` built by
    hand around such a call's micro-batches (`MicroBatches([*group, extra], group.position)`)
    is traced as a list of them, and keeps its own position.

    `since`: the state's `(epoch, cursor)`. Micro-batches `make_batches` yielded before it,
    mixed with ones at or after it, are then replay (a replay buffer holding its groups:
    `[*micro, *buf[0]]`), counted in `replay` and not in `made`, where none of them is of a
    group that the others' are of (a group the state stands inside is no replay). Micro-batches
    of several calls without a state (the loop of `start=state.data.cursor` keywords and an
    auxiliary stream) are then traced to the call standing at the cursor (of several, the one
    given `start=`); the others count as built by hand.

    Raises:
        ValueError: as `step_data`; with `since`, also for micro-batches of several calls
            without a state standing at the cursor that would advance it by other counts.
    """
    if isinstance(micro, MicroBatches):
        origin = micro.__dict__.get("_origin")
        if origin is not None:
            return StepSpan(StepData(micro.position, origin.call, origin.first, True), len(micro))
        span = _span(micro.batches, since)
        if span.data.made_by is None:
            return StepSpan(StepData(micro.position), len(micro))
        if micro.position is None:
            return span
        return span._replace(data=span.data._replace(position=micro.position))
    return _span(micro, since)


def _span(micro: Sequence[Batch], since: tuple[int, int] | None = None) -> StepSpan:
    table = STATE.micro_groups
    if not table:  # no group of make_batches lives (a loop of batches built by hand)
        return StepSpan(_UNKNOWN, len(micro))
    found: list[tuple[MicroBatches | None, Batch]] = []
    for batch in micro:
        ref = table.get(id(batch))
        if ref is None and type(batch) is ZeroWeight:  # one of yours left out of the gradient
            batch = batch.batch
            ref = table.get(id(batch))
        found.append((None if ref is None else ref(), batch))
    return _span_of(found, since)


def _span_of(
    found: list[tuple[MicroBatches | None, Batch]], since: tuple[int, int] | None
) -> StepSpan:
    """`_span` of the micro-batches `found` (each with the live group it is of, or None)."""
    everything = StepSpan(_UNKNOWN, len(found))
    if all(g is None for g, _ in found):
        return everything
    # Refused only where a state's cursor counts them (make_batches(data, state, ...)): a call
    # without a state (evaluation, tests) yields micro-batches that a step may mix freely, and
    # they then have no position, as batches built by hand.
    stateful = any(g.__dict__["_origin"].call.stateful for g, _ in found if g is not None)
    if stateful:  # a call without a state's mixed in (an auxiliary stream): no cursor's own
        found = [(g if g is None or _counted(g) else None, b) for g, b in found]
    elif since is not None:  # a step of the keyword loop, with an auxiliary stream's?
        found = _cursors_call(found, since)
    # Some may be of another origin: built by hand (a replay buffer), or of a group already
    # freed (a step gathered from several accum=1 groups, of which only the last is still
    # held: a token budget). The cursor counts the call's own, and the others only as far as
    # the state's cursor shows them to be the call's earlier ones (accumulate_grads).
    lead = next(i for i, (g, _) in enumerate(found) if g is not None)
    made = [(g, b) for g, b in found if g is not None]
    places = _places(made)
    replay = _replay(made, places, since)
    if replay:  # batches of earlier steps (a replay buffer): not the epoch's, as hand-built ones
        made = [m for k, m in enumerate(made) if k not in replay]
        places = [p for k, p in enumerate(places) if k not in replay]
    call, first = places[0][0].call, places[0][1]
    if any(o.call is not call for o, _ in places) or any(
        index != first + k for k, (_, index) in enumerate(places)
    ):
        if not stateful:
            return everything
        shown = ", ".join(str(index) for _, index in places[:8])
        raise ValueError(
            f"micro holds micro-batches {shown}{', ...' if len(places) > 8 else ''} of the epoch "
            + ("of two make_batches calls" if any(o.call is not call for o, _ in places)
               else "as make_batches yielded them, not consecutive in their order")
            + f": state.data.cursor would advance by {len(places)} while the data went over "
            "others, so a resume would repeat or skip rows. Pass consecutive micro-batches in "
            "the order make_batches yielded them (the group itself, list(micro), micro[i:j]); "
            "to leave one out of the gradient, keep it in as ft.data.ZeroWeight(batch) (it "
            "runs and counts nothing)"
        )  # fmt: skip
    # Consecutive, in order: as many of one group as it holds are the whole group.
    group = made[0][0]
    assert group is not None
    whole = len(found) == len(group.batches) and all(g is group for g, _ in found)
    last_origin, last = places[-1]
    position = last_origin.after[last - last_origin.first]
    if len(made) + len(replay) < len(found) and not stateful:
        position = None  # mixed with others: a call without a state's have none
    return StepSpan(StepData(position, call, first, whole), len(made), lead, len(replay))


def _call_of(group: MicroBatches | None) -> MadeBy | None:
    return None if group is None else group.__dict__["_origin"].call


def _cursors_call(
    found: list[tuple[MicroBatches | None, Batch]], since: tuple[int, int]
) -> list[tuple[MicroBatches | None, Batch]]:
    """Where a step mixes micro-batches of several `make_batches` calls without a state (the
    loop of `make_batches(data, epoch=state.epoch, start=state.data.cursor, ...)` and an
    auxiliary `make_batches(aux, batch_size=...)`): `found` with only the cursor's call's
    kept, the others' as batches built by hand (which the cursor does not count, as beside a
    `make_batches(data, state, ...)` call's). The cursor's call is the one whose micro-batches
    stand at the state's `(epoch, cursor)`; of several there, the one given `start=`. Where
    that leaves calls that would advance the cursor by different counts, raises; where none
    stands at the cursor, `found` is returned as it is (every micro-batch counts, as before).
    """
    calls = list({id(c): c for c in map(_call_of, (g for g, _ in found)) if c is not None}.values())
    if len(calls) < 2:
        return found
    at: dict[int, tuple[MadeBy, int]] = {}  # id(call) -> (call, cursor advance)
    for call in calls:
        mine = [(g if _call_of(g) is call else None, b) for g, b in found]
        span = _span_of(mine, since)  # one call: no recursion; a replay buffer's told apart
        lead, first, made = span.lead, span.data.first, span.made
        ours = span.data.made_by is call and call.epoch == since[0]
        if ours and since[1] <= first <= since[1] + lead:
            at[id(call)] = (call, first + made - since[1])
    if not at:
        return found
    if len({n for _, n in at.values()}) > 1:  # which one's does the cursor count?
        keyed = {k: v for k, v in at.items() if v[0].keyed}
        if len({n for _, n in keyed.values()}) != 1:
            raise ValueError(_AMBIGUOUS.format(counts=sorted(n for _, n in at.values())))
        at = keyed
    chosen = next(iter(at.values()))[0]
    return [(g if _call_of(g) is chosen else None, b) for g, b in found]


_AMBIGUOUS = (
    "micro mixes micro-batches of several make_batches calls without a state, each standing at "
    "state.data.cursor, which would advance it by {counts}: the cursor cannot tell which "
    "call's micro-batches it counts, and a resume would skip or repeat rows. Pass the "
    "training data's call the state, make_batches(data, state, ...) (its micro-batches are "
    "then the only ones the cursor counts), or give start=state.data.cursor to the training "
    "data's call only"
)


def _replay(
    made: Sequence[tuple[MicroBatches | None, Batch]],
    places: Sequence[tuple[_Origin, int]],
    since: tuple[int, int] | None,
) -> set[int]:
    """Which of `made` are replay: before `since` (the state's epoch and cursor, so already
    consumed), mixed with some at or after it, and of groups none of those are of. Else none."""
    if since is None:
        return set()
    before = {k for k, (o, index) in enumerate(places) if (o.call.epoch, index) < since}
    if not before or len(before) == len(made):
        return set()
    current = {id(made[k][0]) for k in range(len(made)) if k not in before}
    if any(id(made[k][0]) in current for k in before):
        return set()  # a group the state stands inside: not replay (refused below, as before)
    return before


def _counted(group: MicroBatches) -> bool:
    """Whether a state's cursor counts the group's micro-batches: `make_batches(data, state)`'s."""
    return bool(group.__dict__["_origin"].call.stateful)


def _places(found: Sequence[tuple[MicroBatches | None, Batch]]) -> list[tuple[_Origin, int]]:
    """(each batch's group origin, the epoch's index of the batch in it). A batch object a group
    holds more than once (pre-batched data repeating one batch) is taken at its next place after
    the last one taken from that group, so `list(micro)` of such a group is its own order."""
    taken: dict[int, int] = {}
    places = []
    for group, batch in found:
        assert group is not None
        origin: _Origin = group.__dict__["_origin"]
        after = taken.get(id(group), -1)
        spots = [i for i, b in enumerate(group.batches) if b is batch]
        index = next((i for i in spots if i > after), spots[0])
        taken[id(group)] = index
        places.append((origin, origin.first + index))
    return places


class Source:
    """An iterable source `make_batches` streams: `items(epoch, pos, seed, shuffle)` yields
    `(row, position after it)` from position `pos` (None: the epoch's start).

    A position is JSON. `describe` says what positions index (a digest of it rides with each
    position, so that resuming over other data raises, naming what changed), and `check`
    refuses a position that is not this source's before anything is read.
    """

    def items(self, epoch: int, pos: Pos, seed: int, shuffle: bool) -> Items:
        raise NotImplementedError

    def describe(self, shuffle: bool) -> dict[str, Any]:
        """What this source's positions index, as a JSON object; by default its type only."""
        return {"stage": "custom", "type": f"{type(self).__module__}.{type(self).__qualname__}"}

    def check(self, pos: Pos) -> None:
        """Raise `ValueError` unless `pos` can be a position of this source; by default any."""


def is_stream(data: Any) -> bool:
    """Whether `make_batches` streams `data` (an iterable source) rather than indexing it."""
    if isinstance(data, (torch.utils.data.IterableDataset, Source)):
        return True
    return type(data).__name__ == "IterableDataset" and hasattr(data, "num_shards")


def _fetch(data: Any, idx: np.ndarray) -> list[Any]:
    indices = idx.tolist()
    getitems = getattr(data, "__getitems__", None)
    if getitems is not None:  # datasets.Dataset and torch datasets fetch a whole batch at once
        return list(getitems(indices))
    return [data[i] for i in indices]
