"""Experiment trackers as sinks: MLflow and Weights & Biases (HF's `report_to`).

Both log the hyperparameters once, when the run is created, and every numeric field of each
record at its `step` (a nested dict's fields under `outer/inner`). The tracker's run id is kept
in a small file in the run folder, so a restarted job (e.g. one resumed from
`ft.latest_checkpoint`) continues the same tracker run instead of opening a new one. Both do
nothing on processes other than rank 0 (the launcher's rank unless `rank=` says otherwise), so
every rank can build them, also before the process group is set up (in a process that may be
one of several, the rank is then taken when the sink is first used).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ftrain.extras.logging._rank import _known_rank, _process_rank
from ftrain.extras.logging._sinks import _scalars, _step, _tag
from ftrain.state import TrainState

__all__ = ["MLflowSink", "WandbSink"]


def _quiet() -> None:
    pass


class _Deferred:
    """Opens a tracker's run when it is first used, where this process's rank was not known
    when the sink was built (no process group yet, no `RANK`): built before
    `init_process_group` in a job launched without `RANK` (`mp.spawn`, a launcher of one's
    own), every rank took itself for rank 0 and logged, or opened a run of its own."""

    def __init__(
        self, known: int | None, open_run: Callable[[], None], quiet: Callable[[], None] = _quiet
    ) -> None:
        self._open: Callable[[], None] | None = None
        self._quiet = quiet
        if known is None:
            self._open = open_run
        else:
            open_run()

    def resolve(self) -> None:
        """Open the run now if this process turns out to be rank 0, else go quiet (once)."""
        if self._open is None:
            return
        if _process_rank(None) != 0:
            self._open = None
            self._quiet()
            return
        self._open()  # if it raises, the next use tries again (records are never dropped)
        self._open = None


def _read_id(path: Path) -> str | None:
    return path.read_text(encoding="utf-8").strip() if path.is_file() else None


def _write_id(path: Path, run_id: str) -> None:
    _write_text(path, run_id + "\n")


def _write_text(path: Path, text: str) -> None:
    # Written atomically: a crash leaves the old file or the new one, never half of one.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class MLflowSink:
    """Logs records to an MLflow run: every numeric field as a metric at the record's `step`.

    The run id is stored in `<run_dir>/mlflow_run_id`; when that file exists (a restarted job),
    the sink reopens that run, so the metric history continues in one run. Steps logged after
    the last checkpoint and before the restart are logged again by the resumed job (with the same
    values, since resume is exact, except the first record after the resume when the
    checkpoint's step is not a log step: its window averages only the resumed steps; see
    docs/logging.md): MLflow keeps both entries, as it does for the steps a guard rollback makes
    again (with other values). Needs the `mlflow` extra
    (`pip install 'ftrain[mlflow]'`).

    Without that file, `MLFLOW_RUN_ID` (what `mlflow run` and Azure ML set for the job's run,
    and `mlflow.start_run()` resumes) names the run to log into: it is reopened, checked as a
    restart's run is, and its id stored in the file, so a restart resumes it too. A file and a
    `MLFLOW_RUN_ID` that name different runs raise.

    Args:
        run_dir: the run's folder (e.g. the checkpoint root).
        tracking_uri: where MLflow stores runs, e.g. `"sqlite:///runs/x/mlflow.db"`; None uses
            MLflow's default (`MLFLOW_TRACKING_URI`).
        experiment: experiment name, created if missing; None: `MLFLOW_EXPERIMENT_NAME` (as
            HF's `MLflowCallback` reads it), else the experiment `MLFLOW_EXPERIMENT_ID` names
            (what `mlflow run` sets; it must exist), else "ftrain", for a new run: MLflow's own
            order. A restart without it resumes the stored run in its experiment, whatever the
            variables say now.
        run_name: display name of a new run.
        params: hyperparameters, logged once when the run is created. A restart must pass the
            same values (MLflow params are immutable).
        rank: this process's rank (`state.strategy.process_rank`); the sink does nothing
            unless it is 0. None: the job's rank (the process group's, else the launcher's
            `RANK`, else 0 in a job of one process); in a process that may be one of several
            whose group is set up after building the sink (an `mp.spawn` worker, or
            `MASTER_ADDR`, `WORLD_SIZE` > 1 or an MPI/SLURM task count > 1 without `RANK`),
            the rank is taken when the sink is first used (`step`, `log` or `close`), and only
            then is the run created or reopened: `run_id` is None until then for a new run.
            Pass 0 on every process to log from each (independent runs, each in its own
            `run_dir`), or the rank to open the run at once.

    Raises:
        ValueError: if a restart (or a run that `MLFLOW_RUN_ID` names) is passed params, an
            `experiment` or a `run_name` that differ from the run's, or the run is not in the
            tracking store or was deleted; if `MLFLOW_RUN_ID` names another run than the file.
        TypeError: for a `rank` that is not an int >= 0 or None.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> None:
        self.run_id: str | None = None
        self.resumed = False
        self._client: Any = None
        self._closed = False  # a record after close() would be dropped: it raises instead
        self._names: set[str] = set()  # metric names MLflow takes (checked once each)
        self._deferred = _Deferred(0, _quiet)
        known = _known_rank(rank)
        if known is not None and known != 0:
            return
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError("MLflowSink needs mlflow: pip install 'ftrain[mlflow]'") from e
        id_file = Path(run_dir) / "mlflow_run_id"
        params = {k: str(v) for k, v in (params or {}).items()}
        for k in params:  # before a run is made for them
            _check_name(k, f"params key {k!r}", "rename the key")
        # MLflow's own way to attach to a run (`mlflow run`, Azure ML jobs; mlflow.start_run()
        # resumes it): ignored, the sink made a run of its own beside the one the job watches.
        stored, attach = _stored_and_attached(id_file, "MLFLOW_RUN_ID", "MLflow")
        if (resume := attach if stored is None else stored) is not None:
            # Checked now, on every rank whose rank is not known yet: reading changes nothing.
            client = MlflowClient(tracking_uri)
            source = _Source(id_file, from_env=stored is None)
            new = _check_resume(client, resume, params, tracking_uri, source, experiment, run_name)
            self.run_id, self.resumed = resume, True  # known now: a fact of run_dir (or the env)

            def open_run() -> None:
                self._client = client
                _reopen(client, resume, new)
                if stored is None:  # a restart resumes it, also without MLFLOW_RUN_ID
                    _write_id(id_file, resume)

        else:
            # experiment="ftrain" was always passed: MLFLOW_EXPERIMENT_NAME, set for MLflow's
            # own client and HF's callback, was ignored and the run went to another experiment.
            # (A resume reopens the stored run where it is, whatever the variable says now.)
            name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or None
            # `mlflow run` names its experiment by id: a run made in "ftrain" left it empty.
            by_id = None if name else os.environ.get("MLFLOW_EXPERIMENT_ID") or None

            def open_run() -> None:
                # Made here, on rank 0 only: a sqlite store is created (migrated) by the client.
                self._client = MlflowClient(tracking_uri)
                where = _experiment_id(self._client, name or "ftrain", by_id)
                self.run_id = _create(self._client, id_file, where, run_name, params)

        self._deferred = _Deferred(known, open_run, self._quiet)

    def _quiet(self) -> None:
        self.run_id, self.resumed = None, False  # not rank 0 after all: as if built with rank=

    def step(self, state: TrainState) -> None:
        self._deferred.resolve()

    def log(self, record: Mapping[str, Any]) -> None:
        step = _step(record)
        self._deferred.resolve()
        if self._client is None:
            _closed(self, self._closed)
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = _scalars(record)
        for k in values.keys() - self._names:  # each name once, before any of the record is sent
            _check_name(k, f"the record at step {step} holds metric {k!r}, which", _RENAME)
            self._names.add(k)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self, *, failed: bool = False) -> None:
        """End the run: FINISHED, or FAILED with `failed=True` (what `Logger` passes when its
        `with` block raised, as MLflow's own `with mlflow.start_run()` ends a run). A second
        close does nothing; a record sent after one raises (off rank 0 every record is dropped).

        Args:
            failed: the run ended on an error. Only this decides: a close that runs inside an
                unrelated `except` block (`sys.exc_info()` set) is a normal finish.
        """
        self._deferred.resolve()
        if self._client is not None:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
            self._client, self._closed = None, True


_RENAME = "rename it (a nested dict's key is logged as 'outer/inner')"


def _check_name(name: Any, what: str, fix: str) -> None:
    """Refuse a param or metric name that MLflow refuses, naming it and where it came from:
    a param before a run is made for it (a run was made, then marked FAILED), a metric when
    a record first holds it, before any of the record is sent (MLflow's refusal named
    `metrics[i].name` of a batch, not the record's key)."""
    from mlflow.utils.validation import (
        MAX_ENTITY_KEY_LENGTH,
        path_not_unique,
        validate_param_and_metric_name,
    )

    if not isinstance(name, str):
        problem = "is not a str"
    elif not validate_param_and_metric_name(name):
        problem = (
            "has a character MLflow refuses (it takes letters, digits, _ - . / space, and : "
            "off Windows)"
        )
    elif path_not_unique(name):
        problem = "is no plain path (MLflow refuses an empty part, '.', '..', or a '/' at an end)"
    elif len(name) > MAX_ENTITY_KEY_LENGTH:
        problem = f"is longer than the {MAX_ENTITY_KEY_LENGTH} characters MLflow takes"
    else:
        return
    raise ValueError(f"MLflowSink: {what} {problem}; {fix}")


def _stored_and_attached(
    id_file: Path, variable: str, tracker: str
) -> tuple[str | None, str | None]:
    """The run id `id_file` holds and the one the environment's `variable` names (None where
    absent); raise where both name runs and they differ (which one to log into is not said)."""
    stored, attach = _read_id(id_file), os.environ.get(variable) or None
    if stored is not None and attach is not None and attach != stored:
        raise ValueError(
            f"{id_file} names {tracker} run {stored!r} but {variable}={attach!r}: unset "
            f"{variable} to resume the stored run, or use a new run_dir (or delete the file) to "
            f"log into the {tracker} run the environment names"
        )
    return stored, attach


def _experiment_id(client: Any, name: str, by_id: str | None) -> str:
    """The id of experiment `name` (created if missing), or `by_id` (`MLFLOW_EXPERIMENT_ID`),
    which must name a live experiment of the store."""
    if by_id is None:
        exp = client.get_experiment_by_name(name)
        return exp.experiment_id if exp else client.create_experiment(name)
    try:
        exp = client.get_experiment(by_id)
    except Exception:  # MLflow raises its own error for an id the store does not hold
        exp = None
    if exp is None or exp.lifecycle_stage != "active":
        state = "is deleted" if exp is not None else "is not in the tracking store"
        raise ValueError(
            f"MLflowSink: MLFLOW_EXPERIMENT_ID={by_id!r} {state}; unset it, or pass experiment="
        )
    return str(exp.experiment_id)


def _create(
    client: Any, id_file: Path, exp_id: str, run_name: str | None, params: dict[str, str]
) -> str:
    """Create a new MLflow run with `params` in experiment `exp_id`; store its id in
    `id_file`."""
    from mlflow.entities import Param

    run_id: str = client.create_run(exp_id, run_name=run_name).info.run_id
    try:
        client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
    except Exception:
        # A param MLflow refuses (a name with "@", a key that is no string): the run,
        # whose id is in no file, stayed RUNNING for good; each retry added another.
        client.set_terminated(run_id, status="FAILED")
        raise
    _write_id(id_file, run_id)
    return run_id


class _Source:
    """Where the id of a run to resume came from: `run_dir`'s file, or `MLFLOW_RUN_ID`."""

    def __init__(self, id_file: Path, *, from_env: bool) -> None:
        self.from_env = from_env
        self.name = "MLFLOW_RUN_ID" if from_env else str(id_file)
        self.new_run = "unset MLFLOW_RUN_ID" if from_env else "delete the file"
        self.other_run = "unset MLFLOW_RUN_ID" if from_env else "use a new run_dir"


def _check_resume(
    client: Any,
    run_id: str,
    params: dict[str, str],
    uri: str | None,
    source: _Source,
    experiment: str | None,
    run_name: str | None,
) -> dict[str, str]:
    """Check a restart's arguments against the stored run's (reading only); return the params
    the run does not have yet."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        # Only a store that answers that it lacks the run: an unreachable server (a connection
        # error) holds it as far as anyone knows, and its error says so itself.
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise ValueError(
            f"{source.name} names MLflow run {run_id!r}, which tracking_uri={uri!r} does not "
            f"hold; pass the tracking_uri that holds it, or {source.new_run} to start a new run"
        ) from e
    if run.info.lifecycle_stage == "deleted":  # refused by the store only when first logged to
        raise ValueError(
            f"{source.name} names MLflow run {run_id!r}, which was deleted: restore it "
            f"(`mlflow runs restore --run-id {run_id}`), or {source.new_run} to start a new run"
        )
    # The stored run wins over experiment= and run_name=: one that asks for another would
    # log into a run it did not ask for. Those not given (MLFLOW_EXPERIMENT_NAME, which names
    # a new run's experiment) are the stored run's.
    held = client.get_experiment(run.info.experiment_id).name
    checks = [("experiment", experiment, held), ("run_name", run_name, run.info.run_name)]
    if source.from_env and run_name is not None and run_name != run.info.run_name:
        # The platform's run (Azure ML, `mlflow run`) keeps its name, as MLflow's start_run
        # does for a run id it is given: a script's run_name there is no conflict to stop for.
        warnings.warn(
            f"MLflowSink: MLFLOW_RUN_ID names run {run_id!r}, named {run.info.run_name!r}; "
            f"run_name={run_name!r} is not applied to it (unset MLFLOW_RUN_ID for a run of "
            "that name)",
            UserWarning,
            stacklevel=4,
        )
        checks.pop()
    for arg, asked, have in checks:
        if asked is not None and asked != have:
            raise ValueError(
                f"{source.name} names MLflow run {run_id!r}, whose {arg} is {have!r}, but "
                f"{arg}={asked!r} was given: pass {arg}={have!r} or leave it out to resume "
                f"that run, or {source.other_run} for a new run"
            )
    logged = run.data.params
    # MLflow keeps a long value's first MAX_PARAM_VAL_LENGTH characters (with a warning): a
    # restart compared the whole value with them and refused every resume of such a run.
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as kept

    changed = {
        k: (logged[k], v) for k, v in params.items() if k in logged and logged[k] != v[:kept]
    }
    if changed:
        raise ValueError(
            f"params differ from those of the resumed MLflow run {run_id} "
            f"(logged, given): {changed}; pass the run's params or use a new run_dir"
        )
    return {k: v for k, v in params.items() if k not in logged}


def _reopen(client: Any, run_id: str, new: dict[str, str]) -> None:
    """Add the params the resumed run does not have, and mark it running again."""
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, v) for k, v in new.items()])
    client.update_run(run_id, status="RUNNING")


def _closed(sink: object, closed: bool) -> None:
    """Refuse a record sent to a closed tracker (off rank 0 a sink drops every record)."""
    if closed:
        raise ValueError(
            f"{type(sink).__name__} is closed (its run finished): log before close(), e.g. "
            "the final evaluation before logger.close()"
        )


def _logged_params(path: Path, given: dict[str, str], run_id: str | None) -> dict[str, str]:
    """The params a resumed W&B run was given (as strings), checked against `given`; empty for
    a run whose params file is missing (written before ftrain kept one)."""
    try:
        logged = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(logged, dict):
        return {}
    changed = {k: (logged[k], v) for k, v in given.items() if k in logged and logged[k] != v}
    if changed:
        raise ValueError(
            f"params differ from those of the resumed W&B run {run_id} (logged, given): "
            f"{changed}; pass the run's params or use a new run_dir"
        )
    return {str(k): str(v) for k, v in logged.items()}


_IDENTITY = ("project", "entity", "name")  # where a W&B run lives, and its display name
# What wandb.init(resume="allow") of the stored id does with another value of each.
_ELSEWHERE = MappingProxyType(
    {
        "project": "W&B would start a new run of that id in that project",
        "entity": "W&B would start a new run of that id under that entity",
        "name": "W&B would rename the run",
    }
)


def _resumed_identity(
    path: Path, project: str | None, init_kwargs: Mapping[str, Any], id_file: Path, run_id: str
) -> tuple[str, dict[str, str]]:
    """The project to resume the stored W&B run in, and the run's identity kept in `path`
    (project, entity, name), checked against the arguments given.

    The stored run wins over WANDB_PROJECT and WANDB_ENTITY: it is the run being resumed, and
    resume="allow" would start a new run of its id wherever they point. An argument given
    that differs is refused, naming it. A run without the file (made before ftrain kept one)
    was made in project "ftrain" unless project= was given: WANDB_PROJECT was not read then.
    """
    held = _held_identity(path)
    asked = {
        "project": project,
        "entity": init_kwargs.get("entity"),
        "name": init_kwargs.get("name"),
    }
    for arg, have in held.items():
        if asked[arg] is not None and asked[arg] != have:
            raise ValueError(
                f"{id_file} names W&B run {run_id!r}, whose {arg} is {have!r}, but "
                f"{arg}={asked[arg]!r} was given ({_ELSEWHERE[arg]}): pass {arg}={have!r} "
                "or leave it out to resume that run, or use a new run_dir for a new run"
            )
    return held.get("project") or project or "ftrain", held


def _held_identity(path: Path) -> dict[str, str]:
    """The project, entity and name kept in `path`; empty without the file."""
    try:
        held = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(held, dict):
        return {}
    return {k: v for k, v in held.items() if k in _IDENTITY and isinstance(v, str) and v}


GLOBAL_STEP = "train/global_step"  # W&B: the x-axis of every metric (`WandbSink`)


class WandbSink:
    """Logs records to a Weights & Biases run, under `train/<key>` and `eval/<key>`, at `step`.

    The run id is stored in `<run_dir>/wandb_run_id`; a restarted job resumes that run
    (`resume="allow"`). Without that file a new run takes the id `WANDB_RUN_ID` gives, as
    `wandb.init` does; a file and a `WANDB_RUN_ID` that name different runs raise. W&B writes
    its files under `<run_dir>/wandb`; `WANDB_MODE=offline` keeps them local until `wandb
    sync`. Every metric is plotted against `train/global_step` (the optimizer step, as HF's
    `WandbCallback` logs it), so that the steps a guard rollback makes again are recorded too
    (W&B drops a record whose own `step=` is below one already logged).
    Needs the `wandb` extra (`pip install 'ftrain[wandb]'`).

    `close()` finishes the run (`run.finish()`); W&B's service process writes and closes the
    run's files a moment later, at the latest when this process exits. Call `wandb.teardown()`
    after `close()` to wait for that, before copying `<run_dir>/wandb` elsewhere.

    Args:
        run_dir: the run's folder (e.g. the checkpoint root).
        project: the W&B project; None: `WANDB_PROJECT` (as HF's `WandbCallback` reads it),
            else "ftrain", for a new run. A restart resumes the stored run where it is (kept
            in `<run_dir>/wandb_run_identity.json`; "ftrain" for a run made before that file
            was kept), whatever `WANDB_PROJECT` and `WANDB_ENTITY` say now.
        params: hyperparameters, the run's config, logged once when the run is created (kept
            in `<run_dir>/wandb_run_params.json`). A restart must pass the same values; new
            keys are added to the config.
        rank: this process's rank (`state.strategy.process_rank`); the sink does nothing
            unless it is 0. None: the job's rank (the process group's, else the launcher's
            `RANK`, else 0 in a job of one process); in a process that may be one of several
            whose group is set up after building the sink (an `mp.spawn` worker, or
            `MASTER_ADDR`, `WORLD_SIZE` > 1 or an MPI/SLURM task count > 1 without `RANK`),
            the rank is taken when the sink is first used (`step`, `log` or `close`), and only
            then is the run created or reopened: `run_id` is None until then for a new run.
            Pass 0 on every process to log from each (independent runs, each in its own
            `run_dir`), or the rank to open the run at once.
        **init_kwargs: passed on to `wandb.init` (e.g. `mode`, `entity`, `name`, `settings`).

    Raises:
        ValueError: if `WANDB_RUN_ID` names another run than `<run_dir>/wandb_run_id`; if
            a restart passes params that differ from the stored run's, or a
            `project` or `entity` other than the stored run's (W&B would start a new run of
            that id there), or another `name` (W&B would rename the run).
        TypeError: for a `rank` that is not an int >= 0 or None.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        params: Mapping[str, Any] | None = None,
        rank: int | None = None,
        **init_kwargs: Any,
    ) -> None:
        self.run_id: str | None = None
        self.resumed = False
        self._run: Any = None
        self._closed = False  # a record after close() would be dropped: it raises instead
        # Checked on every rank: a check on rank 0 only stopped it while the others trained on.
        taken = {"id", "resume", "dir", "config", "project"} & set(init_kwargs)
        if taken:
            raise TypeError(f"WandbSink sets {sorted(taken)} itself; use run_dir/params/project")
        self._deferred = _Deferred(0, _quiet)
        known = _known_rank(rank)
        if known is not None and known != 0:
            return
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError("WandbSink needs wandb: pip install 'ftrain[wandb]'") from e
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_run_id"
        # wandb.init(id=stored) won over the variable: the job's run stayed empty.
        stored, attach = _stored_and_attached(id_file, "WANDB_RUN_ID", "W&B")
        # W&B takes no config on resume (offline it cannot read the run's): the params are
        # kept beside the id and a restart's compared with them, as MLflowSink does.
        params_file = run_dir / "wandb_run_params.json"
        given = {k: str(v) for k, v in (params or {}).items()}
        logged = _logged_params(params_file, given, stored) if stored is not None else {}
        identity_file = run_dir / "wandb_run_identity.json"
        held: dict[str, str] = {}
        if stored is None:
            # project="ftrain" was passed to wandb.init, which wins over WANDB_PROJECT: a run of
            # a job that set it (as HF's docs say to) went to another project.
            project = project if project is not None else os.environ.get("WANDB_PROJECT")
            project = project or "ftrain"
        else:
            project, held = _resumed_identity(identity_file, project, init_kwargs, id_file, stored)
            if "entity" in held:  # wins over WANDB_ENTITY, which wandb.init would read
                init_kwargs = {**init_kwargs, "entity": held["entity"]}
        new = {k: v for k, v in (params or {}).items() if k not in logged}
        config = None if stored is not None else dict(params or {})  # a resumed run has its own
        self.run_id, self.resumed = stored, stored is not None  # known now: a fact of run_dir

        def open_run() -> None:
            run_dir.mkdir(parents=True, exist_ok=True)
            # The variable's id given, not left to wandb.init: W&B reads its variables once a
            # process (at its setup), so one set later was not seen.
            self._run = wandb.init(project=project, dir=str(run_dir), id=stored or attach,
                                   resume="allow", config=config, **init_kwargs)  # fmt: skip
            self.run_id = self._run.id
            if self.resumed and new:
                self._run.config.update(new)
            _write_text(params_file, json.dumps({**logged, **given}, sort_keys=True))
            made = {k: getattr(self._run, k, None) for k in _IDENTITY}
            made = {k: v for k, v in made.items() if isinstance(v, str) and v}  # offline: no entity
            _write_text(identity_file, json.dumps({**made, **held}, sort_keys=True))
            if not self.resumed:
                _write_id(id_file, self._run.id)
            # The optimizer step is a metric that the others are plotted against (HF's
            # WandbCallback does the same), not W&B's own `step=`: W&B drops, with a warning of
            # its own, a record whose `step` is below one already logged, so the steps a guard
            # rollback makes again were lost.
            self._run.define_metric(GLOBAL_STEP)
            self._run.define_metric("*", step_metric=GLOBAL_STEP, step_sync=True)

        self._deferred = _Deferred(known, open_run, self._quiet)

    def _quiet(self) -> None:
        self.run_id, self.resumed = None, False  # not rank 0 after all: as if built with rank=

    def step(self, state: TrainState) -> None:
        self._deferred.resolve()

    def log(self, record: Mapping[str, Any]) -> None:
        step = _step(record)
        self._deferred.resolve()
        if self._run is None:
            _closed(self, self._closed)
            return
        tags = {_tag(k): v for k, v in _scalars(record).items()}
        if GLOBAL_STEP in tags:  # the step below would replace its value
            raise ValueError(
                f"the record's 'global_step' is logged as {GLOBAL_STEP!r}, the axis WandbSink "
                "plots every metric against (the record's 'step'); rename it"
            )
        self._run.log({**tags, GLOBAL_STEP: step})

    def close(self, *, failed: bool = False) -> None:
        """Finish the run: exit code 0, or 1 with `failed=True` (what `Logger` passes when its
        `with` block raised, as W&B's own `with wandb.init()` finishes a run). A second close
        does nothing; a record sent after one raises (off rank 0 every record is dropped).

        Args:
            failed: the run ended on an error. Only this decides: a close that runs inside an
                unrelated `except` block (`sys.exc_info()` set) is a normal finish.
        """
        self._deferred.resolve()
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run, self._closed = None, True
