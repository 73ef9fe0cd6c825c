"""save_checkpoint as one pipeline, each step in one place. Traced (blocking save):

    _save.save_checkpoint -> _layout.collect (-> _tree.flatten_tree): the state's tensors and JSON
    -> _save._stage: host copies (`Strategy.to_host`)
    -> _save._commit: this save's own `root/.tmp-...` directory, _write (whole tensors by
       rank 0 through _io, or every rank's shards through `Strategy.save_shards`), _seal (_io:
       state.json, COMMITTED, rename to `step-<N>`)
    -> _save._rotate (after the commit) -> _save._all_ok (every rank learns the outcome).

_save orchestrates and is the only module returned to: _layout and _tree are entered once
(collect), the strategy once to stage and once to write, _io only by write and seal (file
helpers, no callbacks into checkpoint/). A background save runs the same steps after `_stage`
in a thread; a sharded one stages through `Strategy.save_shards_async` and commits once every
rank's shards are written. A crash at any instant leaves the previous checkpoints untouched or
the new one whole.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ftrain.checkpoint import _frozen
from ftrain.checkpoint import _layout as L
from ftrain.checkpoint._inflight import failure as _failure
from ftrain.checkpoint._inflight import in_flight_into as _in_flight_into
from ftrain.checkpoint._inflight import wait_for_checkpoint as wait_for_checkpoint
from ftrain.checkpoint._io import (
    CheckpointError,
    fsync_tree,
    publish_dir,
    read_json,
    sha256_file,
    write_json,
    write_safetensors,
    write_text,
)
from ftrain.checkpoint._verify import check_savable, check_shard_cover
from ftrain.predicates import best_mode
from ftrain.process_state import STATE
from ftrain.state import TrainState
from ftrain.strategies import Strategy, active_preemption

__all__ = [
    "latest_cadence_checkpoint",
    "latest_checkpoint",
    "raise_pending_save_error",
    "save_checkpoint",
    "step_dirs",
    "wait_for_checkpoint",
]


def save_checkpoint(
    state: TrainState,
    root: str | os.PathLike[str],
    *,
    metrics: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    keep_best: int | None = None,
    best_metric: str | None = None,
    mode: Literal["min", "max"] | None = None,
    checksum: bool = True,
    blocking: bool = True,
) -> Path:
    """Write `state` to `root/step-<state.step>/` atomically, then rotate old checkpoints.

    Saves the trainable parameters, persistent buffers and optimizer state (safetensors) and
    every counter (JSON); frozen parameters are not saved, their sums are (`load_checkpoint`
    checks that it loads onto the same base model). See docs/checkpoints.md.

    Args:
        state: not consumed; training may continue from it.
        root: the run's checkpoint directory (created if missing).
        metrics: numbers to record with this checkpoint, e.g. `{"eval_loss": 1.7}`.
        keep_last: keep this many most recently committed checkpoints (None keeps all; 0 keeps
            only the one just written and the best).
        keep_best: also keep this many best by `metrics[best_metric]`; defaults to 1 when
            `best_metric` is given. Given with `keep_last=None` (which keeps all) it raises.
        best_metric: the metric that ranks checkpoints; `metrics` must hold it. A save without
            it (a preemption save) still keeps the best, ranked as the newest save in `root`
            that had one ranked (recorded in its state.json).
        mode: "min" if lower `best_metric` is better, "max" otherwise. None (default): "min",
            except for a `best_metric` named like a score that is better higher (accuracy, F1,
            ...), which raises rather than keep the worst checkpoint as the best.
        checksum: record each file's SHA-256 so `load_checkpoint` can detect corruption.
        blocking: False copies the tensors and returns while a background thread writes them;
            at most one save is in flight, and its error is raised by the next
            checkpoint call (`save_checkpoint`, `wait_for_checkpoint`, `latest_checkpoint`,
            `load_checkpoint`); training steps do not look. Make the final save of a run
            blocking: a background save that fails at interpreter exit makes the process exit
            with 1.

    A save that `should_save` asked for only because of a preemption (at a step its cadence
    skips) is marked preemption-only in its state.json: it resumes like any other, but the
    spike guard rolls back past it (`latest_cadence_checkpoint`), and rotation keeps the newest
    checkpoint the cadence wrote beside it.

    With several data-parallel ranks, call it on every rank with the same arguments. With DDP
    rank 0 writes; with FSDP every rank writes its own shards (torch.distributed.checkpoint)
    and rank 0 commits them all at once. A blocking save returns on every rank once the
    checkpoint is committed, or raises `CheckpointError` on every rank; a background sharded
    save fails on every rank or none. Either kind loads with any number of ranks.

    Returns:
        The checkpoint directory `root/step-<N>`.

    Raises:
        ValueError: for bad retention arguments, a `root` that is itself a checkpoint,
            `best_metric` missing from `metrics`, or
            ranking by a loss whose recorded function (`metrics[best_metric + "_fn"]`, as
            `evaluate`'s `eval_loss_fn`) differs from that of a committed checkpoint in `root`.
        ConsumedStateError: if a step function consumed `state` (save the state it returned).
        CheckpointError: when the checkpoint could not be written (full disk, `root` is a
            file, ...; the original error is its cause, and when that is an `OSError` the
            `CheckpointError` is one too), or a state field or metric cannot be stored.

    Example:
        >>> import tempfile, torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.adamw())
        >>> root = tempfile.mkdtemp()
        >>> ft.save_checkpoint(state, root).name
        'step-0'
        >>> ft.latest_checkpoint(root).name
        'step-0'
    """
    _check_save_args(state, root, metrics, best_metric, checksum=checksum, blocking=blocking)
    job = _Job(
        Path(root),
        state.step,
        keep_last,
        keep_best,
        best_metric,
        "min" if mode is None else mode,
        checksum,
    )
    job.preemption_only = _off_cadence(state.step)  # read now: the predicate was just asked
    if best_metric is not None and best_metric not in (metrics or {}):
        raise ValueError(
            f"best_metric={best_metric!r} is not in metrics (keys: {sorted(metrics or {})}): "
            f"pass metrics={{{best_metric!r}: value}} to rank this checkpoint, or no best_metric"
        )
    if mode is None:  # "min", unless the metric is a score: the worst would be kept as best
        job.mode = best_mode(best_metric, "save_checkpoint", "best_metric")
    # A consumed state raises ConsumedStateError here (naming the step function that consumed
    # it), before any collective: every rank's loop consumed its state alike.
    _ = state.params
    wait_for_checkpoint()
    _check_one_loss(job, metrics)  # issue 26: never rank checkpoints by two different losses
    strategy = state.strategy
    if blocking:
        return _save_together(job, state, metrics)
    if strategy.checkpoint_sharded:  # every rank writes its own shards in the background
        _start(job, _write_later(job, state, metrics))
    elif strategy.process_rank == 0:  # rank 0 holds whole tensors: it writes them in the background
        staged = _stage(job.collect(state, metrics, sharded=False), strategy, copy=True)
        _start(job, lambda: job.run(staged, strategy))
    return job.path


def check_retention(keep_last: Any, keep_best: Any, best_metric: Any, mode: Any) -> None:
    """Raise a `ValueError` naming the first retention argument `save_checkpoint` refuses:
    `keep_last` (an int >= 0 or None), `keep_best` (an int >= 1 or None, only with
    `best_metric` and a `keep_last`), `mode` ("min" or "max"). For integrations that hand
    retention to another owner (`ftrain.extras.ray.checkpoint_config`) and must refuse what
    ftrain refuses.

    Example:
        >>> from ftrain.checkpoint import check_retention
        >>> check_retention(3, None, None, "min")
        >>> check_retention(None, 2, None, "min")
        Traceback (most recent call last):
        ...
        ValueError: keep_best needs best_metric, the metrics key that ranks checkpoints
    """
    if keep_last is not None and (type(keep_last) is not int or keep_last < 0):
        raise ValueError(f"keep_last must be an int >= 0 or None, got {keep_last!r}")
    if keep_best is not None and (type(keep_best) is not int or keep_best < 1):
        raise ValueError(f"keep_best must be an int >= 1 or None, got {keep_best!r}")
    if keep_best is not None and best_metric is None:
        raise ValueError("keep_best needs best_metric, the metrics key that ranks checkpoints")
    if keep_best is not None and keep_last is None:  # it would be ignored: all are kept
        raise ValueError(
            f"keep_best={keep_best} with keep_last=None deletes nothing (None keeps every "
            "checkpoint); pass keep_last too (keep_last=0 keeps the newest and the best only)"
        )
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if mode == "max" and best_metric is None:  # nothing ranked: it would be ignored
        raise ValueError("mode='max' needs best_metric, the metrics key that it ranks by")


@dataclass
class _Job:
    """Where a save goes and what rotation keeps afterwards."""

    root: Path
    step: int
    keep_last: int | None
    keep_best: int | None
    best_metric: str | None
    mode: str
    checksum: bool
    preemption_only: bool = False  # should_save said yes only because of a preemption

    def __post_init__(self) -> None:
        keep_best, best_metric = self.keep_best, self.best_metric
        check_retention(self.keep_last, keep_best, best_metric, self.mode)
        if best_metric is not None and keep_best is None:
            self.keep_best = 1

    @property
    def path(self) -> Path:
        return _step_dir(self.root, self.step)

    def collect(
        self, state: TrainState, metrics: Mapping[str, Any] | None, *, sharded: bool
    ) -> L.Contents:
        """The checkpoint's contents; a ranked save records its ranking in state.json, so that
        later saves without `best_metric` (preemption, ad hoc) still keep the best."""
        check_savable(state)  # never commit a checkpoint that no load accepts
        contents = L.collect(state, metrics, sharded=sharded)
        if self.best_metric is not None:
            contents.meta[L.RANKING] = {
                "best_metric": self.best_metric, "keep_best": self.keep_best, "mode": self.mode
            }  # fmt: skip
        if self.preemption_only:  # only then: a cadence save's state.json is as before
            contents.meta[L.PREEMPTION_ONLY] = True
        return contents

    def run(self, staged: L.Contents, strategy: Strategy) -> Path:
        """Write, seal, rotate (on the ranks that write)."""
        path = _commit(_ready(staged), self.root, checksum=self.checksum, strategy=strategy)
        if strategy.process_rank == 0:
            self.rotate()
        return path

    def rotate(self) -> None:
        if self.keep_last is not None:
            _rotate(self, self.keep_last)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def _off_cadence(step: int) -> bool:
    """Whether the last `should_save` said yes at `step` only because of a preemption."""
    preempt = active_preemption()
    return preempt is not None and preempt.off_cadence(step)


def _save_together(job: _Job, state: TrainState, metrics: Mapping[str, Any] | None) -> Path:
    """The blocking pipeline on every rank; all return once rank 0 committed, or all raise."""
    strategy = state.strategy
    sharded = strategy.checkpoint_sharded
    error: BaseException | None = None
    try:
        if sharded or strategy.process_rank == 0:  # the ranks that write
            contents = job.collect(state, metrics, sharded=sharded)
            job.run(_stage(contents, strategy, copy=False), strategy)
    except BaseException as e:  # every rank must hear about it, then it is raised here
        error = e
    if not _all_ok(error is None, strategy):
        raise _failure(f"saving step {job.step} into {job.root} failed", error)
    return job.path


def _stage(contents: L.Contents, strategy: Strategy, *, copy: bool) -> L.Contents:
    """Host copies of whole tensors and counters, from `Strategy.to_host` (a sharded state's
    shards are left to the strategy, which writes them where they are or stages them itself).

    `copy` (a background save) decouples the write from the next, in-place step; `ready` is
    then what the writer waits for, so the caller's thread never waits for the device.
    """
    if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian
        raise CheckpointError("checkpoints are written on little-endian machines only")
    whole = [] if contents.meta.get("sharded") else [contents.model, contents.optim]
    counters: list[torch.Tensor] = []  # the counters', metrics' and frozen sums' tensors, in order
    _map_values(contents.meta, counters.append)
    tensors = [t for part in whole for t in part.values()]
    hosts, wait = strategy.to_host([*tensors, *counters], copy=copy)
    it = iter(hosts)  # in the order they went in: model, optimizer, counters
    model, optim = contents.model, contents.optim
    if whole:
        model, optim = (_unshared({n: next(it) for n in part}) for part in whole)
    meta = _map_values(contents.meta, lambda _: next(it))
    return L.Contents(contents.step, model, optim, meta, contents.config, wait)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (views of one buffer): copy those."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() > 0 else t
        seen.add(ptr)
    return out


def _ready(staged: L.Contents) -> L.Contents:
    """Wait for the staging copies, then read the counters and metrics as numbers."""
    if staged.ready is not None:
        staged.ready()
    meta = _map_values(staged.meta, lambda t: t.tolist())  # host sync: saving is the place
    frozen = meta.get(L.FROZEN)
    if isinstance(frozen, _frozen.Sums):
        meta[L.FROZEN] = frozen.as_json()
    return dataclasses.replace(staged, meta=meta, ready=None)


def _map_values(meta: dict[str, Any], fn: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    """`meta` with `fn` applied to the tensors `collect` left in its counters, metrics (0-dim)
    and frozen sums: staged to the host first, then read as numbers (`Tensor.tolist`) by the
    writer."""
    fields = {
        n: {**v, "value": fn(v["value"])}
        if isinstance(v, dict) and isinstance(v.get("value"), torch.Tensor)
        else v
        for n, v in meta["fields"].items()
    }
    metrics = {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in meta["metrics"].items()}
    frozen = meta.get(L.FROZEN)
    if isinstance(frozen, _frozen.Sums):
        return {**meta, "fields": fields, "metrics": metrics, L.FROZEN: frozen.map(fn)}
    return {**meta, "fields": fields, "metrics": metrics}


def _commit(staged: L.Contents, root: Path, *, checksum: bool, strategy: Strategy) -> Path:
    """Write `staged` into a temporary directory of this save's own, seal it, publish it."""
    tmp = _new_tmp(root, staged.step, strategy)
    try:
        files = _write(staged, tmp, strategy)
        if strategy.process_rank == 0:
            _seal(tmp, root, staged, files, checksum=checksum)
    finally:
        if strategy.process_rank == 0:  # gone once published; after a failure, its owner cleans
            shutil.rmtree(tmp, ignore_errors=True)
    return _step_dir(root, staged.step)


def _write(staged: L.Contents, tmp: Path, strategy: Strategy) -> list[str]:
    """Write the tensors (and config.json) into `tmp`; return the files state.json records."""
    if strategy.checkpoint_sharded:
        try:  # collective: when any rank fails, every rank raises
            strategy.save_shards(staged.model, tmp / L.MODEL_DIR)
            strategy.save_shards(staged.optim, tmp / L.OPTIM_DIR)
        except Exception as e:
            raise CheckpointError(f"writing the shards into {tmp} failed: {e}") from e
        return _shard_files(staged, tmp) if strategy.process_rank == 0 else []
    write_safetensors(staged.model, tmp / L.MODEL_FILE)
    write_safetensors(staged.optim, tmp / L.OPTIM_FILE)
    if staged.config is None:
        return [L.MODEL_FILE, L.OPTIM_FILE]
    write_text(staged.config, tmp / L.CONFIG_FILE)
    return [L.MODEL_FILE, L.OPTIM_FILE, L.CONFIG_FILE]


def _shard_files(staged: L.Contents, tmp: Path) -> list[str]:
    """Rank 0, once every rank wrote its shards: add config.json; list the shard files."""
    if staged.config is not None:
        write_text(staged.config, tmp / L.CONFIG_FILE)
    return [
        f"{sub}/{f.name}"
        for sub in (L.MODEL_DIR, L.OPTIM_DIR)
        for f in sorted((tmp / sub).glob("*.safetensors"))
    ]


def _write_later(
    job: _Job, state: TrainState, metrics: Mapping[str, Any] | None
) -> Callable[[], Path]:
    """Stage a sharded state now (the strategy copies its shards); return the write, which
    every rank runs in the background: shards, then rank 0 seals and rotates."""
    strategy = state.strategy
    staged = _stage(job.collect(state, metrics, sharded=True), strategy, copy=True)
    tmp = _new_tmp(job.root, job.step, strategy)

    def commit() -> None:  # rank 0, once every rank's shards are written
        ready = _ready(staged)
        _seal(tmp, job.root, ready, _shard_files(ready, tmp), checksum=job.checksum)
        job.rotate()

    def clean() -> None:  # gone once published; after a failure, only its owner cleans
        if strategy.process_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    try:
        parts = {tmp / L.MODEL_DIR: staged.model, tmp / L.OPTIM_DIR: staged.optim}
        shards = strategy.save_shards_async(parts, commit=commit)
    except BaseException as e:
        clean()
        raise _failure(f"staging step {job.step} failed", e) from e

    def write() -> Path:
        try:
            shards()
        finally:
            clean()
        return job.path

    return write


def _seal(tmp: Path, root: Path, staged: L.Contents, files: list[str], *, checksum: bool) -> None:
    """Record the files in state.json, write the commit marker last, publish as step-N."""
    fsync_tree(tmp)  # files written by others (DCP) are not fsynced yet
    sharded_config = staged.meta.get("sharded") is True and staged.config is not None
    recorded = [*files, L.CONFIG_FILE] if sharded_config else files
    record: dict[str, dict[str, Any]] = {n: {"bytes": (tmp / n).stat().st_size} for n in recorded}
    if checksum:
        for n, digest in zip(recorded, _sha256_parallel([tmp / n for n in recorded]), strict=True):
            record[n]["sha256"] = digest
    meta = {**staged.meta, "files": record}
    if sharded_config:  # "files" lists the shards; config.json is checksummed beside them
        meta[L.SHARDED_CONFIG] = record.pop(L.CONFIG_FILE)
    if staged.meta.get("sharded") is True:  # every rank's shards reached this folder
        check_shard_cover(tmp, meta)
    write_json(meta, tmp / L.STATE_FILE)
    write_json({"state.json": sha256_file(tmp / L.STATE_FILE)}, tmp / L.COMMIT_FILE)
    _after_every_commit(tmp / L.COMMIT_FILE, root)
    final = _step_dir(root, staged.step)
    # Re-saving a step moves the old copy aside into a temporary name first.
    publish_dir(tmp, final, root / _tmp_name(f"replaced-{final.name}"), last_writer_wins=True)


def _after_every_commit(marker: Path, root: Path) -> None:
    """Give the marker a time after every other commit's in `root`: commit order is then
    strict even when the clock is coarse (ms) or went back."""
    for _, path in reversed(committed(root)):
        try:
            last = (path / L.COMMIT_FILE).stat().st_mtime_ns
        except FileNotFoundError:  # rotated away by another writer meanwhile: the next one
            continue
        if marker.stat().st_mtime_ns <= last:
            os.utime(marker, ns=(last + 1, last + 1))
        return


def _all_ok(ok: bool, strategy: Strategy) -> bool:
    """Collective: True on every rank when every rank passed True."""
    failed = torch.tensor(0.0 if ok else 1.0, device=strategy.device)
    return bool(strategy.sum_over_processes(failed) == 0)  # host sync: saving is the place


# --- temporary directories: one per save, removed only by their owner ------------------------

_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"
_OWNER = re.compile(r".*\.(\d+)@([A-Za-z0-9_.-]+)\.[0-9a-f]{8}")
STALE_AFTER_S = 24 * 3600  # another machine's temporary directory this old is a crash's


def _tmp_name(what: str, *, pid: int | None = None, host: str = _HOST) -> str:
    """`.tmp-<what>.<pid>@<host>.<random>`: unique per save, and says who owns it."""
    owner = f"{os.getpid() if pid is None else pid}@{host}"
    return f"{L.TMP_PREFIX}{what}.{owner}.{uuid.uuid4().hex[:8]}"


def _new_tmp(root: Path, step: int, strategy: Strategy) -> Path:
    """Rank 0 makes the directory; with a sharded state every rank learns its name."""
    name, error = "", None
    if strategy.process_rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            tmp = root / _tmp_name(f"step-{step}")
            tmp.mkdir()
            name = tmp.name
        except OSError as e:
            error = e
    if strategy.checkpoint_sharded:
        name = _broadcast_name(name, strategy)
    if error is not None:
        raise _failure(f"cannot create a temporary directory in {root}", error)
    if not name:
        raise CheckpointError(f"rank 0 could not create a temporary directory in {root}")
    return root / name


def _broadcast_name(name: str, strategy: Strategy) -> str:
    """Rank 0's `name` on every rank ("" when rank 0 failed), through a sum of byte codes."""
    codes = torch.zeros(256, dtype=torch.int64)
    codes[: len(name)] = torch.tensor(list(name.encode()), dtype=torch.int64)
    summed = strategy.sum_over_processes(codes.to(strategy.device)).cpu().tolist()
    return bytes(c for c in summed if c).decode()


def _remove_stale(root: Path) -> None:
    """Remove the temporary directories that crashed saves left; never another live save's.

    A committed `step-N` a crashed re-save had moved aside (where the file system cannot swap
    two folders in one step: NFS, Lustre) is put back instead when no `step-N` took its place:
    it was the only copy of that step."""
    for p in root.glob(f"{L.TMP_PREFIX}*"):
        with contextlib.suppress(OSError):  # gone meanwhile: its owner finished
            if _stale(p):
                aside = _ASIDE.match(p.name)
                final = root / aside.group(1) if aside else None
                if final is not None and not final.exists() and (p / L.COMMIT_FILE).is_file():
                    os.rename(p, final)
                    continue
                shutil.rmtree(p, ignore_errors=True)


_ASIDE = re.compile(re.escape(L.TMP_PREFIX) + r"replaced-(step-\d+)\.")


def _stale(p: Path) -> bool:
    m = _OWNER.fullmatch(p.name)
    if m is None:
        return True  # no owner recorded (an older ftrain's): as before, a crash's leftover
    if m.group(2) != _HOST:
        return time.time() - p.lstat().st_mtime > STALE_AFTER_S
    pid = int(m.group(1))
    if pid == os.getpid():  # a save of this process that could not clean up, unless one writes
        in_flight = STATE.save_in_flight
        return in_flight is None or not in_flight.is_alive()
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by another user
        pass
    return False


def _sha256_parallel(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL, so files hash in parallel. Plain threads, not an executor:
    # concurrent.futures refuses new work once the interpreter starts shutting down, which is
    # when a background save still in flight gets finished.
    out = [""] * len(paths)
    work = [lambda i=i: out.__setitem__(i, sha256_file(paths[i])) for i in range(len(paths))]
    threads = [threading.Thread(target=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(out):
        raise CheckpointError(f"hashing {paths} failed")
    return out


# --- which checkpoints exist, and rotation -----------------------------------------------------


def committed(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint under `root`, in commit order (oldest first).

    Commit order is the time the commit marker was written (ties: by step), so that after a
    rollback (resuming an earlier checkpoint, a new run in an old folder) the checkpoints of the
    branch being trained count as the newest.
    """
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = L.STEP_DIR.fullmatch(p.name)
        with contextlib.suppress(OSError):  # not committed (or rotated away meanwhile)
            if m:
                found.append(((p / L.COMMIT_FILE).stat().st_mtime_ns, int(m.group(1)), p))
    return [(step, p) for _, step, p in sorted(found)]


def step_dirs(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every `step-<N>` folder in the run folder `root`, by step, committed or
    not (a save cut short, a damaged checkpoint).

    `latest_checkpoint` and rotation see only committed checkpoints; this is for tools that
    report on every one (`python -m ftrain inspect`). Empty when `root` is not a folder or is
    itself a checkpoint (it holds a `state.json` or a commit marker).

    Raises:
        OSError: if `root` cannot be listed.

    Example:
        >>> import tempfile, torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> root = tempfile.mkdtemp()
        >>> [step for step, _ in ft.checkpoint.step_dirs(root)]
        []
        >>> [step for step, _ in ft.checkpoint.step_dirs(ft.save_checkpoint(state, root).parent)]
        [0]
    """
    root = Path(root)
    if not root.is_dir() or (root / L.STATE_FILE).exists() or (root / L.COMMIT_FILE).exists():
        return []
    found = ((L.STEP_DIR.fullmatch(p.name), p) for p in root.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m is not None)


def _check_root(root: Any) -> None:
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path (str or os.PathLike), got {type(root).__name__}")


def _check_run_folder(root: Path, fix: str) -> None:
    """Refuse a `root` that is itself a checkpoint (`runs/x/step-500` for `runs/x`): a resume
    would find nothing there and start afresh, and saves would nest inside the checkpoint, to
    be deleted with it by the run folder's rotation."""
    try:
        checkpoint = (root / L.STATE_FILE).exists() or (root / L.COMMIT_FILE).exists()
    except OSError:  # unreadable: the save or the listing reports it
        return
    if checkpoint:
        raise ValueError(
            f"root={str(root)!r} is a checkpoint, not a run folder of step-<N> checkpoints: "
            f"pass its parent ({str(root.parent)!r}), {fix}"
        )


def _check_save_args(state: Any, root: Any, metrics: Any, best_metric: Any, **flags: Any) -> None:
    """The arguments of `save_checkpoint`, checked before anything is staged or waited for."""
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    _check_root(root)
    if metrics is not None:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping name -> number, got {metrics!r}")
        for k, v in metrics.items():
            ok = isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool)
            if not (isinstance(k, str) and (ok or (isinstance(v, str) and k.endswith("_fn")))):
                raise TypeError(
                    f"metrics must map names to numbers (a 0-dim tensor is fine; a str only "
                    f"under a '..._fn' name, as evaluate's eval_loss_fn), got {k!r}: {v!r}"
                )
            if isinstance(v, int) and not -(2**1023) < v < 2**1023:
                raise ValueError(
                    f"metrics[{k!r}] is an int beyond float's range; a checkpoint could not "
                    "rank it (pass float(value) or a smaller number)"
                )
    if best_metric is not None and not isinstance(best_metric, str):
        raise TypeError(f"best_metric must be a metrics key (str) or None, got {best_metric!r}")
    _check_run_folder(Path(root), "the folder that holds the run's checkpoints")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")


def latest_checkpoint(
    root: str | os.PathLike[str], *, strategy: Strategy | None = None
) -> Path | None:
    """Return the most recently committed checkpoint under `root`, or None.

    In a run that never went back this is the one with the highest step. After a rollback
    (resuming from an earlier checkpoint and saving again) it is the newest checkpoint of the
    branch being trained, not the higher step of the abandoned one. Directories without the
    commit marker (a save cut short) are ignored. A background save of this process into
    `root` still in flight is waited for: it is the newest (and its error is raised).

    Without `strategy` it reads the folder of the process that calls it and talks to no other
    rank. With one, every rank (every process, under tensor parallelism) must call it: one small
    all-reduce checks that all of them found a checkpoint of the same step, or none. A rank
    whose folder holds none (node-local run folders, a copy lagging behind) would otherwise
    skip `load_checkpoint` and start afresh while the others resume, and its next collective
    would meet theirs (gloo aborts, NCCL may hang).

    Args:
        root: the run folder that `save_checkpoint` writes into.
        strategy: the run's strategy, to agree across ranks (a barrier and a host sync,
            once): with DDP, every rank then sees rank 0's background save into `root`.

    Raises:
        ValueError: if `root` is itself a checkpoint (it holds a `state.json` or a commit
            marker): the run would otherwise start afresh. Pass its parent, or load it.
        CheckpointError: the failure of a background save (see `save_checkpoint`); with
            `strategy`, on every rank, when the ranks found checkpoints of different steps or
            some found none.

    Example:
        >>> import ftrain as ft
        >>> ft.latest_checkpoint("/nonexistent/run") is None
        True
    """
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an ft.strategies.Strategy or None, got {strategy!r}")
    found: list[tuple[int, Path]] = []
    error: Exception | None = None
    try:
        raise_pending_save_error()
        _check_root(root)
        _check_run_folder(Path(root), "or load it directly with load_checkpoint(path, state)")
        if _in_flight_into(Path(root)):  # else: the checkpoint before this process's save
            wait_for_checkpoint()
    except Exception as e:
        error = e
    if strategy is not None:  # with DDP only rank 0 writes: every rank lists once it committed
        strategy.barrier()
    try:
        if error is None:
            found = committed(Path(root))
    except Exception as e:
        error = e
    if error is not None:
        if strategy is not None:  # the other ranks wait in the all-reduce: meet them there
            _agree_on_latest(None, strategy, root, failed=True)
        raise error
    latest = found[-1] if found else None
    if strategy is not None:
        _agree_on_latest(latest, strategy, root)
    return latest[1] if latest else None


def _agree_on_latest(
    latest: tuple[int, Path] | None, strategy: Strategy, root: Any, *, failed: bool = False
) -> None:
    """Raise `CheckpointError` on every rank unless all found a checkpoint of one step, or
    none. The step's 24-bit pieces and their squares are summed: equal on every rank iff
    n * sum(x^2) == sum(x)^2."""
    step = latest[0] if latest else 0
    pieces = [(step >> 24) & 0xFFFFFF, step & 0xFFFFFF]
    flat = [1, int(failed), int(latest is not None), *pieces, *(x * x for x in pieces)]
    local = torch.tensor(flat, dtype=torch.int64, device=strategy.device)
    ranks, failures, found, *rest = strategy.sum_over_processes(local).tolist()
    if failed:
        return  # this rank raises its own error
    where = f"{latest[1].name}" if latest else "none"
    if failures:
        raise CheckpointError(
            f"{failures} of {ranks} ranks failed to look for a checkpoint under {root}; see "
            "their errors"
        )
    if found not in (0, ranks):
        raise CheckpointError(
            f"{found} of {ranks} ranks found a checkpoint under {root} (this rank: {where}): a "
            "rank without one would start afresh while the others resume; give every rank the "
            "same run folder (shared storage)"
        )
    sums, squares = rest[:2], rest[2:]
    if any(ranks * q != t * t for t, q in zip(sums, squares, strict=True)):
        raise CheckpointError(
            f"the {ranks} ranks found checkpoints of different steps under {root} (this rank: "
            f"{where}): each would resume from its own; give every rank the same run folder "
            "(shared storage)"
        )


def latest_cadence_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """Return the most recently committed checkpoint under `root` that is not preemption-only.

    A preemption save at a step the save cadence skips (`should_save` said yes only because of
    `ft.strategies.on_preemption`) is an extra checkpoint that the run never stopped does not
    have. A resume loads it (`latest_checkpoint`), but a rollback to "the newest checkpoint"
    (the spike guard's) must pass over it to the one the cadence wrote, or the resumed run
    would roll back elsewhere than the run never stopped. Checkpoints without the mark (older
    ones too) count as the cadence's. Waits for and reports a background save as
    `latest_checkpoint` does.

    Raises:
        ValueError: if `root` is itself a checkpoint (see `latest_checkpoint`).
        CheckpointError: the failure of a background save (see `save_checkpoint`).

    Example:
        >>> import tempfile, torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> root = tempfile.mkdtemp()
        >>> ft.checkpoint.latest_cadence_checkpoint(ft.save_checkpoint(state, root).parent).name
        'step-0'
    """
    if latest_checkpoint(root) is None:  # checks `root`, waits for a save in flight into it
        return None
    found = committed(Path(root))
    return next((p for _, p in reversed(found) if not _preemption_only(_saved_meta(p))), None)


def _preemption_only(meta: Mapping[str, Any]) -> bool:
    return meta.get(L.PREEMPTION_ONLY) is True


def retained(
    checkpoints: list[tuple[int, Mapping[str, Any]]],
    *,
    keep_last: int,
    keep_best: int | None,
    best_metric: str | None,
    mode: str,
    preemption_only: Collection[int] = (),
) -> set[int]:
    """Steps to keep out of `(step, metrics)` pairs in commit order (oldest first): the
    `keep_last` newest, the `keep_best` best by `metrics[best_metric]` (checkpoints without a
    finite value are not ranked), and always the newest and the best. When the newest are
    `preemption_only` saves (steps the cadence skipped), the newest other one is kept too:
    it is what the spike guard rolls back to (`latest_cadence_checkpoint`)."""
    steps = [s for s, _ in checkpoints]
    keep = set(steps[-keep_last:]) if keep_last else set()
    keep.update(steps[-1:])
    keep.update([s for s in steps if s not in preemption_only][-1:])
    if best_metric is not None:
        scored = [
            (float(m[best_metric]), s) for s, m in checkpoints if _rankable(m.get(best_metric))
        ]
        # Ties go to the older checkpoint, as the first to reach a value is the best (HF).
        scored.sort(key=lambda vs: (vs[0] if mode == "min" else -vs[0], vs[1]))
        keep.update(s for _, s in scored[: max(keep_best or 1, 1)])
    return keep


def _rankable(value: Any) -> bool:
    """A finite number: what ranks. An int beyond float's range (a forged state.json) does not
    (`math.isfinite` raised OverflowError, and every later save's rotation failed)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _rotate(job: _Job, keep_last: int) -> None:
    # The checkpoint just written is the newest, whatever the clock says.
    found = [(s, p) for s, p in committed(job.root) if p != job.path] + [(job.step, job.path)]
    metas = [_saved_meta(p) for _, p in found]
    listed = [(s, _metrics(m)) for (s, _), m in zip(found, metas, strict=True)]
    ranking = (job.best_metric, job.keep_best, job.mode)
    if job.best_metric is None:  # keep the best as the newest ranked save ranked it
        ranking = next(filter(None, map(_ranking, reversed(metas))), ranking)
    best_metric, keep_best, mode = ranking
    marked = {s for (s, _), m in zip(found, metas, strict=True) if _preemption_only(m)}
    keep = retained(
        listed, keep_last=keep_last, keep_best=keep_best, best_metric=best_metric, mode=mode,
        preemption_only=marked,
    )  # fmt: skip
    for s, p in found:
        if s not in keep:
            # Rename to a temporary name first: a crash mid-delete leaves a directory that
            # latest_checkpoint ignores and the next save removes, never a half checkpoint.
            doomed = job.root / _tmp_name(f"deleting-{p.name}")
            try:
                os.rename(p, doomed)
            except FileNotFoundError:  # another writer's rotation in a shared root took it
                continue
            shutil.rmtree(doomed, ignore_errors=True)


def _saved_meta(path: Path) -> Mapping[str, Any]:
    """A committed checkpoint's state.json, or {} if unreadable (rotation never fails on it).

    Read as `load_checkpoint` reads it (a regular file inside the folder, at most 64 MiB): a
    FIFO or a link to /dev/zero in a stray `step-<N>` folder hung every later save."""
    try:
        meta = read_json(path / L.STATE_FILE)
        return meta if isinstance(meta, dict) else {}
    except CheckpointError:  # a damaged or forged file: unranked
        return {}


def _saved_metrics(path: Path) -> Mapping[str, Any]:
    """The metrics a committed checkpoint recorded ({} when unreadable: it ranks nothing)."""
    return _metrics(_saved_meta(path))


def _check_one_loss(job: _Job, metrics: Mapping[str, Any] | None) -> None:
    # `evaluate` names the loss behind eval_loss in eval_loss_fn: a run that changed its loss
    # (a focal loss after cross-entropy) must not rank one against the other.
    key = f"{job.best_metric}_fn"
    if job.best_metric is None or key not in (metrics or {}):
        return
    ours = (metrics or {})[key]
    for step, path in committed(job.root):
        theirs = _saved_metrics(path)
        if step != job.step and key in theirs and theirs[key] != ours:
            raise ValueError(
                f"best_metric={job.best_metric!r} would rank step {job.step}'s {ours!r} against "
                f"step {step}'s {theirs[key]!r} in {str(job.root)!r}: evaluate with the loss "
                "you train on (evaluate(state, batches, loss_fn)) and save to a new root"
            )


def _metrics(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    metrics = meta.get("metrics", {})
    return metrics if isinstance(metrics, dict) else {}


def _ranking(meta: Mapping[str, Any]) -> tuple[str, int, str] | None:
    """(best_metric, keep_best, mode) that a ranked save recorded, or None (none, or malformed)."""
    r = meta.get(L.RANKING)
    if not isinstance(r, dict):
        return None
    name, keep_best, mode = r.get("best_metric"), r.get("keep_best"), r.get("mode")
    if (
        isinstance(name, str)
        and type(keep_best) is int
        and keep_best >= 1
        and mode in ("min", "max")
    ):
        return name, keep_best, mode
    return None


# --- background saves: at most one in flight (held in ftrain.process_state) ------------------


class _Background:
    """A save written by a thread. Whether it finished is an Event the writer sets itself, last:
    on Python 3.11 a `Thread.join` that a signal handler's exception (Ctrl-C) interrupts marks
    the still-running thread stopped, so `Thread.is_alive` cannot be trusted after one."""

    def __init__(self, step: int, write: Callable[[], Path], root: Path | None = None) -> None:
        self.step, self.write, self.root = step, write, root
        self.path: Path | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        # Not a daemon: the interpreter lets it finish before exiting.
        self._thread = threading.Thread(target=self._run, name="ftrain-checkpoint", daemon=False)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self.path = self.write()
        except BaseException as e:  # re-raised in the caller's thread
            self.error = e
        finally:
            self._done.set()

    def is_alive(self) -> bool:
        """Whether the write has not finished yet."""
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the write to finish (an interrupted wait leaves it running and tracked)."""
        if self._done.wait(timeout):
            self._thread.join()  # returns at once: the writer is past its last line


def _start(job: _Job, write: Callable[[], Path]) -> None:
    with STATE.save_lock:
        bg = STATE.save_in_flight = _Background(job.step, write, job.root)
        try:
            bg.start()
        except BaseException as e:
            # A thread that never ran never sets its Event: left recorded, every later
            # checkpoint call and the exit would wait for it forever.
            STATE.save_in_flight = None
            raise _failure(f"starting the background save of step {job.step} failed", e) from e


def raise_pending_save_error() -> None:
    """Raise the error of a finished background save, if it failed (cheap when none did).

    The checkpoint calls run it (`save_checkpoint`, `wait_for_checkpoint`, `latest_checkpoint`,
    `load_checkpoint`), so that a failed background save surfaces at the next of them; it
    never waits for a save still being written.

    Raises:
        CheckpointError: the background save's failure (the original error is its cause).
    """
    bg = STATE.save_in_flight
    if bg is not None and not bg.is_alive() and bg.error is not None:
        wait_for_checkpoint()


@atexit.register
def _finish_at_exit() -> None:
    try:
        wait_for_checkpoint()
    except CheckpointError as e:
        # The run's last checkpoint is lost: say so, and fail the process (a script that
        # ended normally would otherwise exit 0). os._exit skips the exit handlers that were
        # registered before ftrain's; flush what they would have.
        print(f"ftrain: {e}", file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
