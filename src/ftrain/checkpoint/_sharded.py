"""Sharded checkpoints (FSDP): the files every rank wrote, verified before anything reads them.

Layout of a sharded `step-N/`: `model/` and `optimizer/` each hold one safetensors file per rank
(`shard-0000<r>-model-00001-of-00001.safetensors`, written by the strategy's `save_shards`
through torch.distributed.checkpoint, whose header records each chunk's offset in the whole
tensor), then `state.json` and `COMMITTED` as in a whole checkpoint. Nothing is pickled: DCP's
default writer pickles its `.metadata`; the safetensors storage does not need one.

Loading verifies the files (sizes, checksums, headers, and that the chunks tile every tensor
exactly) before the strategy's `load_shards` reads them, so that they are resharded into any
number of ranks, or into a single process, from checked files only. Nothing here imports
torch.distributed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ftrain.checkpoint._io import CheckpointError, check_header, read_regular
from ftrain.checkpoint._layout import CONFIG_FILE, MODEL_DIR, OPTIM_DIR

__all__ = ["MODEL_DIR", "OPTIM_DIR", "placeholders", "read_into", "verify"]

_SHARDING_KEY = "DCP_SHARDING_INFO"


def verify(path: Path, meta: dict[str, Any], *, checksum: bool) -> None:
    """Check every shard file before DCP opens any: listed files only, sizes, checksums,
    headers, and chunks that tile each recorded tensor exactly once."""
    files: dict[str, Any] = meta["files"]
    for sub in (MODEL_DIR, OPTIM_DIR):
        found = (path / sub).glob("*") if (path / sub).is_dir() else []
        on_disk = {f"{sub}/{f.name}" for f in found}
        listed = {n for n in files if n.startswith(f"{sub}/")}
        if on_disk != listed:
            raise CheckpointError(
                f"{path / sub}: files {sorted(on_disk ^ listed)} are missing or not recorded"
            )
    shapes = {
        MODEL_DIR: {n: d for n, d in meta["tensors"].items()},
        OPTIM_DIR: {p: d for p, d in meta["optimizer"].items() if "tensor" in d},
    }
    chunks: dict[tuple[str, str], list[tuple[list[int], list[int]]]] = {}
    for name, entry in sorted(files.items()):
        if name == CONFIG_FILE:  # checked with the other JSON
            continue
        sub, _, fname = name.partition("/")
        if sub not in shapes or "/" in fname or not fname.endswith(".safetensors"):
            raise CheckpointError(f"{path}: unexpected file {name!r} in state.json")
        f = path / name
        data = _read(path, name, entry, checksum)
        header = check_header(data, len(data), f)
        offsets = _sharding_info(data, f)
        for key, (dtype, shape) in header.items():
            want = shapes[sub].get(key)
            off = offsets.get(key)
            if want is None or off is None:
                raise CheckpointError(f"{f}: tensor {key!r} is not recorded in state.json")
            full = want.get("shape")
            if str(dtype).removeprefix("torch.") != want.get("tensor") or not (
                isinstance(off, list)
                and isinstance(full, list)
                and len(off) == len(shape) == len(full)
                and all(type(o) is int and o >= 0 for o in off)
                and all(o + s <= g for o, s, g in zip(off, shape, full, strict=True))
            ):
                raise CheckpointError(f"{f}: shard of {key!r} does not fit {want}")
            chunks.setdefault((sub, key), []).append((off, shape))
    for sub, recorded in shapes.items():
        for key, want in recorded.items():
            if not _tiles(chunks.get((sub, key), []), want["shape"]):
                raise CheckpointError(f"{path / sub}: the shards of {key!r} do not cover it once")


def _read(path: Path, name: str, entry: Any, checksum: bool) -> bytes:
    import hashlib

    f = path / name
    # A regular file inside the folder (no symlink, FIFO or device), of the recorded size.
    data = read_regular(path, name, size=entry.get("bytes") if isinstance(entry, dict) else -1)
    sha = entry.get("sha256")
    if checksum and sha is not None and hashlib.sha256(data).hexdigest() != sha:
        raise CheckpointError(f"{f} does not match its recorded checksum (corrupted)")
    return data


def _sharding_info(data: bytes, f: Path) -> dict[str, Any]:
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n]).get("__metadata__")  # parsed by check_header already
    try:
        info = json.loads(meta[_SHARDING_KEY])
        if not isinstance(info, dict):
            raise TypeError
        return {k: v.get("saved_offsets") for k, v in info.items()}
    except (TypeError, KeyError, ValueError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{f}: missing or malformed shard offsets") from e


def _tiles(parts: list[tuple[list[int], list[int]]], full: list[int]) -> bool:
    """Whether the boxes `parts` (offset, shape) cover the box `full` exactly once."""
    volume = 1
    for d in full:
        volume *= d
    total = 0
    for _, shape in parts:
        v = 1
        for d in shape:
            v *= d
        total += v
    if total != volume:
        return False
    for i, (oa, sa) in enumerate(parts):  # equal volume and no overlap: an exact cover
        for ob, sb in parts[i + 1 :]:
            overlap = all(
                a < b + lb and b < a + la for a, la, b, lb in zip(oa, sa, ob, sb, strict=True)
            )
            if overlap and all(s > 0 for s in sa) and all(s > 0 for s in sb):
                return False
    return True


def read_into(strategy: Any, directory: Path, targets: dict[str, torch.Tensor]) -> None:
    """Fill `targets` (the strategy's tensors) from verified shards, resharded by the strategy;
    collective with several ranks."""
    try:
        strategy.load_shards(directory, targets)
    except Exception as e:  # the files were verified: I/O, or tensors that do not fit
        raise CheckpointError(f"reading the shards in {directory} failed: {e}") from e


def placeholders(records: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Meta-device tensors with each recorded dtype and whole shape (compared, never read)."""
    out = {}
    for name, d in records.items():
        dtype = getattr(torch, str(d.get("tensor")), None)
        shape = d.get("shape")
        if not isinstance(dtype, torch.dtype) or not (
            isinstance(shape, list) and all(type(s) is int and 0 <= s < 2**48 for s in shape)
        ):
            raise CheckpointError(f"malformed tensor record for {name!r}: {d!r}")
        out[name] = torch.empty(shape, dtype=dtype, device="meta")
    return out
