"""Silent failures an adversarial review of ft.optim reproduced: each test failed before its fix.

- Adam counted one step for all parameters; torch.optim counts each parameter's own updates,
  so a parameter whose gradients start late (a second task's head) got another bias
  correction, eagerly and compiled.
- `clip_and_step` inside `swap_ema` trained the average and mixed the live weights into it.
- The EMA's skip-aware weight was float32: float64 averages drifted from the formula.
- `layerwise_lr_decay` gave blocks past `num_layers` a factor above 1, and put blocks of
  separate sequences (encoder and decoder) at one depth.
- `from_torch` stepped a parameter that `grads` left out, on its stale `.grad`.
- Hyperparameters that were accepted and ignored or that broke the step later: `from_torch(lr=)`,
  a string `mask` of `add_decayed_weights` (matched as substrings), NaN or bool factors, an
  infinite loss scale.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ftrain as ft
from ftrain.precision import LossScaling, Precision


class _TwoHeads(torch.nn.Module):
    """Multi-task: step k trains head k % 2 only, so head b has no gradient at step 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 1)
        self.b = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return (self.a if task == 0 else self.b)(x)


def _loss(model, batch):
    x, task = batch
    return (model(x, task) ** 2).sum(), x.shape[0]


def _data(dtype, steps=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=g, dtype=dtype), k % 2) for k in range(steps)]


def _torch_run(model, make, data):
    opt = make(model.parameters())
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss, n = _loss(model, batch)
        (loss / n).backward()
        opt.step()


def _ft_steps(state, data, *, compile=False):
    for batch in data:
        grads, stats = ft.accumulate_grads(state, [batch], _loss)
        state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats, compile=compile)
    return state


ADAMS = [
    ("adamw", lambda: ft.optim.adamw(weight_decay=0.1), torch.optim.AdamW, {"weight_decay": 0.1}),
    ("adam", lambda: ft.optim.adam(weight_decay=0.01), torch.optim.Adam, {"weight_decay": 0.01}),
]


@pytest.mark.parametrize("name,make_ft,cls,kw", ADAMS, ids=[a[0] for a in ADAMS])
def test_adam_counts_each_parameters_updates_like_torch_optim_through_a_resume(
    tmp_path, name, make_ft, cls, kw
):
    torch.manual_seed(0)
    base = _TwoHeads().double()
    theirs = copy.deepcopy(base)
    data = _data(torch.float64)
    _torch_run(theirs, lambda p: cls(p, lr=0.1, **kw), data)
    half = _ft_steps(ft.TrainState.create(copy.deepcopy(base), make_ft()), data[:3])
    path = ft.save_checkpoint(half, tmp_path)
    state = ft.load_checkpoint(path, ft.TrainState.create(copy.deepcopy(base), make_ft()))
    state = _ft_steps(state, data[3:])
    for (n, p), q in zip(state.params.items(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=n)
    # Head a had steps 0, 2, 4, head b steps 1, 3, 5; `steps` counts the updates applied.
    counts = {n: int(c) for n, c in state.opt_state.counts.items()}
    assert counts == {"a.weight": 3, "a.bias": 3, "b.weight": 3, "b.bias": 3}
    assert int(state.opt_state.steps) == 6


def test_compiled_adam_counts_each_parameters_updates_and_skips_like_eager():
    torch.manual_seed(0)
    base = _TwoHeads()
    theirs = copy.deepcopy(base)
    data = _data(torch.float32, steps=5)
    _torch_run(theirs, lambda p: torch.optim.AdamW(p, lr=0.1), data)
    state = _ft_steps(
        ft.TrainState.create(copy.deepcopy(base), ft.optim.adamw()), data, compile=True
    )
    for (n, p), q in zip(state.params.items(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    # A non-finite step is not counted, compiled or not.
    grads, stats = ft.accumulate_grads(state, [data[0]], _loss)
    grads["a.weight"].fill_(float("nan"))
    state, info = ft.clip_and_step(state, grads, lr=0.1, stats=stats, compile=True)
    assert bool(info.skipped)
    assert {n: int(c) for n, c in state.opt_state.counts.items()} == {
        "a.weight": 3, "a.bias": 3, "b.weight": 2, "b.bias": 2,
    }  # fmt: skip


def test_clip_and_step_inside_swap_ema_raises_and_changes_nothing():
    torch.manual_seed(0)
    state = ft.TrainState.create(torch.nn.Linear(3, 1), ft.optim.ema(ft.optim.sgd(), decay=0.5))
    x = torch.randn(4, 3)
    grads, stats = ft.accumulate_grads(state, [x], lambda m, b: (((m(b) - 1) ** 2).sum(), 4))
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    live = {n: p.detach().clone() for n, p in state.params.items()}
    average = {n: a.clone() for n, a in state.opt_state.ema.items()}
    with ft.optim.swap_ema(state):
        grads, stats = ft.accumulate_grads(state, [x], lambda m, b: (((m(b) - 1) ** 2).sum(), 4))
        for donate in (True, False):
            with pytest.raises(
                ValueError, match=r"clip_and_step\(state\) inside ft.optim.swap_ema"
            ):
                ft.clip_and_step(state, grads, lr=0.1, stats=stats, donate=donate)
    for n, p in state.params.items():
        assert torch.equal(p, live[n]), n
        assert torch.equal(state.opt_state.ema[n], average[n]), n


def test_ema_of_float64_weights_follows_the_formula_with_the_skip_check_on():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    state = ft.TrainState.create(model, ft.optim.ema(ft.optim.sgd(), decay=0.9999, warmup=False))
    want = {n: p.detach().clone() for n, p in state.params.items()}
    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(10):  # skip_nonfinite=True: the weight is a device tensor, zero if skipped
        grads, stats = ft.accumulate_grads(state, [x], lambda m, b: (((m(b) - 1) ** 2).sum(), 4))
        state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
        for n, p in state.params.items():
            want[n] = 0.9999 * want[n] + (1 - 0.9999) * p.detach()
    for n in want:
        torch.testing.assert_close(state.opt_state.ema[n], want[n], rtol=0, atol=1e-15, msg=n)


@pytest.mark.parametrize("in_partition", [False, True])
def test_from_torch_leaves_alone_a_parameter_that_grads_leaves_out(in_partition):
    # A plain grads mapping may name a subset: ft.optim.adamw updates only those; from_torch
    # stepped every parameter with a .grad, the left-out one on its stale, unclipped gradient.
    opt = ft.optim.from_torch(torch.optim.AdamW)
    if in_partition:
        opt = ft.optim.partition({"t": opt}, lambda n: "t")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = ft.TrainState.create(model, opt)
    (model(torch.randn(4, 2)) ** 2).sum().backward()
    bias, weight = model.bias.detach().clone(), model.weight.detach().clone()
    state, _ = ft.clip_and_step(state, {"weight": model.weight.grad}, lr=0.1)
    assert torch.equal(model.bias, bias)
    assert not torch.equal(model.weight, weight)


class _EncoderDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 2)
        self.encoder = torch.nn.Module()
        self.encoder.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
        self.head = torch.nn.Linear(2, 5)


class _Stack(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 2)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(n)])
        self.head = torch.nn.Linear(2, 5)


def test_layerwise_lr_decay_refuses_depths_it_would_get_wrong():
    # num_layers below a block index: block 3 got depth 4 > L + 1, a factor of 2.0.
    with pytest.raises(ValueError, match="num_layers=2, but the model has block 3"):
        ft.optim.layerwise_lr_decay(_Stack(4), decay=0.5, num_layers=2)
    # encoder block i and decoder block i got one depth (and one factor).
    with pytest.raises(ValueError, match=r"model numbers its blocks in 2 sequences"):
        ft.optim.layerwise_lr_decay(_EncoderDecoder(), decay=0.5)
    # True is not a decay of 1 (every factor 1: no decay at all), nor a number of layers.
    with pytest.raises(TypeError, match="decay"):
        ft.optim.layerwise_lr_decay(_Stack(2), decay=True)
    with pytest.raises(TypeError, match="num_layers"):
        ft.optim.layerwise_lr_decay(_Stack(2), decay=0.5, num_layers=True)
    labels, factors = ft.optim.layerwise_lr_decay(_Stack(2), decay=0.5, num_layers=3)
    assert labels["layers.1.weight"] == "depth_2" and labels["head.weight"] == "depth_4"
    assert factors["depth_4"] == 1.0 and factors["depth_2"] == 0.25


def test_add_decayed_weights_takes_a_mask_like_adamw_and_refuses_a_string():
    p = {"0.weight": torch.ones(1), "10.weight": torch.ones(1)}
    opt = ft.optim.chain(
        ft.optim.add_decayed_weights(0.5, mask=lambda n: n == "10.weight"), ft.optim.sgd()
    )
    opt.update({n: torch.zeros(1) for n in p}, opt.init(p), p, lr=1.0, step=0)
    assert p["0.weight"].item() == 1.0 and p["10.weight"].item() == 0.5
    # A string was searched for substrings: mask="10.weight" decayed "0.weight" too.
    with pytest.raises(TypeError, match="mask"):
        ft.optim.add_decayed_weights(0.5, mask="10.weight")


REFUSED = {
    "scale-nan": (lambda: ft.optim.scale(float("nan")), ValueError, "factor"),
    "scale-bool": (lambda: ft.optim.scale(True), TypeError, "factor"),
    "clip-str": (lambda: ft.optim.clip("1"), TypeError, "max_abs"),
    "clip-bool": (lambda: ft.optim.clip(True), TypeError, "max_abs"),
    "clip_by_global_norm-bool": (lambda: ft.optim.clip_by_global_norm(True), TypeError, "max_norm"),
    "add_decayed_weights-nan": (
        lambda: ft.optim.add_decayed_weights(float("nan")), ValueError, "weight_decay",
    ),
    "add_decayed_weights-inf": (
        lambda: ft.optim.add_decayed_weights(math.inf), ValueError, "weight_decay",
    ),
    "from_torch-lr": (lambda: ft.optim.from_torch(torch.optim.SGD, lr=0.5), TypeError, "lr"),
    "init_scale-inf": (lambda: LossScaling(init_scale=math.inf), ValueError, "init_scale"),
    "init_scale-str": (lambda: LossScaling(init_scale="1"), ValueError, "init_scale"),
    "growth_factor-inf": (lambda: LossScaling(growth_factor=math.inf), ValueError, "growth_factor"),
    "growth_interval-bool": (
        lambda: LossScaling(growth_interval=True), ValueError, "growth_interval",
    ),
    "loss_scaling-bool": (
        lambda: Precision(torch.float16, loss_scaling=True), TypeError, "loss_scaling",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_hyperparameter_that_would_be_ignored_or_break_the_step_is_refused(case):
    make, error, name = REFUSED[case]
    with pytest.raises(error, match=rf"\b{name}\b"):
        make()


@pytest.mark.parametrize("step", [-1, -5, 1.5, True])
def test_ema_decay_refuses_a_step_that_is_no_update_count(step):
    """ema_decay(-1) raised a bare ZeroDivisionError; a fractional step gave a decay no update
    ever uses."""
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ft.optim.ema_decay(step, decay=0.999)
