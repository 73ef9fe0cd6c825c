"""Log windows (HF's definitions, no host sync until emit), sinks, plots, throughput figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import ftrain as ft
from helpers import ragged_rows, tiny_llama, within


def _stats(loss, tokens=10, samples=2, micro=1):
    t = torch.tensor
    return ft.Stats(t(float(loss)), t(tokens), t(tokens), t(samples), micro)


def _info(norm=1.0, skipped=False, lr=0.1):
    return ft.StepInfo(torch.tensor(norm), torch.tensor(skipped), lr)


def _advance(state, stats):
    d = state.data
    return state.replace(
        step=state.step + 1,
        data=d.replace(
            cursor=d.cursor + stats.num_micro,
            tokens_seen=d.tokens_seen + stats.num_tokens,
            samples_seen=d.samples_seen + stats.num_samples,
        ),
    )


def test_record_follows_hf_definitions():
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    w = ft.logging.window(state)
    for i, loss in enumerate([1.0, 2.0, 3.0]):
        stats = _stats(loss)
        w = ft.logging.update(w, stats, _info(norm=10.0 + i, skipped=i == 1, lr=0.01 * (i + 1)))
        state = _advance(state, stats)
    state = state.replace(epoch=1)
    rec, w2 = ft.logging.emit(w, state, epoch_size=12, flops_per_token=100.0, peak_flops=1e6)
    assert rec["loss"] == pytest.approx(2.0)  # mean of the step losses since the last log
    assert rec["learning_rate"] == 0.03 and rec["grad_norm"] == 12.0  # of the last step
    assert rec["step"] == 3 and rec["epoch"] == pytest.approx(1 + 3 / 12)
    assert rec["tokens_seen"] == 30 and rec["samples_seen"] == 6 and rec["skipped_steps"] == 1
    assert rec["tokens_per_second"] > 0 and rec["samples_per_second"] > 0
    assert rec["flops_per_second"] == pytest.approx(100.0 * rec["tokens_per_second"])
    assert rec["mfu"] == pytest.approx(rec["flops_per_second"] / 1e6)
    assert rec["peak_memory_mb"] > 0
    assert w2.steps == 0 and w2.start_tokens is state.data.tokens_seen
    with pytest.raises(ValueError, match="at least one"):
        ft.logging.emit(w2, state)
    w2 = ft.logging.update(w2, _stats(1.0), _info())
    # Accepted and ignored before: epoch_size=0 (no fractional epoch), peak_flops alone (no mfu).
    with pytest.raises(ValueError, match="epoch_size"):
        ft.logging.emit(w2, state, epoch_size=0)
    with pytest.raises(ValueError, match=r"peak_flops.*flops_per_token"):
        ft.logging.emit(w2, state, peak_flops=1e12)
    with pytest.raises(ValueError, match="peak_flops"):
        ft.logging.Logger(state, every=1, progress=False, flops_per_token=1.0, peak_flops=0)


def test_nan_inf_filter_is_hfs_rule():
    # HF (logging_nan_inf_filter): a non-finite step loss adds tr_loss / (steps so far + 1).
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    w = ft.logging.window(state)
    for loss in [1.0, 2.0, math.nan, math.inf, 4.0]:
        w = ft.logging.update(w, _stats(loss), _info())
    # sums: 1, 3, 3 + 3/3 = 4, 4 + 4/4 = 5, 9  ->  mean over 5 steps
    rec, _ = ft.logging.emit(w, state)
    assert rec["loss"] == pytest.approx(9 / 5)


def test_update_never_reads_the_device_and_emit_reads_once(monkeypatch):
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    w = ft.logging.window(state)
    reads = []

    def read(name):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, **k):
            reads.append(name)
            return real(self, *a, **k)

        return spy

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, read(name))
    stats, info = _stats(1.5), _info()
    reads.clear()
    for _ in range(4):
        w = ft.logging.update(w, stats, info)
    assert reads == []
    ft.logging.emit(w, state)
    assert reads == ["tolist"]
    # The one-call Logger: no read between log steps, one read on a log step.
    logger = ft.logging.Logger(state, every=4, first=False, progress=False)
    for step in range(1, 9):
        reads.clear()
        record = logger.step(state.replace(step=step), stats, info)
        assert reads == (["tolist"] if step % 4 == 0 else []), step
        assert (record is not None) == (step % 4 == 0)
    assert logger.flush(state.replace(step=8)) is None  # nothing since the last record
    logger.step(state.replace(step=9), stats, info)
    reads.clear()
    assert logger.flush(state.replace(step=9))["step"] == 9 and reads == ["tolist"]


def test_window_in_a_real_loop_reports_the_mean_step_loss():
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw())
    rows = ragged_rows(24, seed=2)
    w, losses = ft.logging.window(state), []
    for micro in ft.make_batches(rows, batch_size=4, accum=2, seed=0):
        grads, stats = ft.accumulate_grads(state, micro)
        state, info = ft.clip_and_step(state, grads, stats=stats, lr=1e-3, max_norm=1.0)
        w = ft.logging.update(w, stats, info)
        losses.append(float(stats.loss))
    rec, _ = ft.logging.emit(w, state, epoch_size=ft.data.num_micro_batches(24, 4))
    assert rec["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    assert rec["epoch"] == 1.0 and rec["step"] == 3
    assert rec["grad_norm"] == pytest.approx(float(info.grad_norm))
    assert rec["tokens_seen"] == sum(len(r["input_ids"]) for r in rows)


def test_logger_is_the_log_step_in_one_call(tmp_path):
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw())
    rows = ragged_rows(24, seed=2)
    sink = ft.logging.JSONLSink(tmp_path / "m.jsonl")
    logger = ft.logging.Logger(state, every=2, total_steps=6, sinks=[sink], progress=False)
    manual, returned, losses = ft.logging.window(state), [], []
    while state.step < 6:
        for micro in ft.make_batches(rows, state, batch_size=4, accum=2):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro)
            state, info = ft.clip_and_step(state, grads, stats=stats, lr=1e-3)
            returned.append(logger.step(state, stats, info))
            manual = ft.logging.update(manual, stats, info)
            losses.append(float(stats.loss))
            if ft.should_log(state, every=2, first=True):
                expected, manual = ft.logging.emit(manual, state, epoch_size=6)
                if state.step > 3:  # the epoch size is learned when the first epoch ends
                    assert returned[-1]["epoch"] == expected["epoch"]
                assert returned[-1]["loss"] == pytest.approx(expected["loss"], rel=1e-12)
        else:
            state = ft.next_epoch(state)
    logger.log({"step": 6, "eval_loss": 1.0})
    logger.close()
    assert [r is not None for r in returned] == [True, True, False, True, False, True]
    assert logger.epoch_size == 6  # micro-batches: 24 rows / 4 per micro-batch
    recs = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 4, 6, 6] and recs[-1] == {
        "step": 6,
        "eval_loss": 1.0,
    }
    assert recs[2]["loss"] == pytest.approx((losses[2] + losses[3]) / 2, rel=1e-12)
    assert recs[2]["epoch"] == round(1 + 2 / 6, 4)
    with pytest.raises(ValueError, match="total_steps"):
        ft.logging.Logger(state, every=10)  # a progress bar needs the run's length
    with pytest.raises(ValueError, match="every"):
        ft.logging.Logger(state, every=0, total_steps=10)
    with pytest.raises(ValueError, match="step"):
        logger.log({"eval_loss": 1.0})


def test_progress_prints_lines_without_a_terminal(capsys):
    # Issue 19: nothing at all was printed under nohup/CI/SLURM.
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    logger = ft.logging.Logger(state, every=1, total_steps=3)  # pytest's stderr is no terminal
    logger.step(state.replace(step=1), _stats(2.5), _info(norm=0.5, lr=1e-3))
    logger.log({"step": 1, "eval_loss": 2.25, "eval_items": 10})
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1/3  loss 2.5  learning_rate 0.001  grad_norm 0.5  ")
    assert out[1].startswith("step 1/3  eval_loss 2.25  ") and "eval_items" not in out[1]
    assert len(out) == 2
    quiet = ft.logging.ProgressBar(3, rank=1)  # other ranks print nothing
    quiet.log({"step": 1, "loss": 1.0})
    assert not quiet.enabled and capsys.readouterr().out == ""


def test_bar_keeps_the_train_loss_beside_eval_and_starts_at_the_resumed_step(capsys):
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).replace(step=50)
    logger = ft.logging.Logger(state, every=1, total_steps=100, progress=False)
    bar = ft.logging.ProgressBar(100, rank=0, initial=state.step, lines=False)
    logger.sink = ft.logging.Sinks(bar)
    assert "50/100" in capsys.readouterr().err  # not 0/100: rate and ETA count from 50
    logger.step(state.replace(step=51), _stats(1.5), _info(lr=3e-4))
    logger.log({"step": 51, "eval_loss": 1.25})
    bar._bar.refresh()
    err = capsys.readouterr().err
    assert "51/100" in err and "loss=1.5" in err and "eval_loss=1.25" in err
    assert "learning_rate=0.0003" in err
    logger.close()


# --- sinks ---------------------------------------------------------------------------------------


def test_jsonl_sink_writes_strict_json_and_appends(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    sink = ft.logging.JSONLSink(path)
    sink.log({"step": 1, "loss": 2.5, "grad_norm": math.nan})
    sink.log({"step": 2, "eval_loss": 2.0})
    sink.close()
    again = ft.logging.JSONLSink(path)  # a resumed run appends
    again.log({"step": 2, "eval_loss": 1.9})
    again.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "loss": 2.5, "grad_norm": None},
        {"step": 2, "eval_loss": 2.0},
        {"step": 2, "eval_loss": 1.9},
    ]
    assert "NaN" not in path.read_text()
    recs = ft.logging.read_jsonl(path)  # the last record per step and kind wins
    assert recs == [{"step": 1, "loss": 2.5, "grad_norm": None}, {"step": 2, "eval_loss": 1.9}]


def test_tensorboard_sink_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = ft.logging.TensorBoardSink(tmp_path)
    for step in (1, 2):
        sink.log({"step": step, "loss": 3.0 - step, "learning_rate": 0.1, "note": "x"})
    sink.log({"step": 2, "eval_loss": 1.5})
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert {"train/loss", "train/learning_rate", "eval/loss"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.0)]


def test_progress_bar_prints_lines_without_a_terminal_and_is_off_on_other_ranks(capsys):
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    assert ft.logging.ProgressBar(10).lines  # pytest's stderr is not a TTY
    assert not ft.logging.ProgressBar(10, rank=1).enabled
    bar = ft.logging.ProgressBar(10, enabled=True, lines=False)
    bar.step(state.replace(step=4))
    bar.log({"step": 4, "loss": 1.23456, "learning_rate": 3e-4})
    bar.step(state.replace(step=10))
    bar.close()
    err = capsys.readouterr().err
    assert "10/10" in err and "loss=1.235" in err and "learning_rate=0.0003" in err


def test_sinks_compose_and_reject_non_sinks(tmp_path):
    a, b = ft.logging.JSONLSink(tmp_path / "a.jsonl"), ft.logging.JSONLSink(tmp_path / "b.jsonl")
    with ft.logging.Sinks(a, b, ft.logging.NullSink()) as sink:
        sink.log({"step": 1, "loss": 1.0})
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text() != ""
    with pytest.raises(TypeError, match="not a Sink"):
        ft.logging.Sinks(print)


class _Recorder:
    """A user's sink: records how it was closed; `plain` ones have the old `close(self)`."""

    def __init__(self, closes, name, *, fail_log=False, fail_close=False):
        self.closes, self.name, self.fail_log, self.fail_close = closes, name, fail_log, fail_close

    def step(self, state):
        pass

    def log(self, record):
        if self.fail_log:
            raise OSError(f"{self.name} could not send the record")

    def close(self, *, failed=False):
        self.closes.append((self.name, failed))
        if self.fail_close:
            raise OSError(f"{self.name} could not close")


class _Plain(_Recorder):
    def close(self):
        self.closes.append((self.name, "plain"))


def test_logger_tells_sinks_that_take_it_whether_the_run_failed():
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    for raised in (False, True):
        closes = []
        sinks = [_Recorder(closes, "kw"), _Plain(closes, "plain")]
        try:
            with ft.logging.Logger(state, every=1, sinks=sinks, progress=False) as logger:
                if raised:
                    raise RuntimeError("the block failed")
        except RuntimeError:
            pass
        logger.close()  # a plain close is a normal finish (the trackers ignore a second one)
        assert closes == [("kw", raised), ("plain", "plain"), ("kw", False), ("plain", "plain")]
    closes = []
    logger = ft.logging.Logger(state, every=1, sinks=[_Recorder(closes, "kw")], progress=False)
    logger.close(failed=True)
    assert closes == [("kw", True)]


def test_sinks_close_every_sink_when_one_fails_to_close():
    """One sink that raised while closing left the sinks after it open (an MLflow run stayed
    RUNNING)."""
    closes = []
    sink = ft.logging.Sinks(
        _Recorder(closes, "a", fail_close=True),
        _Recorder(closes, "b", fail_close=True),
        _Plain(closes, "c"),
    )
    with pytest.raises(OSError, match="a could not close"):  # the first error
        sink.close()
    assert closes == [("a", False), ("b", False), ("c", "plain")]
    closes = []
    with (
        pytest.raises(RuntimeError),
        ft.logging.Sinks(_Recorder(closes, "kw"), _Plain(closes, "p")),
    ):
        raise RuntimeError("the block failed")
    assert closes == [("kw", True), ("p", "plain")]


def test_logger_close_closes_the_sinks_as_failed_when_the_last_record_is_refused():
    """A final record that a sink refused left every sink open."""
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    closes = []
    sinks = [_Recorder(closes, "kw", fail_log=True), _Plain(closes, "plain")]
    logger = ft.logging.Logger(state, every=10, sinks=sinks, progress=False, first=False)
    stats = _stats(1.0)
    logger.step(_advance(state, stats), stats, _info())  # step 1 of 10: not a log step
    with pytest.raises(OSError, match="kw could not send the record"):
        logger.close()  # emits step 1, which the sink refuses: the run did not finish
    assert closes == [("kw", True), ("plain", "plain")]


def test_plot_cli_writes_a_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = ft.logging.JSONLSink(path)
    for step in range(1, 21):
        sink.log({"step": step, "loss": 3 / step, "learning_rate": 1e-3, "grad_norm": 1.0})
        if step % 5 == 0:
            sink.log({"step": step, "eval_loss": 3.5 / step})
    sink.close()
    out = tmp_path / "curves.png"
    run = subprocess.run(
        [sys.executable, "-m", "ftrain", "plot", str(path), "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    run = subprocess.run(
        [sys.executable, "-m", "ftrain", "plot", str(empty), "-o", str(tmp_path / "x.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1 and "no log record" in run.stderr


_DEEP = b'{"step": 3, "loss": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
_HUGE = b'{"step": 4, "loss": 1' + b"0" * 399 + b"}"  # 400 digits: no float holds it
_HUGE_STEP = b'{"step": 1' + b"0" * 399 + b', "loss": 1.0}'
_CUT = '{"step": 21, "loss": "\u00e9'.encode()[:-1]  # the last line, cut inside a character


def _log_with(tmp_path, bad_lines):
    """A 20-step log with `bad_lines` (bytes) after line 5, and `_CUT` as its last line."""
    good = [
        json.dumps({"step": s, "loss": 3 / s, "learning_rate": 1e-3, "grad_norm": 1.0}).encode()
        for s in range(1, 21)
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join([*good[:5], *bad_lines, *good[5:]]) + b"\n" + _CUT)
    return path


@pytest.mark.parametrize("bad", [_DEEP, _HUGE, _HUGE_STEP], ids=["deep", "huge", "huge_step"])
def test_plot_skips_and_reports_a_bad_line_and_plots_the_rest(tmp_path, capsys, bad):
    # Before: a traceback (RecursionError, OverflowError) or "error: 'utf-8' codec can't
    # decode" and no plot (issue 27, item 14).
    from ftrain.extras.cli import main

    path = _log_with(tmp_path, [bad])
    with within(30, "plot"):
        assert main(["plot", str(path), "-o", str(tmp_path / "c.png")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("wrote ") and (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")
    why = {_DEEP: "nested too deeply", _HUGE: "an integer of 400 digits, too large for a float",
           _HUGE_STEP: "an integer of 400 digits, too large for a float"}[bad]  # fmt: skip
    assert err == (
        f"warning: skipped 2 bad line(s) of {path}: line 6 ({why}), line 22 (not UTF-8 text "
        "(cut inside a character?))\n"
    )


def test_read_jsonl_reports_every_bad_line_and_keeps_the_good_ones(tmp_path, capsys):
    cut = b'{"step": 7, "loss": [1, 2, {"a": "}'
    others = [b"not json", b"[1, 2]", b'{"step": true, "loss": 1}', b'{"step": -1}',
              b'{"step": 2.0}', b"", b"   ", cut]  # fmt: skip
    path = _log_with(tmp_path, [_DEEP, _HUGE, *others])
    bad = []
    records = ft.logging.read_jsonl(path, on_bad_line=lambda n, why: bad.append((n, why)))
    assert [r["step"] for r in records] == list(range(1, 21))
    assert [n for n, _ in bad] == [6, 7, 8, 9, 10, 11, 12, 15, 31]  # blank lines are no error
    assert bad[2][1].startswith("not JSON (") and bad[3][1] == "no integer 'step' in [0, 2**63)"
    assert ft.logging.read_jsonl(path) == records  # silently without a callback
    # Many bad lines: the count, the first 20 with why, and how many more.
    from ftrain.extras.cli import main

    path.write_bytes(b"\n".join([b"x"] * 25 + [b'{"step": 1, "loss": 1.0}']))
    assert main(["plot", str(path), "-o", str(tmp_path / "d.png")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: skipped 25 bad line(s) of ") and err.count("(not JSON") == 20
    assert err.endswith("line 20 (not JSON (Expecting value)), and 5 more\n")
    # Nothing good: the error, and the lines skipped.
    path.write_bytes(_DEEP)
    assert main(["plot", str(path), "-o", str(tmp_path / "e.png")]) == 1
    err = capsys.readouterr().err
    assert "holds no log record" in err and "skipped 1 bad line(s)" in err


# --- throughput ----------------------------------------------------------------------------------


def test_flops_per_token_is_hfs_estimate():
    model = tiny_llama()
    assert ft.logging.flops_per_token(model) == 6 * model.num_parameters(exclude_embeddings=True)
    plain = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 3))
    assert ft.logging.flops_per_token(plain) == 6 * (8 * 3 + 3)


def test_checkpoint_retention_keeps_the_best_that_track_best_tracks(tmp_path):
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    for step, loss in [(1, 0.9), (2, 0.4), (3, 0.6), (4, 0.7)]:
        metrics = {"eval_loss": loss}
        state = ft.track_best(state.replace(step=step), metrics)
        ft.save_checkpoint(state, tmp_path, metrics=metrics, keep_last=1, best_metric="eval_loss")
    assert state.early_stopping.best_step == 2 and state.early_stopping.patience_counter == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-{state.early_stopping.best_step}",
        "step-4",
    ]


def test_peak_memory_is_the_device_s_own_peak_not_the_host_rss(monkeypatch):
    """Every device but CUDA reported the process's peak RSS as its peak memory (an XPU
    run's records showed host memory)."""
    import math
    import types

    real = torch.get_device_module
    xpu = types.SimpleNamespace(max_memory_allocated=lambda device: 3 * 2**20)
    mps = types.SimpleNamespace()  # no peak kept

    def get_device_module(device=None):
        return {"xpu": xpu, "mps": mps}.get(str(device)) or real(device)

    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    assert ft.logging.peak_memory_mb("xpu") == 3.0
    assert math.isnan(ft.logging.peak_memory_mb("mps"))
    assert ft.logging.peak_memory_mb("cpu") > 1.0


def test_a_progress_bar_built_without_rank_shows_on_rank_0_only(capsys, monkeypatch):
    """`rank` defaulted to 0: a bar built on every process without rank= (which "turns itself
    off elsewhere", says the module) printed every record on every rank."""
    monkeypatch.setenv("RANK", "1")  # torchrun's
    ft.logging.ProgressBar(10, lines=True).log({"step": 1, "loss": 2.0})
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # one of several: its group comes up later
    early = ft.logging.ProgressBar(10, lines=True)  # built before the process group is set up
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    early.log({"step": 1, "loss": 2.0})
    assert not early.enabled and capsys.readouterr().out == ""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    shown = ft.logging.ProgressBar(10, lines=True)
    shown.log({"step": 1, "loss": 2.0})
    assert capsys.readouterr().out.startswith("step 1/10  loss 2")


def test_sinks_give_every_sink_the_record_when_one_raises(tmp_path):
    """A tracker that is down (its log raising) kept every sink after it from the record: a
    loop that tolerates tracker outages (`except ConnectionError`) lost those records from the
    JSONL log too, silently. Every sink gets it; the first error is raised after."""

    class Down:
        def step(self, state):
            raise ConnectionError("tracker down at step")

        def log(self, record):
            raise ConnectionError("tracker down")

        def close(self):
            pass

    class Steps:
        def __init__(self):
            self.seen = []

        def step(self, state):
            self.seen.append(state.step)

        def log(self, record):
            pass

        def close(self):
            pass

    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).replace(step=1)
    steps = Steps()
    sinks = ft.logging.Sinks(Down(), ft.logging.JSONLSink(tmp_path / "m.jsonl"), steps)
    with pytest.raises(ConnectionError, match="tracker down at step"):
        sinks.step(state)
    for step in (1, 2):
        with pytest.raises(ConnectionError, match="tracker down"):
            sinks.log({"step": step, "loss": 2.0})
    sinks.close()
    assert steps.seen == [1]
    assert ft.logging.read_jsonl(tmp_path / "m.jsonl") == [
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": 2.0},
    ]


def test_a_progress_bars_enabled_and_lines_can_be_set_as_before(capsys, monkeypatch):
    """They became read-only properties: `bar.enabled = False` raised AttributeError."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # one of several: the rank taken when used
    bar = ft.logging.ProgressBar(10, rank=0, lines=True)
    bar.lines = False  # after the rank is known
    bar.log({"step": 1, "loss": 1.0})
    assert not bar.lines and capsys.readouterr().out == ""
    bar.enabled = False
    assert not bar.enabled
    early = ft.logging.ProgressBar(10, lines=True)  # the rank is taken when first used
    early.enabled = False
    early.log({"step": 1, "loss": 1.0})
    assert not early.enabled and capsys.readouterr().out == ""
    later = ft.logging.ProgressBar(10, lines=False)
    later.lines = True
    later.log({"step": 2, "loss": 0.5})
    assert later.lines and capsys.readouterr().out.startswith("step 2/10")
