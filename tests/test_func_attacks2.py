"""Silent failures of the research path, second round: each test failed (a wrong value, no
error) before its fix. DP-SGD x eval-mode models, batch norm without running statistics,
module state written one example at a time, ensemble members' tensor attributes, MAML with
inner Adam on a zero gradient, and MAML x evaluate."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import ftrain as ft


def mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(), batch["y"].numel()


def test_private_grads_train_an_eval_mode_model_as_accumulate_grads_does():
    # HF from_pretrained returns a model in eval mode: DP-SGD trained it with dropout off.
    def grads(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1)).train(mode)
        state = ft.TrainState.create(model, ft.optim.sgd(), seed=3)
        batch = {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}
        g, _ = ft.func.private_grads(state, [batch], mse, max_norm=1e6, noise_multiplier=0.0)
        return g, model.training

    (in_train, _), (in_eval, now) = grads(True), grads(False)
    assert now  # put in training mode, as accumulate_grads puts it
    assert all(torch.equal(in_train[n], in_eval[n]) for n in in_train)


def test_a_frozen_batch_norm_is_frozen_alone_and_the_error_says_how():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).eval()
    state = ft.TrainState.create(model, ft.optim.sgd())
    batch = {"x": torch.randn(5, 3), "y": torch.randn(5, 1)}
    # model.eval() as a whole no longer freezes it: private_grads trains the model.
    with pytest.raises(ft.func.FuncError, match=re.escape("model.get_submodule('1').eval()")):
        ft.func.private_grads(state, [batch], mse, max_norm=1.0, noise_multiplier=0.0)
    model[1].eval()
    before = model[1].running_mean.clone()
    ft.func.private_grads(state, [batch], mse, max_norm=1.0, noise_multiplier=0.0)
    assert torch.equal(model[1].running_mean, before) and not model[1].training


def test_batch_norm_without_running_statistics_is_refused_in_eval_mode_too():
    # track_running_stats=False normalises with the batch's statistics in eval mode as well:
    # per-example gradients normalised one example alone, silently not the batch's parts.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, track_running_stats=False), nn.Flatten()
    )
    model[1].eval()  # a BatchNorm frozen in eval mode, in a model that trains
    state = ft.TrainState.create(model, ft.optim.sgd())
    batch = {"x": torch.randn(4, 1, 6, 6), "y": torch.randn(4, 32)}
    with pytest.raises(ft.func.FuncError, match="BatchNorm2d without running statistics"):
        ft.func.per_sample_grads(state, batch, mse)
    with pytest.raises(ft.func.FuncError, match="track_running_stats=False"):
        ft.func.private_grads(state, [batch], mse, max_norm=1.0, noise_multiplier=0.0)


@pytest.mark.parametrize(
    "layer, name",
    [
        (nn.InstanceNorm1d(2, track_running_stats=True), "1.running_mean"),
        (nn.Embedding(5, 2, max_norm=0.1), "0.weight"),
    ],
)
def test_a_forward_that_writes_the_model_is_refused_one_example_at_a_time(layer, name):
    # vmap refuses the write; chunk_size=1 let each example alone update running statistics
    # (or renorm embedding rows) silently: not private, and not the batch's update.
    torch.manual_seed(0)
    if isinstance(layer, nn.Embedding):
        model, x = nn.Sequential(layer, nn.Flatten()), torch.randint(0, 5, (3, 2))
    else:
        model, x = nn.Sequential(nn.Conv1d(1, 2, 1), layer, nn.Flatten()), torch.randn(3, 1, 2)
    state = ft.TrainState.create(model, ft.optim.sgd())
    batch = {"x": x, "y": torch.zeros(3, 4)}
    with pytest.raises(ft.func.FuncError, match=f"the model wrote '{name}' in place"):
        ft.func.per_sample_grads(state, batch, mse, chunk_size=1)


class Scaled(nn.Module):
    def __init__(self, scale, dims):
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.scale, self.dims = torch.tensor(scale), dims

    def forward(self, x):
        return self.lin(x) * self.scale * self.dims[0]


@pytest.mark.parametrize(
    "other, what",
    [(Scaled(3.0, [1.0]), "'<root>.scale' is tensor(3.)"), (Scaled(1.0, [2.0]), "'<root>.dims'")],
)
def test_an_ensemble_refuses_members_whose_tensor_or_list_attributes_differ(other, what):
    # Only member 0's modules run: member 1's scale silently became member 0's.
    with pytest.raises(
        ValueError, match=re.escape(f"member 1 differs from member 0 in module settings: {what}")
    ):
        ft.func.Ensemble([Scaled(1.0, [1.0]), other])
    ens = ft.func.Ensemble([Scaled(2.0, [1.0]), Scaled(2.0, [1.0])])  # alike: accepted
    assert ens(torch.ones(1, 2)).shape == (2, 1, 1)


def test_second_order_maml_with_inner_adam_survives_a_zero_gradient():
    # A dead ReLU unit has an inner gradient of exactly 0: d sqrt(v)/dv = inf times dv/dg = 0
    # made every meta-gradient NaN, so every meta-step was skipped.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)).double()
    with torch.no_grad():
        model[0].bias[0] = -100.0
    task = {
        k: {"x": torch.randn(5, 3, dtype=torch.float64), "y": torch.randn(5, 1).double()}
        for k in ("support", "query")
    }
    loss = ft.func.maml_loss(mse, inner_steps=2, inner_lr=0.05, optimizer=ft.func.inner_adam())
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, _ = ft.accumulate_grads(state, [task], loss)
    assert all(torch.isfinite(g).all() for g in grads.values())
    w, h = model[2].weight, 1e-6  # a live entry, against central finite differences

    def meta(delta):
        with torch.no_grad():
            w[0, 1] += delta
        out = loss(model, task)
        with torch.no_grad():
            w[0, 1] -= delta
        return (out[0] / out[1]).item()

    fd = (meta(h) - meta(-h)) / (2 * h)
    assert abs(grads["2.weight"][0, 1].item() - fd) < 1e-6 * max(1.0, abs(fd))


def test_evaluate_reports_the_maml_query_loss_after_adaptation():
    # evaluate runs under no_grad: the inner steps raised "does not require grad".
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    task = {k: {"x": torch.randn(5, 3), "y": torch.randn(5, 1)} for k in ("support", "query")}
    loss = ft.func.maml_loss(mse, inner_steps=1, inner_lr=0.1)
    state = ft.TrainState.create(model, ft.optim.sgd(), loss_fn=loss)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = ft.evaluate(state, [task])
    adapted = ft.func.inner_loop(
        model, dict(model.named_parameters()), [task["support"]], mse,
        optimizer=ft.func.inner_sgd(), lr=0.1,
    )  # fmt: skip
    want = ft.func.functional_loss(model, adapted, task["query"], mse)
    assert out["eval_loss"] == pytest.approx((want[0] / want[1]).item(), rel=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
