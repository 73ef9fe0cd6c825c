import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ftrain as ft


def _setup(scale=1.0, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x = torch.randn(8, 4) * scale
    loss_fn = lambda m, b: (((m(b) * scale) ** 2).sum(), torch.tensor(b.shape[0]))  # noqa: E731
    return model, x, loss_fn


def test_clipping_equals_clip_grad_norm_and_reports_preclip_norm():
    model, x, loss_fn = _setup(scale=10.0)
    ref = copy.deepcopy(model)
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, stats = ft.accumulate_grads(state, [x], loss_fn)
    ref.zero_grad()
    (((ref(x) * 10.0) ** 2).sum() / 8).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    state, info = ft.clip_and_step(state, grads, lr=0.1, max_norm=0.5, stats=stats)
    torch.testing.assert_close(info.grad_norm, ref_norm)
    assert float(info.grad_norm) > 0.5
    for (n, g), p in zip(grads.items(), ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, msg=n)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_counters_advance():
    model, x, loss_fn = _setup()
    state = ft.TrainState.create(model, ft.optim.sgd())
    for _ in range(3):
        grads, stats = ft.accumulate_grads(state, [x[:5], x[5:]], loss_fn)
        state, info = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert (state.step, state.cursor, int(state.samples_seen)) == (3, 6, 24)
    assert info.lr == 0.1 and not bool(info.skipped)
    grads, _ = ft.accumulate_grads(state, [x], loss_fn)
    state, _ = ft.clip_and_step(state, grads, lr=0.1)  # without stats only step advances
    assert (state.step, state.cursor, int(state.samples_seen)) == (4, 6, 24)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("make", [lambda: ft.optim.adamw(), lambda: ft.optim.sgd(momentum=0.9)])
def test_nonfinite_gradient_skips_update(bad, make):
    model, x, loss_fn = _setup()
    state = ft.TrainState.create(model, make())
    grads, stats = ft.accumulate_grads(state, [x], loss_fn)
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)  # a normal step first
    params = {k: v.detach().clone() for k, v in state.params.items()}
    opt = copy.deepcopy(state.opt_state)
    grads, stats = ft.accumulate_grads(state, [x], loss_fn)
    next(iter(grads.values()))[0].fill_(bad)
    state, info = ft.clip_and_step(state, grads, lr=0.1, max_norm=1.0, stats=stats)
    assert bool(info.skipped) and not torch.isfinite(info.grad_norm)
    assert state.step == 2, "a skipped update still counts as a step, as in HF Trainer"
    for k, v in state.params.items():
        assert torch.equal(v, params[k]), k
    for a, b in zip(
        torch.utils._pytree.tree_leaves(state.opt_state),
        torch.utils._pytree.tree_leaves(opt),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_skip_nonfinite_false_applies_the_update():
    model, x, loss_fn = _setup()
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, _ = ft.accumulate_grads(state, [x], loss_fn)
    next(iter(grads.values()))[0].fill_(float("nan"))
    state, info = ft.clip_and_step(state, grads, lr=0.1, skip_nonfinite=False)
    assert not bool(info.skipped)
    assert torch.isnan(next(iter(state.params.values()))).any()


@pytest.mark.parametrize(
    "kw,err",
    [
        ({"lr": -1.0}, ValueError),
        ({"lr": float("nan")}, ValueError),
        ({"lr": torch.tensor(0.1)}, TypeError),
        ({"lr": 0.1, "max_norm": 0.0}, ValueError),
    ],
)
def test_bad_arguments(kw, err):
    model, x, loss_fn = _setup()
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, _ = ft.accumulate_grads(state, [x], loss_fn)
    with pytest.raises(err):
        ft.clip_and_step(state, grads, **kw)
    assert not state.consumed, "a rejected call must not consume the state"


@settings(max_examples=25, deadline=None)
@given(scale=st.floats(0.01, 100.0), max_norm=st.floats(0.01, 10.0), seed=st.integers(0, 1000))
def test_property_clipped_norm_at_most_max(scale, max_norm, seed):
    model, x, loss_fn = _setup(scale=scale, seed=seed)
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, _ = ft.accumulate_grads(state, [x], loss_fn)
    _, info = ft.clip_and_step(state, grads, lr=0.0, max_norm=max_norm)
    after = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert float(after) <= max_norm * (1 + 1e-5)
    if float(info.grad_norm) <= max_norm:
        torch.testing.assert_close(after, info.grad_norm)  # no clipping below the threshold
