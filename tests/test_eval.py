"""evaluate and predict: batch-size independent losses, modes, streaming outputs, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import ftrain as ft
from helpers import ragged_rows, tiny_gpt2


class Scale(torch.nn.Module):
    """loss_i = (w * x_i)^2: a closed form to check evaluate against."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


def square_loss(model, batch):
    return (model(batch["x"]) ** 2).sum(), torch.tensor(len(batch["x"]))


ROWS = [{"x": torch.tensor(float(i + 1), dtype=torch.float64)} for i in range(10)]


@pytest.mark.parametrize("batch_size", [1, 3, 4, 7, 10])
def test_eval_loss_is_the_closed_form_whatever_the_batch_size(batch_size):
    state = ft.TrainState.create(Scale(), ft.optim.sgd())
    expected = sum((1.5 * (i + 1)) ** 2 for i in range(10)) / 10
    batches = ft.make_batches(ROWS, batch_size=batch_size, shuffle=False)
    out = ft.evaluate(state, batches, square_loss)
    assert out["eval_loss"] == pytest.approx(expected, rel=1e-14)
    assert out["eval_items"] == 10


def test_mean_of_batch_means_would_depend_on_batch_size():
    # What evaluate avoids (HF's eval loss averages batch means): the last batch of 1 weighs 1/4.
    state = ft.TrainState.create(Scale(), ft.optim.sgd())
    means = [
        float(square_loss(state.model, b)[0].detach()) / len(b["x"])
        for (b,) in ft.make_batches(ROWS, batch_size=3, shuffle=False)
    ]
    whole = ft.make_batches(ROWS, batch_size=10, shuffle=False)
    assert np.mean(means) != pytest.approx(ft.evaluate(state, whole, square_loss)["eval_loss"])


def test_token_weighted_eval_loss_does_not_depend_on_batch_size_or_padding():
    state = ft.TrainState.create(tiny_gpt2(dropout=0.1).double(), ft.optim.sgd())
    rows = ragged_rows(13, seed=4)
    values = [
        ft.evaluate(state, ft.make_batches(rows, batch_size=bs, shuffle=False))["eval_loss"]
        for bs in (1, 2, 5, 13)
    ]
    assert max(values) - min(values) < 1e-12


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_without_grad_then_the_previous_mode(training):
    state = ft.TrainState.create(Scale(), ft.optim.sgd())
    state.model.train(training)
    seen = []

    def probe(model, batch):
        seen.append((model.training, torch.is_grad_enabled()))
        return square_loss(model, batch)

    ft.evaluate(state, ft.make_batches(ROWS[:2], batch_size=2), probe)
    assert seen == [(False, False)] and state.model.training is training

    def boom(model, batch):
        raise RuntimeError("bad batch")

    with pytest.raises(RuntimeError, match="bad batch"):
        ft.evaluate(state, ft.make_batches(ROWS[:2], batch_size=2), boom)
    assert state.model.training is training and torch.is_grad_enabled()


def _classifier(n_in=16, n_cls=5):
    torch.manual_seed(0)

    # Named like an HF head: the default loss recognises a sequence classifier by its class.
    class ClfForSequenceClassification(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(n_in, n_cls)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x)

    return ClfForSequenceClassification()


def _cls_rows(n, n_in=16, n_cls=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g)
    y = torch.randint(0, n_cls, (n,), generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)], x, y


def test_classification_metrics_run_one_forward_per_batch():
    model = _classifier()
    rows, x, y = _cls_rows(50)
    state = ft.TrainState.create(model, ft.optim.sgd())
    out = ft.evaluate(
        state, ft.make_batches(rows, batch_size=8, shuffle=False),
        metrics_fn=ft.classification_metrics,
    )  # fmt: skip
    assert model.calls == 7  # ceil(50 / 8) batches, each through the model once
    with torch.no_grad():
        logits = model.lin(x)
    ce = torch.nn.functional.cross_entropy(logits, y).item()
    acc = (logits.argmax(-1) == y).double().mean().item()
    assert out["eval_loss"] == pytest.approx(ce, rel=1e-6)
    assert out["eval_accuracy"] == pytest.approx(acc, abs=1e-12)


def test_loss_fn_beside_a_metrics_loss_raises_naming_both():
    # Issue 19: the metrics' cross-entropy silently replaced the user's loss as eval_loss.
    state = ft.TrainState.create(_classifier(), ft.optim.sgd())
    rows, _, _ = _cls_rows(8)

    def my_loss(model, batch):
        return torch.tensor(0.0), torch.tensor(1)

    with pytest.raises(ValueError, match=r"loss_fn.*metrics_fn"):
        ft.evaluate(
            state, ft.make_batches(rows, batch_size=4, shuffle=False), my_loss,
            metrics_fn=ft.classification_metrics,
        )  # fmt: skip

    def accuracy_only(model, batch):
        m = ft.classification_metrics(model, batch)
        return {"accuracy": m["accuracy"]}

    out = ft.evaluate(
        state, ft.make_batches(rows, batch_size=4, shuffle=False), my_loss,
        metrics_fn=accuracy_only,
    )  # fmt: skip
    assert out["eval_loss"] == 0.0 and "eval_accuracy" in out  # the given loss_fn is used


def test_perplexity_only_where_it_is_one():
    cls = ft.TrainState.create(_classifier(), ft.optim.sgd())
    rows, _, _ = _cls_rows(8)
    batches = lambda: ft.make_batches(rows, batch_size=4, shuffle=False)  # noqa: E731
    assert "eval_ppl" not in ft.evaluate(cls, batches(), metrics_fn=ft.classification_metrics)
    assert "eval_ppl" not in ft.evaluate(cls, batches(), ft.losses.classification_loss())
    assert "eval_ppl" not in ft.evaluate(cls, batches())  # the default: classification_loss
    plain = ft.TrainState.create(torch.nn.Linear(16, 5), ft.optim.sgd())
    with pytest.raises(TypeError, match="loss_fn="):  # a plain module: asked for a loss_fn
        ft.evaluate(plain, batches())
    lm = ft.TrainState.create(tiny_gpt2(), ft.optim.sgd())
    out = ft.evaluate(lm, ft.make_batches(ragged_rows(6, seed=1), batch_size=3, shuffle=False))
    assert out["eval_ppl"] == pytest.approx(np.exp(out["eval_loss"]))  # causal-LM token loss
    custom = ft.evaluate(cls, batches(), lambda m, b: (torch.tensor(2.0), 1), perplexity=True)
    assert custom["eval_ppl"] == pytest.approx(np.exp(2.0))
    lm_batches = ft.make_batches(ragged_rows(6, seed=1), batch_size=3, shuffle=False)
    assert "eval_ppl" not in ft.evaluate(lm, lm_batches, perplexity=False)


def test_predict_streams_exact_per_sample_outputs():
    model = _classifier()
    rows, x, y = _cls_rows(103)
    state = ft.TrainState.create(model, ft.optim.sgd())
    state.model.train()
    it = ft.predict(state, ft.make_batches(rows, batch_size=10, shuffle=False))
    first = next(it)
    assert not state.model.training  # eval mode while the iterator runs
    parts = [first, *it]
    assert state.model.training  # and back once it is exhausted
    logits = np.concatenate([p["logits"] for p in parts])
    labels = np.concatenate([p["labels"] for p in parts])
    assert logits.shape == (103, 5) and [len(p["labels"]) for p in parts][-1] == 3
    with torch.no_grad():
        np.testing.assert_allclose(logits, model.lin(x).numpy(), rtol=1e-6)
    np.testing.assert_array_equal(labels, y.numpy())

    four = list(ft.make_batches(rows[:4], batch_size=4, shuffle=False))
    it = ft.predict(state, four, lambda m, b: {"pred": m(b["x"]).argmax(-1)})
    assert next(it)["pred"].shape == (4,)
    it.close()
    assert state.model.training

    bad = ft.predict(state, four, lambda m, b: {"a": b["x"], "b": b["x"][:2]})
    with pytest.raises(ValueError, match="disagree"):
        next(bad)


_BOUNDED = """
import json, resource, torch, ftrain as ft
torch.manual_seed(0)
class Clf(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 1000)
    def forward(self, x):
        return self.lin(x)
model = Clf()
state = ft.TrainState.create(model, ft.optim.sgd())
def batches():  # 100,000 samples, generated lazily
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        x = torch.randn(1000, 16, generator=g)
        yield {"x": x, "labels": torch.randint(0, 1000, (1000,), generator=g)}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = ft.evaluate(state, batches(), metrics_fn=ft.classification_metrics)
correct = 0
def outputs(m, b):
    return {"pred": m(b["x"]).argmax(-1), "y": b["labels"]}
for p in ft.predict(state, batches(), outputs):
    correct += int((p["pred"] == p["y"]).sum())
growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
res = {"growth_mb": growth, "acc": out["eval_accuracy"], "n": out["eval_items"]}
print(json.dumps({**res, "correct": correct}))
"""


def test_accuracy_over_100k_samples_runs_in_bounded_memory():
    """All logits would be 100k x 1000 float32 = 381 MiB; streaming holds one batch (4 MiB)."""
    run = subprocess.run(
        [sys.executable, "-c", _BOUNDED], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    res = json.loads(run.stdout)
    assert res["n"] == 100_000
    assert res["acc"] == pytest.approx(res["correct"] / 100_000, abs=1e-12)
    assert res["growth_mb"] < 100, res


def focal_loss(model, batch, gamma=2.0):
    """A focal loss (summed, per item): what a user trains on instead of cross-entropy."""
    logp = torch.log_softmax(model(batch["x"]).double(), -1)
    logp = logp.gather(-1, batch["labels"][:, None]).squeeze(-1)
    return -(((1 - logp.exp()) ** gamma) * logp).sum(), torch.tensor(len(logp))


def test_the_record_names_the_loss_it_computed():
    # Issue 26: after training with a focal loss, evaluate without loss_fn reports
    # cross-entropy as eval_loss; the record now says which loss it is.
    import functools

    state = ft.TrainState.create(_classifier(), ft.optim.sgd())
    rows, _, _ = _cls_rows(12)

    def run(*args, **kw):
        return ft.evaluate(state, ft.make_batches(rows, batch_size=5, shuffle=False), *args, **kw)

    default, focal = run(), run(focal_loss)
    assert default["eval_loss_fn"] == "ftrain.losses.default_loss"
    assert focal["eval_loss_fn"].endswith(".focal_loss") and focal["eval_loss_fn"] != "focal_loss"
    assert focal["eval_loss"] != pytest.approx(default["eval_loss"])
    metrics = run(metrics_fn=ft.classification_metrics)
    assert metrics["eval_loss_fn"] == "ftrain.eval.classification_metrics"
    assert metrics["eval_loss"] == pytest.approx(default["eval_loss"])  # both cross-entropy
    gamma0 = run(functools.partial(focal_loss, gamma=0.0))
    assert gamma0["eval_loss_fn"] == focal["eval_loss_fn"]  # a partial: the wrapped function
    accuracy_only = run(focal_loss, metrics_fn=lambda m, b: {"n": (torch.tensor(1.0), 1)})
    assert accuracy_only["eval_loss_fn"] == focal["eval_loss_fn"]  # metrics without a loss
    assert all(isinstance(v, float) for k, v in default.items() if k != "eval_loss_fn")
