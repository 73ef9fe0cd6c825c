"""Streams: iterable sources read shard by shard, each item paired with the position after it.

A position is plain JSON, so it travels in `state.json`. Every stage (shards, packing, mixing)
maps `(epoch, position)` to the items that follow, so resuming needs no saved buffer: the
shuffle window, the packing carry and the mixing counts are all re-derived from the position,
re-reading at most the consumed part of one shard.

Every rank and every worker reads the same global stream and keeps its own micro-batches; that
is what makes every row appear once per epoch, gives all ranks the same micro-batch count, and
lets a checkpoint resume on another rank count with the same global batch.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import numpy as np
import torch

from ftrain.data import _position as P
from ftrain.data._collate import pack_examples
from ftrain.data._common import (
    Batch,
    Items,
    Loading,
    MadeBy,
    MicroBatches,
    Pos,
    Source,
    Spec,
    ZeroWeight,
    agree_over_ranks,
    epoch_order,
    is_stream,
    run_loader,
    saved_generators,
    seed_generators,
    several_processes,
    yielded_group,
)
from ftrain.data._content import row_digest
from ftrain.rng import dropout_seed
from ftrain.strategies import Strategy

__all__ = ["IterableRows", "mix", "pack", "stream", "stream_groups"]

_WINDOW_TAG = 0x5EED_B0F
_ROW_TAG = 0x0520_0E


class _Shards(Source):
    """A `datasets.IterableDataset` or torch `IterableDataset`, read shard by shard.

    With `shuffle`, the shard order is `epoch_order(num_shards, seed, epoch)` and rows are
    shuffled within consecutive windows of `buffer` rows of a shard (the shuffle buffer), each
    window by its own `(seed, epoch, shard, window)` permutation: reproducible on resume.
    """

    def __init__(self, data: Any, *, buffer: int) -> None:
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"shuffle_buffer must be an int >= 1, got {buffer!r}")
        if getattr(data, "_distributed", None) is not None:
            raise ValueError(
                "data was split by split_dataset_by_node, so its ranks' streams could end at "
                "different steps (a hang); pass the whole stream and strategy=state.strategy: "
                "make_batches gives each rank its share"
            )
        self.data, self.buffer = data, buffer
        sharded = hasattr(data, "num_shards") and hasattr(data, "shard")
        self.num_shards = int(data.num_shards) if sharded else 1
        # datasets' shard(num_shards, index, contiguous=True) and the torch protocol
        # docs/data.md describes, shard(num_shards, index): contiguous only where accepted.
        takes = sharded and _takes(data.shard, "contiguous")
        self._shard_kw = {"contiguous": True} if takes else {}
        self._stages = _hf_stages(data, self.num_shards)
        # A seeded ds.shuffle draws the same order every epoch unless told the epoch
        # (HF's Trainer calls set_epoch): each shard is opened at the epoch being read.
        self._reshuffles = any("shuffle_buffer" in stage for stage in self._stages)
        # (epoch, seed, shuffle) -> (shard, digest) of the epoch's first row, as the ranks'
        # agreement read it: its read for training must find the same row.
        self._peeked: dict[tuple[int, int, bool], tuple[int, str]] = {}

    def _open(self, shard: int, epoch: int) -> Iterable[Any]:
        if self._reshuffles:  # shard() makes a new dataset: the caller's keeps its epoch
            part = self.data.shard(self.num_shards, shard, **self._shard_kw)
        elif self.num_shards == 1:
            part = self.data
        else:
            part = self.data.shard(self.num_shards, shard, **self._shard_kw)
        # A dataset with `set_epoch` is told the epoch it is read at, as HF's Trainer tells it
        # (a torch IterableDataset that orders its rows by epoch repeated epoch 0's order).
        set_epoch = getattr(part, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return part

    def describe(self, shuffle: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": "shards", "shards": self.num_shards}
        files = P.data_files(self.data)
        if files is not None:
            out["files"] = files
        rows = P.data_rows(self.data)  # in memory: no file sizes show another length
        if rows is not None:
            out["shard_rows"] = rows
        arguments = P.generator_arguments(self.data)  # from_generator: no files either
        if arguments is not None:
            out["gen_kwargs"] = arguments
        if self._stages:  # a datasets pipeline's take/skip/seeded shuffle: they pick the rows
            out["pipeline"] = self._stages
        if shuffle:  # the windows a resume re-derives
            out["shuffle_buffer"] = self.buffer
        return out

    def check(self, pos: Pos) -> None:
        if pos is not None:
            _shard_pos(pos, self.num_shards)

    def items(self, epoch: int, pos: Pos, seed: int, shuffle: bool) -> Items:
        n = self.num_shards
        order = epoch_order(n, seed, epoch).tolist() if shuffle else list(range(n))
        j0, i0, first = (0, 0, None) if pos is None else _shard_pos(pos, n)
        peeked = self._peeked.get((epoch, seed, shuffle)) if pos is None else None

        def before() -> Iterator[tuple[Any, Pos]]:  # each row with the position *before* it
            for j in range(j0, n):
                skip = i0 if j == j0 else 0
                head = _Head(order[j], first if j == j0 else None)
                if peeked is not None and peeked[0] == order[j]:
                    head = _Head(order[j], peeked[1], peeked=True)
                rows = self._rows(order[j], skip, seed, epoch, shuffle, head)
                empty = True
                for i, row in enumerate(rows, skip):
                    empty = False
                    # A shard's first row is read before any of its rows is yielded (a resume
                    # re-reads it too): its digest tells this stream's shard from another's.
                    yield row, {"shard": j, "row": i, "first": head.digest}
                if empty and skip:  # a resume past the shard's end: it is shorter than it was
                    raise _misfit(f"shard {j} of the epoch has no row {skip} (a shorter shard?)")

        # The position after a row is the one before the next: a shard's last row then points
        # at the next shard, so resuming there re-reads nothing.
        prev = None
        for row, p in before():
            if prev is not None:
                yield prev, p
            prev = row
        if prev is not None:
            yield prev, {"shard": n, "row": 0}

    def _first_rows(self, epoch: int, seed: int, shuffle: bool) -> str | None:
        """The digest of the epoch's first row (of its first shard that has one)."""
        n = self.num_shards
        for shard in epoch_order(n, seed, epoch).tolist() if shuffle else range(n):
            head = _Head(shard, None)
            rows = head.read(_seeded_reads(iter(self._open(shard, epoch)), seed, epoch, shard))
            found = next(rows, _END) is not _END
            rows.close()
            if found:
                self._peeked[epoch, seed, shuffle] = (shard, head.digest)  # (mixed in twice)
                return head.digest
        return None

    def _rows(
        self, shard: int, skip: int, seed: int, epoch: int, shuffle: bool, head: _Head
    ) -> Iterator[Any]:
        it = head.read(_seeded_reads(iter(self._open(shard, epoch)), seed, epoch, shard))
        if not shuffle:
            return islice(it, skip, None)
        return self._windows(it, shard, skip, seed, epoch)

    def _windows(
        self, it: Iterator[Any], shard: int, skip: int, seed: int, epoch: int
    ) -> Iterator[Any]:
        k = self.buffer
        first = skip // k
        it = islice(it, first * k, None)  # whole consumed windows: read, not kept
        for w in range(first, 2**62):
            window = list(islice(it, k))
            if not window:
                return
            g = torch.Generator().manual_seed(dropout_seed(seed ^ _WINDOW_TAG, epoch, shard, w))
            perm = torch.randperm(len(window), generator=g).tolist()
            lo = skip - w * k if w == first else 0
            for t in perm[lo:]:
                yield window[t]


class _Head:
    """The digest of a shard's first row, as it is read; checked against `want` (the digest a
    position saved: a resume over another stream of the same shape raises, where its shard
    and row counts would not show it). A position saved before digests were kept has none."""

    def __init__(self, shard: int, want: str | None, *, peeked: bool = False) -> None:
        self.shard, self.want, self.digest, self.peeked = shard, want, "", peeked

    def read(self, rows: Iterator[Any]) -> Generator[Any, None, None]:
        first = next(rows, _END)
        if first is _END:
            if self.peeked:  # it had a first row a moment ago
                raise ValueError(_ONCE.format(shard=self.shard, now="no row"))
            if self.want is not None:  # the position stands in it: it had rows
                raise _misfit(f"shard {self.shard} has no row, but had when it was saved")
            return
        self.digest = row_digest(first)
        if self.peeked and self.digest != self.want:
            raise ValueError(_ONCE.format(shard=self.shard, now=f"row digest {self.digest}"))
        if self.want is not None and self.digest != self.want:
            raise _misfit(
                f"shard {self.shard}'s first row is not the one read when it was saved (row "
                f"digest {self.want} then, {self.digest} now): another stream of the same shape "
                "(other files of the same names and sizes, another list of rows), or rows that "
                "changed (another tokenizer, max_length or preprocessing)? Rows drawn from a "
                "generator of the data's own (not torch's, numpy's or random's global ones, "
                "which make_batches seeds for each row) differ at every read too. Resume with "
                "the data it was saved with; or restart the epoch, "
                "state.replace(data=state.data.replace(cursor=0, position=None)); or go on "
                "over the changed rows unchecked, state.replace(data=state.data.replace("
                "position=ft.data.unchecked(state.data.position)))" + P.NOT_ITS_DATA
            )
        yield first
        yield from rows


_ONCE = (
    "data gave another first row in shard {shard} than when make_batches read it a moment "
    "earlier to compare it across ranks ({now}): a stream that can be read only once (an "
    "IterableDataset whose __iter__ returns one generator it keeps), or whose rows differ at "
    "every read (drawn from a generator of its own rather than torch's, numpy's or random's "
    "global ones, which make_batches seeds for each row). A stream is read again every epoch "
    "and on every resume: make __iter__ start a new pass over the same rows each time"
)


def _hf_stages(data: Any, num_shards: int) -> list[dict[str, Any]]:
    """The stages of a `datasets.IterableDataset` pipeline that decide which rows come out,
    for the fingerprint; refuses those that reading shard by shard would change or that are
    not reproducible in another process.

    `make_batches` reads shard j as `ds.shard(n, j, contiguous=True)`: row-by-row stages
    (map, filter, concatenate_datasets) give the same rows, but take/skip would apply per
    shard and interleave_datasets would cycle within each shard's sources. The stages are
    datasets' examples iterables (not a public API): matched by class name, as
    `_position.data_files` reads them.
    """
    out: list[dict[str, Any]] = []
    todo = [getattr(data, "_ex_iterable", None)]
    for _ in range(4 * P._MAX_DEPTH):  # down the chain, into every source of a concatenation
        if not todo:
            break
        ex = todo.pop()
        if ex is None:
            continue
        names = {c.__name__ for c in type(ex).__mro__}
        if "CyclingMultiSourcesExamplesIterable" in names and num_shards > 1:
            raise ValueError(
                "data interleaves several sources (datasets.interleave_datasets), which "
                "make_batches cannot read shard by shard (rows would be lost or repeated): "
                "interleave streams with ft.data.mix([...], weights=...) instead, or pass a "
                "map-style dataset"
            )
        for stage in ("Take", "Skip"):
            if f"{stage}ExamplesIterable" in names:
                n = getattr(ex, "n", None)
                if num_shards > 1:
                    raise ValueError(
                        f"data has a {stage.lower()}({n}) stage (ds.{stage.lower()}), which "
                        f"make_batches cannot read shard by shard: it reads each of the "
                        f"{num_shards} shards with ds.shard(...), so {stage.lower()} would "
                        f"pick other rows. Apply it to the data files instead (data_files=...), "
                        "or pass a map-style dataset (load without streaming=True, then "
                        "Dataset.select)"
                    )
                out.append({stage.lower(): n})
        if "BufferShuffledExamplesIterable" in names:
            out.append(_hf_shuffle(ex))
        if "CyclingMultiSourcesExamplesIterable" in names:  # one shard: read as datasets does
            out.append(_hf_interleave(ex))
        todo.append(getattr(ex, "ex_iterable", None))
        todo += list(getattr(ex, "ex_iterables", None) or [])[::-1]
    else:
        if any(t is not None for t in todo):
            raise ValueError(
                f"data's datasets pipeline has more than {4 * P._MAX_DEPTH} stages: too deep "
                "to check for take/skip/interleave stages; flatten it (e.g. fewer "
                "concatenated sources)"
            )
    return out[::-1]  # from the files up


def _hf_shuffle(ex: Any) -> dict[str, Any]:
    """A datasets buffer shuffle's settings; refused without a seed (one per process)."""
    buffer = getattr(ex, "buffer_size", None)
    seeded = _hf_seed(getattr(ex, "generator", None))
    if seeded is None:
        raise ValueError(
            f"data has ds.shuffle(buffer_size={buffer}) without a seed: datasets draws a new "
            "seed in every process, so a resume would lose or repeat rows. Shuffle with "
            "make_batches(shuffle=True) (the buffer is ft.data.stream(ds, shuffle_buffer=...)), "
            "or give the shuffle a seed: ds.shuffle(seed=..., buffer_size=...)"
        )
    return {"shuffle_buffer": buffer, **seeded}


def _hf_interleave(ex: Any) -> dict[str, Any]:
    """A datasets interleave's settings; refused with probabilities but without a seed."""
    out: dict[str, Any] = {"interleave": len(getattr(ex, "ex_iterables", None) or [])}
    out["stopping_strategy"] = getattr(ex, "stopping_strategy", None)
    if "RandomlyCyclingMultiSourcesExamplesIterable" not in {c.__name__ for c in type(ex).__mro__}:
        return out
    probabilities = _jsonable(getattr(ex, "probabilities", None))
    seeded = _hf_seed(getattr(ex, "generator", None))
    if seeded is None:
        raise ValueError(
            f"data has interleave_datasets(probabilities={probabilities}) without a seed: "
            "datasets draws a new seed in every process, so every rank and every resume would "
            "read another mixture of the sources (rows read twice or lost). Give it a seed, "
            "interleave_datasets(..., seed=...), or mix streams with ft.data.mix([...], "
            "weights=...), which is deterministic"
        )
    return {**out, "probabilities": probabilities, **seeded}


def _hf_seed(gen: Any) -> dict[str, Any] | None:
    """`{"seed", ["generator"]}` of a datasets stage's numpy generator, or None without a seed
    (numpy then draws 128 random bits of entropy in each process: an int seed of 2**64 or
    more is taken for one of those)."""
    seq = getattr(getattr(gen, "bit_generator", None), "seed_seq", None)
    entropy = getattr(seq, "entropy", None)
    if entropy is None or (isinstance(entropy, int) and entropy >= 2**64):
        return None
    state = P.digest(_jsonable(gen.bit_generator.state))
    out: dict[str, Any] = {"seed": _jsonable(entropy)}
    try:
        fresh = P.digest(_jsonable(type(gen.bit_generator)(entropy).state))
    except (TypeError, ValueError):
        fresh = None
    if state != fresh:  # a generator= already drawn from: its state says where it stands
        out["generator"] = state
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _seeded_reads(it: Iterator[Any], seed: int, epoch: int, shard: int) -> Iterator[Any]:
    """Read each row with the generators seeded from `(seed, epoch, shard, row)`: randomness
    drawn while a source produces a row is the same for any worker count, rank or resume. The
    generators are left seeded: `_MicroStream` reads a micro-batch's rows inside one
    `saved_generators()` block (saving them per row was ~0.15 ms a row, mostly numpy's)."""
    for i in range(2**62):
        seed_generators(seed ^ _ROW_TAG, epoch, shard, i)
        row = next(it, _END)
        if row is _END:
            return
        yield row


_END = object()


def _takes(fn: Any, name: str) -> bool:
    """Whether `fn` accepts the keyword `name` (or any keyword)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: call it the documented way
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _shard_pos(pos: Pos, n: int) -> tuple[int, int, str | None]:
    """(shard, row, digest of the shard's first row: None in positions saved before it was
    kept, and at the epoch's end, where nothing is left to read)."""
    keys = set(pos) if isinstance(pos, dict) else None
    if keys not in ({"shard", "row"}, {"shard", "row", "first"}):
        raise _misfit(f"a stream of shards has positions {{shard, row}}, got {_cut(pos)}")
    j, i, first = pos["shard"], pos["row"], pos.get("first")
    if not (type(j) is int and type(i) is int and 0 <= j <= n and i >= 0):
        raise _misfit(f"{_cut(pos)} is not a position in a source of {n} shard(s)")
    if j == n and i != 0:
        raise _misfit(f"{_cut(pos)} is past the last of {n} shard(s)")
    if first is not None and not P.is_hex(first):
        raise _misfit(f"{_cut(pos)} has a first-row digest that is not a hex digest")
    return j, i, first


def _misfit(what: str) -> ValueError:
    return ValueError(f"state.data.position does not fit this data: {what}")


def _cut(value: Any) -> str:
    text = json.dumps(value) if _plain(value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _plain(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def stream(data: Any, *, shuffle_buffer: int | None = None) -> Source:
    """Wrap an iterable dataset for `make_batches`, choosing the shuffle buffer size.

    Shards are `data.num_shards` / `data.shard(num_shards, index)` (a `datasets`
    `IterableDataset`: one per file; `.reshard()` gives one per parquet row group); a torch
    `IterableDataset` without them is one shard. Resuming re-reads the consumed part of the
    current shard only. `shuffle_buffer` is 1000 when None, as for a raw iterable dataset
    passed to `make_batches`. A source (`ft.data.stream`, `pack`, `mix`) is returned as it is,
    so `shuffle_buffer` raises for one: its rows are shuffled by the streams it reads.

    Example:
        >>> import torch, ftrain as ft
        >>> class Numbers(torch.utils.data.IterableDataset):
        ...     def __iter__(self):
        ...         return iter([{"x": i} for i in range(6)])
        >>> src = ft.data.stream(Numbers(), shuffle_buffer=3)
        >>> g = ft.make_batches(src, batch_size=3, shuffle=False)
        >>> [b["x"].tolist() for group in g for b in group]
        [[0, 1, 2], [3, 4, 5]]
    """
    if isinstance(data, Source):
        if shuffle_buffer is not None:  # it would be ignored: the source shuffles its own reads
            raise ValueError(
                f"shuffle_buffer={shuffle_buffer!r} for data that is already a source (of "
                "ft.data.stream, pack or mix): its rows are shuffled by the streams it reads, "
                "with their own buffers. Pass shuffle_buffer to the innermost "
                "ft.data.stream(ds, shuffle_buffer=...)"
            )
        return data
    if not is_stream(data):
        raise TypeError(
            f"data must be a datasets.IterableDataset or a torch IterableDataset, got "
            f"{type(data).__name__}"
        )
    return _Shards(data, buffer=1000 if shuffle_buffer is None else shuffle_buffer)


class _Pack(Source):
    def __init__(self, source: Source, block_size: int, mode: str, key: str) -> None:
        self.source, self.block_size, self.mode, self.key = source, block_size, mode, key

    def describe(self, shuffle: bool) -> dict[str, Any]:
        return {
            "stage": "pack",
            "block_size": self.block_size,
            "mode": self.mode,
            "key": self.key,
            "of": self.source.describe(shuffle),
        }

    def check(self, pos: Pos) -> None:
        if pos is None:
            return
        if not (isinstance(pos, dict) and set(pos) == {"src", "tok"}):
            raise _misfit(f"a packed stream has positions {{src, tok}}, got {_cut(pos)}")
        tok = pos["tok"]
        if type(tok) is not int or tok < 0 or (tok and self.mode == "examples"):
            raise _misfit(f"token offset {_cut(tok)} in a {self.mode!r} packing")
        self.source.check(pos["src"])

    def _first_rows(self, epoch: int, seed: int, shuffle: bool) -> Any:
        return _first_rows_of(self.source, epoch, seed, shuffle)

    def items(self, epoch: int, pos: Pos, seed: int, shuffle: bool) -> Items:
        inner, skip = (None, 0) if pos is None else (pos["src"], pos["tok"])
        rows = self.source.items(epoch, inner, seed, shuffle)
        if self.mode == "concat":
            return self._concat(rows, inner, skip)
        return self._examples(rows, inner)

    def _concat(self, rows: Items, before: Pos, skip: int) -> Items:
        size = self.block_size
        segs: deque[list[Any]] = deque()  # [position before the row, first unused token, tokens]
        have = 0
        if skip:  # resuming inside a row: it must still be there, and longer than the offset
            rows = _past(rows, skip, self.key)
        for row, after in rows:
            _unpadded(row, "concat")
            if "labels" in row and list(row["labels"]) != list(row[self.key]):
                # concat makes labels = input_ids: a prompt mask would be lost
                raise ValueError(
                    'pack(mode="concat") on rows with labels: its blocks take labels = '
                    "input_ids, so the rows' labels (a prompt mask) would be lost. Use "
                    'mode="examples", which keeps them, or remove the labels column'
                )
            tokens = list(row[self.key])
            if skip < len(tokens):
                segs.append([before, skip, tokens[skip:]])
                have += len(tokens) - skip
            before, skip = after, 0
            while have >= size:
                have -= size
                block = _take(segs, size)
                nxt = {"src": segs[0][0], "tok": segs[0][1]} if segs else {"src": before, "tok": 0}
                yield {"input_ids": block, "labels": list(block)}, nxt
        if have:  # the stream's last, short block: every token is used once
            block = _take(segs, have)
            yield {"input_ids": block, "labels": list(block)}, {"src": before, "tok": 0}

    def _examples(self, rows: Items, before: Pos) -> Items:
        kept: list[dict[str, Any]] = []
        length = 0
        for row, after in rows:
            _unpadded(row, "examples")
            ids = list(row[self.key])
            n = min(len(ids), self.block_size)
            if kept and length + n > self.block_size:
                yield pack_examples(kept, self.block_size)[0], {"src": before, "tok": 0}
                kept, length = [], 0
            kept.append({"input_ids": ids, "labels": list(row.get("labels", ids))})
            length += n
            before = after
        if length:  # rows without tokens alone make no block (pack_examples drops them)
            yield pack_examples(kept, self.block_size)[0], {"src": before, "tok": 0}


def _unpadded(row: Any, mode: str) -> None:
    """Refuse a row whose attention_mask marks padding: packing keeps only its tokens, so the
    padding would become content (and pack_examples' own check would never see the mask)."""
    mask = row.get("attention_mask") if isinstance(row, Mapping) else None
    if mask is None:
        return
    arrays = (torch.Tensor, np.ndarray)
    if bool((mask == 0).any()) if isinstance(mask, arrays) else 0 in list(mask):
        raise ValueError(
            f'pack(mode="{mode}"): a row\'s attention_mask marks padding, which packing would '
            "keep as tokens (it keeps the token column only). Encode the rows unpadded "
            "(tokenizer(..., padding=False)) before packing"
        )


def _past(rows: Items, skip: int, key: str) -> Items:
    """`rows`, refusing a first row that the token offset `skip` lies beyond."""
    first = next(rows, None)
    if first is None or skip >= len(first[0][key]):
        got = "no row" if first is None else f"a row of {len(first[0][key])} tokens"
        raise _misfit(f"token offset {skip}, but the stream has {got} there")
    yield first
    yield from rows


def _take(segs: deque[list[Any]], n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        seg = segs[0]
        need = n - len(out)
        out += seg[2][:need]
        if need >= len(seg[2]):
            segs.popleft()
        else:
            seg[1], seg[2] = seg[1] + need, seg[2][need:]
    return out


def pack(data: Any, *, block_size: int, mode: str = "concat", key: str = "input_ids") -> Source:
    """Pack a stream of token rows into blocks of `block_size` tokens, resumable mid-block.

    `mode="concat"` concatenates the rows' `key` tokens and cuts them into blocks of exactly
    `block_size` (the stream's last block may be shorter); every token is used once, and a
    row may span two blocks. `mode="examples"` keeps examples whole, as
    `ft.data.pack_examples` does: rows are added to a block until the next does not fit
    (`position_ids` restart per example, a row longer than `block_size` is cut). Blocks are
    rows `{"input_ids", "labels", ...}`.

    Example:
        >>> import ftrain as ft
        >>> rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8]}]
        >>> ds = ft.data.stream(ft.data.IterableRows(rows))
        >>> blocks = ft.make_batches(ft.data.pack(ds, block_size=3), batch_size=1, shuffle=False)
        >>> [b["input_ids"].tolist() for g in blocks for b in g]
        [[[1, 2, 3]], [[4, 5, 6]], [[7, 8]]]
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if mode not in ("concat", "examples"):
        raise ValueError(f"mode must be 'concat' or 'examples', got {mode!r}")
    if not isinstance(key, str):
        raise TypeError(f"key must be the name of the token column (a str), got {key!r}")
    return _Pack(stream(data), block_size, mode, key)


class _Mix(Source):
    def __init__(self, sources: list[Source], weights: list[float]) -> None:
        self.sources, self.weights = sources, weights

    def describe(self, shuffle: bool) -> dict[str, Any]:
        return {
            "stage": "mix",
            "weights": self.weights,
            "sources": [s.describe(shuffle) for s in self.sources],
        }

    def check(self, pos: Pos) -> None:
        if pos is not None:
            _, inner = _mix_pos(pos, self.weights)
            for s, p in zip(self.sources, inner, strict=True):
                s.check(p)

    def _first_rows(self, epoch: int, seed: int, shuffle: bool) -> Any:
        return [
            _first_rows_of(s, epoch, seed + i, shuffle) if w > 0 else None  # 0: never read
            for i, (s, w) in enumerate(zip(self.sources, self.weights, strict=True))
        ]

    def items(self, epoch: int, pos: Pos, seed: int, shuffle: bool) -> Items:
        k = len(self.sources)
        counts, inner = ([0] * k, [None] * k) if pos is None else _mix_pos(pos, self.weights)
        its = [
            s.items(epoch, p, seed + i, shuffle)
            for i, (s, p) in enumerate(zip(self.sources, inner, strict=True))
        ]
        while True:
            # Smooth weighted round-robin: take from the source furthest behind its share, so
            # the realised proportions stay within one row of the weights at every point.
            total = sum(counts) + 1
            i = int(np.argmax([w * total - c for w, c in zip(self.weights, counts, strict=True)]))
            nxt = next(its[i], None)
            if nxt is None:  # the first source to run out ends the epoch
                return
            counts[i] += 1
            inner[i] = nxt[1]
            yield nxt[0], {"counts": list(counts), "src": list(inner)}


def _mix_pos(pos: Pos, weights: list[float]) -> tuple[list[int], list[Pos]]:
    k = len(weights)
    ok = isinstance(pos, dict) and set(pos) == {"counts", "src"}
    if not (ok and all(isinstance(pos[x], list) and len(pos[x]) == k for x in ("counts", "src"))):
        raise _misfit(f"a mix of {k} sources has positions {{counts, src}} of {k}, got {_cut(pos)}")
    counts, inner = pos["counts"], pos["src"]
    if not all(type(c) is int and c >= 0 for c in counts):
        raise _misfit(f"mix counts must be ints >= 0, got {_cut(counts)}")
    if any((c == 0) != (p is None) for c, p in zip(counts, inner, strict=True)):
        raise _misfit(f"mix counts {_cut(counts)} and source positions disagree")
    # The rule keeps every count within about one row of its share (less than one for two
    # sources); k rows is a bound no position it produced exceeds.
    total = sum(counts)
    if any(abs(c - w * total) > k for c, w in zip(counts, weights, strict=True)):
        raise _misfit(f"mix counts {_cut(counts)} do not follow the weights {_cut(weights)}")
    return list(counts), list(inner)


def mix(sources: Sequence[Any], *, weights: Sequence[float]) -> Source:
    """Interleave streams so that their shares of the rows follow `weights` (e.g. 0.7/0.3).

    The order is deterministic (source i is taken whenever it is furthest behind its share),
    so it is reproducible and resumable; the epoch ends when the first source runs out. A
    weight of 0 leaves its source unread.

    Raises:
        TypeError: for `weights` that are not numbers (`True` is not a weight).
        ValueError: for a weight that is negative, infinite or NaN, all weights 0, or not one
            weight per source.

    Example:
        >>> import ftrain as ft
        >>> a = ft.data.IterableRows([{"x": 0}] * 7)
        >>> b = ft.data.IterableRows([{"x": 1}] * 3)
        >>> g = ft.make_batches(ft.data.mix([a, b], weights=[0.7, 0.3]), batch_size=10)
        >>> [b["x"].tolist() for group in g for b in group]
        [[0, 1, 0, 0, 0, 1, 0, 0, 1, 0]]
    """
    if isinstance(sources, (str, bytes, Mapping)) or not isinstance(sources, Sequence):
        raise TypeError(f"sources must be a list of data sources, got {type(sources).__name__}")
    sources = list(sources)
    return _Mix([stream(s) for s in sources], _shares(len(sources), weights))


def _shares(k: int, weights: Sequence[float]) -> list[float]:
    """The weights as shares summing to 1, refusing what would silently starve a source."""
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__iter__"):
        raise TypeError(f"weights must be a sequence of numbers, got {weights!r}")
    ws = list(weights)
    if len(ws) != k or k == 0:
        raise ValueError(
            f"weights must give one weight per source: {k} sources, {len(ws)} weights {ws!r}"
        )
    for w in ws:
        # bool is an int to Python, but True is never a share; numpy numbers are fine.
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Real):
            raise TypeError(f"weights must be numbers, got {w!r} ({type(w).__name__}) in {ws!r}")
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"weights must be finite and >= 0, got {w!r} in {ws!r}")
    top = max(ws)
    if top == 0:
        raise ValueError(f"weights must not all be 0, got {ws!r}")
    scaled = [float(w) / float(top) for w in ws]  # by the largest first: no overflow in the sum
    total = sum(scaled)
    return [w / total for w in scaled]


class IterableRows(torch.utils.data.IterableDataset[Any]):
    """A torch `IterableDataset` over a list of rows (tests and examples): one shard."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)


class _MicroStream(torch.utils.data.IterableDataset[tuple[Batch, str]]):
    """This rank's micro-batches of the global stream with their positions; a worker of W
    keeps micro-batches b = worker (mod W), which DataLoader delivers round-robin, in order."""

    def __init__(self, source: Source, spec: Spec, pos: Pos, start: int, head: str) -> None:
        self.source, self.spec, self.pos, self.start = source, spec, pos, start
        self.head = head  # the JSON object of what every position of this epoch shares

    def __iter__(self) -> Iterator[tuple[Batch, str]]:
        s = self.spec
        worker, workers = _claim_worker()
        rows = s.batch_size * s.world
        items = self.source.items(s.epoch, self.pos, s.seed, s.shuffle)
        b = self.start
        while True:
            # The rows' reads and the collation each seed the generators for themselves; the
            # caller's are put back once a micro-batch, before it is yielded.
            with saved_generators():
                chunk = list(islice(items, rows))
                full = bool(chunk) and not (s.drop_last and len(chunk) < rows)
                mine = full and (b - self.start) % workers == worker
                batch = self._collate(chunk, b) if mine else None
            if not full:
                break
            if mine:
                yield batch, self._position(b + 1, chunk[-1][1])
            b += 1
        if b == 0:  # the README loop would call next_epoch forever
            raise ValueError(
                "data is empty"
                + (f", or drop_last=True with fewer than {rows} rows" if s.drop_last else "")
                + ": the stream yields no micro-batch in an epoch"
            )

    def _collate(self, chunk: list[tuple[Any, Pos]], b: int) -> Batch:
        s = self.spec
        mine = np.array_split(np.arange(len(chunk)), s.world)[s.rank].tolist()
        seed_generators(s.seed, s.epoch, b, s.rank)  # inside the caller's saved_generators()
        if mine:
            return s.collate([chunk[i][0] for i in mine])
        return ZeroWeight(s.collate([chunk[0][0]]))

    def _position(self, cursor: int, pos: Pos) -> str:
        src = json.dumps(pos, separators=(",", ":"))
        out = f'{self.head[:-1]},"cursor":{cursor},"src":{src}}}'
        if len(out) > P._MAX_CHARS:  # every checkpoint of the run would be refused at load
            raise ValueError(_too_long(cursor, len(out), len(src), len(self.head)))
        try:  # what load_checkpoint checks: a few microseconds for a position this short
            P.read_position(out)
        except ValueError as e:
            raise ValueError(
                f"the stream position after micro-batch {cursor} could not be loaded back from "
                f"a checkpoint ({e}): a custom Source's describe() and positions must be plain "
                "JSON (finite numbers, nested at most 64 deep)"
            ) from None
        return out


def _too_long(cursor: int, chars: int, src: int, head: int) -> str:
    """Why a position is too long: the source's position, or the data's description."""
    why = (
        f"its source position alone is {src}: keep a custom Source's positions small (an "
        "index, not the rows or files it read)"
        if src >= head
        else f"the data's description in it (describe(), summarized) alone is {head}: keep a "
        "custom Source's describe() small (a count and digest of what it lists)"
    )
    return (
        f"the stream position after micro-batch {cursor} is {chars} characters, more than the "
        f"{P._MAX_CHARS} that a checkpoint's state.data.position may hold (load_checkpoint "
        f"refuses it); {why}"
    )


def _head(spec: Spec, about: dict[str, Any]) -> str:
    """What every position of the epoch shares, with a digest and a summary of the data."""
    head = {
        "version": P.VERSION,
        "kind": "stream",
        "epoch": spec.epoch,
        "seed": spec.seed,
        "rows": spec.batch_size * spec.world,
        "shuffle": spec.shuffle,
        "fp": P.digest(about),
        "about": P.summary(about),
    }
    return json.dumps(head, separators=(",", ":"))


def _claim_worker() -> tuple[int, int]:
    """(worker id, workers) inside a DataLoader worker, else (0, 1).

    Each worker reads the whole stream itself, so the worker info is hidden from the sources:
    `datasets` would otherwise give each worker a disjoint subset of the shards.
    """
    info = torch.utils.data.get_worker_info()
    if info is None:
        return 0, 1
    torch.utils.data._utils.worker._worker_info = None
    return info.id, info.num_workers


def _resume(start: int, raw: str | None, spec: Spec, source: Source, about: dict[str, Any]) -> Pos:
    """The source position to resume at micro-batch `start`, from the state's stream position,
    checked against the data: a resume that could not be exact raises, naming what changed."""
    if start == 0:
        return None
    if raw is None:
        raise ValueError(
            f"resuming a stream at micro-batch {start} needs its position, which clip_and_step"
            "(stats=...) keeps in state.data.position: pass the state trained (or loaded from a "
            "checkpoint saved) on this stream, make_batches(data, state, ...)"
        )
    pos = P.resumable(raw, "stream")
    _fits(pos, start, spec, about)
    source.check(pos["src"])
    return pos["src"]


def _fits(pos: dict[str, Any], start: int, spec: Spec, about: dict[str, Any]) -> None:
    """Refuse a stream position saved for another place, global batch, shuffle or data."""
    want = {"epoch": spec.epoch, "cursor": start, "seed": spec.seed}
    got = {k: pos.get(k) for k in want}
    if got != want:
        raise ValueError(
            f"state.data.position is the position for {got}, but the state is at {want}: a "
            "state whose cursor was changed without its stream position?"
        )
    rows = spec.batch_size * spec.world
    if pos["rows"] != rows:
        raise ValueError(
            f"batch_size={spec.batch_size} x {spec.world} rank(s) = {rows} rows per global "
            f"micro-batch, but state.data.position was saved with {pos['rows']}: keep the "
            "global batch when resuming" + P.NOT_ITS_DATA
        )
    if pos["shuffle"] != spec.shuffle:
        raise ValueError(
            f"shuffle={spec.shuffle}, but state.data.position was saved with "
            f"shuffle={pos['shuffle']}: keep it when resuming" + P.NOT_ITS_DATA
        )
    # A position saved before in-memory shards' rows (or a from_generator stream's
    # arguments, or a datasets interleave stage) were described digests without them.
    older = (
        P.without_shard_rows(about),
        P.without_generator_arguments(about),
        P.without_interleave(about),
    )
    if pos["fp"] not in {P.digest(about), *map(P.digest, older)}:
        now = P.summary(about)  # as the saved one was kept: long lists by count and digest
        changed = "; ".join(P.changes(pos["about"], now)) or "the sources changed"
        raise ValueError(
            f"state.data.position was saved for other data, so resuming would not be exact: "
            f"{changed}. Resume with the data and settings it was saved with, or restart the "
            "epoch: state.replace(data=state.data.replace(cursor=0, position=None))"
            + P.NOT_ITS_DATA
        )


def _first_rows_of(source: Source, epoch: int, seed: int, shuffle: bool) -> Any:
    """Digests of the first row each stream of `source` reads in the epoch (None for a custom
    `Source`, which is not read for it)."""
    peek = getattr(source, "_first_rows", None)
    return None if peek is None else peek(epoch, seed, shuffle)


def _forget_peeks(source: Source) -> None:
    """Drop what an earlier call's agreement read of `source`'s streams (`_Shards._peeked`)."""
    if isinstance(source, _Shards):
        source._peeked = {}
    elif isinstance(source, _Pack):
        _forget_peeks(source.source)
    elif isinstance(source, _Mix):
        for inner in source.sources:
            _forget_peeks(inner)


def stream_groups(
    data: Any,
    spec: Spec,
    *,
    start: int,
    position: str | None,
    loading: Loading,
    agree: dict[str, Any],
    strategy: Strategy | None,
    made_by: MadeBy,
) -> Iterator[MicroBatches]:
    """make_batches for an iterable source: groups of `accum` micro-batches with positions.
    Every rank must read the same global stream with the same settings (`agree`)."""
    source = stream(data)
    about = source.describe(spec.shuffle)
    # Ranks each given their own part of a stream (IterableRows(rows[rank::world]), a dataset
    # that picks its rows by rank) describe alike, and each kept its part of its own part:
    # the rest was never trained on. Their first rows differ. Read once an epoch, only where
    # ranks are compared (a resume checks the shard it stands in against its position).
    first = None
    _forget_peeks(source)  # a source object reused from an earlier call
    if start == 0 and several_processes(strategy):
        with saved_generators():  # the reads seed the global generators for each row
            first = _first_rows_of(source, spec.epoch, spec.seed, spec.shuffle)
    # The same keys, in the same order, as a map-style call: one collective of one size
    rows = {"rows": None, "content": first, "subset": None, "lengths": None}
    agree_over_ranks(strategy, {"data": P.digest(about), **rows, **agree})
    pos = _resume(start, position, spec, source, about)
    micro = _MicroStream(source, spec, pos, start, _head(spec, about))
    if loading.num_workers == 0 and not loading.pin_memory:
        return _grouped(iter(micro), spec.accum, made_by, start)
    return _grouped(run_loader(loading.loader(micro, spec)), spec.accum, made_by, start)


def _grouped(
    batches: Iterator[tuple[Batch, str]], accum: int, made_by: MadeBy, start: int
) -> Iterator[MicroBatches]:
    group: list[Batch] = []
    after: list[str] = []  # the stream position after each micro-batch of the group
    first = start
    for batch, position in batches:
        group.append(batch)
        after.append(position)
        if len(group) == accum:
            yield yielded_group(tuple(group), tuple(after), made_by, first)
            first += accum
            group, after = [], []
    if group:
        yield yielded_group(tuple(group), tuple(after), made_by, first)
