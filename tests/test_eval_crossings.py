"""Where evaluation, logging, trackers and the guard cross other features: a model whose
submodules keep their own modes, nested records, a resumed or rolled-back run's TensorBoard
curve."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

import ftrain as ft


def _loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(), batch["y"].numel()


def _batches(n=2):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(4, 3, generator=g), "y": torch.randn(4, 1, generator=g)}] * n


def test_evaluate_and_predict_give_each_submodule_its_own_mode_back():
    # A BatchNorm frozen with .eval() inside a training model (fine-tuning keeps its running
    # statistics): model.train() after the evaluation switched it back to training, and the
    # next steps updated its statistics unseen.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1)
    )
    model[1].eval()
    state = ft.TrainState.create(model, ft.optim.sgd(), loss_fn=_loss)
    modes = [m.training for m in model.modules()]
    assert modes == [True, True, False, True, True]
    first = ft.evaluate(state, _batches())
    assert [m.training for m in model.modules()] == modes
    assert ft.evaluate(state, _batches()) == first  # dropout off, BatchNorm not updated
    outs = list(ft.predict(state, _batches(), lambda m, b: {"y": m(b["x"])}))
    assert len(outs) == 2 and [m.training for m in model.modules()] == modes
    stats_before = model[1].running_mean.clone()
    ft.accumulate_grads(state, [_batches(1)[0]])
    assert torch.equal(model[1].running_mean, stats_before)  # still frozen in training
    with pytest.raises(RuntimeError, match="boom"), ft.eval.eval_mode(model):
        raise RuntimeError("boom")
    assert [m.training for m in model.modules()] == modes


def test_sinks_log_a_nested_dict_and_write_its_nonfinite_values_as_null(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = {"step": 3, "loss": 1.0, "tasks": {"a": 0.5, "b": math.nan}, "note": "x"}
    jsonl = ft.logging.JSONLSink(tmp_path / "m.jsonl")
    jsonl.log(record)  # json.dumps raised on the nested NaN: the record was lost mid-run
    jsonl.close()
    line = json.loads((tmp_path / "m.jsonl").read_text())
    assert line == {"step": 3, "loss": 1.0, "tasks": {"a": 0.5, "b": None}, "note": "x"}
    tb = ft.logging.TensorBoardSink(tmp_path / "tb")
    tb.log(record)  # the nested fields were dropped unseen by every tracker
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"train/loss", "train/tasks/a", "train/tasks/b"} == set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("train/tasks/a")] == [(3, 0.5)]


def test_tensorboard_shows_each_step_once_after_a_resume_and_a_rollback(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())

    def run(steps, value):
        for step in steps:
            sink.step(state.replace(step=step))
            sink.log({"step": step, "loss": value + step})

    sink = ft.logging.TensorBoardSink(tmp_path)
    sink.log({"step": 0, "eval_loss": 9.0})
    run(range(1, 7), 0.0)
    sink.close()  # killed at step 6; the newest checkpoint is step 4
    sink = ft.logging.TensorBoardSink(tmp_path)
    sink.log({"step": 4, "eval_loss": 7.0})
    run(range(5, 9), 100.0)
    run(range(6, 8), 200.0)  # a guard rollback to the step-5 checkpoint
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert got == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 105), (6, 206), (7, 207)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(0, 9.0), (4, 7.0)]


def test_read_jsonl_shows_each_step_once_after_a_resume_and_a_rollback(tmp_path):
    # The steps a rollback undid stayed in the log (a run rolled back from step 8 to 5 that
    # stopped at 7 still showed steps 8 and 9 of the undone run); TensorBoard dropped them.
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
    path = tmp_path / "m.jsonl"

    def run(steps, value):
        for step in steps:
            sink.step(state.replace(step=step))
            sink.log({"step": step, "loss": value + step})

    sink = ft.logging.JSONLSink(path)
    sink.log({"step": 0, "eval_loss": 9.0})
    run(range(1, 7), 0.0)
    sink.close()  # killed at step 6; the newest checkpoint is step 4
    sink = ft.logging.JSONLSink(path)
    sink.log({"step": 4, "eval_loss": 7.0})
    run(range(5, 10), 100.0)
    run(range(6, 8), 200.0)  # a guard rollback to the step-5 checkpoint, stopped at 7
    sink.close()
    got = [(r["step"], r.get("loss", r.get("eval_loss"))) for r in ft.logging.read_jsonl(path)]
    assert got == [(0, 9.0), (1, 1), (2, 2), (3, 3), (4, 4), (4, 7.0), (5, 105), (6, 206),
                   (7, 207)]  # fmt: skip
    fresh = ft.logging.JSONLSink(tmp_path / "new.jsonl")  # a new file: no restart line
    fresh.step(state.replace(step=1))
    fresh.log({"step": 1, "loss": 1.0})
    fresh.close()
    assert (tmp_path / "new.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


class TinyForCausalLM(torch.nn.Module):
    """A causal LM by its class name, as the default loss recognises HF's (no transformers
    import: the test stays fast)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)

    def forward(self, input_ids, attention_mask=None, **kw):
        return types.SimpleNamespace(logits=self.head(self.emb(input_ids)))


def test_an_extra_metric_keeps_the_perplexity_of_the_default_lm_loss():
    state = ft.TrainState.create(TinyForCausalLM(), ft.optim.sgd())
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids, "labels": ids}] * 2

    def rows(model, batch):  # no "loss": eval_loss stays the default LM loss
        return {"rows": (torch.tensor(batch["input_ids"].shape[0]), torch.tensor(1))}

    plain = ft.evaluate(state, batches)
    with_rows = ft.evaluate(state, batches, metrics_fn=rows)
    assert with_rows["eval_loss"] == plain["eval_loss"] and with_rows["eval_rows"] == 4.0
    assert with_rows["eval_ppl"] == plain["eval_ppl"] == math.exp(plain["eval_loss"])
    assert "eval_ppl" in ft.evaluate(state, batches, ft.losses.default_loss)


def test_a_resumed_jsonl_log_keeps_its_first_record_after_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = ft.logging.JSONLSink(path)
    sink.log({"step": 1, "loss": 1.0})
    sink.close()
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 2, "lo')  # killed while writing step 2's record
    sink = ft.logging.JSONLSink(path)  # the resumed run logs step 2 again
    sink.log({"step": 2, "loss": 2.0})
    sink.close()
    bad = []
    records = ft.logging.read_jsonl(path, on_bad_line=lambda n, why: bad.append(n))
    assert records == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}] and bad == [2]
    ft.logging.JSONLSink(tmp_path / "new.jsonl").close()
    assert (tmp_path / "new.jsonl").read_text() == ""  # a new log starts with no blank line
