"""ft.func crossed with the core: model modes, freezing after create, weighted item counts,
empty and ZeroWeight micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ftrain as ft
from helpers import FakeRank


def ce_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum"), batch["y"].numel()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def data(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 4, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


DP = {"max_norm": 1.0, "noise_multiplier": 0.0}


def test_an_ensemble_of_eval_mode_members_trains_like_separate_runs():
    """Members in eval mode (as HF's from_pretrained leaves them): accumulate_grads puts each
    separate run in training mode, so the ensemble must be too (BatchNorm's batch statistics
    and running statistics, dropout); its root said `training` and kept them in eval mode."""

    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).eval()

    members, batch = [build(s) for s in range(3)], data(8)
    ens = ft.func.Ensemble([copy.deepcopy(m) for m in members])
    assert not ens.training
    state = ft.TrainState.create(ens, ft.optim.sgd())
    grads, stats = ft.accumulate_grads(state, [batch], ft.func.ensemble_loss(ce_loss))
    ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    for k, m in enumerate(members):
        s = ft.TrainState.create(m, ft.optim.sgd())
        grads, stats = ft.accumulate_grads(s, [batch], ce_loss)
        ft.clip_and_step(s, grads, lr=0.1, stats=stats)
        got = ens.member(k)
        for (n, want), have in zip(m.state_dict().items(), got.state_dict().values(), strict=True):
            torch.testing.assert_close(have, want, msg=n)


def test_private_and_per_sample_grads_follow_freezing_after_create():
    """A parameter frozen after create gets no gradient (accumulate_grads gives it none; it
    was trained, and counted in every example's clipping norm); one unfrozen after create is
    refused as accumulate_grads refuses it (it got no gradient, silently)."""
    model, batch = mlp(), data()
    state = ft.TrainState.create(model, ft.optim.sgd())
    model[0].weight.requires_grad_(False)
    core, _ = ft.accumulate_grads(state, [batch], ce_loss)
    private, _ = ft.func.private_grads(state, [batch], ce_loss, **DP)
    assert sorted(private) == sorted(core) == ["0.bias", "2.bias", "2.weight"]
    assert sorted(ft.func.per_sample_grads(state, batch, ce_loss)) == sorted(core)

    model = mlp()
    model[0].weight.requires_grad_(False)
    state = ft.TrainState.create(model, ft.optim.sgd())
    model[0].weight.requires_grad_(True)
    for call in (
        lambda: ft.func.private_grads(state, [batch], ce_loss, **DP),
        lambda: ft.func.per_sample_grads(state, batch, ce_loss),
    ):
        with pytest.raises(ValueError, match=r"'0\.weight' was frozen when the TrainState was"):
            call()


def test_private_grads_count_fractional_items_as_the_core():
    """A weighted loss may count fractional items (Stats.num_items is float64): 0.4 items in
    all became 0 as an int, and clip_and_step skipped the step as one that counted nothing."""

    def weighted(model, batch):
        loss, n = ce_loss(model, batch)
        return 0.1 * loss, 0.1 * n

    model, batch = mlp(), data(4)
    state = ft.TrainState.create(model, ft.optim.sgd())
    _, core = ft.accumulate_grads(state, [batch], weighted)
    grads, stats = ft.func.private_grads(state, [batch], weighted, **DP)
    assert stats.num_items.dtype == core.num_items.dtype == torch.float64
    torch.testing.assert_close(stats.num_items, core.num_items)
    torch.testing.assert_close(stats.loss, core.loss)
    before = model[0].weight.detach().clone()
    _, info = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert not info.skipped and not torch.equal(model[0].weight, before)


def test_empty_and_zero_weight_micro_batches_count_no_example():
    """Poisson sampling (expected_batch_size) can draw an empty micro-batch, and a rank's
    ZeroWeight stand-in holds another rank's row: neither has an example of this step. Both
    crashed (`range() arg 3`, a generator for a batch) or counted the stand-in's row."""
    model, batch = mlp(), data(4)
    empty = {"x": torch.zeros(0, 4), "y": torch.zeros(0, dtype=torch.long)}
    kw = {"max_norm": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 8}
    key = bytes(range(32))
    state = ft.TrainState.create(model, ft.optim.sgd())
    ref, ref_stats = ft.func.private_grads(state, [batch], ce_loss, noise_key=key, **kw)
    for extra in (empty, ft.data.ZeroWeight(data(1, seed=1))):
        for chunk in (None, 1):
            grads, stats = ft.func.private_grads(
                state, [batch, extra], ce_loss, noise_key=key, chunk_size=chunk, **kw
            )
            for n, g in grads.items():
                torch.testing.assert_close(g, ref[n], msg=n)
            assert int(stats.num_samples) == 4 and stats.num_micro == 2
            torch.testing.assert_close(stats.num_items, ref_stats.num_items)
    # A step with no example at all: the noise alone, over the expected batch size.
    grads, stats = ft.func.private_grads(state, [empty], ce_loss, noise_key=key, **kw)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    assert float(stats.num_items) == 0 and stats.loss.isnan()

    rank = ft.TrainState.create(mlp(), ft.optim.sgd(), strategy=FakeRank(1, 2))
    got = ft.func.per_sample_grads(rank, ft.data.ZeroWeight(data(1)), ce_loss)
    assert {n: tuple(g.shape) for n, g in got.items()} == {
        n: (0, *p.shape) for n, p in rank.params.items()
    }
    assert ft.func.per_sample_grads(state, empty, ce_loss)["0.weight"].shape == (0, 6, 4)
