"""Sharded checkpoints (FSDP): every rank writes its own shards with torch.distributed.checkpoint.

Layout of a sharded `step-N/`: `model/` and `optimizer/` each hold one safetensors file per rank
(`shard-0000<r>-model-00001-of-00001.safetensors`, written by DCP's `HuggingFaceStorageWriter`,
whose header records each chunk's offset in the whole tensor), then `state.json` and
`COMMITTED` as in a whole checkpoint. Nothing is pickled: DCP's default writer pickles its
`.metadata`; the safetensors storage does not need one.

The commit is collective: every rank writes its shards into one temporary directory; DCP's
save returns on every rank only when all of them have written; rank 0 then hashes, seals and
renames the directory, and tells every rank whether that worked. Loading verifies the files
(sizes, checksums, headers, and that the chunks tile every tensor exactly) before DCP reads
them, so that DCP reshards into any number of ranks, or into a single process, from checked
files only.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ftrain.checkpoint import _layout as L
from ftrain.checkpoint._io import CheckpointError, check_header, read_regular, sha256_file

MODEL_DIR = "model"
OPTIM_DIR = "optimizer"
_SHARDING_KEY = "DCP_SHARDING_INFO"


def is_sharded(tensors: Any) -> bool:
    """Whether any of `tensors` is a DTensor (an FSDP parameter or optimizer-state shard)."""
    return any(hasattr(t, "device_mesh") for t in tensors)


def write(tensors: dict[str, torch.Tensor], directory: Path, group: Any) -> None:
    """Collective: every rank writes its shards of `tensors` into `directory`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if not tensors:
        directory.mkdir(parents=True, exist_ok=True)
        return
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    try:
        dcp.save(dict(tensors), storage_writer=writer, process_group=group)
    except (Exception, CheckpointException) as e:  # raised on every rank when any rank failed
        raise CheckpointError(f"writing the shards into {directory} failed: {e}") from e


def record_files(tmp: Path, *, checksum: bool) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes", "sha256"?}} of every shard file, for state.json."""
    files: dict[str, dict[str, Any]] = {}
    for sub in (MODEL_DIR, OPTIM_DIR):
        for f in sorted((tmp / sub).glob("*.safetensors")):
            entry: dict[str, Any] = {"bytes": f.stat().st_size}
            if checksum:
                entry["sha256"] = sha256_file(f)
            files[f"{sub}/{f.name}"] = entry
    return files


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
        if name == L.CONFIG_FILE:  # checked with the other JSON
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


def read_into(directory: Path, targets: dict[str, torch.Tensor]) -> None:
    """Fill `targets` (DTensors or whole tensors) from verified shards; DCP reshards.

    Collective when a process group is up (every rank calls it); local otherwise.
    """
    if not targets:
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        with warnings.catch_warnings():
            # DCP warns whenever it loads without a process group, which is the point here.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(
                dict(targets),
                storage_reader=HuggingFaceStorageReader(str(directory)),
                no_dist=not dist.is_initialized(),
            )
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
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


def commit_ok(ok: bool, strategy: Any) -> bool:
    """Collective: True on every rank when rank 0 (the only one passing False on failure) did."""
    flag = torch.tensor(1.0 if ok else 0.0, device=strategy.device)
    return bool(strategy.all_reduce_sum(flag) == strategy.world_size)


def tmp_dir(root: Path, step: int) -> Path:
    # The same name on every rank: no rank needs to hear it from another.
    return root / f"{L.TMP_PREFIX}step-{step}-sharded"
