"""Ray Train: run the README loop inside `TorchTrainer`, report checkpoints, resume, preempt.

Ray Train starts one worker per rank and initialises torch.distributed in each before it calls
`train_loop_per_worker`, so `ft.strategies.from_env("ddp" | "fsdp")` (or `DDP()`, `FSDP()`)
joins Ray's group as it joins torchrun's; only the checkpoint calls change:

    def train_loop_per_worker(config):
        with ft.strategies.from_env("ddp") as strategy:           # Ray's process group
            state = ft.extras.ray.restore(build(strategy))        # ray.train.get_checkpoint()
            ...  # the README loop
                if ft.should_save(state, every=100, total_steps=total):
                    ft.extras.ray.save_and_report(state, "/local/scratch/run", metrics=...)

Retention has one owner, Ray: `checkpoint_config(keep_last=..., keep_best=...)` says it in
ftrain's words and builds the `ray.train.CheckpointConfig`; ftrain rotates nothing it reports.
See docs/strategies.md ("Ray Train") for the storage layout and the choices Ray forces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

import ftrain as ft
from ftrain.predicates import best_mode
from ftrain.process_state import STATE
from ftrain.state import TrainState

__all__ = [
    "RayPreemption",
    "checkpoint_config",
    "on_preemption",
    "require_ray",
    "restore",
    "run_in_main_thread",
    "save_and_report",
    "wait_for_reports",
]

# What ftrain uses of Ray Train; releases without it (or with Train V2 switched off by
# RAY_TRAIN_V2_ENABLED=0) cannot work, and `require_ray` says so before anything starts.
_NEEDED = ("CheckpointUploadMode", "CheckpointConsistencyMode", "get_all_reported_checkpoints")
TESTED_RAY = "2.60.0"
STAGING_PREFIX = "report-"


def require_ray() -> Any:
    """Import `ray.train` and check that it is a Ray Train that ftrain can work with.

    Returns:
        The `ray.train` module.

    Raises:
        ImportError: when Ray is not installed (`pip install "ftrain[ray]"`), or is a release
            without Ray Train V2's checkpoint upload modes (before 2.50, or V2 switched off by
            RAY_TRAIN_V2_ENABLED=0); the message names the version found.
    """
    try:
        import ray
        import ray.train
    except ImportError as e:
        raise ImportError(
            f'ftrain.extras.ray needs Ray Train: pip install "ftrain[ray]" (tested with ray '
            f"{TESTED_RAY}); importing it failed: {e}"
        ) from e
    missing = [name for name in _NEEDED if not hasattr(ray.train, name)]
    if missing:
        v2 = os.environ.get("RAY_TRAIN_V2_ENABLED", "unset")
        raise ImportError(
            f"ftrain.extras.ray needs Ray Train V2 (ray >= 2.50 with RAY_TRAIN_V2_ENABLED unset "
            f"or 1; tested with {TESTED_RAY}): ray {ray.__version__} with "
            f"RAY_TRAIN_V2_ENABLED={v2} lacks ray.train.{', ray.train.'.join(missing)}. "
            f'Upgrade with pip install "ftrain[ray]" and leave Train V2 on'
        )
    return ray.train


def checkpoint_config(
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    best_metric: str | None = None,
    mode: Literal["min", "max"] | None = None,
) -> Any:
    """Ray's `CheckpointConfig` for ftrain's retention terms: Ray owns retention.

    `save_and_report` never rotates, so what `save_checkpoint(keep_last=..., keep_best=...)`
    would keep is kept by Ray in its storage. Ray always keeps the newest checkpoint and keeps
    `num_to_keep` by one rule, so:

    - `keep_last=N` alone: the N newest (`num_to_keep=N`; 0 keeps the newest, as in ftrain);
    - `best_metric` with `keep_best=K` (default 1) and `keep_last` of 0 or 1: the newest
      and the K best by `metrics[best_metric]` (`checkpoint_score_attribute`); with
      `keep_last=None` nothing is deleted, as in ftrain (and an explicit `keep_best` raises);
    - nothing: every checkpoint stays.

    Args:
        keep_last: the number of newest checkpoints to keep, or None for all.
        keep_best: how many best checkpoints to keep (needs `best_metric`).
        best_metric: the metric that ranks checkpoints; pass it in `save_and_report`'s
            `metrics` at every save (it raises without it; NaN leaves a save unranked).
        mode: "min" if a lower `best_metric` is better, "max" otherwise. None (default):
            "min", except for a `best_metric` named like a score that is better higher
            (accuracy, F1, ...), which raises (as `save_checkpoint`).

    Returns:
        A `ray.train.CheckpointConfig` for `RunConfig(checkpoint_config=...)`.

    Raises:
        ValueError: for a value ftrain's `save_checkpoint` refuses too, or for `keep_last >= 2`
            together with `best_metric` (the N newest *and* the K best), which Ray cannot keep.

    Example:
        >>> from ftrain.extras.ray import checkpoint_config
        >>> c = checkpoint_config(keep_best=2, best_metric="eval_loss", keep_last=1)
        >>> c.num_to_keep, c.checkpoint_score_attribute, c.checkpoint_score_order
        (2, 'eval_loss', 'min')
    """
    ft.checkpoint.check_retention(
        keep_last, keep_best, best_metric, "min" if mode is None else mode
    )
    if mode is None:  # Ray would keep the worst accuracy as the best
        mode = best_mode(best_metric, "checkpoint_config", "best_metric")  # type: ignore[assignment]
    if best_metric is not None and keep_last is not None and keep_last >= 2:
        raise ValueError(
            f"keep_last={keep_last} with best_metric={best_metric!r}: Ray's CheckpointConfig "
            "keeps num_to_keep checkpoints by one rule (the newest, or the best by one score) "
            "besides the newest, so it cannot keep both the N newest and the K best; pass "
            "keep_last=1 (the newest and the best) or drop best_metric"
        )
    train = require_ray()
    if best_metric is None:
        return train.CheckpointConfig(num_to_keep=None if keep_last is None else max(keep_last, 1))
    return train.CheckpointConfig(
        num_to_keep=None if keep_last is None else (keep_best or 1),
        checkpoint_score_attribute=best_metric,
        checkpoint_score_order=mode,
    )


def save_and_report(
    state: TrainState,
    root: str | os.PathLike[str],
    *,
    metrics: Mapping[str, Any] | None = None,
    upload: Literal["async", "sync"] = "async",
) -> Path:
    """Save a committed checkpoint of `state` and report it to Ray Train (every rank calls it).

    The checkpoint is written blocking into `root/<run>/report-<step>/step-<step>`, `<run>`
    being Ray's id of the run (one `fit`), so that runs (trials) sharing `root` never stage
    into one folder, and each save has a folder of its own, so that Ray deleting an uploaded
    copy never races with ftrain listing the run's stages; then
    `ray.train.report` hands it to Ray under the name `step-<step>`: with `upload="async"`
    Ray copies it to its storage in a background thread while training goes on, and deletes
    the local copy once uploaded; `"sync"` returns after the copy. Ray registers a checkpoint
    (`ray.train.get_checkpoint` returns it to a restarted group) only after the upload ended,
    so a restart never sees a half-copied one, and Ray's storage is an ftrain run folder:
    `ft.latest_checkpoint(storage_path / name)` finds the newest step there too.

    Only rank 0 reports the checkpoint; a sharded (FSDP) checkpoint is one folder that every
    rank wrote its shards into, so `root` must be a folder every worker sees (one node, or a
    shared filesystem). Into a node-local folder the save's commit raises CheckpointError on
    every rank (the shards rank 0 sees do not cover the model); this also raises on every rank
    when a rank cannot see the committed checkpoint.
    Retention is Ray's (`checkpoint_config`); this never rotates.

    Ray keeps checkpoints by folder name, so each step is reported once: a save at the step
    of the newest checkpoint this run holds in Ray (this process's last save, or the checkpoint
    the group restored from: a final save after a loop that just saved, or a group restarted
    after its last save) saves and reports nothing, on every rank, and warns that its metrics
    are not reported.

    Args:
        state: the state to save (not consumed).
        root: a local staging folder for the checkpoints before Ray uploads them (each run
            stages into a folder of its own in it).
        metrics: numbers recorded in the checkpoint and reported to Ray (rank 0's are kept
            with the checkpoint; `CheckpointConfig.checkpoint_score_attribute` ranks by them);
            0-dim tensors are read as numbers here (a host sync, at the save). Ray hears
            `step=state.step` besides them: a "step" of another value raises. When the run
            ranks checkpoints (`checkpoint_config(best_metric=...)`), they must hold that
            metric (NaN: unranked, as a preemption save without an evaluation).
        upload: "async" or "sync" (Ray's `CheckpointUploadMode`).

    Returns:
        The local checkpoint folder (gone once an async upload finished); for a step Ray
        already holds, the folder of that checkpoint: this process's earlier save's local one
        (gone once uploaded), or the one the group restored from (in Ray's storage).

    Raises:
        ValueError: for another `upload`, a `metrics["step"]` other than `state.step`,
            metrics without the metric the run's `CheckpointConfig` ranks by, or a step below
            one this run already reported (this process's last save, or the checkpoint the
            group restored from; a rollback): Ray keeps checkpoints by folder name, so a second
            `step-N` shares the first's folder, and Ray's retention deleting one deletes both.
        CheckpointError: on every rank, for a sharded (FSDP) save into a folder the ranks do
            not share (a node-local `root`): the commit finds the shards of other ranks missing.
        RuntimeError: outside a Ray Train worker, when a rank cannot see the committed
            checkpoint (a sharded save that committed), when some ranks already hold the step
            and others do not (they called it at different steps), or for a state whose
            strategy does not span Ray's group (another process rank than the worker's:
            `SingleDevice()` in each worker).
    """
    if upload not in ("async", "sync"):
        raise ValueError(f"upload must be 'async' or 'sync', got {upload!r}")
    train = require_ray()
    context = _in_worker(train, "save_and_report")
    _refuse_other_group(context, state.strategy)
    numbers = {
        k: v.item() if isinstance(v, torch.Tensor) else v for k, v in (metrics or {}).items()
    }
    this_run = _this_run(train, context)
    held = _held_checkpoint(this_run)
    record = STATE.ray_reported if _record_of(this_run) else None
    # The run's token: drawn by rank 0 at the run's first save, carried to every rank.
    token = _refuse_metrics(numbers, state, held, record[1] if record else _new_token())
    if token is None:  # every rank: Ray already holds this step (held is not None)
        assert held is not None
        warnings.warn(
            f"save_and_report at step {state.step}: Ray already holds step-{state.step} of this "
            f"run ({held[1]}, this process's last save or the checkpoint the group restored "
            "from), so nothing is saved or reported and the metrics given are not reported "
            f"({sorted(numbers)}): a second checkpoint of one step would share the first one's "
            "folder in Ray's storage",
            stacklevel=2,
        )
        return held[1]
    STATE.ray_reported = (this_run, token, record[2] if record else None)
    owner = f"{token:012x}"
    run = Path(root) / _run_id(context, owner)  # another run's save of this step stages elsewhere
    stage = run / f"{STAGING_PREFIX}{state.step}"
    path = ft.save_checkpoint(state, stage, metrics=numbers)
    strategy = state.strategy
    if strategy.checkpoint_sharded and _unseen_anywhere(stage, path, strategy):
        raise RuntimeError(
            f"a rank cannot see the committed checkpoint {path}: a sharded checkpoint is written "
            f"by every rank into one folder, so root={str(root)!r} must be shared by every "
            "worker (one node, or a shared filesystem)"
        )
    mode = (
        train.CheckpointUploadMode.ASYNC if upload == "async" else train.CheckpointUploadMode.SYNC
    )
    checkpoint = train.Checkpoint.from_directory(str(path)) if strategy.process_rank == 0 else None
    report = {**numbers, "step": state.step}
    train.report(
        report,
        checkpoint=checkpoint,
        checkpoint_dir_name=path.name,
        checkpoint_upload_mode=mode,
        delete_local_checkpoint_after_upload=True,
    )
    STATE.ray_reported = (this_run, token, str(path))  # every rank: wait_for_reports checks it
    if strategy.process_rank == 0:
        _remove_empty_stages(run, keep=stage)
    return path


def _refuse_metrics(
    metrics: Mapping[str, Any], state: TrainState, held: tuple[int, Path] | None, token: int
) -> int | None:
    """Collective: refuse rank 0's metrics (those the checkpoint keeps and Ray hears) on every
    rank together, so that no rank waits in the save for one that raised; returns rank 0's
    `token` (48 bits: the run's), which the same reduction carries to every rank, or None
    on every rank when Ray already holds this step (`held`, the same on every rank: each
    reported or restored the same checkpoints), so that every rank returns without saving.

    Raises:
        ValueError: on every rank, for a step below `held`'s (`_reported_already`) or rank 0's
            metrics (`_metrics_problem`).
        RuntimeError: on every rank, when some ranks but not all hold this step already.
    """
    strategy = state.strategy
    rank0 = strategy.process_rank == 0
    skip = held is not None and held[0] == state.step
    problem = None if held is None else _reported_already(state.step, held[0])
    if problem is None and rank0 and not skip:
        problem = _metrics_problem(metrics, state.step)
    token = token if rank0 else 0
    # float32 holds integers below 2**24 exactly: the 48-bit token travels as two halves.
    # Each rank votes 1.0 too: their sum is the number of ranks.
    votes = [float(problem is not None), float(skip), 1.0, token >> 24, token & 0xFFFFFF]
    refused, skips, ranks, high, low = strategy.sum_over_processes(
        torch.tensor(votes, dtype=torch.float32, device=strategy.device)
    ).tolist()  # host sync: saving is the place
    if refused > 0:
        raise ValueError(problem or "save_and_report: rank 0 refused its metrics (its error "
                         "says why); no rank saved")  # fmt: skip
    if skips == ranks:
        return None
    if skips > 0:
        raise RuntimeError(
            f"save_and_report at step {state.step}: {int(skips)} of {int(ranks)} ranks already "
            "reported (or restored) this step to Ray and the others did not: the ranks called "
            "save_and_report at different steps; no rank saved"
        )
    return int(high) << 24 | int(low)


def _new_token() -> int:
    """48 random bits naming a run's staging folder where Ray's run id is not found (two runs
    of one name, Ray's default `ray_train_run-<date>` for two runs started in one second, even
    in one process: Ray's local mode runs every fit in the driver)."""
    return int.from_bytes(os.urandom(6), "big")


def _record_of(this_run: Any) -> bool:
    """Whether `STATE.ray_reported` is this run's record (another fit's in Ray's local mode)."""
    return STATE.ray_reported is not None and STATE.ray_reported[0] == this_run


def _held_checkpoint(this_run: Any) -> tuple[int, Path] | None:
    """The step and folder of the newest checkpoint of this run (`_this_run`) that Ray holds
    as this process knows it (the last one this process reported in this run, or the one the
    group restored from), or None."""
    record = STATE.ray_reported
    names = [Path(record[2])] if _record_of(this_run) and record and record[2] else []
    with contextlib.suppress(RuntimeError):  # Ray's error outside a worker (refused before)
        restored = require_ray().get_checkpoint()
        if restored is not None:
            names.append(Path(restored.path))
    steps = [(int(m.group(1)), p) for p in names if (m := _STEP_DIR.fullmatch(p.name))]
    return max(steps, key=lambda s: s[0], default=None)


def _reported_already(step: int, held: int) -> str | None:
    """Why a checkpoint of `step` must not be reported, or None: Ray already holds a later
    one of this run, `held` (the last one this process reported, or the one the group
    restored from); a checkpoint of `held` itself is not saved again (`save_and_report`).

    Ray registers checkpoints by folder name: a second `step-N` goes into the first one's
    folder in Ray's storage, Ray then holds two checkpoints with one path, and its retention,
    deleting the older one, deleted the only copy (a restarted group found no checkpoint). A
    step below the last one (a rollback) would be a name of the abandoned branch."""
    if held <= step:
        return None
    return (
        f"save_and_report at step {step}, but this run already reported step-{held} to "
        f"Ray (the last save of this process, or the checkpoint the group restored from): Ray "
        "registers checkpoints by folder name, so another checkpoint of a step shares the "
        "first one's folder in Ray's storage, and Ray's retention, deleting the older one, "
        "deletes both; report each step once, in increasing order (after a rollback, start "
        "a new run name)"
    )


_STEP_DIR = re.compile(r"step-(\d+)")


def _metrics_problem(metrics: Mapping[str, Any], step: int) -> str | None:
    """What is wrong with the metrics of a save at `step`, or None.

    Ray hears `step=state.step`: another "step" would make the checkpoint and Ray disagree. A
    save without the metric Ray ranks by scores -inf, which in mode "min" ranks it the best
    (Ray keeps it and deletes the real best, only logging an error in its controller); NaN is
    Ray's "no value": ranked last, kept while it is the newest."""
    if metrics.get("step", step) != step:
        return (
            f"metrics['step']={metrics['step']!r} but state.step={step}: save_and_report "
            "reports the checkpoint to Ray with step=state.step, so the checkpoint and Ray "
            "would disagree; drop 'step' from metrics or name your count otherwise"
        )
    config = _run_checkpoint_config()
    metric = None if config is None else config.checkpoint_score_attribute
    if metric is not None and metric not in metrics:
        return (
            f"metrics lack {metric!r}, the metric Ray ranks this run's checkpoints by "
            "(checkpoint_config(best_metric=...)): Ray would rank this checkpoint as the best "
            f"in mode 'min' (the worst in 'max'); pass metrics={{{metric!r}: value}} at every "
            f"save, or {{{metric!r}: float('nan')}} to leave it unranked (Ray ranks NaN last)"
        )
    return None


def _run_checkpoint_config() -> Any:
    """This run's `RunConfig.checkpoint_config`, from Ray Train V2's worker context (no public
    API says it; tests/workers/ray_driver.py checks it is found with the tested Ray), or None
    where this Ray keeps it elsewhere."""
    try:
        from ray.train.v2._internal.execution import context as ray_context

        run_config = ray_context.get_train_context().train_run_context.run_config
    except (ImportError, AttributeError, RuntimeError):
        return None
    return run_config.checkpoint_config


def _this_run(train: Any, context: Any) -> Any:
    """What names this run (one `fit`) in this process, for the record of what it reported:
    Ray Train V2's id of the run; where that is not found, Ray's context of the fit where Ray
    keeps one per fit (its local mode, `num_workers=0`, runs every fit in the driver process:
    the record holds the context, so no later fit's is the same object); or else the run's
    name (a worker process serves one run: a restarted group is new processes)."""
    run_id = _ray_run_id()
    if run_id is not None:
        return run_id
    return context if train.get_context() is context else context.get_experiment_name()


def _ray_run_id() -> str | None:
    """Ray Train V2's id of the run (no public API says it), or None where this Ray keeps it
    elsewhere (or nowhere: its local mode)."""
    try:
        from ray.train.v2._internal.execution import context as ray_context

        return str(ray_context.get_train_context().train_run_context.run_id)
    except (ImportError, AttributeError, RuntimeError):
        return None


def _run_id(context: Any, owner: str) -> str:
    """The folder of this run's stages: Ray Train V2's id of the run (one `fit`: the same on
    every worker and across restarts of its worker group; no public API says it), or where
    this Ray keeps the id elsewhere, the run's name and `owner`, the token the group's rank 0
    drew at the run's first save (the same on every worker, another one after a restart of the
    group or for another fit in the process: a restart reads Ray's storage, never the staging
    root). Two runs (trials) on one node that staged
    into one `root` replaced each other's `report-N/step-N` while Ray still uploaded it: run
    A's reported checkpoint held run B's weights. The name alone was not enough: Ray's default
    name, `ray_train_run-<date>`, is the same for two runs started in one second, and so was
    a token of rank 0's process for two such fits in Ray's local mode (one process)."""
    run_id = _ray_run_id()
    return f"{context.get_experiment_name()}-{owner}" if run_id is None else run_id


def _unseen_anywhere(stage: Path, path: Path, strategy: ft.strategies.Strategy) -> bool:
    """Collective: whether some rank cannot see the committed checkpoint `path`."""
    unseen = torch.tensor(float(ft.latest_checkpoint(stage) != path), device=strategy.device)
    return float(strategy.sum_over_processes(unseen)) > 0  # host sync: saving is the place


def wait_for_reports(timeout_s: float | None = None) -> None:
    """Block until Ray has uploaded and registered every checkpoint reported so far.

    Call it on every rank before leaving on a preemption: a group restarted afterwards then
    resumes from the preemption's checkpoint, not an older one still in flight.

    Args:
        timeout_s: how long to wait at most (None: as long as it takes), a number > 0.

    Raises:
        RuntimeError: outside a Ray Train worker.
        TimeoutError: when Ray has not registered the last checkpoint `save_and_report`
            reported from this process within `timeout_s` (Ray's own wait returns quietly
            then, with the checkpoints registered so far).
        ValueError: for a `timeout_s` that is not a number > 0 or None.
    """
    if timeout_s is not None:
        _check_timeout(timeout_s, "a number > 0 or None")
    train = require_ray()
    context = _in_worker(train, "wait_for_reports")
    registered = train.get_all_reported_checkpoints(
        consistency_mode=train.CheckpointConsistencyMode.COMMITTED, timeout_s=timeout_s
    )
    record = STATE.ray_reported  # an earlier run's (Ray's local mode) is not this run's
    last = None
    if record is not None and record[2] and _record_of(_this_run(train, context)):
        last = Path(record[2]).name
    # Ray keeps the latest checkpoint whatever its retention: absent means not registered yet.
    if last is not None and last not in {Path(r.checkpoint.path).name for r in registered}:
        raise TimeoutError(
            f"wait_for_reports: Ray has not registered checkpoint {last!r} (the last one "
            f"save_and_report reported) within timeout_s={timeout_s}: its upload is still in "
            "flight; a group restarted now would resume from an older checkpoint"
        )


def _check_timeout(timeout_s: Any, allowed: str = "a number > 0") -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be {allowed}, got {timeout_s!r}")  # NaN fails too


def restore(
    state: TrainState, *, strict: bool = True, allow_other_base: bool = False
) -> TrainState:
    """`state` loaded from Ray's newest registered checkpoint, or `state` itself if none.

    `ray.train.get_checkpoint()` is what a restarted worker group resumes from (after a lost
    worker, or a new `fit` on the same `RunConfig(storage_path, name)`, which may have another
    number of workers: ftrain's checkpoints load on any). The folder is read where it lies on
    a local or mounted storage path; from remote storage Ray downloads it first. Sharded (FSDP)
    checkpoints load like whole ones; `load_checkpoint` verifies the commit marker and checksums.

    Args:
        state: a freshly built state (same model and optimizer) to load into.
        strict: as `ft.load_checkpoint`'s.
        allow_other_base: as `ft.load_checkpoint`'s (a base model other than the one the
            checkpoint was trained on, on purpose).

    Raises:
        RuntimeError: outside a Ray Train worker.
        CheckpointError: if Ray's checkpoint is not a committed ftrain checkpoint.
    """
    train = require_ray()
    _in_worker(train, "restore")
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        return state
    with checkpoint.as_directory() as directory:
        return ft.load_checkpoint(
            directory, state, strict=strict, allow_other_base=allow_other_base
        )


def _in_worker(train: Any, name: str) -> Any:
    """Ray Train's context of this worker (raises outside one)."""
    try:
        context = train.get_context()
        context.get_world_rank()
    except Exception as e:  # Ray raises its own error outside a worker
        raise RuntimeError(
            f"ftrain.extras.ray.{name} runs inside TorchTrainer's train_loop_per_worker (a Ray "
            f"Train worker); here there is none ({type(e).__name__}: {e})"
        ) from e
    return context


def _refuse_other_group(context: Any, strategy: ft.strategies.Strategy) -> None:
    """Refuse a state whose strategy is not Ray's group (a `SingleDevice()` in each worker):
    every worker would be process rank 0, train alone and report a checkpoint of its own, and
    Ray would merge their files into one folder."""
    rank = context.get_world_rank()
    if strategy.process_rank != rank:
        raise RuntimeError(
            f"the state's strategy ({strategy!r}) is process rank {strategy.process_rank}, but "
            f"this is Ray Train worker {rank} of {context.get_world_size()}: the strategy does "
            "not span Ray's process group, so each worker trains alone and would report its own "
            "checkpoint; build the state with ft.strategies.from_env('ddp') (or 'fsdp', ...)"
        )


def _remove_empty_stages(root: Path, *, keep: Path) -> None:
    """Remove the staging folders that Ray emptied (their checkpoint is uploaded)."""
    for p in root.glob(f"{STAGING_PREFIX}*"):
        if p != keep:
            with contextlib.suppress(OSError):  # not empty: its upload is still running
                p.rmdir()


# --- preemption ---------------------------------------------------------------------------------


def run_in_main_thread(fn: Callable[[], Any], *, timeout_s: float = 60.0) -> Any:
    """Run `fn` in the process's main thread and return its result (or raise its error).

    Signal handlers belong to the main thread, and Ray Train runs `train_loop_per_worker` in a
    thread of its own. CPython's `Py_AddPendingCall` queues `fn` for the main thread, which runs
    it the next time it runs Python code (a Ray worker's main thread answers the controller's
    health check every `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, 2 s by default). In the main
    thread `fn` just runs.

    Raises:
        TimeoutError: if the main thread did not run Python code within `timeout_s`; the call
            then never runs (it stays queued, and does nothing when it comes due), so a failed
            `on_preemption` installs no handler later behind the caller's back.
        ValueError: for a `timeout_s` that is not a number > 0 (in the main thread too).
    """
    _check_timeout(timeout_s)
    if threading.current_thread() is threading.main_thread():
        return fn()
    done, lock = threading.Event(), threading.Lock()
    outcome: dict[str, Any] = {}
    phase = ["queued"]  # -> "started" (the main thread took it) or "cancelled" (timed out)

    def call(_: Any) -> int:
        with lock:
            if phase[0] == "cancelled":  # the caller was told it failed: do nothing late
                return 0
            phase[0] = "started"
        try:
            outcome["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e
        done.set()
        return 0

    callback = _PENDING_CALL(call)  # referenced until it ran (below)
    if ctypes.pythonapi.Py_AddPendingCall(callback, None) != 0:
        raise RuntimeError("CPython's queue of pending calls is full; try again")
    if not done.wait(timeout_s):
        with lock:
            late = phase[0] == "started"  # the main thread took it just now: wait for it
            phase[0] = "started" if late else "cancelled"
        if late:
            done.wait()
        else:
            # Still queued: it runs whenever the main thread runs Python code again, and then
            # does nothing (cancelled); its callback must outlive this frame, so it is kept
            # (one small object, on error).
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(callback))
            raise TimeoutError(
                f"the main thread ran no Python code for {timeout_s} s, so it could not run "
                f"{getattr(fn, '__name__', fn)!r} (signal handlers are installed there)"
            )
    del callback
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


_PENDING_CALL = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class RayPreemption(contextlib.AbstractContextManager["RayPreemption"]):
    """`ft.strategies.on_preemption()`'s flag, installed from Ray's training thread.

    `requested` is the core `Preemption`'s: true on every rank at the same step once some rank
    was signalled (the vote rides on `accumulate_grads`' all-reduce). `close()` (or leaving the
    `with` block) restores the previous handlers, Ray's own SIGTERM handler included.
    """

    def __init__(self, inner: ft.strategies.Preemption) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"RayPreemption({self.inner!r})"

    @property
    def requested(self) -> bool:
        return self.inner.requested

    @property
    def received(self) -> bool:
        return self.inner.received

    def close(self) -> None:
        run_in_main_thread(self.inner.close)

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def on_preemption(
    signals: Iterable[signal.Signals] = (signal.SIGTERM,), *, timeout_s: float = 60.0
) -> RayPreemption:
    """`ft.strategies.on_preemption(signals)` for a Ray Train worker: SIGTERM becomes the flag.

    A Ray worker's SIGTERM handler exits the process at once; while this is active the signal
    instead sets ftrain's preemption flag, which every rank learns at the same step, so that all
    save that step (`should_save` is True) and leave the loop. Leave then by raising (Ray
    restarts the group under `FailureConfig(max_failures=...)`, from the checkpoint just
    reported: call `wait_for_reports()` first) or by returning (Ray counts the run finished).

    Ray's own notice of a node being drained (`ray.train.get_preemption_info()`, polled every
    few seconds) is separate: read it at the same step on every rank (it is a barrier) and save.

    Args:
        signals: the signals that mean "this worker is about to be killed".
        timeout_s: how long to wait for the main thread to install the handlers.

    Raises:
        ValueError, TypeError: as `ft.strategies.on_preemption`; a ValueError too for a
            `timeout_s` that is not a number > 0.
        TimeoutError: see `run_in_main_thread`.
    """
    inner = run_in_main_thread(lambda: ft.strategies.on_preemption(signals), timeout_s=timeout_s)
    return RayPreemption(inner)
