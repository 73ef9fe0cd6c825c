"""ft.func steps that skip: a DP-SGD step without an example (Poisson sampling), and an
ensemble member whose gradient is not finite."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ftrain as ft

KEY = bytes(range(32))  # a test key; a run uses secrets.token_bytes(32)


def ce_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum"), batch["y"].numel()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def data(n, seed=0, width=6):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, width, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def empty(width=6):
    return {"x": torch.zeros(0, width), "y": torch.zeros(0, dtype=torch.long)}


# --- DP-SGD: a step that drew no example -----------------------------------------------------


def test_a_step_without_example_and_without_expected_batch_size_is_refused():
    """(sum of clipped gradients + noise) / B with B = the number of examples = 0: the gradient
    was inf or NaN, and clip_and_step skipped it silently (num_items 0)."""
    state = ft.TrainState.create(mlp(), ft.optim.sgd())
    for micro in ([empty()], [empty(), empty()]):
        for sigma in (0.0, 1.0):
            with pytest.raises(ValueError, match=r"no example in this step .*expected_batch_size"):
                ft.func.private_grads(
                    state, micro, ce_loss, max_norm=1.0, noise_multiplier=sigma, noise_key=KEY
                )
    # An empty micro-batch beside one with examples is no empty step.
    grads, stats = ft.func.private_grads(
        state, [empty(), data(3)], ce_loss, max_norm=1.0, noise_multiplier=1.0, noise_key=KEY
    )
    assert int(stats.num_samples) == 3 and all(g.isfinite().all() for g in grads.values())


def opacus_empty_step(model, *, lr, sigma, max_norm, batch_size, sample_rate):
    """Opacus' DPOptimizer on an empty Poisson batch: the parameters after it, and its
    accountant's step count."""
    opacus = pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    opt = opacus.optimizers.DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=lr), noise_multiplier=sigma, max_grad_norm=max_norm,
        expected_batch_size=batch_size, loss_reduction="mean",
    )  # fmt: skip
    accountant = RDPAccountant()
    opt.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' full-backward-hook notice
        ce_loss(gsm, empty(model.in_features))[0].backward()
    opt.step()
    return accountant.history[0][2]


def assert_noise_scale(delta: torch.Tensor, std: float) -> None:
    """Mean 0 and variance std**2, within six standard errors (false alarm ~1e-9), which a
    wrong scale (a factor of B, of max_norm, of sqrt(2); no noise) cannot pass."""
    d, n = delta.double(), delta.numel()
    assert abs(d.mean()) < 6 * std / math.sqrt(n)
    assert abs(d.var() / std**2 - 1) < 6 * math.sqrt(2 / n)


def test_an_empty_poisson_step_is_counted_like_opacus():
    """The step counter advances on an empty step, as Opacus' accountant counts it, so
    `epsilon(steps=state.step)` accounts for the step whether it applied or not."""
    kw = {"sigma": 1.5, "max_norm": 2.0, "batch_size": 10, "sample_rate": 0.01}
    opacus_steps = opacus_empty_step(nn.Linear(6, 3), lr=0.5, **kw)
    state = ft.TrainState.create(nn.Linear(6, 3), ft.optim.sgd())
    grads, stats = ft.func.private_grads(
        state, [empty()], ce_loss, max_norm=2.0, noise_multiplier=1.5, expected_batch_size=10,
        noise_key=KEY,
    )  # fmt: skip
    state, _ = ft.clip_and_step(state, grads, lr=0.5, stats=stats)
    assert state.step == opacus_steps == 1
    assert state.data.cursor == 1 and int(state.data.samples_seen) == 0


def test_an_empty_poisson_step_applies_the_noise_like_opacus():
    """Opacus' DPOptimizer steps on an empty Poisson batch: the clipped sum is 0, noise of std
    sigma * C is added and divided by expected_batch_size. Skipping it instead changes the
    trajectory and releases a noiseless outcome (the parameters exactly as they were) that
    the sampled Gaussian mechanism the accountant analyses never gives."""
    lr, sigma, c, b = 0.5, 1.5, 2.0, 10
    std = lr * sigma * c / b  # of each parameter's change
    torch.manual_seed(0)
    model = nn.Linear(100, 100)  # 10,100 noise coordinates
    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    opacus_empty_step(theirs, lr=lr, sigma=sigma, max_norm=c, batch_size=b, sample_rate=0.01)
    assert_noise_scale(torch.cat([(p - q).flatten() for p, q in zip(
        theirs.parameters(), model.parameters(), strict=True)]).detach(), std)  # fmt: skip

    state = ft.TrainState.create(ours, ft.optim.sgd())
    grads, stats = ft.func.private_grads(
        state, [empty(100)], ce_loss, max_norm=c, noise_multiplier=sigma, expected_batch_size=b,
        noise_key=KEY,
    )  # fmt: skip
    state, info = ft.clip_and_step(state, grads, lr=lr, stats=stats)
    assert not bool(info.skipped)
    delta = torch.cat([(state.params[n] - p).flatten() for n, p in model.named_parameters()])
    assert_noise_scale(delta.detach(), std)


# --- ensembles: a member whose gradient is not finite ----------------------------------------


def poison(model: nn.Module) -> nn.Module:
    """A NaN weight: every loss, and so every gradient, of this member is NaN."""
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    return model


ROWS = [{"x": data(24, seed=1)["x"][i], "y": torch.tensor(i % 3)} for i in range(24)]


def train(state, steps, loss=None):
    """The README loop (no clipping) for `steps` steps; the `info` of each."""
    loss = loss or ft.func.ensemble_loss(ce_loss)
    infos = []
    for micro in ft.make_batches(ROWS, state, batch_size=4, accum=2):
        grads, stats = ft.accumulate_grads(state, micro, loss)
        norms = ft.func.clip_members(grads, None)  # measures only: which members are not finite
        state, info = ft.clip_and_step(state, grads, lr=1e-2, stats=stats)
        infos.append((bool(info.skipped), norms.isfinite().tolist()))
        if state.step == steps:
            return state, infos
    raise AssertionError("ROWS ran out")


def members_opt():
    wds, lrs = [0.0, 0.1, 0.3], [1.0, 0.5, 2.0]
    return ft.func.sweep(
        [ft.optim.adamw(weight_decay=w) for w in wds], lr_factors=lrs
    )  # fmt: skip


def test_a_sweep_skips_only_the_non_finite_member():
    """Separate runs skip the non-finite one's step alone; in an lr sweep one diverged member
    stopped every member for the rest of the run (the ensemble's one norm was NaN)."""
    sick = ft.TrainState.create(ft.func.Ensemble([mlp(0), poison(mlp(1)), mlp(2)]), members_opt())
    sick, infos = train(sick, 3)
    well = ft.TrainState.create(ft.func.Ensemble([mlp(0), mlp(1), mlp(2)]), members_opt())
    well, _ = train(well, 3)
    # Reported: clip_and_step says a member skipped, the member norms say which.
    assert infos == [(True, [True, False, True])] * 3
    for k in (0, 2):  # bit for bit the members trained beside a finite member 1
        for (n, p), q in zip(
            sick.model.member(k).named_parameters(), well.model.member(k).parameters(), strict=True
        ):
            assert torch.equal(p, q), (k, n)
        assert int(sick.opt_state[k].steps) == 3
    skipped = sick.model.member(1)
    for (n, p), q in zip(skipped.named_parameters(), poison(mlp(1)).parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True, msg=n)  # untouched
    assert int(sick.opt_state[1].steps) == 0  # its optimizer counted no update
    assert all(not m.any() for m in sick.opt_state[1].mu.values())
    assert sick.step == 3


def test_a_step_without_item_still_skips_every_member_of_a_sweep():
    """With every member finite, clip_and_step's skip has another cause (here no item: every
    label ignored), which holds for all members, as for each separate run."""

    def masked(model, batch):
        y = torch.full_like(batch["y"], -100)
        return F.cross_entropy(model(batch["x"]), y, reduction="sum"), (y != -100).sum()

    state = ft.TrainState.create(ft.func.Ensemble([mlp(0), mlp(1), mlp(2)]), members_opt())
    before = {n: p.detach().clone() for n, p in state.params.items()}
    state, infos = train(state, 2, ft.func.ensemble_loss(masked))
    assert infos == [(True, [True, True, True])] * 2
    assert all(torch.equal(state.params[n], p) for n, p in before.items())
    assert [int(s.steps) for s in state.opt_state] == [0, 0, 0]

    # Beside a non-finite member too (was: the finite ones stepped on their zero gradients,
    # AdamW's decay moving them, where each separate run skipped: it counted no item).
    sick = ft.TrainState.create(ft.func.Ensemble([mlp(0), poison(mlp(1)), mlp(2)]), members_opt())
    before = {n: p.detach().clone() for n, p in sick.params.items()}
    sick, infos = train(sick, 2, ft.func.ensemble_loss(masked))
    assert infos == [(True, [True, False, True])] * 2
    for n, p in before.items():
        torch.testing.assert_close(sick.params[n], p, rtol=0, atol=0, equal_nan=True, msg=n)
    assert [int(s.steps) for s in sick.opt_state] == [0, 0, 0]


def test_partition_and_ema_refuse_to_wrap_a_sweep():
    """Either would decide one member's skip otherwise than its separate run: a partition
    group on its part of the gradients only (a member NaN in one group stepped in the other,
    half a step), an ema with one skip for every member's average."""
    labels = lambda name: "first" if name.startswith("0.") else "last"  # noqa: E731
    with pytest.raises(ValueError, match=r"partition group 'first' of ft.func.sweep"):
        ft.optim.partition({"first": members_opt(), "last": members_opt()}, labels)
    with pytest.raises(ValueError, match=r"ema of ft.func.sweep.*sweep\(\[ft.optim.ema\("):
        ft.optim.ema(members_opt())
    with pytest.raises(ValueError, match=r"ema of ft\.func\.sweep"):
        ft.optim.ema(ft.optim.chain(ft.optim.clip_by_global_norm(1.0), members_opt()))


def test_a_sweep_of_ema_members_keeps_the_skipped_members_average_alone():
    """The way to average a sweep: each member's own ema, which its own skip holds."""

    def opt():
        return ft.func.sweep(
            [ft.optim.ema(ft.optim.adamw(weight_decay=w)) for w in (0.0, 0.1, 0.3)]
        )

    sick = ft.TrainState.create(ft.func.Ensemble([mlp(0), poison(mlp(1)), mlp(2)]), opt())
    start = [{n: a.clone() for n, a in s.ema.items()} for s in sick.opt_state]
    sick, infos = train(sick, 3)
    assert [i[1] for i in infos] == [[True, False, True]] * 3
    well, _ = train(ft.TrainState.create(ft.func.Ensemble([mlp(0), mlp(1), mlp(2)]), opt()), 3)
    for k in (0, 2):  # as when member 1 is finite
        for n, a in well.opt_state[k].ema.items():
            assert torch.equal(sick.opt_state[k].ema[n], a), (k, n)
    for n, a in start[1].items():  # never updated
        torch.testing.assert_close(sick.opt_state[1].ema[n], a, rtol=0, atol=0, equal_nan=True)


def test_one_optimizer_for_all_members_skips_all_on_a_non_finite_member():
    """Documented: the members share the optimizer's step count, so no member can skip alone
    (docs/research.md); `ft.func.sweep([opt] * K)` skips only the non-finite one."""
    state = ft.TrainState.create(
        ft.func.Ensemble([mlp(0), poison(mlp(1)), mlp(2)]), ft.optim.adamw()
    )  # fmt: skip
    before = state.model.member(0)[0].weight.detach().clone()
    state, infos = train(state, 2)
    assert infos == [(True, [True, False, True])] * 2
    assert torch.equal(state.model.member(0)[0].weight, before)


def test_clip_members_without_max_norm_only_measures():
    grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]]), "b": torch.tensor([[0.0], [0.0]])}
    want = {n: g.clone() for n, g in grads.items()}
    norms = ft.func.clip_members(grads, None)
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.5]))
    assert all(torch.equal(grads[n], g) for n, g in want.items())
    norms = ft.func.clip_members(grads, 1.0)
    torch.testing.assert_close(grads["w"], torch.tensor([[0.6, 0.8], [0.3, 0.4]]))
    with pytest.raises(ValueError, match="max_norm"):
        ft.func.clip_members(grads, 0.0)


@pytest.mark.parametrize("value", [None, 0, "False"])
def test_a_skip_empty_that_is_not_a_bool_is_refused(value):
    """0 or None read as false would apply a 0/0 step; "False" as true would skip it."""
    state = ft.TrainState.create(mlp(0), ft.optim.sgd())
    grads, stats = ft.accumulate_grads(state, [data(4)], ce_loss)
    with pytest.raises(TypeError, match=r"stats.skip_empty must be True or False"):
        ft.clip_and_step(state, grads, lr=0.1, stats=stats._replace(skip_empty=value))
