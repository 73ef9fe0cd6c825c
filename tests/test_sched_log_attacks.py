"""Silent failures found by attacking schedules, predicates, precision and the logging sinks.

Each test failed (a wrong value, or an argument or record dropped without an error) before its
fix.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import ftrain as ft
from ftrain.precision import LossScaling

BATCH = [(torch.ones(4, 2), torch.zeros(4, 1))]


def _mse(model, batch):
    return ((model(batch[0]) - batch[1]) ** 2).sum(), torch.tensor(4)


def _state():
    torch.manual_seed(0)
    return ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())


def _step(state):
    grads, stats = ft.accumulate_grads(state, BATCH, _mse)
    state, info = ft.clip_and_step(state, grads, stats=stats, lr=0.01)
    return state, stats, info


# --- Logger -------------------------------------------------------------------------------


def test_logger_built_before_a_checkpoint_load_counts_tokens_from_the_loaded_state():
    """A Logger built on the fresh state, then a checkpoint loaded (here: 6 steps run without
    it): the window counted tokens from 0, so the first record's tokens_per_second held every
    token of the 6 earlier steps (32 tokens over 2 steps' time for 8)."""
    state = _state()
    logger = ft.logging.Logger(state, every=2, progress=False, first=False)
    for _ in range(6):
        state, _, _ = _step(state)
    seen = int(state.data.tokens_seen)
    state, stats, info = _step(state)
    assert logger.step(state, stats, info) is None
    assert int(logger.window.start_tokens) == seen
    assert int(logger.window.start_samples) == int(state.data.samples_seen) - 4


def test_logger_refuses_a_step_that_skips_steps():
    """`logger.step` called only on log steps: each record's loss was the one step's, not the
    window's mean, without an error."""
    state = _state()
    logger = ft.logging.Logger(state, every=3, progress=False, first=False)
    calls = 0
    for _ in range(6):
        state, stats, info = _step(state)
        if ft.should_log(state, every=3):
            calls += 1
            if calls == 1:  # the first: like a checkpoint loaded after building the logger
                logger.step(state, stats, info)
            else:
                with pytest.raises(ValueError, match=r"got step 6 after step 3: call it after"):
                    logger.step(state, stats, info)


def test_logger_times_the_step_after_a_rollback_from_the_last_step_s_end(monkeypatch):
    """After a rollback (or a checkpoint loaded after building the logger) the new window
    opened when the step was already done: its tokens over no time at all, so the first
    record's tokens_per_second was ~1e9 times the real one (4 tokens a second here)."""
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    state = _state()
    logger = ft.logging.Logger(state, every=1, progress=False)
    rates = []
    for _ in range(3):
        state, stats, info = _step(state)
        clock[0] += 1.0  # each step takes a second
        rates.append(logger.step(state, stats, info)["tokens_per_second"])
    state, stats, info = _step(state.replace(step=1))  # rolled back to step 1, step 2 again
    clock[0] += 1.0
    rates.append(logger.step(state, stats, info)["tokens_per_second"])
    assert rates == [4.0, 4.0, 4.0, 4.0]


# --- sinks --------------------------------------------------------------------------------


def test_jsonl_sink_logs_numpy_values_and_refuses_arrays(tmp_path):
    """A 0-dim numpy array (np.mean(x, keepdims=False) of an array, a reward) made json.dumps
    fail, while the trackers skipped it without a word."""
    path = tmp_path / "m.jsonl"
    sink = ft.logging.JSONLSink(path)
    sink.log({"step": 1, "reward": np.array(1.5), "nested": {"a": np.array([2.5])}})
    with pytest.raises(TypeError, match=r"record\['reward'\] is an array of shape \(2,\)"):
        sink.log({"step": 2, "reward": np.array([1.0, 2.0])})
    sink.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 1, "reward": 1.5, "nested": {"a": 2.5}}]


@pytest.mark.parametrize("step", [10.5, 10.0, True, -1, None, torch.tensor(2.5)])
def test_sinks_refuse_a_step_that_is_not_an_int(tmp_path, step):
    """The trackers logged `int(step)` (10.5 at 10); JSONL wrote a line that read_jsonl then
    skipped as having no integer step."""
    sink = ft.logging.JSONLSink(tmp_path / "m.jsonl")
    with pytest.raises(TypeError, match="'step' must be an int >= 0"):
        sink.log({"step": step, "loss": 1.0})
    sink.log({"step": torch.tensor(3), "loss": 1.0})  # an integer tensor is an int
    sink.close()
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 3, "loss": 1.0}\n'


def test_tensorboard_sink_refuses_a_float_step(tmp_path):
    pytest.importorskip("tensorboard")
    sink = ft.logging.TensorBoardSink(tmp_path)
    with pytest.raises(TypeError, match=r"'step' must be an int >= 0, got 10\.5"):
        sink.log({"step": 10.5, "loss": 1.0})
    sink.close()


def test_mlflow_sink_logs_numpy_values_and_refuses_records_after_close(tmp_path, monkeypatch):
    """A 0-dim numpy value was dropped (JSONL raised on it), and a record sent after close()
    (the final evaluation after logger.close()) was dropped without an error."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    sink = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=uri)
    sink.log({"step": 1, "reward": np.array(1.5), "score": np.float32(0.25)})
    with pytest.raises(TypeError, match=r"record\['b'\] is an array of shape \(2,\)"):
        sink.log({"step": 1, "b": np.array([1.0, 2.0])})
    sink.close()
    with pytest.raises(ValueError, match="MLflowSink is closed"):
        sink.log({"step": 2, "eval_loss": 1.0})
    sink.close()  # a second close does nothing
    assert MlflowClient(uri).get_run(sink.run_id).data.metrics == {"reward": 1.5, "score": 0.25}
    quiet = ft.logging.MLflowSink(tmp_path / "other", tracking_uri=uri, rank=1)
    quiet.close()
    quiet.log({"step": 3, "loss": 1.0})  # off rank 0 every record is dropped, closed or not


# --- precision ----------------------------------------------------------------------------


@pytest.mark.parametrize("init_scale", [1e39, 2.0**200, 1e-46])
def test_loss_scaling_refuses_an_init_scale_float32_cannot_hold(init_scale):
    """1e39 became an inf float32 scale (every step skipped, inf * backoff stays inf), 1e-46 a
    zero one (every gradient 0 / 0): training stopped while the loop ran on."""
    with pytest.raises(ValueError, match="init_scale must be within float32's normal range"):
        LossScaling(init_scale=init_scale)
    assert LossScaling(init_scale=2.0**120).init_scale == 2.0**120  # large but finite: fine


# --- schedules ----------------------------------------------------------------------------


def test_schedule_refuses_a_fractional_step_tensor():
    """`hasattr(step, "__index__")` let a float tensor through: lr(tensor(2.5)) was 0.625."""
    lr = ft.schedules.warmup_linear(1.0, warmup_steps=4, total_steps=10)
    with pytest.raises(TypeError, match="step must be an int"):
        lr(torch.tensor(2.5))
    with pytest.raises(TypeError, match="step must be an int"):
        lr(True)
    assert lr(torch.tensor(3)) == lr(np.int64(3)) == lr(3) == 0.75


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: ft.schedules.cosine_with_min_lr(0.1, 0, 10, min_lr=0.5), r"min_lr \(0.5\)"),
        (lambda: ft.schedules.cosine_with_min_lr(0.1, 0, 10, min_lr_rate=2.0), "min_lr_rate"),
        (
            lambda: ft.schedules.from_name(
                "cosine_warmup_with_min_lr", peak_lr=0.1, total_steps=10, min_lr=0.2
            ),
            r"min_lr \(0.2\) must be <= peak_lr",
        ),
    ],
)
def test_min_lr_above_the_peak_is_refused(build, match):
    """The "decay to min_lr" rose from peak_lr to min_lr (0.1 to 0.5 over the run)."""
    with pytest.raises(ValueError, match=match):
        build()
    lr = ft.schedules.cosine_with_min_lr(0.1, 0, 10, min_lr=0.1)  # equal: a constant
    assert [lr(s) for s in (0, 5, 10)] == pytest.approx([0.1, 0.1, 0.1])


@pytest.mark.parametrize("lr", [math.nan, math.inf, -1.0, True, "1e-3"])
def test_plateau_init_refuses_an_lr_that_is_no_finite_number(lr):
    """A NaN lr was never reduced (nan - new > eps is False), a string failed at the first
    reduction, mid-run."""
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        ft.schedules.Plateau(patience=0).init(lr)


def test_first_record_after_a_resume_off_the_log_cadence_averages_the_resumed_steps(tmp_path):
    """What docs/logging.md says (it said "logged twice, with equal values"): a checkpoint at
    step 3, every=2: the resumed run's record at 4 is step 4's loss alone; the interrupted
    run's was the mean of steps 3 and 4. Later records are equal."""

    def run(until, out):
        state = _state()
        if (ckpt := ft.latest_checkpoint(tmp_path)) is not None:
            state = ft.load_checkpoint(ckpt, state)
        logger = ft.logging.Logger(state, every=2, progress=False, first=False)
        while state.step < until:
            state, stats, info = _step(state)
            out["losses"][state.step] = float(stats.loss)
            if (record := logger.step(state, stats, info)) is not None:
                out["records"].append((record["step"], record["loss"]))
            if state.step == 3:
                ft.save_checkpoint(state, tmp_path)

    first = {"losses": {}, "records": []}
    run(5, first)
    resumed = {"losses": {}, "records": []}
    run(6, resumed)
    assert resumed["losses"][4] == first["losses"][4]  # resume is exact
    assert first["records"][1] == (4, pytest.approx((first["losses"][3] + first["losses"][4]) / 2))
    assert resumed["records"][0] == (4, pytest.approx(resumed["losses"][4]))
    assert resumed["records"][1] == (
        6,
        pytest.approx((resumed["losses"][5] + resumed["losses"][6]) / 2),
    )


def test_tensorboard_sink_refuses_two_fields_of_one_name(tmp_path):
    """`{"tasks/a": 1.0, "tasks": {"a": 2.0}}`: the trackers logged one of the two values."""
    pytest.importorskip("tensorboard")
    sink = ft.logging.TensorBoardSink(tmp_path)
    with pytest.raises(ValueError, match="two values named 'tasks/a'"):
        sink.log({"step": 1, "tasks/a": 1.0, "tasks": {"a": 2.0}})
    sink.log({"step": 1, "tasks": {"a": 2.0, "b": 3.0}, "a": 1.0})  # distinct names: fine
    sink.close()
