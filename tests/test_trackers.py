"""Experiment trackers as sinks: MLflow (sqlite store) and W&B (offline), read back from disk."""

from __future__ import annotations

import json
import struct
import time

import pytest
import torch

import ftrain as ft

PARAMS = {"lr": 0.05, "max_norm": 1.0, "optimizer": "sgd"}


def _data(n=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return [{"x": x[i], "y": x[i].sum(0, keepdim=True)} for i in range(n)]


def _loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(), batch["y"].numel()


def _train(root, sink_factory, *, until, total=6, optimizer=None):
    """The loop with a Logger (every step) and a checkpoint every 3 steps, stopping at `until`
    as a killed job would (no close); a second call resumes from the latest checkpoint."""
    torch.manual_seed(0)
    state = ft.TrainState.create(torch.nn.Linear(3, 1), optimizer or ft.optim.sgd(), seed=0)
    if (ckpt := ft.latest_checkpoint(root)) is not None:
        state = ft.load_checkpoint(ckpt, state)
    sink = sink_factory()
    logger = ft.logging.Logger(state, every=1, sinks=[sink], progress=False)
    data = _data()
    while state.step < until:
        for micro in ft.make_batches(data, state, batch_size=4):
            grads, stats = ft.accumulate_grads(state, micro, _loss)
            state, info = ft.clip_and_step(state, grads, stats=stats, lr=0.05, max_norm=1.0)
            logger.step(state, stats, info)
            if ft.should_eval(state, every=2, total_steps=total):
                logger.log({"step": state.step, **ft.evaluate(state, [data[:8]], _loss)})
            if ft.should_save(state, every=3, total_steps=total):
                ft.save_checkpoint(state, root)
            if state.step >= until:
                break
        else:
            state = ft.next_epoch(state)
    return sink


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    # A file store: MLflow's sqlite store works the same but builds its schema through ~60
    # migrations (10 s on a loaded CI core). MLflow 3 asks for this opt-in to the file store.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)  # a job's run would be attached to
    return (tmp_path / "mlruns").as_uri()


def test_mlflow_sink_logs_params_once_every_metric_at_its_step_and_resumes_the_run(
    tmp_path, mlflow_uri
):
    from mlflow.tracking import MlflowClient

    uri = mlflow_uri
    root = tmp_path / "run"

    def make():
        return ft.logging.MLflowSink(root, tracking_uri=uri, experiment="t", params=PARAMS)

    first = _train(root, make, until=5)  # killed at step 5; the last checkpoint is step 3
    assert not first.resumed
    second = _train(root, make, until=6)  # the restart: resumes from step 3
    assert second.resumed and second.run_id == first.run_id
    second.close()

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert [r.info.run_id for r in runs] == [first.run_id]  # one run, not one per restart
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in PARAMS.items()}
    loss = client.get_metric_history(first.run_id, "loss")
    # Steps 4 and 5 were logged before the kill and again after the resume, with equal values.
    assert sorted(m.step for m in loss) == [1, 2, 3, 4, 4, 5, 5, 6]
    by_step: dict[int, set[float]] = {}
    for m in loss:
        by_step.setdefault(m.step, set()).add(m.value)
    assert all(len(v) == 1 for v in by_step.values())
    evals = client.get_metric_history(first.run_id, "eval_loss")
    assert sorted({m.step for m in evals}) == [2, 4, 6]
    norms = client.get_metric_history(first.run_id, "grad_norm")
    assert {m.step for m in norms} == set(range(1, 7))


def test_mlflow_sink_refuses_changed_params_and_is_silent_off_rank_0(tmp_path, mlflow_uri):
    uri = mlflow_uri
    root = tmp_path / "run"
    ft.logging.MLflowSink(root, tracking_uri=uri, params={"lr": 0.1}).close()
    with pytest.raises(ValueError, match=r"params differ.*'lr'"):
        ft.logging.MLflowSink(root, tracking_uri=uri, params={"lr": 0.2})
    other = tmp_path / "other"
    quiet = ft.logging.MLflowSink(other, tracking_uri=uri, params={"lr": 0.1}, rank=1)
    quiet.log({"step": 1, "loss": 1.0})
    quiet.close()
    assert quiet.run_id is None and not other.exists()
    (other / "mlflow_run_id").parent.mkdir()
    (other / "mlflow_run_id").write_text("0123456789abcdef")
    with pytest.raises(ValueError, match="does not hold"):
        ft.logging.MLflowSink(other, tracking_uri=uri)


def test_mlflow_sink_resumes_a_run_whose_long_param_mlflow_truncated(tmp_path, mlflow_uri):
    """MLflow keeps a param value's first 6000 characters: the restart compared the whole value
    with them and refused to resume ("params differ"), on every restart."""
    from mlflow.tracking import MlflowClient

    files = ",".join(f"shard-{i:05d}.parquet" for i in range(400))  # 8000 characters
    root = tmp_path / "run"
    first = ft.logging.MLflowSink(root, tracking_uri=mlflow_uri, params={"files": files})
    first.close()
    logged = MlflowClient(mlflow_uri).get_run(first.run_id).data.params["files"]
    assert len(files) > len(logged) and files.startswith(logged)
    again = ft.logging.MLflowSink(root, tracking_uri=mlflow_uri, params={"files": files})
    assert again.resumed and again.run_id == first.run_id
    again.close()
    with pytest.raises(ValueError, match=r"params differ.*'files'"):  # a real change still raises
        ft.logging.MLflowSink(root, tracking_uri=mlflow_uri, params={"files": "x" + files})


def _wandb_records(path):
    """Protobuf records of a .wandb file (W&B's LevelDB-style log: 32 KiB blocks of chunks with
    a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # the rest of a block too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _finished_records(path, timeout=60.0):
    """The records of a run W&B has finished writing: `run.finish()` returns once W&B's service
    has the run's exit record, and the service writes and closes the file a moment later (at
    the latest when the process exits), so a read right after `close()` can see a bare header."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:  # a file being written may end in a record cut short
            records = _wandb_records(path) if path.stat().st_size >= 7 else []
        except DecodeError:
            records = []
        if any(rec.WhichOneof("record_type") == "exit" for rec in records):
            return records
        assert time.monotonic() < deadline, f"W&B never finished writing {path}"
        time.sleep(0.05)


def test_wandb_sink_offline_run_files_hold_config_once_and_every_metric(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    root = tmp_path / "run"

    def make():
        return ft.logging.WandbSink(root, project="t", params=PARAMS)

    first = _train(root, make, until=5)
    first.close()  # W&B flushes its files on finish
    # W&B names offline folders by the second they start in: a resume within the same second
    # would reuse the first run's folder. Start the second run in the next second.
    time.sleep(1.0 - time.time() % 1.0 + 0.05)
    second = _train(root, make, until=6)
    second.close()
    assert second.resumed and second.run_id == first.run_id

    runs = sorted(root.glob(f"wandb/offline-run-*-{first.run_id}/run-{first.run_id}.wandb"))
    assert len(runs) == 2  # W&B writes one offline folder per process, for one run id
    history: list[dict] = []
    configs = []
    for path in runs:
        for rec in _finished_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                # "train/loss" is stored as the nested key ["train", "loss"].
                items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                history.append({k: json.loads(v) for k, v in items.items()})
            elif kind == "run":
                config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
                configs.append({k: v for k, v in config.items() if k != "_wandb"})
    assert configs == [PARAMS, {}]  # the config is logged once
    steps = [h["train/global_step"] for h in history if "train/loss" in h]
    assert steps == [1, 2, 3, 4, 5, 4, 5, 6]
    assert sorted(h["train/global_step"] for h in history if "eval/loss" in h) == [2, 4, 4, 6]


def test_wandb_sink_keeps_the_steps_a_rollback_makes_again(tmp_path, monkeypatch):
    """W&B drops a record whose `step=` is below one already logged (with a warning of its
    own): the steps after a guard rollback were lost until training passed the undone ones.
    (One offline run, ~10 s to start here, also holds two refusals: a record's `global_step`
    became `train/global_step`, overwritten by the step; a record sent after close() was
    dropped without an error.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = ft.logging.WandbSink(tmp_path / "run", project="t")
    with pytest.raises(ValueError, match="'global_step' is logged as 'train/global_step'"):
        sink.log({"step": 1, "global_step": 7})
    for step, loss in [(1, 3.0), (2, 2.0), (3, 9.0), (2, 2.5), (3, 1.5)]:  # rolled back to 1
        sink.log({"step": step, "loss": loss})
    sink.close()
    with pytest.raises(ValueError, match="WandbSink is closed"):
        sink.log({"step": 4, "eval_loss": 1.0})
    (path,) = (tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb")
    got = []
    for rec in _finished_records(path):
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            if "train/loss" in items:
                got.append(
                    (json.loads(items["train/global_step"]), json.loads(items["train/loss"]))
                )
    assert got == [(1, 3.0), (2, 2.0), (3, 9.0), (2, 2.5), (3, 1.5)]


def test_wandb_sink_does_nothing_off_rank_0_and_rejects_its_own_arguments(tmp_path):
    quiet = ft.logging.WandbSink(tmp_path / "r", params=PARAMS, rank=1)
    quiet.log({"step": 1, "loss": 1.0})
    quiet.close()
    assert quiet.run_id is None and not (tmp_path / "r").exists()
    with pytest.raises(TypeError, match=r"\['id'\]"):
        ft.logging.WandbSink(tmp_path / "r", id="x")


def test_profiler_traces_the_chosen_steps_with_their_ops(tmp_path):
    prof = ft.logging.Profiler(tmp_path / "prof", steps=(3, 4), warmup=1)
    _train(tmp_path / "run", lambda: prof, until=7, total=7, optimizer=ft.optim.adamw())
    (trace,) = prof.traces()
    assert trace.parent == tmp_path / "prof" and trace.name.endswith(".pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]  # Chrome trace format
    names = {e.get("name") for e in events}
    assert "aten::addmm" in names  # the Linear forward
    assert "aten::mse_loss" not in names and "aten::pow" in names  # our loss: (d ** 2).sum()
    assert "aten::_fused_adamw_" in names  # the optimizer step
    steps = sorted(n for n in names if (n or "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]  # 3 and 4; not the warmup step (#0)


def test_profiler_refuses_impossible_windows_and_skips_one_resumed_inside_it(tmp_path):
    with pytest.raises(ValueError, match="warmup \\+ 2 <= first"):
        ft.logging.Profiler(tmp_path, steps=(2, 3), warmup=1)
    with pytest.raises(ValueError, match="first <= last"):
        ft.logging.Profiler(tmp_path, steps=(5, 4))
    state = ft.TrainState.create(torch.nn.Linear(3, 1), ft.optim.sgd())
    for first_seen in (5, 6):  # step 5 (and 6) done first: recorded steps ran unprofiled
        prof = ft.logging.Profiler(tmp_path / str(first_seen), steps=(5, 6))
        with pytest.warns(RuntimeWarning, match=f"steps 5..{first_seen} ran unprofiled, so "
                          "this run writes no trace"):  # fmt: skip
            prof.step(state.replace(step=first_seen))
        for step in range(first_seen + 1, 9):
            prof.step(state.replace(step=step))  # no warning, no error: the loop goes on
        prof.close()
        assert prof.done and prof.traces() == [] and not (tmp_path / str(first_seen)).exists()
    late = ft.logging.Profiler(tmp_path / "late", steps=(5, 6))
    late.step(state.replace(step=9))  # resumed after the window: nothing to do
    late.close()
    assert late.traces() == []


def _profiled_steps(trace):
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::addmm" in names  # the steps' own ops
    return sorted(n for n in names if (n or "").startswith("ProfilerStep#"))


@pytest.mark.parametrize(("steps", "warmup", "recorded"), [
    ((6, 7), 3, ["ProfilerStep#1", "ProfilerStep#2"]),  # warmup 3..5: 5 left, as #0
    ((5, 6), 2, ["ProfilerStep#0", "ProfilerStep#1"]),  # warmup 3..4: none left
])  # fmt: skip
def test_a_run_resumed_in_the_profilers_warmup_records_the_chosen_steps(
    tmp_path, steps, warmup, recorded
):
    """A job resumed from a checkpoint inside the window raised in `step()` ("choose later
    steps"): restarted automatically, it resumed from the same checkpoint and crashed there
    again, every time. Resumed during the warmup, the chosen steps are all still ahead."""
    root = tmp_path / "run"
    _train(root, ft.logging.NullSink, until=4, total=7)  # killed at step 4; checkpoint at 3
    prof = ft.logging.Profiler(tmp_path / "prof", steps=steps, warmup=warmup)
    with pytest.warns(RuntimeWarning, match=f"profiling steps {steps[0]}..{steps[1]} after "
                      f"{int(recorded[0][-1])} warmup step"):  # fmt: skip
        _train(root, lambda: prof, until=7, total=7)  # resumes at 3: step 4 is seen first
    assert prof.done
    (trace,) = prof.traces()
    assert _profiled_steps(trace) == recorded


def test_a_run_resumed_past_the_profilers_first_step_is_not_crash_looped(tmp_path):
    root = tmp_path / "run"
    _train(root, ft.logging.NullSink, until=5, total=7)  # killed at step 5; checkpoint at 3
    for until in (5, 7):  # each restart resumes from step 3 (killed at 5 again, then done)
        prof = ft.logging.Profiler(tmp_path / "prof", steps=(4, 5), warmup=1)
        with pytest.warns(RuntimeWarning, match="steps 4..4 ran unprofiled"):
            _train(root, lambda p=prof: p, until=until, total=7)
        assert prof.traces() == []
    assert ft.latest_checkpoint(root).name == "step-7"  # the last step (total=7) is saved


def test_a_resumed_wandb_run_refuses_another_project_or_name_as_mlflow_does(tmp_path, monkeypatch):
    """The stored run id won silently over `project=`: W&B's resume="allow" started a new run
    of that id in the other project (MLflowSink refuses another experiment or run_name)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    root = tmp_path / "run"
    first = ft.logging.WandbSink(root, project="baseline", name="a")
    first.close()
    with pytest.raises(ValueError, match="whose project is 'baseline', but project='ablation'"):
        ft.logging.WandbSink(root, project="ablation")
    with pytest.raises(
        ValueError, match=r"whose name is 'a', but name='b' was given \(W&B would rename the run\)"
    ):
        ft.logging.WandbSink(root, project="baseline", name="b")
    (root / "wandb_run_identity.json").write_text('{"entity": "me", "project": "baseline"}')
    with pytest.raises(ValueError, match="whose entity is 'me', but entity='team'"):
        ft.logging.WandbSink(root, project="baseline", entity="team")
    assert len(list(root.glob("wandb/offline-run-*"))) == 1  # nothing was started elsewhere


def test_wandb_sink_without_project_takes_wandb_project(tmp_path, monkeypatch):
    """project="ftrain" was always passed to wandb.init, which wins over WANDB_PROJECT: a job
    that set it (HF's WandbCallback reads it) logged into another project, silently."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    sink = ft.logging.WandbSink(tmp_path / "run", rank=0)
    assert sink._run.project == "from-env"
    sink.close()
    monkeypatch.setenv("WANDB_PROJECT", "other")  # a restart resumes the run where it is
    resumed = ft.logging.WandbSink(tmp_path / "run", rank=0)
    assert (resumed.resumed, resumed._run.project) == (True, "from-env")
    resumed.close()


def test_a_resumed_wandb_run_stays_where_it_is_whatever_the_environment_says(tmp_path, monkeypatch):
    """A restart took WANDB_PROJECT (or WANDB_ENTITY) over the stored run's: a run made before
    the identity file was kept (always in "ftrain") resumed as a new run of its id in the
    variable's project, and one that had the file was refused, naming an argument not given."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    root = tmp_path / "run"
    ft.logging.WandbSink(root, rank=0).close()
    (root / "wandb_run_identity.json").unlink()  # a run made before ftrain kept the file
    monkeypatch.setenv("WANDB_PROJECT", "team-proj")
    old = ft.logging.WandbSink(root, rank=0)
    assert (old.resumed, old._run.project) == (True, "ftrain")
    old.close()
    identity = json.loads((root / "wandb_run_identity.json").read_text())
    assert identity["project"] == "ftrain"
    monkeypatch.setenv("WANDB_ENTITY", "team")
    (root / "wandb_run_identity.json").write_text('{"entity": "me", "project": "ftrain"}')
    again = ft.logging.WandbSink(root, rank=0)
    assert (again._run.project, again._run.entity) == ("ftrain", "me")
    again.close()


def test_mlflow_sink_without_experiment_takes_mlflow_experiment_name(
    tmp_path, mlflow_uri, monkeypatch
):
    """experiment="ftrain" was always passed: a job that set MLFLOW_EXPERIMENT_NAME (read by
    MLflow's own client and HF's MLflowCallback) logged into another experiment, silently."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    sink = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=mlflow_uri, rank=0)
    sink.close()
    client = MlflowClient(mlflow_uri)
    run = client.get_run(sink.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "from-env"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "other")  # a restart resumes the run
    resumed = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=mlflow_uri, rank=0)
    assert (resumed.resumed, resumed.run_id) == (True, sink.run_id)
    resumed.close()


def test_a_resumed_mlflow_run_takes_no_experiment_from_the_environment(
    tmp_path, mlflow_uri, monkeypatch
):
    """A restart without experiment= took MLFLOW_EXPERIMENT_NAME as given: a run made in
    "ftrain" (the default before the variable was read) was refused once it was set, with a
    message blaming an experiment= that was never passed."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    root = tmp_path / "run"
    first = ft.logging.MLflowSink(root, tracking_uri=mlflow_uri, rank=0)
    first.log({"step": 1, "loss": 1.0})
    first.close()
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-exp")
    again = ft.logging.MLflowSink(root, tracking_uri=mlflow_uri, rank=0)
    again.log({"step": 2, "loss": 0.5})
    again.close()
    client = MlflowClient(mlflow_uri)
    run = client.get_run(first.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "ftrain"
    assert [m.step for m in client.get_metric_history(first.run_id, "loss")] == [1, 2]
    with pytest.raises(ValueError, match="whose experiment is 'ftrain', but experiment='x'"):
        ft.logging.MLflowSink(root, tracking_uri=mlflow_uri, experiment="x")  # given: checked


def test_an_unreachable_mlflow_server_is_not_said_to_lack_the_stored_run(tmp_path, monkeypatch):
    """Any MlflowException (a connection error too) was reported as "tracking_uri does not hold
    it ... delete the file to start a new run": advice that loses the run's history."""
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    (tmp_path / "mlflow_run_id").write_text("0123456789abcdef0123456789abcdef\n")
    with pytest.raises(MlflowException) as raised:
        ft.logging.MLflowSink(tmp_path, tracking_uri="http://127.0.0.1:9")
    assert "does not hold" not in str(raised.value)
    assert raised.value.error_code != "RESOURCE_DOES_NOT_EXIST"


def test_a_stored_run_the_mlflow_store_lacks_is_named(tmp_path, mlflow_uri):
    (tmp_path / "mlflow_run_id").write_text("0123456789abcdef0123456789abcdef\n")
    with pytest.raises(ValueError, match=r"which tracking_uri='file:.*' does not hold"):
        ft.logging.MLflowSink(tmp_path, tracking_uri=mlflow_uri)


def _outer_run(uri, experiment="outer", **params):
    """A run made as `mlflow run` makes one for its entry point (its params logged), whose id
    it passes to the job as MLFLOW_RUN_ID."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment(experiment), run_name="job").info.run_id
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    return client, run_id


def test_mlflow_sink_logs_into_the_run_mlflow_run_id_names_and_keeps_it(
    tmp_path, mlflow_uri, monkeypatch
):
    """MLFLOW_RUN_ID (set by `mlflow run` and Azure ML, resumed by mlflow.start_run()) was
    ignored: the sink made a run of its own, and the run the job is watched in stayed empty."""
    client, outer = _outer_run(mlflow_uri, lr=0.1)
    client.set_terminated(outer)  # reopened as mlflow.start_run(run_id) does
    monkeypatch.setenv("MLFLOW_RUN_ID", outer)
    root = tmp_path / "run"
    params = {"lr": 0.1, "seed": 0}
    first = _train(
        root, lambda: ft.logging.MLflowSink(root, tracking_uri=mlflow_uri, params=params), until=5
    )
    assert (first.run_id, first.resumed) == (outer, True)
    assert client.get_run(outer).info.status == "RUNNING"
    assert (root / "mlflow_run_id").read_text().strip() == outer
    monkeypatch.delenv("MLFLOW_RUN_ID")  # a restart without it resumes the run from the file
    second = _train(root, lambda: ft.logging.MLflowSink(root, tracking_uri=mlflow_uri), until=6)
    assert second.run_id == outer
    second.close()
    runs = client.search_runs([client.get_run(outer).info.experiment_id, "0"])
    assert [r.info.run_id for r in runs] == [outer]  # no run of the sink's own
    run = client.get_run(outer)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1", "seed": "0"}
    assert sorted(m.step for m in client.get_metric_history(outer, "loss")) == [
        1, 2, 3, 4, 4, 5, 5, 6
    ]  # fmt: skip
    assert client.get_experiment_by_name("ftrain") is None


def test_a_run_mlflow_run_id_names_is_checked_as_a_restarts_run_is(
    tmp_path, mlflow_uri, monkeypatch
):
    client, outer = _outer_run(mlflow_uri, lr=0.1)
    monkeypatch.setenv("MLFLOW_RUN_ID", outer)
    root = tmp_path / "run"

    def sink(**kwargs):
        return ft.logging.MLflowSink(root, tracking_uri=mlflow_uri, **kwargs)

    with pytest.raises(ValueError, match=r"params differ.*'lr'"):
        sink(params={"lr": 0.2})
    with pytest.raises(
        ValueError, match=r"MLFLOW_RUN_ID names MLflow run .*, whose experiment is 'outer', but "
        r"experiment='x' was given.*or unset MLFLOW_RUN_ID for a new run"
    ):  # fmt: skip
        sink(experiment="x")
    # The platform's run keeps its name (MLflow's start_run(run_id=...) does): a script's
    # run_name there was refused, stopping every Azure ML job that named its runs.
    with pytest.warns(UserWarning, match="named 'job'; run_name='other' is not applied to it"):
        named = ft.logging.MLflowSink(
            tmp_path / "named", tracking_uri=mlflow_uri, run_name="other", rank=0
        )
    named.close()
    assert named.run_id == outer and client.get_run(outer).info.run_name == "job"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "elsewhere")  # the run's own experiment wins
    sink(rank=0, experiment="outer", run_name="job").close()
    (root / "mlflow_run_id").write_text(outer + "\n")
    _, other = _outer_run(mlflow_uri, experiment="second")
    monkeypatch.setenv("MLFLOW_RUN_ID", other)
    with pytest.raises(ValueError, match=f"names MLflow run '{outer}' but MLFLOW_RUN_ID='{other}'"):
        sink()
    (root / "mlflow_run_id").unlink()
    quiet = sink(rank=1)  # off rank 0: nothing is read or written
    quiet.log({"step": 1, "loss": 1.0})
    assert quiet.run_id is None and not (root / "mlflow_run_id").exists()
    client.delete_run(other)
    with pytest.raises(ValueError, match=f"MLFLOW_RUN_ID names MLflow run '{other}', which was "
                       "deleted"):  # fmt: skip
        sink()
    monkeypatch.setenv("MLFLOW_RUN_ID", "0123456789abcdef0123456789abcdef")
    with pytest.raises(ValueError, match=r"MLFLOW_RUN_ID names .* does not hold; pass the "
                       r"tracking_uri that holds it, or unset MLFLOW_RUN_ID"):  # fmt: skip
        sink()
    assert not (root / "mlflow_run_id").exists()
    assert [r.info.run_id for r in client.search_runs(["0"])] == []  # no run was made


def test_mlflow_sink_without_experiment_takes_mlflow_experiment_id(
    tmp_path, mlflow_uri, monkeypatch
):
    """`mlflow run` names the job's experiment by MLFLOW_EXPERIMENT_ID: a new run went to
    "ftrain", leaving that experiment empty. MLflow's order: the name variable first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    exp_id = client.create_experiment("by-id")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp_id)
    sink = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=mlflow_uri, rank=0)
    sink.close()
    assert client.get_run(sink.run_id).info.experiment_id == exp_id
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "by-name")  # the name wins, as in MLflow
    named = ft.logging.MLflowSink(tmp_path / "other", tracking_uri=mlflow_uri, rank=0)
    named.close()
    run = client.get_run(named.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "by-name"
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    client.delete_experiment(exp_id)
    with pytest.raises(ValueError, match=f"MLFLOW_EXPERIMENT_ID='{exp_id}' is deleted"):
        ft.logging.MLflowSink(tmp_path / "third", tracking_uri=mlflow_uri, rank=0)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "987654321")
    with pytest.raises(ValueError, match="MLFLOW_EXPERIMENT_ID='987654321' is not in the"):
        ft.logging.MLflowSink(tmp_path / "fourth", tracking_uri=mlflow_uri, rank=0)


def test_wandb_sink_takes_wandb_run_id_for_a_new_run_and_refuses_another_on_resume(
    tmp_path, monkeypatch
):
    """wandb.init(id=<stored id>) won over WANDB_RUN_ID: a restart told to log into the job's
    run resumed the stored one, and the job's run stayed empty."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_RUN_ID", "job-run-1")
    sink = ft.logging.WandbSink(tmp_path / "run", rank=0)
    assert sink.run_id == "job-run-1"
    sink.close()
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == "job-run-1"
    again = ft.logging.WandbSink(tmp_path / "run", rank=0)  # the same id: a resume
    assert (again.resumed, again.run_id) == (True, "job-run-1")
    again.close()
    monkeypatch.setenv("WANDB_RUN_ID", "job-run-2")
    with pytest.raises(ValueError, match="names W&B run 'job-run-1' but WANDB_RUN_ID='job-run-2'"):
        ft.logging.WandbSink(tmp_path / "run", rank=0)
    import wandb

    wandb.teardown()  # W&B keeps the variables it read at its setup for the process
