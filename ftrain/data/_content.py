"""A cheap digest of what map-style data holds: a few rows at fixed places, hashed.

A map position records the number of rows, which orders the epoch; rows of the same count but
other contents (another tokenizer, `max_length` or preprocessing) would be read from the same
indices without a word. The digest hashes the first and the last row and six more at places
drawn from the row count alone, so any run over the same data draws the same rows: eight
reads, whatever the size of the data.

Only data whose rows are plain values in memory or on disk are read for it: a tensor or numpy
array, a list or tuple of rows, a `TensorDataset`, a `datasets.Dataset` (its stored rows, in
Arrow, without the formatting or transform set on it). A torch dataset of your own is not
read (its `__getitem__` may be costly, random, or count its reads: rows are read when trained
on, never skipped ones), and its positions hold no digest.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import uuid
from typing import Any

import numpy as np
import torch

__all__ = ["content_digest"]

_SAMPLED = 6  # rows at places drawn from the row count, besides the first and the last
_DEPTH = 32  # nesting beyond this is hashed by type only (rows are a few levels deep)
_AS_TEXT = (datetime.date, datetime.time, datetime.timedelta, decimal.Decimal, uuid.UUID)
_SCALARS = (bool, int, float, str, type(None))


def content_digest(data: Any, n: int) -> str | None:
    """A 16-hex-digit digest of a few rows of `data` (`n` rows), or None for data not read
    for it (see the module docstring)."""
    rows = _reader(data)
    if rows is None:
        return None
    h = hashlib.sha256(f"rows:{n}".encode())
    for row in rows(_places(n)):
        _feed(h, row, 0)
    return h.hexdigest()[:16]


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


def _feed(h: Any, value: Any, depth: int) -> None:
    """Hash `value` with its type, so that 1, 1.0, "1" and True differ."""
    if isinstance(value, _SCALARS):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, list) and all(type(v) in _SCALARS for v in value):
        h.update(f"list:{value!r};".encode())  # token ids: one repr, not one update each
    elif isinstance(value, torch.Tensor):
        _feed_tensor(h, value)
    elif isinstance(value, np.ndarray) and value.dtype != object:
        h.update(f"ndarray:{value.dtype.str}{list(value.shape)};".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.generic):
        h.update(f"np:{value.dtype.str}:{value.item()!r};".encode())
    elif isinstance(value, (bytes, bytearray)):
        h.update(f"bytes:{len(value)};".encode())
        h.update(value)
    elif isinstance(value, _AS_TEXT):
        h.update(f"{type(value).__name__}:{value};".encode())
    elif depth < _DEPTH and isinstance(value, dict):
        h.update(f"dict:{len(value)};".encode())
        for key in sorted(value, key=str):
            _feed(h, str(key), depth + 1)
            _feed(h, value[key], depth + 1)
    elif depth < _DEPTH and isinstance(value, (list, tuple, np.ndarray)):
        h.update(f"{type(value).__name__}:{len(value)};".encode())
        for v in value:
            _feed(h, v, depth + 1)
    else:  # an object whose contents are not known here (its repr may hold an address)
        h.update(f"object:{type(value).__module__}.{type(value).__qualname__};".encode())


def _feed_tensor(h: Any, t: torch.Tensor) -> None:
    h.update(f"tensor:{t.dtype}{list(t.shape)};".encode())
    if t.layout == torch.strided and not t.is_quantized:
        # The bytes of any dtype (bfloat16 has no numpy type). A device tensor is copied to
        # the host: a sync, once per make_batches call (an epoch), never per step.
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes())
