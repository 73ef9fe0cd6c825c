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
    state, info = ft.clip_and_step(state, grads, lr=0.1, max_norm=0.5, stats=stats, donate=False)
    torch.testing.assert_close(info.grad_norm, ref_norm)
    assert float(info.grad_norm) > 0.5
    for (n, g), p in zip(grads.items(), ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, msg=n)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for p, q in zip(state.model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_counters_advance():
    model, x, loss_fn = _setup()
    state = ft.TrainState.create(model, ft.optim.sgd())
    for _ in range(3):
        grads, stats = ft.accumulate_grads(state, [x[:5], x[5:]], loss_fn)
        state, info = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert (state.step, state.data.cursor, int(state.data.samples_seen)) == (3, 6, 24)
    assert info.lr == 0.1 and not bool(info.skipped)
    grads, _ = ft.accumulate_grads(state, [x], loss_fn)
    state, _ = ft.clip_and_step(state, grads, lr=0.1)  # without stats only step advances
    assert (state.step, state.data.cursor, int(state.data.samples_seen)) == (4, 6, 24)


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
    _, info = ft.clip_and_step(state, grads, lr=0.0, max_norm=max_norm, donate=False)
    after = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert float(after) <= max_norm * (1 + 1e-5)
    if float(info.grad_norm) <= max_norm:
        torch.testing.assert_close(after, info.grad_norm)  # no clipping below the threshold


def test_gradients_are_donated_and_released():
    """The README loop keeps `grads` across iterations: a donated step must release them, or
    old and new gradients coexist during the next accumulate_grads (issue 12, 1.13x memory)."""
    model, x, loss_fn = _setup()
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, stats = ft.accumulate_grads(state, [x], loss_fn)
    assert not grads.consumed and len(grads) == 4
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert grads.consumed and dict.__len__(grads) == 0, "the mapping still holds tensors"
    assert all(p.grad is None for p in model.parameters()), "the .grad tensors were kept"
    readers = [
        lambda: grads["0.weight"],
        lambda: list(grads.values()),
        lambda: dict(grads),
        lambda: len(grads),
        lambda: "0.weight" in grads,
        lambda: grads.get("0.weight"),
        lambda: ft.clip_and_step(state, grads, lr=0.1),
    ]
    for read in readers:
        with pytest.raises(ft.ConsumedStateError, match="consumed by clip_and_step at step 0"):
            read()
    assert "consumed" in repr(grads)
    assert state.step == 1, "the rejected reuse must not consume the new state"
    state, _ = ft.clip_and_step(state, ft.accumulate_grads(state, [x], loss_fn)[0], lr=0.1)


def test_donate_false_keeps_the_gradients():
    model, x, loss_fn = _setup()
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, _ = ft.accumulate_grads(state, [x], loss_fn)
    kept = {n: g.clone() for n, g in grads.items()}
    ft.clip_and_step(state, grads, lr=0.1, donate=False)
    assert not grads.consumed
    for n, p in state.params.items():
        assert grads[n] is p.grad
        torch.testing.assert_close(grads[n], kept[n])


def test_plain_mapping_is_applied_and_the_param_grads_released():
    model, _, _ = _setup()
    state = ft.TrainState.create(model, ft.optim.sgd())
    before = {n: p.detach().clone() for n, p in state.params.items()}
    mine = {n: torch.ones_like(p) for n, p in state.params.items()}
    state, _ = ft.clip_and_step(state, mine, lr=0.5)
    for n, p in state.params.items():
        torch.testing.assert_close(p, before[n] - 0.5)
        assert torch.equal(mine[n], torch.ones_like(p)), "a user's own dict is left alone"


@pytest.mark.parametrize(
    "grads,match",
    [
        ({"0.weight": torch.ones(1)}, r"grads\['0.weight'\].*\(1,\).*\(6, 4\)"),
        ({"0.weight": torch.ones(6, 4, dtype=torch.float64)}, r"0\.weight.*float64.*float32"),
        ({"0.weight": torch.ones(6, 4, device="meta")}, r"0\.weight.*meta.*cpu"),
        ({"nope": torch.ones(1)}, r"'nope'.*not a trainable parameter.*0\.weight"),
    ],
)
def test_gradient_metadata_is_checked_against_the_parameters(grads, match):
    model, _, _ = _setup()
    state = ft.TrainState.create(model, ft.optim.adamw())
    before = {n: p.detach().clone() for n, p in state.params.items()}
    with pytest.raises(ValueError, match=match):
        ft.clip_and_step(state, grads, lr=0.1)
    assert not state.consumed
    for n, p in state.params.items():
        assert torch.equal(p, before[n])
    with pytest.raises(TypeError, match=r"grads\['0.bias'\] must be a tensor"):
        ft.clip_and_step(state, {"0.bias": [0.0] * 6}, lr=0.1)


def test_wrong_shape_gradient_raises_instead_of_crashing():
    """Issue 20's reproducer segfaulted in the fused kernel; run it in a subprocess so that a
    crash fails this test instead of killing the test run."""
    import subprocess
    import sys

    code = (
        "import torch, ftrain as ft\n"
        "s = ft.TrainState.create(torch.nn.Linear(4000, 4000, bias=False), ft.optim.sgd())\n"
        "try:\n"
        "    ft.clip_and_step(s, {'weight': torch.ones(1)}, lr=0.1)\n"
        "except ValueError as e:\n"
        "    print('raised', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised grads['weight'] does not match" in out.stdout


def test_a_step_without_items_is_skipped_and_reports_nan_loss():
    """Zero counted items (every label -100 in the step): nothing was learned, so the update is
    skipped on the device (no weight decay, no moment decay) and the mean loss is NaN, which
    the log window filters like HF. The counters still advance."""
    model, x, _ = _setup()
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.5))
    counted = lambda m, b: (m(b).pow(2).sum(), torch.tensor(b.shape[0]))  # noqa: E731
    grads, stats = ft.accumulate_grads(state, [x], counted)
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)  # moments are non-zero now
    before = {n: p.detach().clone() for n, p in state.params.items()}
    empty = lambda m, b: (m(b).sum() * 0.0, torch.tensor(0))  # noqa: E731
    grads, stats = ft.accumulate_grads(state, [x[:3], x[3:]], empty)
    assert torch.isnan(stats.loss) and int(stats.num_items) == 0
    state, info = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert bool(info.skipped) and (state.step, state.data.cursor) == (2, 3)
    for n, p in state.params.items():
        assert torch.equal(p, before[n]), n
    w = ft.logging.update(ft.logging.window(state), stats, info)
    assert float(w.loss_sum) == 0.0, "the NaN loss is filtered out of the log window"
