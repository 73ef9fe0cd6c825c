"""Batches: a deterministic epoch order, grouped into micro-batches, split across ranks.

The order of an epoch is a pure function of `(seed, epoch)`, so resuming needs only the
`cursor` (micro-batches already consumed), and skipping them costs nothing: indices are sliced,
rows are never read.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ftrain.strategies._base import Strategy

if TYPE_CHECKING:
    from ftrain.state import TrainState

__all__ = [
    "Cursor",
    "Group",
    "IterableRows",
    "Source",
    "ZeroWeight",
    "epoch_order",
    "find_batch_size",
    "is_out_of_memory",
    "is_stream",
    "length_grouped_order",
    "make_batches",
    "mix",
    "num_micro_batches",
    "pack",
    "pad_collate",
    "run_loader",
    "seeded",
    "stream",
    "weighted",
]

Batch = Any
Collate = Callable[[list[Any]], Batch]

# Key of the per-(seed, epoch) generator: a fixed odd multiplier keeps nearby seeds apart.
_EPOCH_STRIDE = 0x9E3779B97F4A7C15


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * _EPOCH_STRIDE + epoch) % (2**63))


@functools.lru_cache(maxsize=4)
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


def make_batches(
    data: Any,
    *,
    batch_size: int,
    accum: int = 1,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    collate_fn: Collate | None = None,
    start: int = 0,
    group_by_length: bool = False,
    lengths: Sequence[int] | None = None,
    strategy: Strategy | None = None,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    pin_memory: bool = False,
) -> Iterator[list[Batch]]:
    """Yield one epoch as lists of `accum` collated micro-batches (the last list may be shorter).

    With W data-parallel ranks, global micro-batch b is rows `[b*bs*W, (b+1)*bs*W)` of the
    epoch order, split into W contiguous parts (`numpy.array_split`); this rank collates its
    part. The union over ranks equals what one process yields with `batch_size=bs*W`. When the
    final global micro-batch has fewer than W rows, ranks left without rows get a `ZeroWeight`
    stand-in, so that every rank runs the same number of micro-batches.

    Fetching and collating micro-batch b runs with torch's default generator, Python's `random`
    and numpy's global generator seeded from `(seed, epoch, b, rank)`, in worker processes and
    in-process alike: random augmentations are the same for any `num_workers` and on resume.

    Iterable sources (`datasets.IterableDataset`, torch `IterableDataset`, `ft.data.pack`,
    `ft.data.mix`) are streamed; each yielded group then carries its stream position, which
    `accumulate_grads` and `clip_and_step` put into `state.cursor`, so `start=state.cursor`
    resumes the stream exactly (docs/data.md).

    Args:
        data: a `datasets.Dataset`, a map-style torch dataset, a sequence of rows, or an
            iterable source (see above).
        batch_size: rows per micro-batch on this rank.
        accum: micro-batches per optimizer step.
        seed: with `epoch`, fixes the order.
        epoch: which epoch's order.
        shuffle: shuffle rows; otherwise the dataset order.
        drop_last: drop the final global micro-batch if it has fewer than `bs*W` rows.
        collate_fn: turns a list of rows into a batch; `pad_collate()` by default.
        start: micro-batches of this epoch already consumed (e.g. `state.cursor`); skipped
            without reading any row.
        group_by_length: order like HF's `LengthGroupedSampler` (mega-batches of rows of similar
            length); lengths come from `lengths` or each row's `input_ids`.
        lengths: row lengths for `group_by_length`, to avoid reading every row.
        strategy: supplies the data-parallel `rank` and `world_size`. Required under an
            initialised process group of several ranks (see Raises).
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
            a missing `strategy` under an initialised multi-rank process group (a default group
            may hold tensor-parallel ranks that must read the same rows, so it is not guessed).
        TypeError: for data that is neither indexable nor iterable, or a non-integer
            `seed`/`epoch`.

    Example:
        >>> import ftrain as ft
        >>> rows = [{"input_ids": [1] * (i + 1)} for i in range(5)]
        >>> groups = list(ft.make_batches(rows, batch_size=2, accum=2, shuffle=False))
        >>> [[b["input_ids"].shape[0] for b in g] for g in groups]
        [[2, 2], [1]]
    """
    seed, epoch = _integer("seed", seed), _integer("epoch", epoch)
    _validate(batch_size=batch_size, accum=accum, start=start, data=data)
    rank, world = _ranks(strategy)
    loading = _Loading.check(num_workers, prefetch_factor, pin_memory)
    collate = pad_collate() if collate_fn is None else collate_fn
    spec = _Spec(batch_size, accum, seed, epoch, shuffle, drop_last, collate, rank, world)
    if is_stream(data):
        from ftrain._stream import stream_groups

        return stream_groups(data, spec, start=start, loading=loading)
    micro = _MicroBatches(
        data, _order(data, spec, group_by_length, lengths), spec, total=_total(data, spec, start)
    )
    return _groups(_load(micro, range(start, len(micro)), loading), accum)


class _Spec(NamedTuple):
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


def _integer(name: str, value: Any) -> int:
    # bool is an int to Python but never a seed or an epoch; numpy integers are fine.
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    out = int(value.__index__())
    if name == "epoch" and out < 0:
        raise ValueError(f"epoch must be >= 0, got {out}")
    return out


def _ranks(strategy: Strategy | None) -> tuple[int, int]:
    if strategy is not None:
        return strategy.rank, strategy.world_size
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"strategy is None under an initialised process group of {dist.get_world_size()} "
            "ranks: every rank would read the same rows. Pass strategy=state.strategy (each "
            "rank reads its share), or strategy=ft.strategies.SingleDevice() to give every rank "
            "all rows on purpose"
        )
    return 0, 1


def _order(data: Any, spec: _Spec, group_by_length: bool, lengths: Any) -> np.ndarray:
    n = len(data)
    if group_by_length:
        lens = lengths if lengths is not None else [len(data[i]["input_ids"]) for i in range(n)]
        # HF groups by the per-step batch (train_batch_size * accumulation), over all ranks.
        rows = spec.batch_size * spec.world * spec.accum
        return length_grouped_order(lens, rows, spec.seed, spec.epoch)
    return epoch_order(n, spec.seed, spec.epoch) if spec.shuffle else np.arange(n)


def _total(data: Any, spec: _Spec, start: int) -> int:
    """Micro-batches in the epoch, refusing an epoch that would make the README loop spin."""
    n = len(data)
    if n == 0:
        raise ValueError("data is empty: an epoch would yield nothing and the loop would never end")
    total = num_micro_batches(n, spec.batch_size, world_size=spec.world, drop_last=spec.drop_last)
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

    def __init__(self, data: Any, order: np.ndarray, spec: _Spec, *, total: int) -> None:
        self.data, self.order, self.spec, self.total = data, order, spec, total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, b: int) -> Batch:
        s = self.spec
        rows = s.batch_size * s.world
        part = self.order[b * rows : (b + 1) * rows]
        chunk = np.array_split(part, s.world)[s.rank]
        with seeded(s.seed, s.epoch, b, s.rank):
            if len(chunk):
                return s.collate(_fetch(self.data, chunk))
            # only the final, short global micro-batch can leave a rank without rows
            return ZeroWeight(s.collate(_fetch(self.data, part[:1])))


# Keeps data-path seeds apart from the dropout seeds of the same numbers (grads.dropout_seed).
_DATA_STREAM = 0xDA7A


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
    from ftrain.grads import dropout_seed

    s = dropout_seed(seed ^ _DATA_STREAM, epoch, micro, rank)
    saved = torch.default_generator.get_state(), random.getstate(), np.random.get_state()
    torch.default_generator.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


class _Loading(NamedTuple):
    """How micro-batches are loaded: in-process, or by DataLoader workers."""

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool

    @classmethod
    def check(cls, num_workers: int, prefetch_factor: int | None, pin_memory: bool) -> _Loading:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if prefetch_factor is not None:
            if num_workers == 0:
                raise ValueError(
                    f"prefetch_factor={prefetch_factor!r} needs num_workers > 0 (the loop's "
                    "own process loads one micro-batch at a time); drop it or add workers"
                )
            if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
                raise ValueError(f"prefetch_factor must be an int >= 1, got {prefetch_factor!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs a CUDA device; pass pin_memory=False on CPU")
        return cls(num_workers, prefetch_factor, bool(pin_memory))

    def loader(self, dataset: Any, **kw: Any) -> torch.utils.data.DataLoader[Batch]:
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            collate_fn=_identity,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            **kw,
        )


def _identity(batch: Batch) -> Batch:
    return batch


def _load(micro: _MicroBatches, indices: range, loading: _Loading) -> Iterator[Batch]:
    """Micro-batches `indices` in order: in-process, or from DataLoader workers, whose
    in-order delivery makes the output independent of which worker finishes first."""
    if loading.num_workers == 0 and not loading.pin_memory:
        return (micro[b] for b in indices)
    return run_loader(loading.loader(micro, sampler=indices))


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


class Cursor(int):
    """`state.cursor` after a step on a stream: the micro-batch count, carrying the stream
    `position` (JSON) that `make_batches(start=state.cursor)` resumes from.

    Example:
        >>> from ftrain.data import Cursor
        >>> c = Cursor(3, '{"cursor": 3}')
        >>> c + 1, c.position
        (4, '{"cursor": 3}')
    """

    position: str | None

    def __new__(cls, value: int, position: str | None = None) -> Cursor:
        out = super().__new__(cls, value)
        out.position = position
        return out


class Group(list):
    """A list of micro-batches for one optimizer step; `position` is the stream position
    after it (JSON, None for map-style data), which `clip_and_step` stores in the state."""

    position: str | None = None


def _groups(batches: Iterator[Batch], accum: int) -> Iterator[list[Batch]]:
    group: list[Batch] = []
    for batch in batches:
        group.append(batch)
        if len(group) == accum:
            yield group
            group = []
    if group:
        yield group


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


def pad_collate(
    *,
    pad_id: int = 0,
    label_pad_id: int = -100,
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
    attention_mask: bool = True,
) -> Collate:
    """Return a collate function for rows that are dicts of token lists/tensors or scalars.

    Sequence fields are padded to the longest row: `input_ids` with `pad_id`, `labels` with
    `label_pad_id`, `attention_mask` (created from the row lengths when missing, unless
    `attention_mask=False`) with 0, and any other sequence (e.g. `position_ids`) with 0.
    Scalars (e.g. a class `label`) are stacked. Rows that are not dicts use torch's default
    collate.

    Args:
        pad_id: padding token id for `input_ids`.
        label_pad_id: padding for `labels`; -100 is ignored by the losses.
        padding_side: "right" or "left".
        pad_to_multiple_of: round the padded length up to a multiple of this.
        attention_mask: create a mask for rows without one (off for packed rows, whose
            example boundaries HF models read from `position_ids`).

    Example:
        >>> from ftrain.data import pad_collate
        >>> rows = [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3], "labels": [3]}]
        >>> b = pad_collate(pad_id=9)(rows)
        >>> b["input_ids"].tolist(), b["labels"].tolist(), b["attention_mask"].tolist()
        ([[1, 2], [3, 9]], [[1, 2], [3, -100]], [[1, 1], [1, 0]])
    """
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of!r}")
    pads = {"input_ids": pad_id, "labels": label_pad_id, "attention_mask": 0}

    def collate(rows: list[Any]) -> Batch:
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        if not isinstance(rows[0], Mapping):
            return torch.utils.data.default_collate(rows)
        out: dict[str, Any] = {}
        for key in rows[0]:
            values = [torch.as_tensor(r[key]) for r in rows]
            if values[0].dim() == 0:
                out[key] = torch.stack(values)
                continue
            out[key] = _pad(values, pads.get(key, 0), padding_side, pad_to_multiple_of)
        if attention_mask and "input_ids" in out and "attention_mask" not in out:
            masks = [torch.ones(len(r["input_ids"]), dtype=torch.long) for r in rows]
            out["attention_mask"] = _pad(masks, 0, padding_side, pad_to_multiple_of)
        return out

    return collate


def _pad(values: list[torch.Tensor], pad: int, side: str, multiple: int | None) -> torch.Tensor:
    length = max(v.shape[0] for v in values)
    if multiple:
        length = -(-length // multiple) * multiple
    out = values[0].new_full((len(values), length, *values[0].shape[1:]), pad)
    for i, v in enumerate(values):
        if side == "right":
            out[i, : v.shape[0]] = v
        else:
            out[i, length - v.shape[0] :] = v
    return out


# Messages of out-of-memory errors raised as plain RuntimeErrors (accelerate's list).
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
    """Return `state` with `batch_size` set to the largest size that `probe` runs without
    running out of memory (HF's `auto_find_batch_size`).

    Tries `start`, then `int(size * factor)` after each out-of-memory error (0.9 as HF and
    accelerate do; 0.5 halves), down to 1. `probe(state, size)` should run the most expensive
    step at that size, e.g. `accumulate_grads` on a batch of `size` longest rows; it must not
    consume `state`. A state whose `batch_size` is already set (say, resumed from a checkpoint)
    is returned as it is, without probing: the resumed run keeps the size it started with.

    Raises:
        ValueError: for `start < 1` or `factor` outside (0, 1).
        RuntimeError: when not even a batch of 1 fits.
        Exception: any error of `probe` that is not an out-of-memory error.

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> def probe(state, size):
        ...     if size > 20:
        ...         raise torch.OutOfMemoryError("out of memory (simulated)")
        >>> ft.data.find_batch_size(state, probe, start=64, factor=0.5).batch_size
        16
    """
    if state.batch_size is not None:
        return state
    if not (isinstance(start, int) and start >= 1):
        raise ValueError(f"start must be an int >= 1, got {start!r}")
    if not 0 < factor < 1:
        raise ValueError(f"factor must be in (0, 1), got {factor!r}")
    import gc

    size = start
    while size >= 1:
        try:
            probe(state, size)
            return state.replace(batch_size=size)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
        finally:
            for p in state.params.values():
                p.grad = None  # what the probe's backward left behind
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        size = int(size * factor)
    raise RuntimeError(f"no batch size from {start} down to 1 fits in memory")


# The stream stages build on the names above; imported last so that _stream can import them.
from ftrain._stream import IterableRows, Source, mix, pack, stream  # noqa: E402
