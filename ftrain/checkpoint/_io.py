"""File-level safety: durable writes, checksums, and safetensors reading that trusts nothing.

Every reader here turns any malformed input into `CheckpointError` before a byte reaches a
parser that could allocate from it: the safetensors header is validated by hand (sizes,
offsets, dtypes) first, and nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save_file as _st_save_file

__all__ = [
    "CheckpointError",
    "fsync_dir",
    "fsync_tree",
    "open_regular",
    "publish_dir",
    "read_checked",
    "read_header",
    "read_json",
    "read_regular",
    "read_safetensors",
    "sha256_file",
    "write_json",
    "write_safetensors",
    "write_text",
    "write_atomically",
]

# A shape with more dimensions than this is not a tensor any framework builds (torch's limit is
# lower); refusing it keeps products of dimensions small to compute.
MAX_DIMS = 64
# Bigger headers than this are not produced by any real checkpoint; refusing them early keeps a
# hostile file from making us allocate. (safetensors itself caps headers at 100 MB.)
MAX_HEADER_BYTES = 100 * 2**20
MAX_JSON_BYTES = 64 * 2**20

# Every dtype safetensors writes (its `_TYPES`): a tensor that was saved must load back, or a
# committed checkpoint (a float8 buffer, a uint16 table, a complex parameter) could never load.
_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U64": torch.uint64,
        "U32": torch.uint32,
        "U16": torch.uint16,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
        "C64": torch.complex64,
    }
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, hostile or does not fit the state."""


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside `path` durable (a no-op where unsupported)."""
    with contextlib.suppress(OSError):  # platforms without directory handles
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
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


def publish_dir(tmp: Path, final: Path, aside: Path, *, last_writer_wins: bool = False) -> None:
    """Rename the finished directory `tmp` to `final` durably.

    An existing `final` is renamed to `aside` first (a directory cannot be renamed over a
    non-empty one) and removed afterwards. With `last_writer_wins` (a checkpoint: another
    writer of the run folder, a requeued job beside its predecessor saving the same steps, may
    publish `final` or rotate it away between the look and the rename) it looks again, and
    the last writer's copy stays; without, a `final` published meanwhile raises.

    Where the system can (Linux: `renameat2(RENAME_EXCHANGE)`), an existing `final` is swapped
    with `tmp` in one step instead, so that at no instant is there no `final`: a process killed
    between the two renames (a requeued job's predecessor re-saving a step) left only
    temporaries, which the next save's sweep removed, and no checkpoint of that step.
    """
    fsync_dir(tmp)
    for attempt in range(_PUBLISH_TRIES if last_writer_wins else 1):
        if final.exists() and _exchange(tmp, final):  # `tmp` holds the earlier copy now
            fsync_dir(final.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        moved = False
        if final.exists():
            with contextlib.suppress(FileNotFoundError):  # rotated away meanwhile
                os.rename(final, aside)
                moved = True
        try:
            os.rename(tmp, final)
        except OSError as e:
            raced = e.errno in (errno.ENOTEMPTY, errno.EEXIST)
            if raced and last_writer_wins and attempt + 1 < _PUBLISH_TRIES:
                if moved:  # published meanwhile: the copy set aside is superseded
                    shutil.rmtree(aside, ignore_errors=True)
                continue
            if moved:
                with contextlib.suppress(OSError):
                    os.rename(aside, final)  # put the earlier copy back
            raise
        if moved:
            shutil.rmtree(aside, ignore_errors=True)
        break
    fsync_dir(final.parent)


_PUBLISH_TRIES = 3
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories `a` and `b` atomically (Linux's `renameat2` with
    `RENAME_EXCHANGE`); False where the C library, kernel or file system cannot, or `b` is
    gone (the caller then renames in two steps)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library older than glibc 2.28
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOENT, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def write_atomically(
    directory: str | os.PathLike[str], write: Callable[[Path], object], *, overwrite: bool = False
) -> Path:
    """Fill a directory through `write(tmp)` so that it appears complete or not at all.

    `write` fills a fresh temporary folder next to `directory`; every file in it is then
    fsynced and the folder renamed into place (replacing an existing `directory` when
    `overwrite`). Checkpoints are written this way; so are HF exports, by `save_pretrained`
    code that fsyncs nothing itself. A failure leaves no temporary folder behind.

    Returns:
        `directory` as a Path.

    Raises:
        FileExistsError: if `directory` exists and `overwrite` is False.

    Example:
        >>> import tempfile, pathlib, ftrain as ft
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "export"
        >>> write = lambda tmp: (tmp / "a.txt").write_text("hi")
        >>> ft.checkpoint.write_atomically(out, write).name, (out / "a.txt").read_text()
        ('export', 'hi')
    """
    directory = Path(directory)
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        fsync_tree(tmp)
        publish_dir(tmp, directory, directory.parent / f".{directory.name}.old-{tmp.name[-8:]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def write_json(obj: Any, path: Path) -> None:
    """Write `obj` as JSON to `path` and fsync it."""
    if isinstance(obj, dict):
        # One top-level key per line, values compact: readable without being 10 lines/tensor.
        rows = (f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(obj.items()))
        text = "{\n " + ",\n ".join(rows) + "\n}\n"
    else:
        text = json.dumps(obj)
    write_text(text, path)


@contextlib.contextmanager
def open_regular(folder: Path, name: str, *, size: int | None = None) -> Iterator[int]:
    """Open `folder/name` for reading only if it is a regular file inside `folder`; yield its fd.

    Every component of `name` is opened relative to its parent with `O_NOFOLLOW`, so a symlink
    (to `/dev/zero`, or out of the folder) is refused; `O_NONBLOCK` keeps a FIFO from blocking
    the open, and `fstat` refuses anything that is not a regular file (FIFO, device, folder).
    With `size`, the file must have exactly that many bytes (the size recorded at save).
    Any failure, permission denied included, is a `CheckpointError`.
    """
    where = folder / name
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"{where}: not a plain file name inside the checkpoint")
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    fds: list[int] = []
    try:
        fds.append(os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)))
        for part in parts[:-1]:
            flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow
            fds.append(os.open(part, flags, dir_fd=fds[-1]))
        flags = os.O_RDONLY | nofollow | getattr(os, "O_NONBLOCK", 0)
        fds.append(os.open(parts[-1], flags, dir_fd=fds[-1]))
        info = os.fstat(fds[-1])
    except OSError as e:
        for fd in fds:
            os.close(fd)
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{where} is a symlink; checkpoints hold regular files") from e
        raise CheckpointError(f"cannot read {where}: {e.strerror or e}") from e
    for fd in fds[:-1]:
        os.close(fd)
    try:
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{where} is not a regular file")
        if size is not None and info.st_size != size:
            raise CheckpointError(
                f"{where} has {info.st_size} bytes, not the {size} recorded with its checksum "
                "(truncated or corrupted)"
            )
        yield fds[-1]
    finally:
        os.close(fds[-1])


def read_regular(
    folder: Path, name: str, *, size: int | None = None, limit: int | None = None
) -> bytes:
    """The bytes of the regular file `folder/name` (see `open_regular`), at most `limit`."""
    with open_regular(folder, name, size=size) as fd:
        have = os.fstat(fd).st_size
        if limit is not None and have > limit:
            raise CheckpointError(f"{folder / name} is {have} bytes, more than the {limit} allowed")
        chunks, left = [], have
        try:
            while left > 0 and (chunk := os.read(fd, min(left, 2**26))):
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as e:
            raise CheckpointError(f"cannot read {folder / name}: {e.strerror or e}") from e
    data = b"".join(chunks)
    if len(data) != have:
        raise CheckpointError(f"{folder / name} changed size while it was read")
    return data


def read_checked(
    folder: Path, name: str, *, size: int | None, sha256: str | None, limit: int | None = None
) -> bytes:
    """The bytes of the regular file `folder/name` (see `read_regular`), which must match
    `sha256` when it is given."""
    data = read_regular(folder, name, size=size, limit=limit)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{folder / name} does not match its recorded checksum (corrupted)")
    return data


def read_json(path: Path, *, sha256: str | None = None, size: int | None = None) -> Any:
    """Parse the JSON file `path` (a regular file, see `open_regular`), checking its digest and
    size first when they are given."""
    data = read_checked(path.parent, path.name, size=size, sha256=sha256, limit=MAX_JSON_BYTES)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def shape_numel(shape: Any) -> int | None:
    """The element count of a shape read from a file, or None when it is not a sane shape:
    a list of at most `MAX_DIMS` ints in [0, 2**48) whose product stays below 2**62."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        return None
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < 2**48:
            return None
        numel *= d
        if numel >= 2**62:  # checked as it grows: never a product of thousands of digits
            return None
    return numel


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
    numel = shape_numel(shape)
    # A dict in place of the dtype is unhashable: look it up only when it is a string.
    torch_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else None
    if torch_dtype is None or numel is None or not isinstance(offsets, list):
        raise bad
    if len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise bad
    begin, stop = offsets
    if not 0 <= begin <= stop <= body or stop - begin != numel * torch_dtype.itemsize:
        raise CheckpointError(f"{where}: tensor {name!r} claims bytes outside the file")
    return torch_dtype, list(shape)  # type: ignore[arg-type]  # a list of ints, checked above


def read_safetensors(
    folder: Path, name: str, *, size: int, sha256: str | None = None
) -> dict[str, torch.Tensor]:
    """Load tensors from the regular file `folder/name` of `size` bytes after validating it.

    With a digest the file is read once into memory and hashed; without one it is memory-mapped
    (for checkpoints too big to hash on every load) through the descriptor already checked.
    """
    where = folder / name
    if sha256 is not None:
        data = read_checked(folder, name, size=size, sha256=sha256)
        check_header(data, len(data), where)
        try:
            return _st_load(data)
        except (SafetensorError, ValueError, RuntimeError) as e:  # pragma: no cover - pre-checked
            raise CheckpointError(f"{where}: {e}") from e
    with open_regular(folder, name, size=size) as fd:
        _header_at(fd, size, where)
        return _map(fd, where)


def read_header(
    folder: Path, name: str, *, size: int, sha256: str | None
) -> dict[str, tuple[torch.dtype, list[int]]]:
    """Check a safetensors file as `read_safetensors` does, without loading it; its header."""
    if sha256 is not None:
        return check_header(
            read_checked(folder, name, size=size, sha256=sha256), size, folder / name
        )
    with open_regular(folder, name, size=size) as fd:
        return _header_at(fd, size, folder / name)


def _header_at(fd: int, size: int, where: Path) -> dict[str, tuple[torch.dtype, list[int]]]:
    try:
        head = os.pread(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return check_header(head + os.pread(fd, min(n, MAX_HEADER_BYTES), 8), size, where)
    except OSError as e:
        raise CheckpointError(f"cannot read {where}: {e.strerror or e}") from e


def _map(fd: int, where: Path) -> dict[str, torch.Tensor]:
    """Memory-map the checked file through its descriptor (never by name again: the name could
    have been swapped since); read it whole where /proc/self/fd is missing."""
    from safetensors.torch import load_file

    by_fd = Path(f"/proc/self/fd/{fd}")
    try:
        if by_fd.exists():
            return load_file(str(by_fd))
        return _st_load(b"".join(iter(lambda: os.read(fd, 2**26), b"")))  # pragma: no cover
    except (SafetensorError, ValueError, RuntimeError, OSError) as e:  # pragma: no cover
        raise CheckpointError(f"{where}: {e}") from e
