"""`make_batches`: a deterministic epoch order, grouped into micro-batches, split across ranks.

The order of an epoch is a pure function of `(seed, epoch)`, so resuming needs only the
cursor (micro-batches already consumed), and skipping them costs nothing: indices are sliced,
rows are never read.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ftrain.data import _position as P
from ftrain.data._collate import pad_collate
from ftrain.data._common import (
    Batch,
    Collate,
    Loading,
    MadeBy,
    MicroBatches,
    Spec,
    ZeroWeight,
    _fetch,
    agree_over_ranks,
    epoch_order,
    is_stream,
    length_grouped_order,
    num_micro_batches,
    record_resumed,
    run_loader,
    saved_generators,
    seed_generators,
    several_processes,
    yielded_group,
)
from ftrain.data._content import content_digest, legacy_digest, subset_digest
from ftrain.data._stream import stream_groups
from ftrain.state import TrainState
from ftrain.strategies import Strategy, bare_module

__all__ = ["find_batch_size", "is_out_of_memory", "make_batches"]


def make_batches(
    data: Any,
    state: TrainState | None = None,
    *,
    batch_size: int,
    accum: int = 1,
    seed: int | None = None,
    epoch: int | None = None,
    start: int | None = None,
    strategy: Strategy | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
    collate_fn: Collate | None = None,
    group_by_length: bool = False,
    lengths: Sequence[int] | None = None,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    pin_memory: bool = False,
) -> Iterator[MicroBatches]:
    """Yield one epoch as groups of `accum` collated micro-batches (the last may be shorter).

    With a `state` (the training loop), the seed, the epoch, where this epoch stands (the
    cursor, and a stream's position) and the data-parallel strategy come from it:
    `make_batches(train_ds, state, batch_size=8, accum=4)` resumes exactly where the state
    stands. Without one (evaluation, tests), `seed`, `epoch`, `start` and `strategy` are
    keywords (defaults 0, 0, 0 and one process).

    With W data-parallel ranks, global micro-batch b is rows `[b*bs*W, (b+1)*bs*W)` of the
    epoch order, split into W contiguous parts (`numpy.array_split`); this rank collates its
    part. The union over ranks equals what one process yields with `batch_size=bs*W`. When the
    final global micro-batch has fewer than W rows, ranks left without rows get a `ZeroWeight`
    stand-in, so that every rank runs the same number of micro-batches.

    Fetching and collating micro-batch b runs with torch's default generator, Python's `random`
    and numpy's global generator seeded from `(seed, epoch, b, rank)`, in worker processes and
    in-process alike: random augmentations are the same for any `num_workers` and on resume.

    Each group is an `ft.data.MicroBatches` (a read-only sequence of batches) carrying the
    epoch's position (JSON), which `accumulate_grads` and `clip_and_step` keep in
    `state.data.position`, so the next `make_batches(data, state, ...)` resumes exactly or raises
    naming what changed. Map-style data then continues from the row it reached even with
    another `batch_size`, `accum` or world size. Iterable sources (`datasets.IterableDataset`,
    torch `IterableDataset`, `ft.data.pack`, `ft.data.mix`) are streamed; their position is
    where the stream stands after the group, with a digest of what it indexes (docs/data.md).

    Args:
        data: a `datasets.Dataset`, a map-style torch dataset, a sequence of rows, or an
            iterable source (see above).
        state: the training state to read the seed, epoch, position and strategy from.
        batch_size: rows per micro-batch on this rank.
        accum: micro-batches per optimizer step.
        seed: with `epoch`, fixes the order (only without a `state`).
        epoch: which epoch's order (only without a `state`).
        start: micro-batches of this epoch already consumed, skipped without reading any row
            (only without a `state`, and only 0 for a stream).
        strategy: supplies the data-parallel `rank` and `world_size` (only without a `state`).
            Required under an initialised process group of several ranks (see Raises).
        shuffle: shuffle rows; otherwise the dataset order.
        drop_last: drop the final global micro-batch if it has fewer than `bs*W` rows.
        collate_fn: turns a list of rows into a batch; `pad_collate()` by default.
        group_by_length: order like HF's `LengthGroupedSampler` (mega-batches of rows of similar
            length); lengths come from `lengths` or each row's `input_ids`.
        lengths: row lengths for `group_by_length` (one per row), to avoid reading every row.
        num_workers: background processes that fetch and collate micro-batches (torch
            `DataLoader`'s meaning); 0 loads in the loop's process. The output is the same.
        prefetch_factor: micro-batches loaded in advance by each worker (torch's meaning: 2
            when None); only with `num_workers > 0`.
        pin_memory: collate into page-locked memory, so the strategy's non-blocking copy to
            the GPU overlaps compute; needs CUDA.

    Raises:
        ValueError: for a non-positive `batch_size`/`accum`, a negative `start` or one beyond
            the epoch, an empty `data`, `drop_last` leaving no micro-batch, a negative
            `num_workers`, `prefetch_factor` without workers, `pin_memory` without CUDA, and
            a `collate_fn` that draws from a generator of its own (HF's
            `DataCollatorForLanguageModeling(seed=...)`: build it without a seed),
            a missing `strategy` under an initialised multi-rank process group (a default group
            may hold tensor-parallel ranks that must read the same rows, so it is not guessed),
            processes of a multi-rank group given other data or settings than each other
            (checked with one small collective per call, so every process calls together),
            `seed`/`epoch`/`start`/`strategy` given together with a `state`, a `batch_size`
            other than `state.data.batch_size` (the size `find_batch_size` settled on), a
            strategy whose `rank` is not in `[0, world_size)`, a stream
            resumed at `start > 0` without the state that holds its position, and a
            `state.data.position` that is malformed or does not fit the data and settings (the
            row count, a digest of a few rows, seed, shuffle or lengths; a stream's other
            files, shards, shuffle buffer, packing, mixing or global batch, or the first row
            of the shard it stands in, when that shard is read), naming what changed. Also
            for a `seed` outside [0, 2**63); `lengths` of another length than `data`
            (checked when grouping), or on a stream; `group_by_length` on a stream or with
            `shuffle=False`; and a `datasets` stream whose pipeline reading shard by shard
            would change (`take`/`skip` over several shards, `interleave_datasets`) or that
            shuffles without a seed.
        TypeError: for data that is neither indexable nor iterable, or a non-integer
            `seed`/`epoch`.

    Example:
        >>> import ftrain as ft
        >>> rows = [{"input_ids": [1] * (i + 1)} for i in range(5)]
        >>> groups = list(ft.make_batches(rows, batch_size=2, accum=2, shuffle=False))
        >>> [[b["input_ids"].shape[0] for b in g] for g in groups]
        [[2, 2], [1]]
    """
    _check_kinds(state, strategy, collate_fn, shuffle, drop_last, group_by_length)
    _check_label_side(collate_fn, state)
    _check_own_generator(collate_fn)
    _check_grouping(data, shuffle, group_by_length, lengths)
    keyed = state is None and start is not None  # the keyword loop's: start=state.data.cursor
    where = _where(state, seed=seed, epoch=epoch, start=start, strategy=strategy)
    seed, epoch, start, stream_pos, strategy = where
    _validate(batch_size=batch_size, accum=accum, start=start, data=data)
    _check_found_size(state, batch_size)
    rank, world = _ranks(strategy)
    loading = Loading.check(num_workers, prefetch_factor, pin_memory)
    collate = pad_collate() if collate_fn is None else collate_fn
    spec = Spec(batch_size, accum, seed, epoch, shuffle, drop_last, collate, rank, world)
    given = _given(spec, start, stream_pos, group_by_length)
    made_by = MadeBy(strategy, epoch, state is not None, start, keyed)
    # A state's call that starts mid-epoch is told apart (evaluation data given the state).
    resumed = start if state is not None else 0
    if is_stream(data):
        return record_resumed(
            stream_groups(
                data,
                spec,
                start=start,
                position=stream_pos,
                loading=loading,
                agree=given,
                strategy=strategy,
                made_by=made_by,
            ),
            resumed,
        )
    n = len(data)
    lens = _lengths(data, lengths) if group_by_length else None
    content = content_digest(data, n) if n else None
    subset = subset_digest(data) if several_processes(strategy) else None
    rows = {"rows": n, "content": content, "subset": subset, "lengths": _digest(lens)}
    # The keys of a stream's call too, in its order: one collective of one size on every rank
    agree_over_ranks(strategy, {"data": None, **rows, **given})
    if n == 0:
        raise ValueError("data is empty: an epoch would yield nothing and the loop would never end")
    pos = _map_position(n, spec, start, stream_pos, lens, content, lambda: legacy_digest(data, n))
    micro = _MicroBatches(data, _order(n, spec, pos, lens), spec, pos, _total(n, spec, start, pos))
    position = json.dumps(pos, separators=(",", ":"))
    batches = _load(micro, range(start, len(micro)), loading)
    return record_resumed(_groups(batches, accum, position, made_by, start), resumed)


def _given(spec: Spec, start: int, position: str | None, grouped: bool) -> dict[str, Any]:
    """What every rank must be given alike (`agree_over_ranks`), besides the data."""
    return {
        "batch_size": spec.batch_size,
        "accum": spec.accum,
        "seed": spec.seed,
        "epoch": spec.epoch,
        "start": start,
        "position": position,
        "shuffle": spec.shuffle,
        "drop_last": spec.drop_last,
        "group_by_length": grouped,
    }


def _digest(lengths: Sequence[int] | None) -> str | None:
    if lengths is None:
        return None
    return hashlib.sha256(np.asarray(lengths, np.int64).tobytes()).hexdigest()[:16]


def _check_kinds(
    state: Any, strategy: Any, collate_fn: Any, shuffle: Any, drop_last: Any, grouped: Any
) -> None:
    if state is not None and not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState or None, got {type(state).__name__}")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an ft.strategies.Strategy, got {strategy!r}")
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(
            f"collate_fn must be callable (a list of rows -> a batch), got {collate_fn!r}"
        )
    flags = {"shuffle": shuffle, "drop_last": drop_last, "group_by_length": grouped}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")


def _check_label_side(collate_fn: Any, state: Any) -> None:
    """Refuse HF's `DataCollatorForSeq2Seq` padding the labels of an encoder-decoder on the
    left (it pads them on its tokenizer's `padding_side`): the decoder would read padding
    between its start token and the target, whose first token is then predicted from a pad,
    and a row's loss depends on the rows padded with it. (`pad_collate` refuses the same.)
    The model is the collator's `model`, else the state's; a causal LM is left alone."""
    tokenizer = getattr(collate_fn, "tokenizer", None)
    if getattr(tokenizer, "padding_side", None) != "left":
        return
    if not hasattr(collate_fn, "label_pad_token_id"):  # not a collator that pads labels
        return
    model = getattr(collate_fn, "model", None)
    if model is None and state is not None:
        model = state.model
    config = getattr(bare_module(model), "config", None) if model is not None else None
    if getattr(config, "is_encoder_decoder", False) is True:
        raise ValueError(
            f"collate_fn ({type(collate_fn).__name__}) pads the labels on the left (its "
            "tokenizer's padding_side='left'): an encoder-decoder's decoder would read the "
            "padding before the target, and predict the target's first token from a pad. Set "
            "tokenizer.padding_side = 'right' (ft.generate pads prompts itself), or use "
            "ft.data.pad_collate()"
        )


def _check_own_generator(collate_fn: Any) -> None:
    """Refuse a collator that draws from a generator of its own (HF's
    `DataCollatorForLanguageModeling(seed=...)`): make_batches seeds the global generators per
    micro-batch from `(seed, epoch, b, rank)`, which its generator ignores, so its masking
    restarted on resume, was the same on every rank, and changed with `num_workers`. A causal
    LM's (`mlm=False`) draws nothing: it copies the inputs into the labels."""
    seed = getattr(collate_fn, "seed", None)
    if seed is None or not hasattr(collate_fn, "generator"):
        return
    if getattr(collate_fn, "mlm", True) is False:
        return
    raise ValueError(
        f"collate_fn ({type(collate_fn).__name__}) draws from a generator of its own "
        f"(seed={seed!r}): its random masking would restart at every resume, repeat on every "
        "data-parallel rank and change with num_workers. Build it without a seed: make_batches "
        "seeds torch's, numpy's and Python's generators for each micro-batch from (seed, epoch, "
        "micro-batch, rank), which makes its masking reproducible as it is"
    )


def _check_grouping(data: Any, shuffle: bool, grouped: bool, lengths: Any) -> None:
    """Refuse length-grouping arguments that would be accepted and then ignored."""
    if is_stream(data) and (grouped or lengths is not None):
        given = "group_by_length=True" if grouped else "lengths="
        raise ValueError(
            f"{given} on a stream: a stream is read in its shards' order, so it cannot be "
            "ordered by length. Drop group_by_length/lengths, or pass a map-style dataset"
        )
    if grouped and not shuffle:
        raise ValueError(
            "group_by_length=True with shuffle=False: the length-grouped order is a random "
            "one (HF's LengthGroupedSampler), drawn from the seed. Pass shuffle=True, or sort "
            "the rows by length yourself and pass shuffle=False without group_by_length"
        )


def _where(
    state: TrainState | None, **given: Any
) -> tuple[int, int, int, str | None, Strategy | None]:
    """(seed, epoch, start, stream position, strategy): from the state, or from the keywords."""
    if state is None:
        seed, epoch, start = (
            _integer(k, given[k] if given[k] is not None else 0) for k in ("seed", "epoch", "start")
        )
        return seed, epoch, start, None, given["strategy"]
    clash = sorted(k for k, v in given.items() if v is not None)
    if clash:
        raise ValueError(
            f"make_batches got a state and {', '.join(f'{k}=' for k in clash)}: the state already "
            "says the seed, epoch, position and strategy. Drop them, or pass no state"
        )
    d = state.data
    return state.seed, state.epoch, d.cursor, d.position, state.strategy


def _check_found_size(state: TrainState | None, batch_size: int) -> None:
    """Refuse a batch size other than the one `find_batch_size` settled on (kept in checkpoints),
    which would otherwise be ignored without a word."""
    found = None if state is None else state.data.batch_size
    if found is not None and batch_size != found:
        raise ValueError(
            f"batch_size={batch_size}, but state.data.batch_size={found} (the size "
            "ft.data.find_batch_size settled on, kept in checkpoints): pass "
            "batch_size=state.data.batch_size, or drop the found size first, "
            "state.replace(data=state.data.replace(batch_size=None))"
        )


def _integer(name: str, value: Any) -> int:
    # bool is an int to Python but never a seed or an epoch; numpy integers are fine.
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    out = int(value.__index__())
    if name == "epoch" and out < 0:
        raise ValueError(f"epoch must be >= 0, got {out}")
    if name == "seed" and not 0 <= out < 2**63:  # what a position holds; 2**64 would be 0
        raise ValueError(f"seed must be in [0, 2**63), got {out}")
    return out


def _ranks(strategy: Strategy | None) -> tuple[int, int]:
    if strategy is not None:
        rank, world = strategy.rank, strategy.world_size
        # rank -1 would take the last rank's part (numpy indexing): two ranks, the same rows
        if not (_whole(world) and world >= 1 and _whole(rank) and 0 <= rank < world):
            raise ValueError(
                f"strategy has rank {rank!r} of world_size {world!r}: make_batches needs a "
                "data-parallel rank in [0, world_size) to give each rank its own rows"
            )
        return int(rank), int(world)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"strategy is None under an initialised process group of {dist.get_world_size()} "
            "ranks: every rank would read the same rows. Pass strategy=state.strategy (each "
            "rank reads its share), or strategy=ft.strategies.SingleDevice() to give every rank "
            "all rows on purpose"
        )
    return 0, 1


def _whole(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _lengths(data: Any, lengths: Sequence[int] | None) -> Sequence[int]:
    if lengths is None:
        return [len(data[i]["input_ids"]) for i in range(len(data))]
    if not hasattr(lengths, "__len__") or len(lengths) != len(data):
        got = len(lengths) if hasattr(lengths, "__len__") else type(lengths).__name__
        raise ValueError(
            f"lengths must give one length per row of data: {len(data)} rows, lengths has {got}"
        )
    return lengths


def _order(n: int, spec: Spec, pos: dict[str, Any], lens: Sequence[int] | None) -> np.ndarray:
    if lens is not None:  # grouped by the position's mega-batch rows: kept through a resume
        return length_grouped_order(lens, pos["group"], spec.seed, spec.epoch)
    return epoch_order(n, spec.seed, spec.epoch) if spec.shuffle else np.arange(n)


def _map_position(
    n: int,
    spec: Spec,
    start: int,
    raw: str | None,
    lens: Sequence[int] | None,
    content: str | None,
    legacy: Callable[[], str | None],
) -> dict[str, Any]:
    """The epoch's map-style position: micro-batch `cursor` began at `row` of the epoch order,
    and each since holds `rows` rows (ftrain/data/_position.py).

    Resuming from `state.data.position` keeps its order and continues from the row it reached,
    with this call's global batch; without one (`start=`, or a state never trained on this
    epoch), `start` counts micro-batches of this call's size.
    """
    fresh = _fresh(n, spec, lens, content)
    if raw is None:
        return fresh
    saved = P.resumable(raw, "map")
    _same_order(saved, fresh)
    _same_rows(saved, fresh, start, legacy)
    # A position saved before rows were digested (or over data not read for it), or with the
    # legacy digest, takes the digest of the data it goes on over.
    saved = {**saved, "content": fresh["content"] or saved.get("content")}
    if start < saved["cursor"]:
        raise ValueError(
            f"state.data.cursor={start} is before micro-batch {saved['cursor']}, where "
            "state.data.position starts counting: a cursor moved back without its position?"
        )
    if saved["rows"] == fresh["rows"]:
        return saved
    # Another global batch (batch_size or rank count): go on from the row reached.
    left = -(-(n - saved["row"]) // saved["rows"])  # micro-batches the saved epoch had left
    if start - saved["cursor"] > left:
        raise ValueError(
            f"start={start} is beyond the epoch's {saved['cursor'] + left} micro-batches of "
            f"{saved['rows']} rows that state.data.position counts"
        )
    reached = min(saved["row"] + (start - saved["cursor"]) * saved["rows"], n)
    return {**saved, "rows": fresh["rows"], "cursor": start, "row": reached}


def _fresh(n: int, spec: Spec, lens: Sequence[int] | None, content: str | None) -> dict[str, Any]:
    """The position of an epoch read from its start with this call's settings."""
    rows = spec.batch_size * spec.world
    group = digest = None
    if lens is not None:  # HF groups by the per-step batch; the order depends on every length
        group = rows * spec.accum
        digest = _digest(lens)
    return {
        "version": P.VERSION,
        "kind": "map",
        "epoch": spec.epoch,
        "seed": spec.seed,
        "n": n,
        "shuffle": spec.shuffle,
        "group": group,
        "lengths": digest,
        "rows": rows,
        "cursor": 0,
        "row": 0,
        "content": content,
    }


def _same_order(saved: dict[str, Any], fresh: dict[str, Any]) -> None:
    """Refuse a resume whose epoch order would differ from the saved one, naming why."""
    why = {
        "epoch": "state.data.position is the position of another epoch",
        "seed": "the seed orders the epoch",
        "n": "data has another number of rows, so the epoch is ordered differently",
        "shuffle": "shuffle changes the epoch's order",
        "lengths": "group_by_length orders the epoch by the rows' lengths",
    }
    for key, reason in why.items():
        if saved[key] != fresh[key]:
            label = {"n": "rows", "lengths": "lengths digest"}.get(key, key)
            raise ValueError(
                f"{label} {_show(saved[key])} when state.data.position was saved, now "
                f"{_show(fresh[key])}: {reason}, so resuming would not be exact. Resume with "
                "the same data and settings, or restart the epoch: "
                "state.replace(data=state.data.replace(cursor=0, position=None))"
                + (P.NOT_ITS_DATA if key in ("n", "shuffle", "lengths") else "")
            )


def _same_rows(
    saved: dict[str, Any], fresh: dict[str, Any], start: int, legacy: Callable[[], str | None]
) -> None:
    """Refuse a resume over rows of other contents (same count), when both digests exist.

    A position saved before mappings were read holds `legacy_digest`'s, computed only when
    the digests differ (eight rows read again)."""
    then, now = saved.get("content"), fresh["content"]
    if then is None or now is None or then == now or then == legacy():
        return
    raise ValueError(
        f"data holds other rows than when state.data.position was saved: the same {fresh['n']} "
        f"rows, but a digest of a few of them was {then!r} then and is {now!r} now (another "
        "tokenizer, max_length or preprocessing? another split, a torch Subset from "
        "random_split without a seeded generator=?), so the resumed epoch would go on over "
        "other rows. Resume with the data it was saved with; or restart the epoch, "
        "state.replace(data=state.data.replace(cursor=0, position=None)); or go on from "
        f"micro-batch {start} of this epoch over the new rows, unchecked (exact only with the "
        "same global batch), state.replace(data=state.data.replace(position=None))" + P.NOT_ITS_DATA
    )


def _show(value: Any) -> str:
    return "none (no group_by_length)" if value is None else repr(value)


def _total(n: int, spec: Spec, start: int, pos: dict[str, Any]) -> int:
    """Micro-batches in the epoch, refusing an epoch that would make the README loop spin."""
    rest = num_micro_batches(
        n - pos["row"], spec.batch_size, world_size=spec.world, drop_last=spec.drop_last
    )
    total = pos["cursor"] + rest
    if total == 0:
        raise ValueError(
            f"drop_last=True leaves no micro-batch: {n} rows < batch_size={spec.batch_size} x "
            f"{spec.world} rank(s); pass drop_last=False or a smaller batch_size"
        )
    if start > total:
        raise ValueError(
            f"start={start} is beyond the epoch's {total} micro-batches (a cursor from another "
            "batch size, rank count or dataset?)"
        )
    return total


class _MicroBatches(torch.utils.data.Dataset[Batch]):
    """Index b -> this rank's collated micro-batch b of the epoch: what workers run."""

    def __init__(
        self, data: Any, order: np.ndarray, spec: Spec, pos: dict[str, Any], total: int
    ) -> None:
        self.data, self.order, self.spec, self.total = data, order, spec, total
        self.base = pos["row"] - pos["cursor"] * spec.batch_size * spec.world

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, b: int) -> Batch:
        with saved_generators():
            return self.seeded_item(b)

    def seeded_item(self, b: int) -> Batch:
        """Micro-batch b, fetched and collated with the global generators seeded for it (and
        left seeded: the caller saves and restores them)."""
        s = self.spec
        rows = s.batch_size * s.world
        # rows [b*rows, (b+1)*rows) of the epoch order, shifted where a resume changed the
        # global batch mid-epoch (the position's row at its cursor).
        lo = self.base + b * rows
        part = self.order[lo : lo + rows]
        chunk = np.array_split(part, s.world)[s.rank]
        seed_generators(s.seed, s.epoch, b, s.rank)
        if len(chunk):
            return s.collate(_fetch(self.data, chunk))
        # only the final, short global micro-batch can leave a rank without rows
        return ZeroWeight(s.collate(_fetch(self.data, part[:1])))


def _load(micro: _MicroBatches, indices: range, loading: Loading) -> Iterator[Batch]:
    """Micro-batches `indices` in order: in-process, or from DataLoader workers, whose
    in-order delivery makes the output independent of which worker finishes first. In-process
    with `pin_memory`, DataLoader pins what `_in_process` collates (its own pinning, in this
    process: no worker)."""
    if loading.num_workers:
        return run_loader(loading.loader(micro, micro.spec, sampler=indices))
    batches = _in_process(micro, indices)
    if not loading.pin_memory:
        return batches
    return run_loader(loading.loader(_Iterated(batches), micro.spec))


class _Iterated(torch.utils.data.IterableDataset[Batch]):
    """An iterator as a DataLoader's dataset (in this process only: it is not picklable)."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        return self.batches


def _in_process(micro: _MicroBatches, indices: range) -> Iterator[Batch]:
    """Micro-batches `indices` in order, a group's worth (`accum`, as `_groups` cuts them from
    the first) collated under one save and restore of the global generators, each from its own
    seeds: the same batches as one `micro[b]` at a time, and the caller's generators are back
    before the group reaches the loop."""
    accum = micro.spec.accum
    for lo in range(indices.start, indices.stop, accum):
        with saved_generators():
            group = [micro.seeded_item(b) for b in range(lo, min(lo + accum, indices.stop))]
        yield from group


def _groups(
    batches: Iterator[Batch], accum: int, position: str, made_by: MadeBy, start: int
) -> Iterator[MicroBatches]:
    group: list[Batch] = []
    first = start
    for batch in batches:
        group.append(batch)
        if len(group) == accum:
            yield yielded_group(tuple(group), (position,) * accum, made_by, first)
            first += accum
            group = []
    if group:
        yield yielded_group(tuple(group), (position,) * len(group), made_by, first)


def _validate(*, batch_size: int, accum: int, start: int, data: Any) -> None:
    for name, value, low in (
        ("batch_size", batch_size, 1),
        ("accum", accum, 1),
        ("start", start, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not is_stream(data) and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(
            f"data must support len() and indexing (a datasets.Dataset, a map-style torch "
            f"Dataset or a sequence) or be an iterable source (datasets.IterableDataset, torch "
            f"IterableDataset, ft.data.pack/mix), got {type(data).__name__}"
        )


_OOM_MESSAGES = (
    " out of memory.",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` says a device (or the host) ran out of memory."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return (
        isinstance(error, RuntimeError)
        and len(error.args) == 1
        and isinstance(error.args[0], str)
        and any(m in error.args[0] for m in _OOM_MESSAGES)
    )


def find_batch_size(
    state: TrainState,
    probe: Callable[[TrainState, int], Any],
    *,
    start: int,
    factor: float = 0.9,
) -> TrainState:
    """Return `state` with `data.batch_size` set to the largest size that `probe` runs without
    running out of memory (HF's `auto_find_batch_size`).

    Tries `start`, then `int(size * factor)` after each out-of-memory error (0.9 as HF and
    accelerate do; 0.5 halves), down to 1. `probe(state, size)` should run the most expensive
    step at that size, e.g. `accumulate_grads` on a batch of `size` longest rows; it must not
    consume `state`. A state whose `data.batch_size` is already set (say, resumed from a checkpoint)
    is returned as it is, without probing: the resumed run keeps the size it started with, and
    `make_batches(data, state, batch_size=...)` refuses another one. On several ranks the
    sizes tried are agreed on: one that runs out of memory on any rank is dropped on all (one
    host sync per size tried), so that every rank reads its share of the same global batch.
    A probe whose own collectives (`accumulate_grads` under DDP or FSDP) some ranks reach and
    others do not, having run out of memory before them, cannot be agreed on: the job fails
    (gloo) or waits for the collective timeout (NCCL). Probe every rank with the same longest
    rows, so that the ranks run out of memory together.

    Raises:
        ValueError: for `start < 1` or `factor` outside (0, 1), also when the state's size is
            already set.
        RuntimeError: when not even a batch of 1 fits.
        Exception: any error of `probe` that is not an out-of-memory error.

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> def probe(state, size):
        ...     if size > 20:
        ...         raise torch.OutOfMemoryError("out of memory (simulated)")
        >>> ft.data.find_batch_size(state, probe, start=64, factor=0.5).data.batch_size
        16
    """
    # Checked first: a resumed state skips the probing, not the arguments' meaning.
    if isinstance(start, bool) or not (isinstance(start, int) and start >= 1):
        raise ValueError(f"start must be an int >= 1, got {start!r}")
    if isinstance(factor, bool) or not (isinstance(factor, (int, float)) and 0 < factor < 1):
        raise ValueError(f"factor must be in (0, 1), got {factor!r}")
    if state.data.batch_size is not None:
        return state
    size = start
    while size >= 1:
        if _fits_everywhere(state, probe, size):
            return state.replace(data=state.data.replace(batch_size=size))
        size = int(size * factor)
    raise RuntimeError(f"no batch size from {start} down to 1 fits in memory")


def _fits_everywhere(state: TrainState, probe: Callable[[TrainState, int], Any], size: int) -> bool:
    """Whether `probe` runs at `size` on every process of the job.

    Ranks agree: one that runs out of memory makes all of them back off, so that they settle
    on one size. Ranks of different sizes would read overlapping rows (rank r of a global
    micro-batch takes its part of `batch_size x world` rows counted with its own batch_size)
    and run different numbers of micro-batches. One host sync per size tried, at setup.
    """
    out_of_memory = False
    try:
        probe(state, size)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        out_of_memory = True
    finally:
        for p in state.params.values():
            p.grad = None  # what the probe's backward left behind
    if out_of_memory:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    strategy = state.strategy
    flag = torch.tensor(float(out_of_memory), device=strategy.device)
    return not bool(strategy.sum_over_processes(flag) > 0)  # host sync (setup, not the step)
