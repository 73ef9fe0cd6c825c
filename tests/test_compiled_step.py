"""clip_and_step(..., compile=True): the same step as eager, one compile per run, loud limits.

Tolerance: the compiled update is plain tensor ops fused by inductor where eager runs
PyTorch's fused kernels, so results agree to float32 rounding: rtol 1e-5, atol 1e-6 after a
few steps (measured differences are ~5e-8).
"""

import copy
import os

import pytest
import torch
from torch._dynamo.utils import counters

import ftrain as ft
from ftrain.precision import LossScaling, Precision
from helpers import opt_state_tensors

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _loss(m, b):
    return ((m(b) ** 2).sum(), b.shape[0])


def _run(model, opt, *, compile, steps, nan_at=None, donate=True, precision=None):
    """`steps` README-loop steps on fixed data with a warmup-cosine lr (a new lr every step)."""
    strategy = ft.strategies.SingleDevice("cpu", precision=precision)
    state = ft.TrainState.create(model, opt, seed=0, strategy=strategy)
    lr = ft.schedules.warmup_cosine(peak_lr=0.05, warmup_steps=3, total_steps=steps)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    infos = []
    for k in range(steps):
        grads, stats = ft.accumulate_grads(state, [x[:5], x[5:]], _loss)
        if k == nan_at:
            next(iter(grads.values()))[0].fill_(float("nan"))
        old = state
        state, info = ft.clip_and_step(
            state, grads, stats=stats, lr=lr(state.step), max_norm=0.5, compile=compile,
            donate=donate,
        )  # fmt: skip
        infos.append((info.grad_norm.clone(), bool(info.skipped)))
    return state, infos, old


def _assert_same(eager, compiled):
    (a, infos_a, _), (b, infos_b, _) = eager, compiled
    for (norm_a, skip_a), (norm_b, skip_b) in zip(infos_a, infos_b, strict=True):
        torch.testing.assert_close(norm_b, norm_a, equal_nan=True, **TOL)
        assert skip_b == skip_a
    for name in a.params:
        torch.testing.assert_close(b.params[name], a.params[name], **TOL, msg=name)
    ta, tb = opt_state_tensors(a.opt_state), opt_state_tensors(b.opt_state)
    assert tb.keys() == ta.keys()
    for path in ta:
        torch.testing.assert_close(tb[path], ta[path], **TOL, msg=path)


@pytest.mark.slow
def test_compiled_adamw_matches_eager_compiles_once_and_checkpoints_the_same(tmp_path):
    model = _model()
    eager = _run(copy.deepcopy(model), ft.optim.adamw(weight_decay=0.1), compile=False,
                 steps=6, nan_at=3)  # fmt: skip
    counters.clear()
    compiled = _run(model, ft.optim.adamw(weight_decay=0.1), compile=True, steps=6, nan_at=3)
    # Six learning rates and a skipped (NaN) step, one graph: lr is a tensor input.
    assert counters["stats"]["unique_graphs"] == 1
    assert [skip for _, skip in compiled[1]] == [False, False, False, True, False, False]
    _assert_same(eager, compiled)
    # The compiled step keeps the eager state: same checkpoint files, loadable by eager.
    pa = ft.save_checkpoint(eager[0], tmp_path / "eager")
    pb = ft.save_checkpoint(compiled[0], tmp_path / "compiled")
    assert sorted(os.listdir(pb)) == sorted(os.listdir(pa))
    fresh = ft.TrainState.create(_model(), ft.optim.adamw(weight_decay=0.1))
    loaded = ft.load_checkpoint(pb, fresh)
    assert (
        opt_state_tensors(loaded.opt_state).keys() == opt_state_tensors(eager[0].opt_state).keys()
    )
    torch.testing.assert_close(loaded.params["0.weight"], compiled[0].params["0.weight"])


@pytest.mark.slow
def test_compiled_sgd_with_fp16_loss_scaling_matches_eager_and_donate_false_keeps_the_state():
    opt = lambda: ft.optim.sgd(momentum=0.9, nesterov=True, weight_decay=0.01)  # noqa: E731
    model = _model()
    # Overflows on the first two steps, then trains.
    scaling = Precision(torch.float16, LossScaling(init_scale=2.0**18, backoff_factor=0.25))
    eager = _run(copy.deepcopy(model), opt(), compile=False, steps=4, precision=scaling)
    counters.clear()
    compiled = _run(model, opt(), compile=True, steps=4, donate=False, precision=scaling)
    # SGD's first update sets the momentum buffer: one graph for it, one for the rest.
    assert counters["stats"]["unique_graphs"] == 2
    assert [skip for _, skip in compiled[1]] == [True, True, False, False]
    assert float(compiled[0].scaler.scale) == float(eager[0].scaler.scale)
    _assert_same(eager, compiled)
    last_input = compiled[2]
    assert last_input.step == 3 and last_input.params["0.weight"].shape == (6, 4)


@pytest.mark.slow
def test_compiled_adam_with_l2_decay_and_maximize_matches_eager():
    opt = lambda: ft.optim.adam(weight_decay=0.1, maximize=True, mask=["0.weight"])  # noqa: E731
    model = _model()
    eager = _run(copy.deepcopy(model), opt(), compile=False, steps=3)
    _assert_same(eager, _run(model, opt(), compile=True, steps=3))


class _Sharded(ft.strategies.SingleDevice):
    checkpoint_sharded = True


@pytest.mark.parametrize(
    ("make_state", "error", "match"),
    [
        (
            lambda m: ft.TrainState.create(m, ft.optim.from_torch(torch.optim.RMSprop)),
            ValueError,
            "supports the optimizers ft.optim.adamw, adam and sgd",
        ),
        (
            lambda m: ft.TrainState.create(m, ft.optim.adamw(), strategy=_Sharded()),
            ValueError,
            "sharded parameters",
        ),
    ],
)
def test_compile_raises_for_what_it_does_not_support(make_state, error, match):
    state = make_state(_model())
    grads, stats = ft.accumulate_grads(state, [torch.ones(2, 4)], _loss)
    with pytest.raises(error, match=match):
        ft.clip_and_step(state, grads, stats=stats, lr=0.1, compile=True)
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)  # nothing was consumed


def test_compile_must_be_a_bool():
    state = ft.TrainState.create(_model(), ft.optim.adamw())
    grads, _ = ft.accumulate_grads(state, [torch.ones(2, 4)], _loss)
    with pytest.raises(TypeError, match="compile must be True or False, got 'yes'"):
        ft.clip_and_step(state, grads, lr=0.1, compile="yes")
