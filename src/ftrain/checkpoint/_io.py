"""File-level safety: durable writes, checksums, and safetensors reading that trusts nothing.

Every reader here turns any malformed input into `CheckpointError` before a byte reaches a
parser that could allocate from it: the safetensors header is validated by hand (sizes,
offsets, dtypes) first, and nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save_file as _st_save_file

__all__ = [
    "CheckpointError",
    "fsync_dir",
    "fsync_tree",
    "publish_dir",
    "read_json",
    "read_safetensors",
    "sha256_file",
    "write_json",
    "write_safetensors",
    "write_text",
]

# Bigger headers than this are not produced by any real checkpoint; refusing them early keeps a
# hostile file from making us allocate. (safetensors itself caps headers at 100 MB.)
MAX_HEADER_BYTES = 100 * 2**20
MAX_JSON_BYTES = 64 * 2**20

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, hostile or does not fit the state."""


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside `path` durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            h.update(chunk)
    return h.hexdigest()


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write CPU tensors to `path` and fsync it."""
    _st_save_file(tensors, path, metadata={"format": "pt"})
    _fsync_file(path)


def write_text(text: str, path: Path) -> None:
    """Write `text` to `path` and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(path: Path) -> None:
    """fsync every file under `path` (for files written by code that does not, e.g. HF's)."""
    for f in path.rglob("*"):
        if f.is_file():
            _fsync_file(f)


def publish_dir(tmp: Path, final: Path, aside: Path) -> None:
    """Rename the finished directory `tmp` to `final` durably.

    An existing `final` is renamed to `aside` first (a directory cannot be renamed over a
    non-empty one) and removed afterwards.
    """
    fsync_dir(tmp)
    if final.exists():
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


def write_json(obj: Any, path: Path) -> None:
    """Write `obj` as JSON to `path` and fsync it."""
    if isinstance(obj, dict):
        # One top-level key per line, values compact: readable without being 10 lines/tensor.
        rows = (f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(obj.items()))
        text = "{\n " + ",\n ".join(rows) + "\n}\n"
    else:
        text = json.dumps(obj)
    write_text(text, path)


def _read_bytes(path: Path, limit: int | None = None) -> bytes:
    try:
        size = path.stat().st_size
        if limit is not None and size > limit:
            raise CheckpointError(f"{path} is {size} bytes, more than the {limit} allowed")
        return path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def read_json(path: Path, *, sha256: str | None = None) -> Any:
    """Parse a JSON file, checking its digest first when `sha256` is given."""
    data = _read_bytes(path, MAX_JSON_BYTES)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path} does not match its recorded checksum (corrupted)")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def check_header(data: bytes | memoryview, file_size: int, where: Path) -> dict[str, Any]:
    """Validate a safetensors header against the file size; return {name: (dtype, shape)}.

    Checks everything a reader allocates from: the header length, that every tensor's byte
    range lies inside the file and matches its dtype and shape, and that ranges tile the data.
    """
    if file_size < 8 or len(data) < 8:
        raise CheckpointError(f"{where} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER_BYTES or 8 + n > file_size or len(data) < 8 + n:
        raise CheckpointError(f"{where}: header claims {n} bytes, file has {file_size}")
    try:
        header = json.loads(bytes(data[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: unreadable safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: safetensors header is not a JSON object")
    body = file_size - 8 - n
    spans, out = [], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _check_entry(name, info, body, where)
        spans.append(tuple(info["data_offsets"]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise CheckpointError(f"{where}: tensor data ranges overlap or leave gaps")
        end = stop
    if end != body:
        raise CheckpointError(f"{where}: tensor data covers {end} of {body} bytes")
    return out


def _check_entry(name: str, info: Any, body: int, where: Path) -> tuple[torch.dtype, list[int]]:
    bad = CheckpointError(f"{where}: malformed header entry for {name!r}")
    if not isinstance(info, dict):
        raise bad
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES or not isinstance(shape, list) or not isinstance(offsets, list):
        raise bad
    if not all(type(d) is int and 0 <= d < 2**48 for d in shape):
        raise bad
    if len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise bad
    begin, stop = offsets
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= stop <= body or stop - begin != numel * _DTYPES[dtype].itemsize:
        raise CheckpointError(f"{where}: tensor {name!r} claims bytes outside the file")
    return _DTYPES[dtype], shape


def read_safetensors(path: Path, *, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Load tensors from `path` after validating it; verify its digest when `sha256` is given.

    With a digest the file is read once into memory and hashed; without one it is memory-mapped
    (for checkpoints too big to hash on every load).
    """
    if sha256 is not None:
        data = _read_bytes(path)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise CheckpointError(f"{path} does not match its recorded checksum (corrupted)")
        check_header(data, len(data), path)
        try:
            return _st_load(data)
        except (SafetensorError, ValueError, RuntimeError) as e:  # pragma: no cover - pre-checked
            raise CheckpointError(f"{path}: {e}") from e
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            check_header(head + f.read(min(n, MAX_HEADER_BYTES)), size, path)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, ValueError, RuntimeError, OSError) as e:  # pragma: no cover
        raise CheckpointError(f"{path}: {e}") from e
