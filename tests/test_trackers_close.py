"""How a tracker run ends: finished or failed from what the caller says (`Logger`'s `with` block
raised, `close(failed=True)`), never from an exception that happens to be handled around the
close; read back from the MLflow store and the W&B offline files."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from helpers import rank_rule_over
from test_trackers import _finished_records


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as in test_trackers.py
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return (tmp_path / "mlruns").as_uri()


def _status(uri, sink):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).get_run(sink.run_id).info.status


def _steps(logger, n=2):
    """`n` steps of a tiny regression, each folded into `logger` (a log record every step)."""
    state = ft.TrainState.create(torch.nn.Linear(3, 1), ft.optim.sgd(), seed=0)
    batch = [(torch.ones(4, 3), torch.zeros(4, 1))]

    def loss_fn(model, b):
        return ((model(b[0]) - b[1]) ** 2).sum(), torch.tensor(4)

    for _ in range(n):
        grads, stats = ft.accumulate_grads(state, batch, loss_fn)
        state, info = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
        logger.step(state, stats, info)
    return state


def _logger(sink):
    state = ft.TrainState.create(torch.nn.Linear(3, 1), ft.optim.sgd(), seed=0)
    return ft.logging.Logger(state, every=1, sinks=[sink], progress=False)


def test_mlflow_close_inside_an_unrelated_except_block_finishes_the_run(tmp_path, mlflow_uri):
    """`close()` read `sys.exc_info()`: a clean run closed in an `except` block that handled
    something else (a user's Ctrl-C handler, a retry after an OOM) was marked FAILED."""
    sink = ft.logging.MLflowSink(tmp_path / "a", tracking_uri=mlflow_uri)
    logger = _logger(sink)
    try:
        _steps(logger)
        raise KeyboardInterrupt  # the user stops a healthy run
    except KeyboardInterrupt:
        logger.close()
    assert _status(mlflow_uri, sink) == "FINISHED"

    retried = ft.logging.MLflowSink(tmp_path / "b", tracking_uri=mlflow_uri)
    try:
        raise MemoryError("the first attempt ran out of memory")
    except MemoryError:
        with _logger(retried) as logger:  # the retry, which succeeds
            _steps(logger)
    assert _status(mlflow_uri, retried) == "FINISHED"


def test_mlflow_run_fails_only_when_told_and_a_second_close_keeps_the_outcome(tmp_path, mlflow_uri):
    raised = ft.logging.MLflowSink(tmp_path / "a", tracking_uri=mlflow_uri)
    with pytest.raises(RuntimeError, match="diverged"), _logger(raised) as logger:
        _steps(logger)
        raise RuntimeError("diverged")
    logger.close()  # a `finally: logger.close()` after the block: the run stays FAILED
    assert _status(mlflow_uri, raised) == "FAILED"

    told = ft.logging.MLflowSink(tmp_path / "b", tracking_uri=mlflow_uri)
    logger = _logger(told)
    _steps(logger)
    logger.close(failed=True)  # without `with`: `except BaseException: close(failed=True)`
    logger.close()
    assert _status(mlflow_uri, told) == "FAILED"

    # The failed run resumed by a restart is running again, and a clean close finishes it.
    resumed = ft.logging.MLflowSink(tmp_path / "b", tracking_uri=mlflow_uri)
    assert resumed.resumed and resumed.run_id == told.run_id
    resumed.log({"step": 3, "loss": 1.0})  # (the run is reopened when the sink is first used)
    assert _status(mlflow_uri, resumed) == "RUNNING"
    try:
        raise ValueError("handled by the caller, unrelated to the run")
    except ValueError:
        resumed.close()
    assert _status(mlflow_uri, resumed) == "FINISHED"


def test_trackers_off_rank_0_take_the_outcome_and_do_nothing(tmp_path, mlflow_uri):
    """`Logger` passes `failed=` to every sink on every rank: off rank 0 the trackers take it
    and stay silent (no run, no folder; a record is dropped, also after close)."""
    for quiet in (
        ft.logging.MLflowSink(tmp_path / "m", tracking_uri=mlflow_uri, rank=1),
        ft.logging.WandbSink(tmp_path / "w", rank=1),
    ):
        with pytest.raises(RuntimeError), _logger(quiet) as logger:
            _steps(logger)
            raise RuntimeError("diverged")
        quiet.close()
        quiet.log({"step": 3, "loss": 1.0})
        assert quiet.run_id is None
    assert not (tmp_path / "m").exists() and not (tmp_path / "w").exists()
    # The arguments WandbSink sets itself were refused on rank 0 only.
    with pytest.raises(TypeError, match=r"WandbSink sets \['id'\] itself"):
        ft.logging.WandbSink(tmp_path / "w", id="x", rank=1)


def _exit_code(run_dir):
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    exits = [r for r in _finished_records(path) if r.WhichOneof("record_type") == "exit"]
    (code,) = [r.exit.exit_code for r in exits]
    return code


def test_wandb_exit_code_comes_from_the_logger_block_not_the_handled_exception(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    clean = ft.logging.WandbSink(tmp_path / "clean", project="t")
    logger = _logger(clean)
    try:
        _steps(logger)
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        logger.close()  # was exit code 1: an exception was being handled
    failed = ft.logging.WandbSink(tmp_path / "failed", project="t")
    with pytest.raises(RuntimeError), _logger(failed) as logger:
        _steps(logger)
        raise RuntimeError("diverged")
    assert _exit_code(tmp_path / "clean") == 0
    assert _exit_code(tmp_path / "failed") == 1


def test_mlflow_names_mlflow_refuses_are_refused_before_anything_is_sent(tmp_path, mlflow_uri):
    """A param MLflow refuses made a run that then ended FAILED (one more per retry); a metric
    it refuses (an eval metric: first logged maybe hours into training) raised MLflow's
    `metrics[0].name`, not the record's key. Both are refused by ftrain, naming the key."""
    from mlflow.tracking import MlflowClient

    with pytest.raises(ValueError, match=r"MLflowSink: params key 'lr@peak' has a character"):
        ft.logging.MLflowSink(tmp_path / "a", tracking_uri=mlflow_uri, params={"lr@peak": 0.1})
    client = MlflowClient(mlflow_uri)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
    assert not (tmp_path / "a" / "mlflow_run_id").exists()

    sink = ft.logging.MLflowSink(tmp_path / "b", tracking_uri=mlflow_uri)
    sink.log({"step": 1, "loss": 2.0})
    bad = {"step": 7, "eval_loss": 1.0, "eval": {"acc@1": 0.5}}
    with pytest.raises(ValueError, match=r"record at step 7 holds metric 'eval/acc@1', which has"):
        sink.log(bad)
    with pytest.raises(ValueError, match=r"metric 'eval/', which is no plain path"):
        sink.log({"step": 7, "eval": {"": 0.5}})
    sink.log({"step": 8, "eval_loss": 0.5})
    sink.close()
    history = client.get_metric_history(sink.run_id, "eval_loss")
    assert [(m.step, m.value) for m in history] == [(8, 0.5)]  # none of the refused record


def test_a_forwarding_wrapper_sink_passes_the_failure_on(tmp_path, mlflow_uri):
    """A sink of yours that wraps a tracker and forwards `close(*args, **kwargs)` (renaming
    keys, filtering records) gets `failed=` too: a crashed run ends FAILED through it (it ended
    FINISHED: a `**kwargs` close was called without arguments). A positional-only `failed`
    is passed positionally; a plain `close(self)` is called without arguments."""

    class Prefix:
        def __init__(self, inner):
            self.inner = inner

        def step(self, state):
            self.inner.step(state)

        def log(self, record):
            self.inner.log({k if k == "step" else f"train/{k}": v for k, v in record.items()})

        def close(self, *args, **kwargs):
            self.inner.close(*args, **kwargs)

    closed = []

    class Positional:
        def step(self, state): ...
        def log(self, record): ...
        def close(self, failed, /):
            closed.append(("positional", failed))

    class Plain:
        def step(self, state): ...
        def log(self, record): ...
        def close(self):
            closed.append(("plain",))

    sink = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=mlflow_uri)
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    sinks = [Prefix(sink), Positional(), Plain()]
    with (
        pytest.raises(RuntimeError, match="training crashed"),
        ft.logging.Logger(state, every=1, progress=False, sinks=sinks),
    ):
        raise RuntimeError("training crashed")
    assert _status(mlflow_uri, sink) == "FAILED"
    assert closed == [("positional", True), ("plain",)]


def test_file_sinks_refuse_a_record_after_close_naming_the_sink(tmp_path):
    """A record sent after `close()` (the final evaluation after `logger.close()`): JSONLSink
    raised Python's "I/O operation on closed file", TensorBoardSink opened a new events file
    for it, quietly. Both refuse, as the trackers do, naming the sink; what was logged before
    stays as written."""
    jsonl = ft.logging.JSONLSink(tmp_path / "log.jsonl")
    jsonl.log({"step": 1, "loss": 2.0})
    jsonl.close()
    with pytest.raises(ValueError, match=r"JSONLSink is closed: log before close\(\)"):
        jsonl.log({"step": 2, "eval_loss": 1.0})
    assert (tmp_path / "log.jsonl").read_text().splitlines() == ['{"step": 1, "loss": 2.0}']
    pytest.importorskip("tensorboard")
    board = ft.logging.TensorBoardSink(tmp_path / "tb")
    board.log({"step": 1, "loss": 2.0})
    board.close()
    files = sorted((tmp_path / "tb").iterdir())
    with pytest.raises(ValueError, match=r"TensorBoardSink is closed: log before close\(\)"):
        board.log({"step": 2, "eval_loss": 1.0})
    assert sorted((tmp_path / "tb").iterdir()) == files  # no new events file


def _one_of_several(monkeypatch):
    """A process of a job of several whose group comes up after its sinks were built: no
    `RANK`, but `MASTER_ADDR` set (as for `mp.spawn` and launchers of one's own); a process
    with neither is a job of one, rank 0 at once (test below)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def _group_comes_up(monkeypatch, rank):
    """The job's process group, set up after the sinks were built (`mp.spawn`, a launcher of
    one's own that sets no `RANK`), as this process sees it: rank `rank` of 2."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)


@pytest.mark.parametrize("kind", ["mlflow", "wandb"])
def test_a_tracker_built_before_the_process_group_takes_its_rank_when_first_used(
    tmp_path, monkeypatch, mlflow_uri, kind
):
    """Built before `init_process_group` in a job launched without `RANK`, every rank took
    itself for rank 0: each opened a run (and logged every record) into the same run_dir."""
    _one_of_several(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    if kind == "mlflow":
        sink = ft.logging.MLflowSink(run, tracking_uri=mlflow_uri, params={"lr": 0.1})
    else:
        sink = ft.logging.WandbSink(run, params={"lr": 0.1})
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).replace(step=1)
    _group_comes_up(monkeypatch, rank=1)
    sink.step(state)
    sink.log({"step": 1, "loss": 1.0})
    sink.close()
    assert sink.run_id is None and not sink.resumed and not run.exists()
    if kind == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(mlflow_uri)
        assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_an_mlflow_sink_built_before_the_process_group_logs_on_rank_0(
    tmp_path, monkeypatch, mlflow_uri
):
    _one_of_several(monkeypatch)
    sink = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=mlflow_uri, params={"lr": 0.1})
    assert sink.run_id is None  # opened when first used, on rank 0
    _group_comes_up(monkeypatch, rank=0)
    sink.log({"step": 1, "loss": 1.0})
    sink.close()
    from mlflow.tracking import MlflowClient

    got = MlflowClient(mlflow_uri).get_run(sink.run_id)
    assert got.data.metrics == {"loss": 1.0} and got.data.params == {"lr": "0.1"}
    assert (tmp_path / "run" / "mlflow_run_id").read_text().strip() == sink.run_id
    # A restart's refusals are still raised when the sink is built, on every rank.
    with pytest.raises(ValueError, match=r"params differ.*'lr'"):
        ft.logging.MLflowSink(tmp_path / "run", tracking_uri=mlflow_uri, params={"lr": 0.2})


def test_a_profiler_built_before_the_process_group_names_its_trace_by_its_rank(
    tmp_path, monkeypatch
):
    _one_of_several(monkeypatch)
    prof = ft.logging.Profiler(tmp_path / "prof", steps=(3, 3), warmup=1)
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    _group_comes_up(monkeypatch, rank=1)
    prof.step(state.replace(step=1))  # the profiler starts (its rank is taken now)
    monkeypatch.undo()  # (torch's profiler asks the faked group more than its rank)
    for step in range(2, 4):
        torch.ones(2).sum()
        prof.step(state.replace(step=step))
    (trace,) = prof.traces()
    assert trace.name.startswith("rank1.")
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "prof").iterdir()) == ["rank1"]


def test_an_mlflow_run_that_failed_to_open_on_first_use_is_opened_on_the_next(
    tmp_path, monkeypatch, mlflow_uri
):
    """A run opened when the sink is first used: one that failed to open (a store down) must
    not leave the sink dropping every later record as if it were off rank 0."""
    from mlflow.tracking import MlflowClient

    _one_of_several(monkeypatch)
    sink = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=mlflow_uri)
    real = MlflowClient.create_run

    def down(self, *args, **kwargs):
        monkeypatch.setattr(MlflowClient, "create_run", real)  # up again for the next try
        raise ConnectionError("tracking server down")

    monkeypatch.setattr(MlflowClient, "create_run", down)
    with pytest.raises(ConnectionError):
        sink.log({"step": 1, "loss": 2.0})
    sink.log({"step": 2, "loss": 1.0})
    sink.close()
    assert MlflowClient(mlflow_uri).get_run(sink.run_id).data.metrics == {"loss": 1.0}


@pytest.mark.parametrize("rank", ["0", 0.0, True, -1])
def test_a_rank_that_is_no_int_is_refused_by_every_rank_taking_sink(tmp_path, mlflow_uri, rank):
    """rank="0" (os.environ["RANK"] passed as is) is no 0: the trackers and the bar did nothing
    on any rank, and the profiler named its trace rank0.0."""
    match = r"rank must be an int >= 0 \(e\.g\. state\.strategy\.process_rank\) or None"
    with pytest.raises(TypeError, match=match):
        ft.logging.MLflowSink(tmp_path / "m", tracking_uri=mlflow_uri, rank=rank)
    with pytest.raises(TypeError, match=match):
        ft.logging.WandbSink(tmp_path / "w", rank=rank)
    with pytest.raises(TypeError, match=match):
        ft.logging.ProgressBar(10, rank=rank)
    with pytest.raises(TypeError, match=match):
        ft.logging.Profiler(tmp_path / "p", steps=(3, 4), rank=rank)
    assert not (tmp_path / "m").exists() and not (tmp_path / "w").exists()


def test_an_integer_rank_of_another_type_is_taken(tmp_path, mlflow_uri, capsys):
    """A numpy integer (np.int64 from an array of ranks) or a 0-dim integer tensor is an
    integer: the rank check refused it, naming it as no int."""
    import numpy as np

    for rank in (np.int64(1), torch.tensor(1)):
        sink = ft.logging.MLflowSink(tmp_path / "m", tracking_uri=mlflow_uri, rank=rank)
        assert sink.run_id is None  # rank 1: quiet
        ft.logging.WandbSink(tmp_path / "w", rank=rank).close()
        bar = ft.logging.ProgressBar(10, rank=rank, lines=True)
        bar.log({"step": 1, "loss": 1.0})
        assert not bar.enabled and capsys.readouterr().out == ""
        profiler = ft.logging.Profiler(tmp_path / "p", steps=(3, 4), rank=rank)
        assert type(profiler.rank) is int and profiler.rank == 1
    shown = ft.logging.ProgressBar(10, rank=np.int64(0), lines=True)
    shown.log({"step": 1, "loss": 1.0})
    assert capsys.readouterr().out.startswith("step 1/10")
    with pytest.raises(TypeError, match=r"rank must be an int >= 0"):
        ft.logging.ProgressBar(10, rank=np.True_)
    assert not (tmp_path / "m").exists() and not (tmp_path / "w").exists()


WHERE = ["alone", "mp.spawn", "MASTER_ADDR", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
         "PET_NNODES"]  # fmt: skip
# What a launcher sets that says how many processes the job has, or where its group meets.
LAUNCHER = ("RANK", "MASTER_ADDR", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
            "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
            "PET_NNODES", "PET_MASTER_ADDR", "JOB_COMPLETION_INDEX", "RAY_RAYLET_PID")  # fmt: skip


@pytest.mark.parametrize("where", WHERE)
def test_a_tracker_in_a_job_of_one_opens_its_run_when_built(tmp_path, monkeypatch, mlflow_uri,
                                                            where):  # fmt: skip
    """Waiting for a process group that a plain script never sets up left every script's run
    unopened until the first step: run_id None after building, a wrong tracking URI failing
    only after the model loaded. Only a process that may be one of several waits."""
    import multiprocessing

    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    if where == "mp.spawn":
        monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    elif where != "alone":
        monkeypatch.setenv(where, "127.0.0.1" if where == "MASTER_ADDR" else "2")
    sink = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=mlflow_uri)
    assert (sink.run_id is not None) == (where == "alone")
    bar = ft.logging.ProgressBar(10, lines=True)
    bar.log({"step": 1, "loss": 1.0})  # alone: shown; otherwise the rank is taken now: 0 too
    assert bar.enabled
    sink.close()


def test_every_process_from_env_takes_for_one_of_several_waits_for_its_rank(monkeypatch):
    """The launchers' variables are read twice: by `from_env` (core) and by the trackers'
    rank (an extra, which may not import the core's private names). The trackers missed
    some: a srun task of a step of 4 (SLURM_STEP_NUM_TASKS; SLURM_NTASKS is the allocation's)
    and a pod of several started with `python` (PET_NNODES, or JOB_COMPLETION_INDEX beside
    PET_MASTER_ADDR) took itself for rank 0 and opened a run when its sink was built, one per
    process. Every environment `from_env` takes for one of several (it refuses it, or its
    WORLD_SIZE is above 1) must leave the rank to be taken later."""
    values = {
        "WORLD_SIZE": [None, "1", "2"],
        "SLURM_NTASKS": [None, "1", "4"],
        "SLURM_STEP_NUM_TASKS": [None, "1", "4"],
        "SLURM_PROCID": [None, "0"],
        "OMPI_COMM_WORLD_SIZE": [None, "1", "2"],
        "PMI_SIZE": [None, "2"],
        "MV2_COMM_WORLD_SIZE": [None, "2"],
        "PET_NNODES": [None, "1", "2", "1:2", "x"],
        "PET_MASTER_ADDR": [None, "10.0.0.1"],
        "JOB_COMPLETION_INDEX": [None, "0"],
        "MASTER_ADDR": [None, "10.0.0.1"],
        "RAY_RAYLET_PID": [None, "1"],
    }
    several, alone, refused = rank_rule_over(monkeypatch, values, LAUNCHER)
    for env, message in refused:
        assert "WORLD_SIZE is unset" in message or "SLURM_NTASKS" in message, (env, message)
    assert several > 1000 and alone > 50  # both kinds were met
