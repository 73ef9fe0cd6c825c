"""clip_and_step(compile=True) crossed with the step's other arguments: same meaning as eager.

The compiled tests share one optimizer (`OPT`) and one step variant (stats given,
skip_nonfinite=False, a max_norm, every parameter with a gradient), so the file compiles one
graph: the compiled step is cached per optimizer `update`.
"""

import copy

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import ftrain as ft
from ftrain.grads import Stats

TOL = {"rtol": 1e-5, "atol": 1e-6}
OPT = ft.optim.adamw(weight_decay=0.1)
X = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _loss(m, b):
    return ((m(b) ** 2).sum(), b.shape[0])


def _steps(state, *, compile, max_norms, host_items=None):
    """One step per max_norm (stats counting `host_items` on the host where given)."""
    infos = []
    for mn in max_norms:
        grads, stats = ft.accumulate_grads(state, [X], _loss)
        if host_items is not None:
            stats = stats._replace(num_items=host_items)
        state, info = ft.clip_and_step(
            state, grads, stats=stats, lr=0.05, max_norm=mn, skip_nonfinite=False,
            compile=compile,
        )  # fmt: skip
        infos.append(info)
    return state, infos


def _same(a, b):
    for name in a.params:
        torch.testing.assert_close(b.params[name], a.params[name], **TOL, msg=name)


def test_a_schedule_of_max_norm_neither_recompiles_nor_is_ignored():
    # A float max_norm was a constant of the graph: each new value recompiled, and the ninth
    # failed the step inside dynamo. Now a tensor, refilled when it changes.
    model, norms = _model(), [0.05, 0.1, 0.2, 0.2]
    eager, _ = _steps(ft.TrainState.create(copy.deepcopy(model), OPT), compile=False,
                      max_norms=norms)  # fmt: skip
    counters.clear()
    compiled, infos = _steps(ft.TrainState.create(model, OPT), compile=True, max_norms=norms)
    assert counters["stats"]["unique_graphs"] <= 1  # 0 when another test compiled it first
    _same(eager, compiled)
    # Clipped to each step's own max_norm: the first gradient (norm > 0.2) differs per value.
    assert float(infos[0].grad_norm) > 0.2


@pytest.mark.parametrize("compile", [False, True])
def test_a_stats_counting_on_the_host_steps_or_skips_like_a_device_count(compile):
    # A Stats of yours may count items on the host; with skip_nonfinite=False the skip test
    # was a Python bool, and the update failed on it (AttributeError, or inside dynamo).
    state = ft.TrainState.create(_model(), OPT)
    before = {n: p.clone() for n, p in state.params.items()}
    state, infos = _steps(state, compile=compile, max_norms=[1.0], host_items=0)
    assert bool(infos[0].skipped) and state.step == 1  # counted nothing: skipped
    assert all(torch.equal(state.params[n], before[n]) for n in before)
    state, infos = _steps(state, compile=compile, max_norms=[1.0], host_items=6.0)
    assert not bool(infos[0].skipped)
    assert not torch.equal(state.params["0.weight"], before["0.weight"])


def test_a_stats_count_that_is_not_a_number_is_refused():
    state = ft.TrainState.create(_model(), OPT)
    grads, stats = ft.accumulate_grads(state, [X], _loss)
    with pytest.raises(TypeError, match=r"stats\.num_items must be a tensor or a number, got str"):
        ft.clip_and_step(state, grads, stats=stats._replace(num_items="6"), lr=0.1)
    for count in (np.int64(3), np.float32(3.0)):  # numpy numbers are numbers (they stepped)
        grads, stats = ft.accumulate_grads(state, [X], _loss)
        state, info = ft.clip_and_step(state, grads, stats=stats._replace(num_items=count), lr=0.1)
        assert not bool(info.skipped)


def test_past_the_recompile_limit_the_step_raises_naming_compile_and_consumes_nothing():
    state, _ = _steps(ft.TrainState.create(_model(), OPT), compile=True, max_norms=[1.0])
    grads, stats = ft.accumulate_grads(state, [X], _loss)
    del grads["2.bias"]  # another set of parameters with gradients: another graph
    limit = torch._dynamo.config.patch(recompile_limit=1)
    with limit, pytest.raises(ValueError, match=r"clip_and_step\(compile=True\) compiled more"):
        ft.clip_and_step(state, grads, stats=stats, lr=0.1, max_norm=1.0, skip_nonfinite=False,
                         compile=True)  # fmt: skip
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)  # nothing was consumed
    assert state.step == 2


@pytest.mark.parametrize(
    "make",
    [
        lambda: ft.optim.partition(
            {"m": ft.optim.muon(), "a": ft.optim.adamw()},
            lambda name: "m" if name.endswith("weight") else "a",
        ),
        lambda: ft.optim.ema(ft.optim.adamw()),
        lambda: ft.optim.chain(ft.optim.clip(1.0), ft.optim.adamw()),
        lambda: ft.optim.partition({"a": ft.optim.adamw()}, lambda name: "a"),
    ],
    ids=["muon", "ema", "chain", "partition"],
)
def test_compile_refuses_optimizers_without_a_traceable_twin(make):
    state = ft.TrainState.create(_model(), make())
    grads, stats = ft.accumulate_grads(state, [X], _loss)
    with pytest.raises(ValueError, match=r"supports the optimizers ft\.optim\.adamw, adam and sgd"):
        ft.clip_and_step(state, grads, stats=stats, lr=0.1, compile=True)


def test_a_step_with_a_host_count_still_takes_the_device_count_as_is():
    state = ft.TrainState.create(_model(), OPT)
    grads, stats = ft.accumulate_grads(state, [X], _loss)
    assert isinstance(stats, Stats) and isinstance(stats.num_items, torch.Tensor)
    state, info = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    assert not bool(info.skipped)


@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize(
    "layout",
    [lambda g: g.t().contiguous().t(), lambda g: g[:1, :1].expand_as(g)],
    ids=["transposed", "expanded"],
)
def test_a_gradient_laid_out_otherwise_than_its_parameter_is_applied_as_its_values(
    opt, layout, max_norm
):
    # The fused kernels read a gradient as if laid out like its parameter: a transposed one
    # updated the wrong elements, an expanded one read past its storage (NaN weights).
    model = torch.nn.Linear(30, 40)
    ref = copy.deepcopy(model)
    make = {"adamw": lambda: ft.optim.adamw(weight_decay=0.1), "sgd": lambda: ft.optim.sgd(
        momentum=0.9)}[opt]  # fmt: skip
    torch_opt = {"adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1),
                 "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[opt]  # fmt: skip
    g = torch.randn(40, 30, generator=torch.Generator().manual_seed(2))
    grads = {"weight": layout(g), "bias": torch.ones(40)}
    state = ft.TrainState.create(model, make())
    state, _ = ft.clip_and_step(state, grads, lr=0.1, max_norm=max_norm)
    o = torch_opt(ref.parameters())
    ref.weight.grad, ref.bias.grad = grads["weight"].contiguous(), torch.ones(40)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    o.step()
    torch.testing.assert_close(state.params["weight"], ref.weight, **TOL)
    torch.testing.assert_close(state.params["bias"], ref.bias, **TOL)
