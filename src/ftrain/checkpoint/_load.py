"""load_checkpoint: verify everything, compare with the live state, then copy in place.

Nothing is written into the state until every file has been read, verified and matched, so a
failed load leaves the state as it was.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ftrain.checkpoint import _layout as L
from ftrain.checkpoint import _sharded
from ftrain.checkpoint._io import CheckpointError, read_json, read_safetensors
from ftrain.checkpoint._save import raise_pending_save_error
from ftrain.checkpoint._tree import Node, describe, flatten, unflatten
from ftrain.state import TrainState

__all__ = ["CheckpointMismatchError", "CheckpointMismatchWarning", "load_checkpoint", "read_meta"]


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the state; `differences` lists every mismatch."""

    def __init__(self, path: Path, differences: list[str]) -> None:
        self.differences = differences
        lines = "\n  ".join(differences)
        super().__init__(
            f"checkpoint {path} does not match the state ({len(differences)} "
            f"difference(s)):\n  {lines}\npass strict=False to load what matches"
        )


class CheckpointMismatchWarning(UserWarning):
    """Issued by `load_checkpoint(..., strict=False)` for what it did not load."""


def load_checkpoint(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    strict: bool = True,
    verify: bool = True,
) -> TrainState:
    """Load a checkpoint into `state`'s tensors (in place) and return the resumed state.

    `state` is the template: build it exactly as for a fresh run (same model, optimizer and
    strategy). Parameters, buffers and optimizer state are copied into its tensors and the
    counters are replaced; frozen parameters keep their values. `state` is consumed.

    Args:
        path: a `root/step-<N>` directory, e.g. from `latest_checkpoint`.
        state: the freshly created state to load into.
        strict: raise on any mismatch; False loads what matches and warns about the rest.
        verify: check every file against the SHA-256 recorded at save. Turning it off skips
            reading whole files into memory (for very large checkpoints) but lets silent
            corruption of tensor data through.

    Returns:
        The state at the checkpoint's step, epoch and cursor.

    Raises:
        CheckpointMismatchError: (strict) listing every missing, unexpected or reshaped
            parameter and optimizer-state difference.

        CheckpointError: when the checkpoint is incomplete, corrupted or not a checkpoint.

    A checkpoint written with one number of data-parallel ranks loads with another, whole
    (DDP, one process) or sharded (FSDP) either way: torch.distributed.checkpoint reshards.
    With a process group up, call it on every rank. `cursor` counts global micro-batches, so
    keep `batch_size * ranks` the same across the change for the data order to continue
    exactly.
    """
    raise_pending_save_error()
    path = Path(path)
    meta = read_meta(path)
    files = meta["files"]
    sharded = meta.get("sharded") is True
    if sharded:
        _sharded.verify(path, meta, checksum=verify)  # every file, before DCP opens any
        tensors = {
            L.MODEL_FILE: _sharded.placeholders(meta["tensors"]),
            L.OPTIM_FILE: _sharded.placeholders(
                {p: d for p, d in meta["optimizer"].items() if "tensor" in d}
            ),
        }
    else:
        tensors = {
            n: read_safetensors(path / n, sha256=files[n].get("sha256") if verify else None)
            for n in (L.MODEL_FILE, L.OPTIM_FILE)
        }
    module = state.strategy.unwrap(state.model)
    live = L.model_tensors(module, dict(state.params))
    opt_flat = flatten(state.opt_state)
    diffs, model_pairs = _match_model(meta, tensors[L.MODEL_FILE], live, module)
    opt_diffs, opt_values = _match_optimizer(meta, tensors[L.OPTIM_FILE], opt_flat, live)
    diffs += opt_diffs
    if diffs and strict:
        raise CheckpointMismatchError(path, diffs)
    fields = _fields(meta, state)  # may still reject the file: before anything is written
    lazy = sorted(p for p in opt_values if p not in opt_flat)  # a torch optimizer's own state
    if lazy and state.strategy.checkpoint_sharded:
        raise CheckpointError(
            f"{path}: the state of a from_torch optimizer ({lazy[0]}, ...) cannot be loaded "
            "into sharded (FSDP) parameters; use an ft.optim optimizer with FSDP"
        )
    if diffs:
        warnings.warn(
            f"load_checkpoint({path}) skipped {len(diffs)} item(s): " + "; ".join(diffs),
            CheckpointMismatchWarning,
            stacklevel=2,
        )
    with torch.no_grad():
        if sharded:
            model_dir, strategy = path / _sharded.MODEL_DIR, state.strategy
            _sharded.read_into(strategy, model_dir, {n: dst for n, dst, _ in model_pairs})
            device = state.strategy.device
            targets = {
                p: opt_flat[p] if p in opt_flat else torch.empty_like(v, device=device)
                for p, v in opt_values.items()
                if isinstance(v, torch.Tensor)
            }
            _sharded.read_into(strategy, path / _sharded.OPTIM_DIR, targets)
            opt_values.update(targets)
        else:
            for _, dst, src in model_pairs:
                state.strategy.copy_whole(dst, src)
        copy = state.strategy.copy_whole
        opt_state = unflatten(state.opt_state, opt_values, copy) if opt_values else state.opt_state
    return state.consume("load_checkpoint", opt_state=opt_state, **fields)


def read_meta(path: Path) -> dict[str, Any]:
    """Read and validate a committed checkpoint's `state.json` (checked against the marker)."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    if not (path / L.COMMIT_FILE).is_file():
        raise CheckpointError(f"{path} is incomplete: no {L.COMMIT_FILE} marker (save cut short)")
    marker = read_json(path / L.COMMIT_FILE)
    digest = marker.get("state.json") if isinstance(marker, dict) else None
    if not isinstance(digest, str):
        raise CheckpointError(f"{path / L.COMMIT_FILE} is malformed")
    meta = read_json(path / L.STATE_FILE, sha256=digest)
    _validate(meta, path)
    return meta


def _validate(meta: Any, path: Path) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{path / L.STATE_FILE}: {what}")

    need(isinstance(meta, dict), "not a JSON object")
    need(
        meta.get("format") == L.FORMAT, f"not an ftrain checkpoint (format {meta.get('format')!r})"
    )
    version = meta.get("format_version")
    need(
        version == L.FORMAT_VERSION,
        f"format version {version!r}; this ftrain reads {L.FORMAT_VERSION}",
    )
    for key, kind in [
        ("fields", dict),
        ("metrics", dict),
        ("params", list),
        ("optimizer", dict),
        ("files", dict),
    ]:
        need(isinstance(meta.get(key), kind), f"{key!r} missing or not a {kind.__name__}")
    need(type(meta.get("world_size")) is int, "'world_size' missing or not an int")
    need(
        all(
            isinstance(r, list) and len(r) == 4 and isinstance(r[0], str) and isinstance(r[2], list)
            for r in meta["params"]
        ),
        "malformed 'params' table",
    )
    sharded = meta.get("sharded") is True
    names = [n for n in meta["files"]] if sharded else [L.MODEL_FILE, L.OPTIM_FILE]
    for name in names:
        entry = meta["files"].get(name)
        need(isinstance(entry, dict), f"no record of {name}")
        sha = entry.get("sha256")
        need(sha is None or isinstance(sha, str), f"malformed checksum for {name}")
    if sharded:
        need(isinstance(meta.get("tensors"), dict), "'tensors' missing or not a dict")
        for n, d in meta["tensors"].items():
            need(isinstance(d, dict) and "tensor" in d, f"malformed tensor record {n!r}")
    for p, d in meta["optimizer"].items():
        need(isinstance(d, dict) and len(d) in (1, 2), f"malformed optimizer entry {p!r}")


def _match_model(
    meta: dict[str, Any],
    saved: dict[str, torch.Tensor],
    live: dict[str, torch.Tensor],
    module: torch.nn.Module,
) -> tuple[list[str], list[tuple[str, torch.Tensor, torch.Tensor]]]:
    diffs, pairs = [], []
    for name in sorted(live.keys() - saved.keys()):
        diffs.append(f"missing from checkpoint: {name} {describe(live[name])}")
    for name in sorted(saved.keys() - live.keys()):
        diffs.append(f"unexpected in checkpoint: {name} {describe(saved[name])}")
    for name in sorted(live.keys() & saved.keys()):
        dst, src = live[name], saved[name]
        if dst.shape != src.shape or dst.dtype != src.dtype:
            diffs.append(f"{name}: checkpoint has {describe(src)}, model has {describe(dst)}")
        else:
            pairs.append((name, dst, src))
    frozen_saved = {r[0]: r for r in meta["params"] if r[3] is False}
    for name, p in module.named_parameters():
        row = frozen_saved.get(name)
        if not p.requires_grad and row is not None and list(p.shape) != row[2]:
            diffs.append(f"frozen {name}: checkpoint has shape {row[2]}, model has {list(p.shape)}")
    return diffs, pairs


def _match_optimizer(
    meta: dict[str, Any],
    saved: dict[str, torch.Tensor],
    template: dict[str, Any],
    live: dict[str, torch.Tensor],
) -> tuple[list[str], dict[str, Any]]:
    entries: dict[str, Any] = meta["optimizer"]
    diffs: list[tuple[str, str]] = []  # (path, message)
    values: dict[str, Any] = {}
    for p, want in template.items():
        got = entries.get(p)
        if got is None:
            diffs.append((p, f"optimizer state missing from checkpoint: {p or '<root>'}"))
        elif describe(want) != _describe_saved(got, saved.get(p)):
            has = _describe_saved(got, saved.get(p))
            diffs.append(
                (
                    p,
                    f"optimizer state {p or '<root>'}: checkpoint has {has}, state has "
                    f"{describe(want)}",
                )
            )
        elif not isinstance(want, Node):
            values[p] = saved[p] if "tensor" in got else got["value"]
    torch_roots = [p for p, v in template.items() if isinstance(v, Node) and v.startswith("torch:")]
    for p in sorted(entries.keys() - template.keys()):
        root = next((r for r in torch_roots if _under(p, r)), None)
        if root is None:
            diffs.append((p, f"optimizer state unexpected in checkpoint: {p}"))
            continue
        # A torch optimizer creates its state lazily, so the template has none to compare.
        name, got = p[len(root) + 1 :].split("/")[0] if root else p.split("/")[0], entries[p]
        if name not in live:
            diffs.append((p, f"optimizer state for unknown parameter: {p}"))
        elif got == {"node": "dict"}:
            continue
        elif "tensor" in got and p in saved:
            values[p] = saved[p]
        elif "value" in got and isinstance(got["value"], (bool, int, float, str, type(None))):
            values[p] = got["value"]
        else:
            diffs.append((p, f"optimizer state {p}: malformed entry {got!r}"))
    for p in sorted(saved.keys() - entries.keys()):
        diffs.append((p, f"optimizer tensor {p} is in {L.OPTIM_FILE} but not in {L.STATE_FILE}"))
    # Report a container of another type once, not again for everything below it.
    heads = [p for p, _ in diffs if isinstance(template.get(p), Node)]
    report = [m for p, m in diffs if not any(_under(p, h) and p != h for h in heads)]
    # A partial optimizer state is worse than a fresh one: load none of it on a mismatch.
    return report, ({} if report else values)


def _under(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + "/")


def _describe_saved(entry: dict[str, Any], tensor: torch.Tensor | None) -> str:
    if "node" in entry:
        return str(entry["node"])
    if "tensor" in entry:
        return describe(tensor) if tensor is not None else "a tensor missing from the file"
    return type(entry.get("value")).__name__


def _fields(meta: dict[str, Any], state: TrainState) -> dict[str, Any]:
    """The saved counters, checked against the types the state's fields declare."""
    out: dict[str, Any] = {}
    saved = meta["fields"]
    hints = _hints(type(state))
    for f in dataclasses.fields(state):
        if f.name in L.NOT_PLAIN or f.name not in saved:
            continue
        value, current = saved[f.name], getattr(state, f.name)
        if _optional_tensor(f) and (value is None or current is None):
            # e.g. the float16 loss scale, saved by an fp16 run and resumed in bf16 or the
            # other way round: the new run keeps its own (fresh) value.
            if value is not None and not _is_saved_tensor(value):
                raise CheckpointError(f"state field {f.name!r} is malformed: {value!r}")
            continue
        if isinstance(current, torch.Tensor):
            number = value.get("value") if isinstance(value, dict) else None
            try:
                if type(number) not in (int, float):
                    raise TypeError
                out[f.name] = torch.tensor(number, dtype=current.dtype, device=current.device)
            except (TypeError, ValueError, RuntimeError, OverflowError) as e:
                raise CheckpointError(f"state field {f.name!r} is malformed: {value!r}") from e
        elif _fits(value, hints.get(f.name)):
            out[f.name] = value
        else:
            raise CheckpointError(f"state field {f.name!r} is malformed: {value!r}")
    for name in ("step", "epoch", "cursor", "seed"):
        if type(out.get(name)) is not int or out[name] < 0:
            raise CheckpointError(f"state field {name!r} is missing or not an int >= 0")
    scale = out.get("loss_scale")
    if scale is not None and not (bool(torch.isfinite(scale)) and float(scale) > 0):
        raise CheckpointError(f"state field 'loss_scale' must be finite and > 0, got {scale}")
    return out


def _optional_tensor(f: dataclasses.Field[Any]) -> bool:
    text = f.type if isinstance(f.type, str) else ""
    return {t.strip() for t in text.split("|")} == {"torch.Tensor", "None"}


def _is_saved_tensor(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"dtype", "value"}
        and type(value["value"]) in (int, float)
    )


_PLAIN_TYPES: dict[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "None": type(None),
}


def _hints(cls: type) -> dict[str, set[type] | None]:
    """Allowed JSON types per plain field, from annotations like `float | None`.

    Annotations are strings here (`from __future__ import annotations`); they are parsed, not
    evaluated. A field annotated with anything else is only checked for being a plain value.
    """
    out: dict[str, set[type] | None] = {}
    for f in dataclasses.fields(cls):
        text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        names = [t.strip() for t in text.split("|")]
        out[f.name] = (
            {_PLAIN_TYPES[n] for n in names} if all(n in _PLAIN_TYPES for n in names) else None
        )
    return out


def _fits(value: Any, allowed: set[type] | None) -> bool:
    if type(value) not in (bool, int, float, str, type(None)):
        return False
    if allowed is None:
        return True
    # A float field may hold an int a user stored; bool is never an int here.
    return type(value) in allowed or (type(value) is int and float in allowed)
