"""One validator for a checkpoint folder, shared by `load_checkpoint`, `inspect` and `export`.

`open_checkpoint` checks everything that does not depend on the state a checkpoint is loaded
into: the commit marker, `state.json` (digest, then every field's type and shape), each file
(a regular file inside the folder, its recorded size and digest, its safetensors header),
`config.json`, and that the optimizer file holds exactly the tensors `state.json` records. What
`inspect` calls complete, `load_checkpoint` can read; what one refuses, the other refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import torch

from ftrain.checkpoint import _frozen
from ftrain.checkpoint import _layout as L
from ftrain.checkpoint._inflight import wait_for_save_into
from ftrain.checkpoint._io import (
    MAX_HEADER_BYTES,
    CheckpointError,
    check_header,
    open_regular,
    read_checked,
    read_header,
    read_json,
    read_safetensors,
    shape_numel,
)
from ftrain.data import check_position
from ftrain.optim import EmaState
from ftrain.state import TrainState, plain_values

__all__ = ["Opened", "check_savable", "open_checkpoint", "read_meta", "validate_meta"]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_SCALARS = (bool, int, float, str, type(None))
_COUNTERS = ("step", "epoch", "data.cursor", "seed")
# The values TrainState's own integer fields hold (int64 counters; a batch size >= 1): a file
# outside them is refused, and a save never writes one. A seed of 2**64 would silently give
# seed 0's data order and dropout (TrainState.create refuses seeds >= 2**63).
_RANGES: Mapping[str, tuple[int, int]] = MappingProxyType(
    {
        **{n: (0, 2**63) for n in ("step", "epoch", "seed", "data.cursor")},
        **{n: (0, 2**63) for n in ("data.tokens_seen", "data.samples_seen")},
        "data.batch_size": (1, 2**63),
        "early_stopping.best_step": (0, 2**63),
        "early_stopping.patience_counter": (0, 2**63),
        "scaler.growth_tracker": (0, 2**31),
    }
)


@dataclasses.dataclass(frozen=True)
class Opened:
    """A checkpoint that passed every file-level check (`open_checkpoint`).

    Attributes:
        path: the `step-<N>` folder.
        meta: its `state.json`: counters, metrics, the parameter table, versions, files.
        tensors: `"model"` and/or `"optimizer"` (those asked for) -> tensors by name; for a
            sharded checkpoint, meta-device tensors of each whole shape (read the values with
            `read_model_tensors`, or load the checkpoint).
        digest: the SHA-256 of `state.json`, the checkpoint's identity (it records every
            file's digest).
        config: the model's `config.json` (checked), or None when it has none.
    """

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]
    digest: str
    config: dict[str, Any] | None

    @property
    def ema_averages(self) -> dict[str, str]:
        """Parameter name -> the optimizer-state path of its EMA average (`ft.optim.ema`:
        `ema/<name>`, or `<group path>/ema/<name>` inside a partition); empty for a run trained
        without an EMA. The model's own tensors are the live weights."""
        records: dict[str, Any] = self.meta["optimizer"]
        out: dict[str, str] = {}
        for root, entry in records.items():
            if entry.get("node") != _EMA_NODE:
                continue
            head = f"{root}/ema/" if root else "ema/"
            for path, leaf in records.items():
                name = path[len(head) :]
                if path.startswith(head) and "tensor" in leaf and "/" not in name:
                    out.setdefault(name, path)
        return out


_EMA_NODE = f"tuple:{EmaState.__name__}"  # how the checkpoint records an EmaState container


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a committed checkpoint's `state.json` (checked against the marker).

    Cheaper than `open_checkpoint`: the other files are not checked.

    Raises:
        CheckpointError: if the marker or `state.json` is missing, does not match, or is
            malformed.
    """
    return _meta_and_digest(Path(path))[0]


# The parts a checkpoint holds tensors for, and the file each one is in (whole layout).
_PARTS = (("model", L.MODEL_FILE), ("optimizer", L.OPTIM_FILE))


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    keep: Iterable[Literal["model", "optimizer"]] = ("model", "optimizer"),
) -> Opened:
    """Check the checkpoint at `path` as `load_checkpoint` does; return what it read.

    The one validator: the commit marker, `state.json` (digest, then every field's type and
    shape), each file (a regular file inside the folder, its recorded size and digest, its
    safetensors header), `config.json`, and that the optimizer file holds exactly the tensors
    `state.json` records. What it accepts, `load_checkpoint` can read. It needs no state, so
    tools read checkpoints with it (`python -m ftrain inspect`, `ft.export_checkpoint`).

    Args:
        path: a `step-<N>` folder.
        verify: check each file's recorded SHA-256 (sizes and headers are always checked).
        keep: the parts whose tensors to return; the others are checked and dropped.

    Raises:
        CheckpointError: for anything missing, incomplete, corrupted or malformed.

    Example:
        >>> import tempfile, torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.adamw())
        >>> path = ft.save_checkpoint(state, tempfile.mkdtemp())
        >>> opened = ft.checkpoint.open_checkpoint(path, keep=["model"])
        >>> opened.meta["fields"]["step"], sorted(opened.tensors["model"])
        (0, ['bias', 'weight'])
    """
    path = Path(path)
    wanted: set[str] = set(keep)
    if unknown := sorted(wanted - {part for part, _ in _PARTS}):
        raise ValueError(f"keep names unknown parts {unknown}: use 'model' and/or 'optimizer'")
    try:
        meta, digest = _meta_and_digest(path)
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        if meta.get("sharded") is True:
            _verify_shards(path, meta, checksum=verify)
            optimizer = {p: d for p, d in meta["optimizer"].items() if "tensor" in d}
            shapes = {"model": meta["tensors"], "optimizer": optimizer}
            tensors = {part: _placeholders(shapes[part]) for part in wanted}
        else:
            headers = {}
            for part, name in _PARTS:
                entry = meta["files"][name]
                sha = entry.get("sha256") if verify else None
                if part in wanted:
                    tensors[part] = read_safetensors(path, name, size=entry["bytes"], sha256=sha)
                    headers[part] = {n: (t.dtype, list(t.shape)) for n, t in tensors[part].items()}
                else:
                    headers[part] = read_header(path, name, size=entry["bytes"], sha256=sha)
            _check_optimizer_file(meta["optimizer"], headers["optimizer"], path)
        config = read_config(path, meta, verify=verify)
    except OSError as e:  # e.g. permission denied on a sub-folder listing
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    return Opened(path, meta, tensors, digest, config)


def read_config(path: Path, meta: dict[str, Any], *, verify: bool = True) -> dict[str, Any] | None:
    """The checkpoint's `config.json` as a dict (checked against its recorded size and digest),
    or None when it has none."""
    entry = meta["files"].get(L.CONFIG_FILE, meta.get(L.SHARDED_CONFIG))
    if entry is None:
        try:
            os.lstat(path / L.CONFIG_FILE)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointError(f"cannot read {path / L.CONFIG_FILE}: {e.strerror}") from e
        entry = {}  # present but not recorded (older sharded saves): parsed, not verified
    sha = entry.get("sha256") if verify else None
    config = read_json(path / L.CONFIG_FILE, sha256=sha, size=entry.get("bytes"))
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / L.CONFIG_FILE} is not a JSON object")
    return config


def _meta_and_digest(path: Path) -> tuple[dict[str, Any], str]:
    # A background save of this process may still be writing `path` (or replacing, or
    # rotating it away): wait for it.
    wait_for_save_into(path)
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise CheckpointError(_not_a_folder(path))
        os.lstat(path / L.COMMIT_FILE)
    except (FileNotFoundError, NotADirectoryError) as e:
        if not os.path.isdir(path):
            raise CheckpointError(_not_a_folder(path)) from e
        raise CheckpointError(_uncommitted(path)) from None
    except OSError as e:  # permission denied, on the folder or a parent
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    marker = read_json(path / L.COMMIT_FILE)
    digest = marker.get("state.json") if isinstance(marker, dict) else None
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise CheckpointError(f"{path / L.COMMIT_FILE} is malformed")
    meta = read_json(path / L.STATE_FILE, sha256=digest)
    validate_meta(meta, path)
    return meta, digest


_SAVE_TMP = f"{L.TMP_PREFIX}step-"  # a save's temporary folder (not a rotation's, "deleting-")


def _not_a_folder(path: Path) -> str:
    """Why `path` is no checkpoint folder at all: missing, a dangling link, or a file."""
    if os.path.exists(path):
        what = "it is a file" if os.path.isfile(path) else "it is not a folder"
    elif os.path.islink(path):
        try:
            what = f"it is a symbolic link to {os.readlink(path)}, which does not exist"
        except OSError:  # removed meanwhile
            what = "it does not exist"
    else:
        what = "it does not exist"
    return f"{path} is not a checkpoint directory: {what}"


def _uncommitted(path: Path) -> str:
    """Why a folder without a commit marker is refused: a save (or a copy of a checkpoint) cut
    short, or a folder that never was a checkpoint."""
    try:
        names = {p.name for p in path.iterdir()}
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    if _cut_short(path.name, names):
        return f"{path} is incomplete: no {L.COMMIT_FILE} marker (save cut short)"
    head = (
        f"{path} is not a checkpoint: no {L.COMMIT_FILE} marker, no {L.STATE_FILE} and no "
        f"{L.OPTIM_FILE} in it"
    )
    if any(L.STEP_DIR.fullmatch(n) or n.startswith(_SAVE_TMP) for n in names):
        return f"{head}; {_run_folder_hint(path, names)}"
    if {L.CONFIG_FILE, L.MODEL_FILE} <= names:
        return (
            f"{head}; its {L.CONFIG_FILE} and {L.MODEL_FILE} make it an HF model directory "
            "(from_pretrained loads it), or a checkpoint copied only in part"
        )
    return f"{head}; a checkpoint is a step-<N> folder that ft.save_checkpoint wrote"


def _cut_short(name: str, names: set[str]) -> bool:
    """Whether a folder without a marker is what a save (or a copy of a checkpoint) left.

    A save writes the tensors, then state.json, then the marker, all inside `.tmp-...`, and
    renames it to step-<N> once sealed: that name, a `step-<N>` one (a copy cut short, or a
    marker lost), or the files only a checkpoint holds are its traces. `model.safetensors`
    beside a `config.json` is also what an HF model directory holds: not counted there.
    """
    if name.startswith(L.TMP_PREFIX) or L.STEP_DIR.fullmatch(name):
        return True
    if names & {L.STATE_FILE, L.OPTIM_FILE, L.OPTIM_DIR, L.MODEL_DIR}:
        return True
    return L.MODEL_FILE in names and L.CONFIG_FILE not in names


def _run_folder_hint(path: Path, names: set[str]) -> str:
    """What to pass instead of a run folder: its newest committed checkpoint, or why none."""
    steps = sorted((int(m.group(1)), n) for n in names if (m := L.STEP_DIR.fullmatch(n)))
    # Newest by the marker's time, as `latest_checkpoint` orders them (_save.committed).
    marked = []
    for step, n in steps:
        with contextlib.suppress(OSError):  # no marker: not committed
            marked.append(((path / n / L.COMMIT_FILE).stat().st_mtime_ns, step, n))
    if marked:
        return (
            f"it is a run folder: pass one of its checkpoints, e.g. {path / max(marked)[2]} "
            "(the newest committed one, which ft.latest_checkpoint gives)"
        )
    cut = [n for _, n in steps] + sorted(n for n in names if n.startswith(_SAVE_TMP))
    listed = ", ".join(cut[:3]) + (f" and {len(cut) - 3} more" if len(cut) > 3 else "")
    verb = "is a save" if len(cut) == 1 else "are saves"
    return (
        f"it is a run folder with no committed checkpoint in it: {listed} {verb} cut short "
        f"(no {L.COMMIT_FILE} marker)"
    )


def validate_meta(meta: Any, path: Path) -> None:
    """Check every part of a parsed `state.json` that loading or printing it relies on."""
    where = path / L.STATE_FILE

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{where}: {what}")

    need(isinstance(meta, dict), "not a JSON object")
    fmt, version = meta.get("format"), meta.get("format_version")
    need(fmt == L.FORMAT, f"not an ftrain checkpoint (format {_short(fmt)})")
    need(version == L.FORMAT_VERSION, f"format version {_short(version)}; this ftrain reads 1")
    for key, kind in [
        ("fields", dict),
        ("metrics", dict),
        ("params", list),
        ("optimizer", dict),
        ("files", dict),
    ]:
        need(isinstance(meta.get(key), kind), f"{key!r} missing or not a {kind.__name__}")
    world = meta.get("world_size")
    need(type(world) is int and world >= 1, "'world_size' missing or not an int >= 1")
    need(all(_is_param_row(r) for r in meta["params"]), "malformed 'params' table")
    if L.FROZEN in meta:  # absent in checkpoints written before 2026-11-27
        problem = _frozen.check_record(meta[L.FROZEN], meta["params"])
        need(problem is None, str(problem))
    metrics = meta["metrics"].values()
    need(all(isinstance(v, _SCALARS) and _float_sized(v) for v in metrics), "malformed 'metrics'")
    _validate_files(meta, need)
    for p, d in meta["optimizer"].items():
        need(_is_optimizer_entry(d), f"malformed optimizer entry {_short(p)}")
    if meta.get("sharded") is True:
        need(isinstance(meta.get("tensors"), dict), "'tensors' missing or not a dict")
        for n, d in meta["tensors"].items():
            need(_is_tensor_record(d), f"malformed tensor record {_short(n)}")
    _validate_fields(meta["fields"], need)


def _validate_files(meta: dict[str, Any], need: Any) -> None:
    files = meta["files"]
    records = list(files.items())
    if L.SHARDED_CONFIG in meta:
        need(
            meta.get("sharded") is True, f"{L.SHARDED_CONFIG!r} in a checkpoint that is not sharded"
        )
        records.append((L.CONFIG_FILE, meta[L.SHARDED_CONFIG]))
    for name, entry in records:
        ok = isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        need(ok and (sha is None or _SHA256.fullmatch(str(sha))), f"bad record of {_short(name)}")
        need(all(p not in ("", ".", "..") for p in name.split("/")), f"bad name {_short(name)}")
    if meta.get("sharded") is not True:
        for name in (L.MODEL_FILE, L.OPTIM_FILE):
            need(name in files, f"no record of {name}")


def _validate_fields(fields: dict[str, Any], need: Any) -> None:
    hints = field_hints(TrainState)
    for name, value in fields.items():
        kind = hints.get(name)
        if kind == "tensor":
            need(_is_saved_tensor(value), f"state field {_short(name)} is malformed")
        elif kind == "tensor?":
            need(value is None or _is_saved_tensor(value), f"state field {name!r} is malformed")
        elif isinstance(kind, set):
            need(fits(value, kind), f"state field {_short(name)} is malformed: {_short(value)}")
        else:  # a field of a TrainState subclass: any plain value or 0-dim tensor
            ok = type(value) in _SCALARS or _is_saved_tensor(value)
            need(ok, f"state field {_short(name)} is malformed")
    for name in _COUNTERS:
        v = fields.get(name)
        need(type(v) is int and v >= 0, f"state field {name!r} is missing or not an int >= 0")
    for name in _RANGES.keys() & fields.keys():
        v = fields[name]
        v = v["value"] if isinstance(v, dict) else v
        need(in_range(name, v), f"state field {name!r} {range_text(name)}: {_short(v)}")
    stream = fields.get("data.position")
    if isinstance(stream, str):  # make_batches checks it fits the data; here, that it is one
        try:
            check_position(stream)
        except ValueError as e:
            need(False, f"state field 'data.position': {e}")
    scale = fields.get("scaler.scale")
    if isinstance(scale, dict):
        v = scale["value"]
        need(math.isfinite(v) and v > 0, f"state field 'scaler.scale' must be finite and > 0: {v}")


def _float_sized(value: Any) -> bool:
    """Not an int beyond float's range: saves refuse one, and ranking (rotation, `inspect`)
    compares metrics as floats."""
    return type(value) is not int or -(2**1023) < value < 2**1023


def in_range(name: str, value: Any) -> bool:
    """Whether `value` is one the TrainState field `name` can hold (see `_RANGES`); None is
    left to the field's declared type."""
    bounds = _RANGES.get(name)
    if bounds is None or value is None:
        return True
    return type(value) is int and bounds[0] <= value < bounds[1]


def range_text(name: str) -> str:
    lo, hi = _RANGES[name]
    return f"must be an int in [{lo}, {'2**63' if hi == 2**63 else hi})"


def check_savable(state: TrainState) -> None:
    """Refuse, before anything is written, a state field that `load_checkpoint` would refuse.

    A value of another type than its field declares (a 0-dim tensor in a `float` field, a
    float in an `int` field) or outside the field's range, or a `data.position` that
    `check_position` refuses (over 1 MiB), would be written and committed, and
    `latest_checkpoint` would pick a checkpoint that no load accepts.

    Raises:
        CheckpointError: naming the field, what it holds and what it declares.
    """
    hints = field_hints(type(state))
    for name, value in plain_values(state).items():
        hint, problem = hints.get(name), None
        if isinstance(value, torch.Tensor):
            if isinstance(hint, set):
                problem = f"is declared {_declared(hint)}; store a number (float(x), int(x))"
            elif value.dim() == 0 and _number_kinds(value.dtype) is None:
                problem = f"is a {value.dtype} tensor; checkpoints hold bool, int and float ones"
        elif hint in ("tensor", "tensor?"):
            if not (value is None and hint == "tensor?"):
                problem = "is declared a 0-dim torch.Tensor; store one (torch.tensor(x))"
        elif isinstance(hint, set) and (value is None or isinstance(value, L.PLAIN)):
            # What state.json will hold (a numpy float64 is a float there, an IntEnum an int).
            kind: Any = next((t for t in (bool, int, float, str) if isinstance(value, t)), None)
            plain = value if kind is None else kind(value)
            if not fits(plain, hint):
                problem = f"is declared {_declared(hint)}"
            elif not in_range(name, plain):
                problem = range_text(name)
        if problem is not None:
            raise CheckpointError(
                f"TrainState field {name!r} holds {_short(value)}, which a checkpoint could not "
                f"load back: it {problem}"
            )
    position = state.data.position
    if isinstance(position, str):  # load_checkpoint runs the same check on it
        try:
            check_position(position)
        except ValueError as e:
            raise CheckpointError(
                f"TrainState field 'data.position' could not be loaded back from a checkpoint: {e}"
            ) from None


def _declared(hint: set[type]) -> str:
    return " | ".join(sorted("None" if t is type(None) else t.__name__ for t in hint))


def _number_kinds(dtype: torch.dtype) -> tuple[type, ...] | None:
    """The Python types `Tensor.item()` gives for a 0-dim tensor of `dtype` and JSON keeps
    exactly (a float field may also hold an int a user wrote); None for other dtypes."""
    if dtype == torch.bool:
        return (bool,)
    if dtype.is_floating_point:
        return (int, float)
    if dtype.is_complex:
        return None
    return (int,)


def field_hints(cls: type, prefix: str = "") -> dict[str, Any]:
    """Per plain field by dotted name (sub-states walked, as `_layout.leaves` names them):
    "tensor", "tensor?" (optional tensor), the set of plain JSON types allowed (from
    annotations like `float | None`), or None (anything plain).

    Annotations are strings here (`from __future__ import annotations`): parsed, not evaluated.
    A sub-state's class is read from the field's default (`DataState()` or a factory).
    """
    plain = {"int": int, "float": float, "str": str, "bool": bool, "None": type(None)}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in L.NOT_PLAIN:
            continue
        sub = _substate(f)
        if sub is not None:
            out.update(field_hints(sub, f"{prefix}{f.name}."))
            continue
        text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        names = {t.strip() for t in text.split("|")}
        if names == {"torch.Tensor"}:
            out[prefix + f.name] = "tensor"
        elif names == {"torch.Tensor", "None"}:
            out[prefix + f.name] = "tensor?"
        else:
            out[prefix + f.name] = {plain[n] for n in names} if names <= plain.keys() else None
    return out


def _substate(f: dataclasses.Field[Any]) -> type | None:
    """The dataclass a field holds as a sub-state, from its default, or None."""
    if dataclasses.is_dataclass(f.default) and not isinstance(f.default, type):
        return type(f.default)
    factory = f.default_factory
    if isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return factory
    return None


def fits(value: Any, allowed: set[type] | None) -> bool:
    """Whether a plain JSON value fits a field's allowed types (an int fits a float field)."""
    if type(value) not in _SCALARS:
        return False
    if allowed is None:
        return True
    # A float field may hold an int a user stored; bool is never an int here.
    return type(value) in allowed or (type(value) is int and float in allowed)


def _is_saved_tensor(value: Any) -> bool:
    """A 0-dim tensor field as saved: {"dtype", "value"} with a number the dtype can hold."""
    if not (isinstance(value, dict) and set(value) == {"dtype", "value"}):
        return False
    dtype, number = _dtype(value["dtype"]), value["value"]
    kinds = None if dtype is None else _number_kinds(dtype)
    if kinds is None or type(number) not in kinds:  # 2.5 in an int64 would load as 2
        return False
    try:
        torch.tensor(number, dtype=dtype)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return False
    return True


def _dtype(name: Any) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _is_param_row(r: Any) -> bool:
    return (
        isinstance(r, list)
        and len(r) == 4
        and isinstance(r[0], str)
        and _dtype(r[1]) is not None
        and shape_numel(r[2]) is not None
        and isinstance(r[3], bool)
    )


def _is_tensor_record(d: Any) -> bool:
    return (
        isinstance(d, dict)
        and set(d) == {"tensor", "shape"}
        and _dtype(d["tensor"]) is not None
        and shape_numel(d["shape"]) is not None
    )


def _is_optimizer_entry(d: Any) -> bool:
    if not isinstance(d, dict):
        return False
    if set(d) == {"node"}:
        return isinstance(d["node"], str)
    if set(d) == {"value"}:
        return isinstance(d["value"], _SCALARS)
    return _is_tensor_record(d)


def _check_optimizer_file(
    records: dict[str, Any], header: dict[str, tuple[torch.dtype, list[int]]], path: Path
) -> None:
    """The optimizer file holds exactly the tensors state.json records, as recorded."""
    wanted = {p: d for p, d in records.items() if "tensor" in d}
    for p in sorted(wanted.keys() ^ header.keys())[:1]:
        where = L.STATE_FILE if p in wanted else L.OPTIM_FILE
        raise CheckpointError(
            f"{path}: optimizer tensor {_short(p)} is only in {where} (the files disagree)"
        )
    for p, d in wanted.items():
        dtype, shape = header[p]
        if _dtype(d["tensor"]) != dtype or d["shape"] != shape:
            raise CheckpointError(
                f"{path}: optimizer tensor {_short(p)} is {dtype}{shape} in {L.OPTIM_FILE} "
                f"but {d['tensor']}{d['shape']} in {L.STATE_FILE}"
            )


def _short(value: Any) -> str:
    """repr of a value read from a file, cut short (it may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- the sharded layout: one shard file per rank in model/ and optimizer/ (docs/checkpoints.md)


def _verify_shards(path: Path, meta: dict[str, Any], *, checksum: bool) -> None:
    """Check every shard file before DCP opens any: listed files only, sizes, checksums,
    headers, and chunks that tile each recorded tensor exactly once."""
    files: dict[str, Any] = meta["files"]
    for sub in (L.MODEL_DIR, L.OPTIM_DIR):
        found = (path / sub).glob("*") if (path / sub).is_dir() else []
        on_disk = {f"{sub}/{f.name}" for f in found}
        listed = {n for n in files if n.startswith(f"{sub}/")}
        if on_disk != listed:
            raise CheckpointError(
                f"{path / sub}: files {sorted(on_disk ^ listed)} are missing or not recorded"
            )

    def read(name: str, entry: dict[str, Any]) -> tuple[bytes, int]:
        sha = entry.get("sha256") if checksum else None
        data = read_checked(path, name, size=entry["bytes"], sha256=sha)
        return data, len(data)

    _check_cover(path, meta, read)


def check_shard_cover(path: Path, meta: dict[str, Any]) -> None:
    """Check, from their headers, that the shard files `meta["files"]` lists in `path` tile
    each tensor `meta` records exactly once: at the commit of a sharded save, before
    `COMMITTED` is written.

    Every rank writes its shards into the folder rank 0 made and commits. Where ranks see
    different folders under one path (a node-local disk on each node), the others' shards
    went elsewhere, and rank 0 committed a checkpoint of its own shards only: the run saved
    without a word, and no checkpoint of it loaded.

    Raises:
        CheckpointError: naming the first tensor the shards do not cover, and the cause.
    """

    def read(name: str, entry: dict[str, Any]) -> tuple[bytes, int]:
        with open_regular(path, name, size=entry["bytes"]) as fd:
            head = os.pread(fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            return head + os.pread(fd, min(n, MAX_HEADER_BYTES), 8), entry["bytes"]

    try:
        _check_cover(path, meta, read)
    except CheckpointError as e:
        raise CheckpointError(
            f"{e}: every rank writes its shards into the folder rank 0 commits, so the root of "
            "a sharded checkpoint must be one folder that every rank sees (a shared "
            "filesystem, not a disk of each node); nothing was committed"
        ) from e


def _check_cover(
    path: Path, meta: dict[str, Any], read: Callable[[str, dict[str, Any]], tuple[bytes, int]]
) -> None:
    """The headers of the shard files (`read(name, entry) -> (bytes from the start, file
    size)`) against the recorded tensors: each chunk fits, and together they tile it once."""
    files: dict[str, Any] = meta["files"]
    shapes = {
        L.MODEL_DIR: meta["tensors"],
        L.OPTIM_DIR: {p: d for p, d in meta["optimizer"].items() if "tensor" in d},
    }
    chunks: dict[tuple[str, str], list[tuple[list[int], list[int]]]] = {}
    for name, entry in sorted(files.items()):
        if name == L.CONFIG_FILE:  # checked with the other JSON
            continue
        sub, _, fname = name.partition("/")
        if sub not in shapes or "/" in fname or not fname.endswith(".safetensors"):
            raise CheckpointError(f"{path}: unexpected file {name!r} in state.json")
        f = path / name
        data, size = read(name, entry)
        header = check_header(data, size, f)
        offsets = _sharding_info(data, f)
        for key, (dtype, shape) in header.items():
            want, off = shapes[sub].get(key), offsets.get(key)
            if want is None or off is None:
                raise CheckpointError(f"{f}: tensor {key!r} is not recorded in state.json")
            full = want["shape"]
            if str(dtype).removeprefix("torch.") != want["tensor"] or not (
                isinstance(off, list)
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


def _sharding_info(data: bytes, f: Path) -> dict[str, Any]:
    """Each tensor's offset in the whole tensor, from the header DCP wrote (checked JSON)."""
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n]).get("__metadata__")  # parsed by check_header already
    try:
        info = json.loads(meta["DCP_SHARDING_INFO"])
        if not isinstance(info, dict):
            raise TypeError
        return {k: v.get("saved_offsets") for k, v in info.items()}
    except (TypeError, KeyError, ValueError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{f}: missing or malformed shard offsets") from e


def _tiles(parts: list[tuple[list[int], list[int]]], full: list[int]) -> bool:
    """Whether the boxes `parts` (offset, shape; each inside `full`, checked by the caller)
    cover the box `full` exactly once.

    The boxes' edges cut `full` into a grid of cells; each box covers a block of them, and an
    exact cover counts every cell once (numpy adds 1 over each box's block). Linear in the
    boxes, where comparing every pair was quadratic: a forged checkpoint of ~100k one-element
    shard files took an hour to refuse. A grid of more than `_MAX_CELLS` cells (sharding
    splits each dimension evenly or nearly: as many cells as shards) is not a tiling that
    torch writes, and is refused.
    """
    if sum(math.prod(shape) for _, shape in parts) != math.prod(full):
        return False
    boxes = [(o, s) for o, s in parts if all(x > 0 for x in s)]  # empty shards cover nothing
    cuts = [
        sorted({0, n, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)})
        for d, n in enumerate(full)
    ]
    if math.prod(len(c) - 1 for c in cuts) > _MAX_CELLS:
        return False
    index = [{x: i for i, x in enumerate(c)} for c in cuts]
    counts = np.zeros([len(c) - 1 for c in cuts], dtype=np.int64)
    for o, s in boxes:
        block = tuple(slice(at[a], at[a + n]) for at, a, n in zip(index, o, s, strict=True))
        counts[block] += 1
    return bool((counts == 1).all())


_MAX_CELLS = 1 << 22


def _placeholders(records: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Meta-device tensors of each recorded (validated) dtype and whole shape."""
    return {
        n: torch.empty(d["shape"], dtype=_dtype(d["tensor"]), device="meta")
        for n, d in records.items()
    }
