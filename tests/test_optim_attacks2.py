"""Silent failures a second adversarial review of ft.optim reproduced; each test failed before
its fix.

- `sgd` on float16/bfloat16 parameters on the CPU did not move them: torch 2.13's CPU
  `_fused_sgd_` updates only the last `numel % 16` elements of a half-precision tensor.
- `decay_mask` of a `torch.compile`d (or DDP) model named `_orig_mod.0.weight`, the state
  `0.weight`: `adamw(mask=...)` decayed nothing. A hand-made mask so named is refused at init.
- `from_torch` of a factory that left a parameter out never trained it; a param group's own lr
  was overwritten by each step's.
- `ema` of float16/bfloat16 parameters stalled: `(1 - decay) * (param - ema)` rounded away.
- `from_torchopt` failed with a bare KeyError when a parameter had no gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchopt

import ftrain as ft


def _mlp(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(
        dtype
    )


def _grads(model: torch.nn.Module, steps: int) -> list[dict[str, torch.Tensor]]:
    """Gradients for `steps` updates (the third one NaN: a skipped step), in the model's dtype."""
    g = torch.Generator().manual_seed(1)
    out = [
        {n: torch.randn(p.shape, generator=g).to(p.dtype) for n, p in model.named_parameters()}
        for _ in range(steps)
    ]
    out[2]["0.bias"][0] = float("nan")
    return out


SGDS = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    {"momentum": 0.5, "maximize": True, "weight_decay": 0.01},
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", SGDS, ids=lambda kw: ",".join(kw) or "plain")
def test_sgd_moves_half_precision_parameters_as_torch_sgd_does(dtype, kw):
    base = _mlp(dtype)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    steps = _grads(base, 5)
    state = ft.TrainState.create(ours, ft.optim.sgd(**kw))
    for grads in steps:
        state, _ = ft.clip_and_step(state, {n: g.clone() for n, g in grads.items()}, lr=0.05)
    opt = torch.optim.SGD(theirs.parameters(), lr=0.05, foreach=False, **kw)
    for grads in steps[:2] + steps[3:]:  # torch never sees the skipped step
        for n, p in theirs.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    for (name, p), q, b in zip(
        ours.named_parameters(), theirs.parameters(), base.parameters(), strict=True
    ):
        assert not torch.equal(p, b), f"{name} did not move"
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))


def test_decay_mask_of_a_compiled_model_names_the_states_parameters():
    model = _net()
    compiled = torch.compile(model)
    assert ft.optim.decay_mask(compiled) == ft.optim.decay_mask(model) == {"0.weight"}
    state = ft.TrainState.create(
        compiled, ft.optim.adamw(weight_decay=0.5, mask=ft.optim.decay_mask(compiled))
    )
    w0 = model[0].weight.detach().clone()
    zero = {n: torch.zeros_like(p) for n, p in state.params.items()}
    ft.clip_and_step(state, zero, lr=1.0)  # a zero gradient: only the decay moves the weight
    torch.testing.assert_close(model[0].weight.detach(), w0 * 0.5)


@pytest.mark.parametrize(
    "make",
    [
        lambda mask: ft.optim.adamw(mask=mask),
        lambda mask: ft.optim.sgd(weight_decay=0.1, mask=mask),
        lambda mask: ft.optim.chain(ft.optim.add_decayed_weights(0.1, mask=mask), ft.optim.sgd()),
    ],
)
@pytest.mark.parametrize("prefix", ["_orig_mod.", "module."])
def test_a_mask_naming_parameters_through_a_wrapper_is_refused(make, prefix):
    with pytest.raises(
        ValueError, match=r"mask names '.*0\.weight', but the parameter is '0\.weight'"
    ):
        ft.TrainState.create(_net(), make([f"{prefix}0.weight"]))


def test_from_torch_refuses_a_factory_that_leaves_a_parameter_out():
    def weights_only(params, lr):
        return torch.optim.SGD([p for p in params if p.dim() > 1], lr=lr)

    with pytest.raises(
        ValueError, match=r"hold each trainable parameter once.*missing: \['0\.bias'"
    ):
        ft.TrainState.create(_net(), ft.optim.from_torch(weights_only))


def test_from_torch_refuses_param_groups_with_their_own_lr():
    def two_groups(params, lr):
        return torch.optim.SGD([{"params": params[:1], "lr": 1.0}, {"params": params[1:]}], lr=lr)

    with pytest.raises(ValueError, match=r"param groups with their own lr \[1\.0, 0\.0\]"):
        ft.TrainState.create(_net(), ft.optim.from_torch(two_groups))


def test_from_torch_with_groups_of_other_settings_still_steps_like_torch():
    def two_groups(params, lr):
        return torch.optim.AdamW(
            [{"params": params[:1], "weight_decay": 0.0}, {"params": params[1:]}], lr=lr
        )

    base = _net()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    state = ft.TrainState.create(ours, ft.optim.from_torch(two_groups))
    ref = two_groups(list(theirs.parameters()), lr=0.1)
    for _ in range(3):
        ft_grads = {n: torch.ones_like(p) for n, p in state.params.items()}
        state, _ = ft.clip_and_step(state, ft_grads, lr=0.1)
        for p in theirs.parameters():
            p.grad = torch.ones_like(p)
        ref.step()
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ema_refuses_half_precision_parameters(dtype):
    with pytest.raises(ValueError, match="a float16/bfloat16 average stalls"):
        ft.TrainState.create(_net().to(dtype), ft.optim.ema(ft.optim.adamw()))


def test_from_torchopt_names_the_parameters_without_a_gradient():
    state = ft.TrainState.create(_net(), ft.optim.from_torchopt(torchopt.adam(lr=1.0)))
    grads = {n: torch.ones_like(p) for n, p in state.params.items() if n.startswith("0.")}
    with pytest.raises(
        ValueError, match=r"from_torchopt: no gradient for \['1\.weight', '1\.bias'\]"
    ):
        ft.clip_and_step(state, grads, lr=0.1)
