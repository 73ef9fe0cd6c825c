"""Every ft optimizer against torch.optim on deep copies of one model, same data, N steps:
parameter *deltas* must agree (torchopt's test recipe), in float64 and float32."""

import copy

import pytest
import torch

import ftrain as ft

STEPS = 20
CASES = [
    (
        "adamw",
        lambda: ft.optim.adamw(weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=0, weight_decay=0.1),
    ),
    (
        "adamw_betas",
        lambda: ft.optim.adamw(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
        lambda p: torch.optim.AdamW(p, lr=0, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
    ),
    (
        "adam",
        lambda: ft.optim.adam(weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=0, weight_decay=0.01),
    ),
    ("sgd", lambda: ft.optim.sgd(), lambda p: torch.optim.SGD(p, lr=0)),
    (
        "sgd_momentum",
        lambda: ft.optim.sgd(momentum=0.9, dampening=0.1, weight_decay=1e-3),
        lambda p: torch.optim.SGD(p, lr=0, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    ),
    (
        "sgd_nesterov",
        lambda: ft.optim.sgd(momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0, momentum=0.9, nesterov=True),
    ),
    (
        "from_torch_rmsprop",
        lambda: ft.optim.from_torch(torch.optim.RMSprop, alpha=0.9),
        lambda p: torch.optim.RMSprop(p, lr=0, alpha=0.9),
    ),
]


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(
        dtype
    )


def _data(dtype):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 5, generator=g, dtype=dtype), torch.randn(6, 3, generator=g, dtype=dtype))
        for _ in range(STEPS)
    ]


def _loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum(), torch.tensor(x.shape[0])


def _lr(step):
    return 0.05 * (1 + step) / STEPS  # a changing lr exercises lr-as-argument


def _run_ft(make, model, data):
    state = ft.TrainState.create(model, make())
    for batch in data:
        grads, stats = ft.accumulate_grads(state, [batch], _loss)
        state, _ = ft.clip_and_step(state, grads, lr=_lr(state.step), stats=stats)
    return state


def _run_torch(make, model, data):
    opt = make(model.parameters())
    for step, batch in enumerate(data):
        opt.zero_grad()
        loss, n = _loss(model, batch)
        (loss / n).backward()
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.step()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("name,make_ft,make_torch", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_optim(name, make_ft, make_torch, dtype, tol):
    base = _model(dtype)
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    data = _data(dtype)
    _run_ft(make_ft, ours, data)
    _run_torch(make_torch, theirs, data)
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        d_ours, d_theirs = p.detach() - start[n], q.detach() - start[n]
        assert d_theirs.abs().max() > 0
        torch.testing.assert_close(d_ours, d_theirs, rtol=tol * STEPS, atol=tol * STEPS, msg=n)


def test_decay_mask_matches_hf_rule_and_param_groups():
    from transformers import Trainer

    from helpers import tiny_llama

    model = tiny_llama()
    hf = set(Trainer.get_decay_parameter_names(None, model))
    ours = ft.optim.decay_mask(model)
    names = {n for n, _ in model.named_parameters()}
    assert ours == hf & names
    assert "model.norm.weight" not in ours and "model.layers.0.mlp.up_proj.weight" in ours

    # adamw(mask=...) equals torch AdamW with HF's two param groups.
    base = _model(torch.float64)
    mask = ft.optim.decay_mask(base)
    assert mask == {"0.weight", "2.weight"}
    ours_m, theirs_m = copy.deepcopy(base), copy.deepcopy(base)
    data = _data(torch.float64)
    _run_ft(lambda: ft.optim.adamw(weight_decay=0.5, mask=mask), ours_m, data)
    groups = lambda ps: torch.optim.AdamW(  # noqa: E731
        [
            {
                "params": [p for n, p in theirs_m.named_parameters() if n in mask],
                "weight_decay": 0.5,
            },
            {
                "params": [p for n, p in theirs_m.named_parameters() if n not in mask],
                "weight_decay": 0.0,
            },
        ],
        lr=0,
    )
    _run_torch(groups, theirs_m, data)
    for p, q in zip(ours_m.parameters(), theirs_m.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_from_torchopt_matches_torch_adamw():
    import torchopt

    base = _model(torch.float64)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    data = _data(torch.float64)
    _run_ft(lambda: ft.optim.from_torchopt(torchopt.adamw(lr=1.0, weight_decay=0.0)), ours, data)
    _run_torch(lambda p: torch.optim.AdamW(p, lr=0, weight_decay=0.0), theirs, data)
    # torchopt's AdamW is its own implementation (not torch's kernel): it agrees to ~1e-4, and
    # a wrong lr scaling would be off by orders of magnitude more.
    for p, q, b in zip(ours.parameters(), theirs.parameters(), base.parameters(), strict=True):
        torch.testing.assert_close(p - b, q - b, rtol=1e-3, atol=1e-5)


def test_chain_with_transforms():
    p = {"w": torch.tensor([1.0, 1.0])}
    opt = ft.optim.chain(
        ft.optim.scale(2.0),
        ft.optim.clip_by_global_norm(1.0),
        ft.optim.add_decayed_weights(0.5),
        ft.optim.sgd(),
    )
    opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(p), p, lr=1.0, step=0)
    # scale -> [6, 8]; clip to norm 1 -> [0.6, 0.8]; + 0.5 * w -> [1.1, 1.3]; w - g
    torch.testing.assert_close(p["w"], torch.tensor([-0.1, -0.3]), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="must end with"):
        ft.optim.chain(ft.optim.scale(1.0))
    with pytest.raises(TypeError, match="Transform"):
        ft.optim.chain(ft.optim.sgd(), ft.optim.sgd())


@pytest.mark.parametrize(
    "make",
    [
        lambda: ft.optim.adamw(),
        lambda: ft.optim.adam(),
        lambda: ft.optim.sgd(momentum=0.9),
        lambda: ft.optim.from_torch(torch.optim.RMSprop),
    ],
    ids=["adamw", "adam", "sgd", "from_torch"],
)
def test_found_inf_skips_update_and_state(make):
    """Conformance: every optimizer leaves params and state untouched when found_inf is set."""
    opt = make()
    p = {"w": torch.nn.Parameter(torch.ones(3))}
    s = opt.init(p)
    s = opt.update({"w": torch.ones(3)}, s, p, lr=0.1, step=0)
    before_p = p["w"].detach().clone()
    before_s = copy.deepcopy(s) if not isinstance(s, ft.optim.TorchOptimizerState) else None
    opt.update({"w": torch.full((3,), 2.0)}, s, p, lr=0.1, step=1, found_inf=torch.ones(()))
    assert torch.equal(p["w"], before_p)
    if before_s is not None:
        for a, b in zip(
            torch.utils._pytree.tree_leaves(s),
            torch.utils._pytree.tree_leaves(before_s),
            strict=True,
        ):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: ft.optim.adamw(betas=(0.9, 1.0)), "betas"),
        (lambda: ft.optim.adamw(eps=-1.0), "eps"),
        (lambda: ft.optim.adam(weight_decay=-0.1), "weight_decay"),
        (lambda: ft.optim.sgd(momentum=-1.0), "momentum"),
        (lambda: ft.optim.sgd(nesterov=True), "nesterov"),
        (lambda: ft.optim.sgd(dampening=0.5), "dampening=0.5 damps the momentum buffer"),
        (lambda: ft.optim.clip(0.0), "max_abs"),
    ],
)
def test_factories_validate(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
