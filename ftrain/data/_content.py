"""A cheap digest of what map-style data holds: a few rows at fixed places, hashed.

A map position records the number of rows, which orders the epoch; rows of the same count but
other contents (another tokenizer, `max_length` or preprocessing) would be read from the same
indices without a word. The digest hashes the first and the last row and six more at places
drawn from the row count alone, so any run over the same data draws the same rows: eight
reads, whatever the size of the data.

Only data whose rows are plain values in memory or on disk are read for it: a tensor or numpy
array, a list or tuple of rows, a `TensorDataset`, a `datasets.Dataset` (its stored rows, in
Arrow, without the formatting or transform set on it), a torch `Subset` by its indices (and
what it picks from), and a torch `ConcatDataset` by its parts. A torch dataset of your own is
not read (its `__getitem__` may be costly, random, or count its reads: rows are read when
trained on, never skipped ones), and its positions hold no digest.

Numbers are hashed by kind (bool, int, float, complex), shape and value, whatever holds them:
`[[1, 2]]`, an int32 or int64 tensor and an int numpy array of those values hash alike (a
collate that turns a row's lists into tensors in place changes nothing), floats after an exact
widening to float64 (bfloat16, float16); `1`, `1.0` and `True` differ, alone or in arrays.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["content_digest", "legacy_digest", "row_digest", "subset_digest"]

_SAMPLED = 6  # rows at places drawn from the row count, besides the first and the last
_DEPTH = 32  # nesting beyond this is hashed by type only (rows are a few levels deep)
_AS_TEXT = (datetime.date, datetime.time, datetime.timedelta, decimal.Decimal, uuid.UUID)
_NUMBERS = "biufc"  # numpy kinds hashed by value: bool, int, unsigned, float, complex
_I64 = np.iinfo(np.int64).max
_TEXT = (str, type(None))


def content_digest(data: Any, n: int) -> str | None:
    """A 16-hex-digit digest of a few rows of `data` (`n` rows), or None for data not read
    for it (see the module docstring).

    A torch `Subset` (nested ones too) is digested by all its indices and the digest of the
    dataset it picks from (whose own rows are read only if that is data read for it):
    `random_split` without a seeded `generator` draws another split in every run, and a
    resume would go on over other rows, some of them the validation split's. A torch
    `ConcatDataset` by the length and digest of each of its parts (None when no part is read).
    """
    h = hashlib.sha256(f"rows:{n}".encode())
    picked = subset_digest(data)
    if picked is not None:
        inner = data
        while isinstance(inner, torch.utils.data.Subset):
            inner = inner.dataset
        h.update(f"subset:{picked};of:{content_digest(inner, len(inner))};".encode())
        return h.hexdigest()[:16]
    if isinstance(data, torch.utils.data.ConcatDataset):
        # Each part as it would be alone: a concatenation of tokenized lists is read for it.
        sizes = np.diff(data.cumulative_sizes, prepend=0).tolist()
        parts = [(k, content_digest(d, k)) for d, k in zip(data.datasets, sizes, strict=True)]
        if all(digest is None for _, digest in parts):
            return None
        h.update(f"concat:{parts!r};".encode())
        return h.hexdigest()[:16]
    rows = _reader(data)
    if rows is None:
        return None
    for row in rows(_places(n)):
        _feed(h, row, 0)
    return h.hexdigest()[:16]


def legacy_digest(data: Any, n: int) -> str | None:
    """The digest that positions saved before mappings were read held, or None where it was
    none: rows that are mappings but not dicts (a tokenizer's `BatchEncoding`) hashed by their
    type alone, a torch `Subset` or `ConcatDataset` not read. Such a position still resumes
    over the rows it was saved with."""
    rows = _reader(data)
    if rows is None:
        return None
    h = hashlib.sha256(f"rows:{n}".encode())
    for row in rows(_places(n)):
        _feed(h, row, 0, mappings=False)
    return h.hexdigest()[:16]


def row_digest(row: Any) -> str:
    """A 16-hex-digit digest of one row, hashed as `content_digest` hashes rows: what a stream
    position keeps of the first row of the shard it stands in (`_stream.py`)."""
    h = hashlib.sha256(b"row;")
    _feed(h, row, 0)
    return h.hexdigest()[:16]


def subset_digest(data: Any) -> str | None:
    """A digest of the indices of a torch `Subset` (nested ones too), or None for other data."""
    h, found = hashlib.sha256(), False
    while isinstance(data, torch.utils.data.Subset):
        idx = data.indices
        if isinstance(idx, range):  # random_split's are lists; a range need not be spelled out
            h.update(f"range({idx.start},{idx.stop},{idx.step});".encode())
        else:
            h.update(np.asarray(idx, np.int64).tobytes() + b";")
        data, found = data.dataset, True
    return h.hexdigest()[:16] if found else None


def _places(n: int) -> list[int]:
    """The first and last row and `_SAMPLED` more, from `n` alone (sha256: the same in every
    Python, numpy and torch)."""
    drawn = (
        int.from_bytes(hashlib.sha256(f"ftrain-rows:{n}:{i}".encode()).digest()[:8], "big") % n
        for i in range(_SAMPLED)
    )
    return sorted({0, n - 1, *drawn})


def _reader(data: Any) -> Any:
    """`indices -> rows` for data whose rows are read for the digest, else None."""
    if isinstance(data, (torch.Tensor, np.ndarray, list, tuple)):
        return lambda idx: [data[i] for i in idx]
    if type(data) is torch.utils.data.TensorDataset:
        return lambda idx: [data[i] for i in idx]
    kind = type(data)
    if kind.__name__ == "Dataset" and kind.__module__.startswith("datasets."):
        # The stored rows, without a format or transform set on the data (an on-the-fly
        # transform may be random); select/shuffle indices are applied.
        arrow = data.with_format("arrow")
        return lambda idx: arrow[idx].to_pylist()
    return None


def _feed(h: Any, value: Any, depth: int, mappings: bool = True) -> None:
    """Hash `value` with its kind, so that 1, 1.0, "1" and True differ; numbers by value.
    Without `mappings`, only dicts are read as mappings (`legacy_digest`)."""
    numbers = _numeric(value)
    if numbers is not None:
        _feed_numbers(h, numbers)
    elif isinstance(value, (str, int, type(None))):  # an int here is past 64 bits
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, torch.Tensor):
        _feed_tensor(h, value, depth)
    elif isinstance(value, np.ndarray) and value.dtype != object:  # text, dates
        h.update(f"ndarray:{value.dtype.str}{list(value.shape)};".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.generic):
        h.update(f"np:{value.dtype.str}:{value.item()!r};".encode())
    elif isinstance(value, (bytes, bytearray)):
        h.update(f"bytes:{len(value)};".encode())
        h.update(value)
    elif isinstance(value, _AS_TEXT):
        h.update(f"{type(value).__name__}:{value};".encode())
    elif depth < _DEPTH and isinstance(value, Mapping if mappings else dict):
        h.update(f"dict:{len(value)};".encode())  # a tokenizer's BatchEncoding too
        for key in sorted(value, key=_order):  # 1 and "1" are two keys, in either order
            _feed(h, key, depth + 1, mappings)
            _feed(h, value[key], depth + 1, mappings)
    elif depth < _DEPTH and isinstance(value, (set, frozenset)):
        h.update(f"set:{len(value)};".encode())
        for v in sorted(value, key=_order):
            _feed(h, v, depth + 1, mappings)
    elif isinstance(value, (list, tuple)) and all(type(v) in _TEXT for v in value):
        h.update(f"texts:{list(value)!r};".encode())  # words: one repr, not one update each
    elif depth < _DEPTH and isinstance(value, (list, tuple, np.ndarray)):
        h.update(f"seq:{len(value)};".encode())
        for v in value:
            _feed(h, v, depth + 1, mappings)
    else:  # an object whose contents are not known here (its repr may hold an address)
        h.update(f"object:{type(value).__module__}.{type(value).__qualname__};".encode())


def _order(value: Any) -> tuple[str, str]:
    return type(value).__name__, str(value)


def _numeric(value: Any) -> np.ndarray | None:
    """The numbers `value` holds as an array, whatever holds them (a Python number or list, a
    numpy array, a tensor), or None if it is not a rectangular array of numbers."""
    if isinstance(value, torch.Tensor):
        return _tensor_numbers(value)
    if isinstance(value, (list, tuple)):
        return _list_numbers(value)
    if isinstance(value, (bool, int, float, complex, np.generic, np.ndarray)):
        numbers = np.asarray(value)  # a Python int past 64 bits: an object array
        return numbers if numbers.dtype.kind in _NUMBERS else None
    return None


def _tensor_numbers(t: torch.Tensor) -> np.ndarray | None:
    """A strided tensor's values on the host, floats as float64 (exact from every float)."""
    if t.is_nested or t.is_meta or t.is_quantized or t.layout != torch.strided:
        return None
    t = t.detach().resolve_conj().resolve_neg()
    wide = torch.complex128 if t.is_complex() else torch.float64 if t.is_floating_point() else None
    try:  # a device tensor is copied to the host: a sync, once per make_batches call
        return (t.to("cpu", wide) if wide else t.to("cpu")).numpy()
    except (RuntimeError, TypeError):  # a dtype with no float64 or numpy form (float4)
        return None


def _list_numbers(row: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    if row and isinstance(row[0], torch.Tensor):  # numpy cannot read every tensor
        parts = [_tensor_numbers(t) if isinstance(t, torch.Tensor) else None for t in row]
        arrays = [p for p in parts if p is not None]
        if len(arrays) < len(parts) or len({p.shape for p in arrays}) > 1:
            return None
        return np.stack(arrays)
    if row and isinstance(row[0], (str, bytes, dict, type(None))):
        return None  # never numbers: spare numpy a copy of a long list of words
    try:
        numbers = np.asarray(row)
    except Exception:  # ragged, or elements numpy cannot read: hashed one by one instead
        return None
    kind = numbers.dtype.kind
    if kind not in _NUMBERS:
        return None
    if kind in "fc":  # ints past 2**53 promoted to float lost digits: hash them one by one
        flat = numbers.reshape(-1)
        values = np.concatenate([flat.real, flat.imag]) if kind == "c" else flat
        if np.any(np.isfinite(values) & (np.abs(values) >= 2.0**53)):
            return None
    return numbers


def _feed_numbers(h: Any, numbers: np.ndarray) -> None:
    """Numbers by kind, shape and value: ints as int64, floats as float64, one NaN."""
    kind = numbers.dtype.kind
    if kind == "b":
        numbers = numbers.astype(np.bool_)
    elif kind == "u" and numbers.dtype.itemsize == 8 and numbers.size and numbers.max() > _I64:
        numbers = numbers.astype("<u8")  # no int64 form (a list of such ints is uint64 too)
    elif kind in "iu":
        kind, numbers = "i", numbers.astype("<i8")
    else:
        numbers = numbers.astype("<f8" if kind == "f" else "<c16")  # a copy: written below
        flat = numbers.reshape(-1).view("<f8")
        flat[np.isnan(flat)] = np.nan  # NaN's sign and payload are not data
    h.update(f"num:{kind}{list(numbers.shape)};".encode())
    h.update(np.ascontiguousarray(numbers).tobytes())


def _feed_tensor(h: Any, t: torch.Tensor, depth: int) -> None:
    """A tensor with no plain array of numbers: nested, sparse, quantized, meta, float4."""
    h.update(f"tensor:{t.dtype}:{t.layout}:{'nested' if t.is_nested else list(t.shape)};".encode())
    t = t.detach()
    if t.is_meta:
        return  # no values, only a shape
    if t.is_nested:
        for part in t.unbind():  # rows of other lengths
            _feed(h, part, depth + 1)
    elif t.is_quantized:
        _feed(h, t.dequantize(), depth + 1)
    elif t.layout != torch.strided:  # sparse: the indices and values of its COO form
        coo = (t if t.layout == torch.sparse_coo else t.to_sparse()).coalesce()
        _feed(h, coo.indices(), depth + 1)
        _feed(h, coo.values(), depth + 1)
    else:
        flat = t.resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes())
