"""Batches: a deterministic epoch order, grouped into micro-batches, split across ranks.

The order of an epoch is a pure function of `(seed, epoch)`, so resuming needs only the
`cursor` (micro-batches already consumed), and skipping them costs nothing: indices are sliced,
rows are never read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ftrain.strategies._base import Strategy

if TYPE_CHECKING:
    from ftrain.state import TrainState

__all__ = [
    "ZeroWeight",
    "epoch_order",
    "find_batch_size",
    "is_out_of_memory",
    "length_grouped_order",
    "make_batches",
    "num_micro_batches",
    "pad_collate",
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
) -> Iterator[list[Batch]]:
    """Yield one epoch as lists of `accum` collated micro-batches (the last list may be shorter).

    With W data-parallel ranks, global micro-batch b is rows `[b*bs*W, (b+1)*bs*W)` of the
    epoch order, split into W contiguous parts (`numpy.array_split`); this rank collates its
    part. The union over ranks equals what one process yields with `batch_size=bs*W`. When the
    final global micro-batch has fewer than W rows, ranks left without rows get a `ZeroWeight`
    stand-in, so that every rank runs the same number of micro-batches.

    Args:
        data: a `datasets.Dataset`, a map-style torch dataset or a sequence of rows.
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
        strategy: supplies the data-parallel `rank` and `world_size` (1 process by default).

    Raises:
        ValueError: for a non-positive `batch_size`/`accum`, or a negative `start`.
        TypeError: for data that has no `len` and `__getitem__`.

    Example:
        >>> import ftrain as ft
        >>> rows = [{"input_ids": [1] * (i + 1)} for i in range(5)]
        >>> groups = list(ft.make_batches(rows, batch_size=2, accum=2, shuffle=False))
        >>> [[b["input_ids"].shape[0] for b in g] for g in groups]
        [[2, 2], [1]]
    """
    _validate(batch_size=batch_size, accum=accum, start=start, data=data)
    rank, world = (0, 1) if strategy is None else (strategy.rank, strategy.world_size)
    collate = pad_collate() if collate_fn is None else collate_fn
    n = len(data)
    rows = batch_size * world
    if group_by_length:
        lens = lengths if lengths is not None else [len(data[i]["input_ids"]) for i in range(n)]
        # HF groups by the per-step batch (train_batch_size * accumulation), over all ranks.
        order = length_grouped_order(lens, rows * accum, seed, epoch)
    elif shuffle:
        order = epoch_order(n, seed, epoch)
    else:
        order = np.arange(n)
    total = num_micro_batches(n, batch_size, world_size=world, drop_last=drop_last)
    group: list[Batch] = []
    for b in range(start, total):
        chunk = np.array_split(order[b * rows : (b + 1) * rows], world)[rank]
        if len(chunk):
            group.append(collate(_fetch(data, chunk)))
        else:  # only the final, short global micro-batch can leave a rank without rows
            group.append(ZeroWeight(collate(_fetch(data, order[b * rows : b * rows + 1]))))
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
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(
            f"data must support len() and indexing (a datasets.Dataset, a map-style torch "
            f"Dataset or a sequence), got {type(data).__name__}"
        )


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
