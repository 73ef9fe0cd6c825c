"""Evaluation, prediction and best-metric ranking: each test is a silent wrong result that the
tree gave before (a second round after test_eval_attacks.py)."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft

# --- predict ---------------------------------------------------------------------------------


def _linear_state(**kw):
    torch.manual_seed(0)
    return ft.TrainState.create(torch.nn.Linear(3, 2), ft.optim.sgd(), **kw)


def _outputs(model, batch):
    return {"y": model(batch["x"])}


BATCHES = [{"x": torch.randn(4, 3)} for _ in range(3)]


def test_the_loop_body_of_predict_runs_with_the_callers_grad_mode():
    """predict's no_grad was held across its yields: the caller's loop body (and anything it
    did after a `next(it)`) ran without gradients; a model output there had no grad_fn."""
    state = _linear_state()
    it = ft.predict(state, BATCHES, _outputs)
    for out in it:
        assert out["y"].shape == (4, 2)
        assert torch.is_grad_enabled()
        assert state.model(torch.randn(2, 3)).requires_grad
    assert torch.is_grad_enabled()


def test_the_loop_body_of_predict_runs_without_the_strategys_autocast():
    """predict's bf16 autocast was held across its yields: the caller's float32 metric code in
    the loop body ran its matmuls in bf16 without a word."""
    strategy = ft.strategies.SingleDevice("cpu", precision="bf16")
    state = _linear_state(strategy=strategy)
    w = torch.randn(2, 2)
    seen = []

    def outputs(model, batch):
        seen.append(torch.is_autocast_enabled("cpu"))  # the forward still runs under autocast
        return _outputs(model, batch)

    for out in ft.predict(state, BATCHES, outputs):
        assert not torch.is_autocast_enabled("cpu")
        assert (torch.from_numpy(out["y"]) @ w).dtype == torch.float32
    assert seen == [True, True, True]


def test_predict_keeps_the_model_in_eval_mode_across_batches_and_no_grad_in_the_forward():
    state = _linear_state()
    state.model.train()
    grads = []

    def outputs(model, batch):
        grads.append(torch.is_grad_enabled())
        return _outputs(model, batch)

    it = ft.predict(state, BATCHES, outputs)
    next(it)
    assert not state.model.training  # documented: eval mode while the iterator runs
    list(it)
    assert state.model.training and grads == [False, False, False]


# --- track_best ------------------------------------------------------------------------------


def test_track_best_without_mode_refuses_a_score_that_is_better_higher():
    """track_best(state, m, metric="eval_accuracy") ranked with the default mode='min': after
    accuracies 0.5, 0.9, 0.4 the best was 0.4 (HF's Trainer takes greater_is_better=True for
    any metric not ending in "loss")."""
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
    for metric in ("eval_accuracy", "eval_f1", "eval_roc_auc", "eval_exact_match", "eval_bleu"):
        with pytest.raises(ValueError, match=rf"track_best\(metric='{metric}'\) needs mode"):
            ft.track_best(state, {metric: 0.5}, metric=metric)
    for acc in (0.5, 0.9, 0.4):
        state = ft.track_best(state, {"eval_accuracy": acc}, metric="eval_accuracy", mode="max")
    assert state.early_stopping.best_metric == 0.9
    # losses (and other names) keep the default "min"
    s = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
    for loss in (0.5, 0.9, 0.4):
        s = ft.track_best(s, {"eval_loss": loss})
    assert (s.early_stopping.best_metric, s.early_stopping.mode) == (0.4, "min")
    assert (
        ft.track_best(
            s.replace(early_stopping=ft.state.EarlyStoppingState()), 3.0, metric="eval_ppl"
        ).early_stopping.mode
        == "min"
    )


# --- evaluate --------------------------------------------------------------------------------


def test_a_stand_in_batch_whose_loss_is_nan_counts_nothing():
    """A rank without rows in the final global micro-batch runs a ZeroWeight stand-in (a copy of
    one real row) and counted it as 0 * its sums: a loss written as mean * count is NaN on a
    row whose labels are all -100, and 0 * NaN made the global eval_loss NaN on two ranks where
    one process reported a finite loss."""
    torch.manual_seed(0)
    state = ft.TrainState.create(torch.nn.Linear(3, 4), ft.optim.sgd())

    def loss_fn(model, batch):
        n = (batch["labels"] != -100).sum()
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"]) * n, n

    real = {"x": torch.randn(4, 3), "labels": torch.tensor([1, 2, -100, 3])}
    stand_in = ft.data.ZeroWeight({"x": real["x"][2:3], "labels": real["labels"][2:3]})
    alone = ft.evaluate(state, [real], loss_fn)
    ranked = ft.evaluate(state, [real, stand_in], loss_fn)
    assert ranked["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-12)
    assert ranked["eval_items"] == alone["eval_items"] == 3


def test_a_metrics_loss_on_some_batches_only_is_refused_not_mixed_with_the_default_loss():
    """A metrics_fn that returned "loss" on the first batch only: eval_loss summed its loss
    there with the default loss on the other batches (53.9 for a model whose loss is 4.1),
    named ftrain.losses.default_loss, with an eval_ppl of the mixture."""
    from helpers import ragged_rows, tiny_gpt2

    state = ft.TrainState.create(tiny_gpt2(), ft.optim.sgd())
    calls = []

    def metrics_fn(model, batch):
        calls.append(1)
        out = {"rows": (torch.tensor(float(len(batch["labels"]))), 1)}
        if len(calls) == 1:
            out["loss"] = (torch.tensor(1000.0), 1)
        return out

    batches = list(ft.make_batches(ragged_rows(6), batch_size=3, shuffle=False))
    with pytest.raises(ValueError, match="evaluate: metrics_fn returned 'loss' on some batches"):
        ft.evaluate(state, batches, metrics_fn=metrics_fn)
    # the same name on every batch is fine either way
    kept = ft.evaluate(state, batches, metrics_fn=lambda m, b: {"rows": (len(b["labels"]), 1)})
    assert kept["eval_loss"] == pytest.approx(ft.evaluate(state, batches)["eval_loss"])
