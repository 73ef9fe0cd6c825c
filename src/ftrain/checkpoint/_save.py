"""save_checkpoint, latest_checkpoint, rotation, and the one background save allowed in flight.

A save is atomic: everything is written into `root/.tmp-…`, fsynced, sealed with the commit
marker, then renamed to `root/step-<N>` and the rename fsynced. A crash at any instant leaves
either the previous checkpoints untouched or the new one complete. Rotation runs only after the
new checkpoint is committed.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ftrain.checkpoint import _layout as L
from ftrain.checkpoint import _sharded
from ftrain.checkpoint._io import (
    CheckpointError,
    fsync_tree,
    publish_dir,
    sha256_file,
    write_json,
    write_safetensors,
    write_text,
)
from ftrain.checkpoint._tree import Node, flatten
from ftrain.state import TrainState

__all__ = ["latest_checkpoint", "save_checkpoint", "wait_for_checkpoint"]


@dataclass
class _Staged:
    """Everything a save writes, detached from the live state (safe to write in the background)."""

    step: int
    model: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]
    meta: dict[str, Any]
    config: str | None


def save_checkpoint(
    state: TrainState,
    root: str | os.PathLike[str],
    *,
    metrics: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    keep_best: int | None = None,
    best_metric: str | None = None,
    mode: Literal["min", "max"] = "min",
    checksum: bool = True,
    blocking: bool = True,
) -> Path:
    """Write `state` to `root/step-<state.step>/` atomically, then rotate old checkpoints.

    Saves the trainable parameters, persistent buffers and optimizer state (safetensors) and
    every counter (JSON); frozen parameters are not saved. See docs/checkpoints.md.

    Args:
        state: not consumed; training may continue from it.
        root: the run's checkpoint directory (created if missing).
        metrics: numbers to record with this checkpoint, e.g. `{"eval_loss": 1.7}`.
        keep_last: keep this many newest checkpoints (None keeps all; 0 keeps only the newest
            and the best).
        keep_best: also keep this many best by `metrics[best_metric]`; defaults to 1 when
            `best_metric` is given.
        best_metric: the metric that ranks checkpoints.
        mode: "min" if lower `best_metric` is better, "max" otherwise.
        checksum: record each file's SHA-256 so `load_checkpoint` can detect corruption.
        blocking: False copies the tensors and returns while a background thread writes them;
            at most one save is in flight, and its error is raised by the next
            `clip_and_step` or checkpoint call. Make the final save of a run blocking.

    With several data-parallel ranks, call it on every rank. With DDP rank 0 writes, and a
    blocking save returns on every rank once the checkpoint is committed. With FSDP every rank
    writes its own shards (torch.distributed.checkpoint), rank 0 commits them all at once, and
    the save is always blocking: it returns on every rank after the commit, or raises on every
    rank. Either kind loads with any number of ranks.

    Returns:
        The checkpoint directory `root/step-<N>`.

    Raises:
        ValueError: for bad retention arguments.
        CheckpointError: when a state field or metric cannot be stored.

    Example:
        >>> import tempfile, torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.adamw())
        >>> root = tempfile.mkdtemp()
        >>> ft.save_checkpoint(state, root).name
        'step-0'
        >>> ft.latest_checkpoint(root).name
        'step-0'
    """
    _check_retention(keep_last, keep_best, best_metric, mode)
    if best_metric is not None and keep_best is None:
        keep_best = 1
    wait_for_checkpoint()
    root, strategy = Path(root), state.strategy
    if _sharded.is_sharded(state.params.values()):
        rotation = (keep_last, keep_best, best_metric, mode)
        return _save_sharded(state, root, metrics, rotation, checksum=checksum)
    path = L.step_dir(root, state.step)
    if strategy.rank != 0:
        # Replicated data parallelism: rank 0 holds everything and writes it; the others wait
        # (when blocking) so that no rank runs ahead of the commit.
        if blocking:
            strategy.barrier()
        return path
    staged = _stage(state, metrics, copy=not blocking)
    job = _Job(staged, root, keep_last, keep_best, best_metric, mode, checksum)
    if not blocking:
        _start(job)
        return path
    try:
        return job.run()
    finally:
        strategy.barrier()


def _save_sharded(
    state: TrainState,
    root: Path,
    metrics: Mapping[str, Any] | None,
    rotation: tuple[int | None, int | None, str | None, str],
    *,
    checksum: bool,
) -> Path:
    """Every rank writes its shards; rank 0 seals and renames the directory; all agree."""
    strategy = state.strategy
    keep_last, keep_best, best_metric, mode = rotation
    tmp = _sharded.tmp_dir(root, state.step)
    if strategy.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        clean_tmp(root)
        tmp.mkdir()
    strategy.barrier()  # the directory exists before anyone writes into it
    module = strategy.unwrap(state.model)
    opt_flat = flatten(state.opt_state)
    model = L.model_tensors(module, dict(state.params))
    group = getattr(strategy, "group", None)
    _sharded.write({n: t.detach() for n, t in model.items()}, tmp / _sharded.MODEL_DIR, group)
    optim = {p: v.detach() for p, v in opt_flat.items() if isinstance(v, torch.Tensor)}
    _sharded.write(optim, tmp / _sharded.OPTIM_DIR, group)
    final, error = L.step_dir(root, state.step), None
    if strategy.rank == 0:
        try:
            meta = _meta(state, metrics, module, opt_flat)  # reads the counters: a host sync
            meta["sharded"] = True
            meta["tensors"] = {n: _describe(t) for n, t in model.items()}
            meta["files"] = _sharded.record_files(tmp, checksum=checksum)
            config = getattr(module, "config", None)
            to_json = getattr(config, "to_json_string", None)
            if callable(to_json):
                write_text(to_json(), tmp / L.CONFIG_FILE)
            fsync_tree(tmp)
            _seal(tmp, root, state.step, meta)
            if keep_last is not None:
                _rotate(root, keep_last, keep_best, best_metric, mode)
        except BaseException as e:  # every rank must hear about it, then it is raised here
            error = e
    if not _sharded.commit_ok(error is None, strategy):
        raise CheckpointError(f"rank 0 could not commit the sharded checkpoint {final}") from error
    return final


def _check_retention(
    keep_last: int | None, keep_best: int | None, best_metric: str | None, mode: str
) -> None:
    if keep_last is not None and (type(keep_last) is not int or keep_last < 0):
        raise ValueError(f"keep_last must be an int >= 0 or None, got {keep_last!r}")
    if keep_best is not None and (type(keep_best) is not int or keep_best < 1):
        raise ValueError(f"keep_best must be an int >= 1 or None, got {keep_best!r}")
    if keep_best is not None and best_metric is None:
        raise ValueError("keep_best needs best_metric, the metrics key that ranks checkpoints")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")


def _stage(state: TrainState, metrics: Mapping[str, Any] | None, *, copy: bool) -> _Staged:
    if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian
        raise CheckpointError("checkpoints are written on little-endian machines only")
    module = state.strategy.unwrap(state.model)
    opt_flat = flatten(state.opt_state)

    seen: set[int] = set()

    def host(t: torch.Tensor) -> torch.Tensor:
        # A copy decouples an async write from the next (donated, in-place) step. safetensors
        # refuses tensors that share memory (views of one buffer), so those are copied too.
        t = t.detach()
        ptr = t.untyped_storage().data_ptr()
        shared = ptr in seen and t.numel() > 0
        seen.add(ptr)
        if copy or shared:
            return t.to("cpu", copy=True).contiguous()
        return t.cpu().contiguous()

    with torch.no_grad():
        model = {n: host(t) for n, t in L.model_tensors(module, dict(state.params)).items()}
        optim = {p: host(v) for p, v in opt_flat.items() if isinstance(v, torch.Tensor)}
    config = getattr(module, "config", None)
    meta = _meta(state, metrics, module, opt_flat)
    to_json = getattr(config, "to_json_string", None)
    return _Staged(state.step, model, optim, meta, to_json() if callable(to_json) else None)


def _meta(
    state: TrainState, metrics: Mapping[str, Any] | None, module: Any, opt_flat: dict[str, Any]
) -> dict[str, Any]:
    table = L.param_table(module)
    meta = {
        "format": L.FORMAT,
        "format_version": L.FORMAT_VERSION,
        "ftrain_version": _version(),
        "torch_version": torch.__version__,
        "fields": L.plain_fields(state),
        "metrics": _metrics(metrics),
        "world_size": state.strategy.world_size,
        "params": table,
        "fingerprint": L.fingerprint(table),
        "optimizer": {p: _describe(v) for p, v in opt_flat.items()},
    }
    adapter = _peft_config(module)
    if adapter is not None:
        meta["peft"] = adapter
    return meta


def _peft_config(module: Any) -> dict[str, Any] | None:
    """A PEFT model's adapter config as JSON (for the CLI's export), or None."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or list(configs) != ["default"]:
        return None
    as_json = json.dumps(
        configs["default"].to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)
    )
    return dict(json.loads(as_json))


def _describe(leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, Node):
        return {"node": str(leaf)}
    if isinstance(leaf, torch.Tensor):
        return {"tensor": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape)}
    return {"value": leaf}


def _metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()  # host sync: metrics are read once, at save time
        if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, float, str))):
            raise CheckpointError(f"metric {k!r}={v!r} is not a string key with a plain value")
        out[k] = v
    return out


def _version() -> str:
    from ftrain import __version__

    return __version__


@dataclass
class _Job:
    staged: _Staged
    root: Path
    keep_last: int | None
    keep_best: int | None
    best_metric: str | None
    mode: str
    checksum: bool

    def run(self) -> Path:
        path = _commit(self.staged, self.root, checksum=self.checksum)
        if self.keep_last is not None:
            _rotate(self.root, self.keep_last, self.keep_best, self.best_metric, self.mode)
        return path


def _commit(staged: _Staged, root: Path, *, checksum: bool) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    clean_tmp(root)
    tmp = root / f"{L.TMP_PREFIX}step-{staged.step}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    write_safetensors(staged.model, tmp / L.MODEL_FILE)
    write_safetensors(staged.optim, tmp / L.OPTIM_FILE)
    names = [L.MODEL_FILE, L.OPTIM_FILE]
    if staged.config is not None:
        write_text(staged.config, tmp / L.CONFIG_FILE)
        names.append(L.CONFIG_FILE)
    files: dict[str, dict[str, Any]] = {n: {"bytes": (tmp / n).stat().st_size} for n in names}
    if checksum:
        for n, digest in zip(names, _sha256_parallel([tmp / n for n in names]), strict=True):
            files[n]["sha256"] = digest
    return _seal(tmp, root, staged.step, {**staged.meta, "files": files})


def _seal(tmp: Path, root: Path, step: int, meta: dict[str, Any]) -> Path:
    """Write state.json and the commit marker into the finished `tmp`, then publish it."""
    write_json(meta, tmp / L.STATE_FILE)
    write_json({"state.json": sha256_file(tmp / L.STATE_FILE)}, tmp / L.COMMIT_FILE)
    final = L.step_dir(root, step)
    # Re-saving a step moves the old copy aside into a temporary name first.
    publish_dir(tmp, final, root / f"{L.TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:8]}")
    return final


def _sha256_parallel(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL, so files hash in parallel. Plain threads, not an executor:
    # concurrent.futures refuses new work once the interpreter starts shutting down, which is
    # when a background save still in flight gets finished.
    out = [""] * len(paths)

    def work(i: int) -> None:
        out[i] = sha256_file(paths[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, len(paths))]
    for t in threads:
        t.start()
    work(0)
    for t in threads:
        t.join()
    if not all(out):
        raise CheckpointError(f"hashing {paths} failed")
    return out


def clean_tmp(root: Path) -> None:
    """Remove temporary directories that a crashed save left in `root`."""
    for p in root.glob(f"{L.TMP_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)


def committed(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = L.STEP_DIR.fullmatch(p.name)
        if m and L.is_committed(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """Return the committed checkpoint with the highest step under `root`, or None.

    Directories without the commit marker (a save cut short) are ignored.

    Example:
        >>> import ftrain as ft
        >>> ft.latest_checkpoint("/nonexistent/run") is None
        True
    """
    raise_pending_save_error()
    found = committed(Path(root))
    return found[-1][1] if found else None


def retained(
    checkpoints: list[tuple[int, Mapping[str, Any]]],
    *,
    keep_last: int,
    keep_best: int | None,
    best_metric: str | None,
    mode: str,
) -> set[int]:
    """Steps to keep out of `(step, metrics)` pairs: the `keep_last` newest, the `keep_best`
    best by `metrics[best_metric]` (checkpoints without a finite value are not ranked), and
    always the newest and the best."""
    steps = sorted(s for s, _ in checkpoints)
    keep = set(steps[-keep_last:]) if keep_last else set()
    keep.update(steps[-1:])
    if best_metric is not None:
        scored = [
            (float(m[best_metric]), s)
            for s, m in checkpoints
            if isinstance(m.get(best_metric), (int, float)) and math.isfinite(m[best_metric])
        ]
        # Ties go to the older checkpoint, as the first to reach a value is the best (HF).
        scored.sort(key=lambda vs: (vs[0] if mode == "min" else -vs[0], vs[1]))
        keep.update(s for _, s in scored[: max(keep_best or 1, 1)])
    return keep


def _rotate(
    root: Path, keep_last: int, keep_best: int | None, best_metric: str | None, mode: str
) -> None:
    found = committed(root)
    listed = [(s, _saved_metrics(p)) for s, p in found]
    keep = retained(
        listed, keep_last=keep_last, keep_best=keep_best, best_metric=best_metric, mode=mode
    )
    for s, p in found:
        if s not in keep:
            # Rename to a temporary name first: a crash mid-delete leaves a directory that
            # latest_checkpoint ignores and the next save removes, never a half checkpoint.
            doomed = root / f"{L.TMP_PREFIX}deleting-{p.name}-{uuid.uuid4().hex[:8]}"
            os.rename(p, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def _saved_metrics(path: Path) -> Mapping[str, Any]:
    try:
        meta = json.loads((path / L.STATE_FILE).read_text(encoding="utf-8"))
        metrics = meta.get("metrics", {})
        return metrics if isinstance(metrics, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


# --- background saves: at most one in flight -------------------------------------------------

_lock = threading.Lock()
_inflight: _Background | None = None


class _Background(threading.Thread):
    def __init__(self, job: _Job) -> None:
        super().__init__(name="ftrain-checkpoint", daemon=False)
        self.job = job
        self.path: Path | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.path = self.job.run()
        except BaseException as e:  # re-raised in the caller's thread
            self.error = e


def _start(job: _Job) -> None:
    global _inflight
    with _lock:
        _inflight = _Background(job)
        _inflight.start()


def wait_for_checkpoint() -> Path | None:
    """Block until the background save (if any) is written; return its path.

    Raises:
        CheckpointError: if the background save failed (the original error is its cause).
    """
    global _inflight
    with _lock:
        bg, _inflight = _inflight, None
    if bg is None:
        return None
    bg.join()
    if bg.error is not None:
        raise CheckpointError(f"background save of step {bg.job.staged.step} failed") from (
            bg.error
        )
    return bg.path


def raise_pending_save_error() -> None:
    """Raise the error of a finished background save, if it failed (cheap when none did)."""
    bg = _inflight
    if bg is not None and not bg.is_alive() and bg.error is not None:
        wait_for_checkpoint()


@atexit.register
def _finish_at_exit() -> None:
    try:
        wait_for_checkpoint()
    except CheckpointError as e:  # pragma: no cover - reported, the interpreter is exiting
        print(f"ftrain: {e}: {e.__cause__!r}", file=sys.stderr)
