"""Mixed precision: bf16 autocast and float16 with dynamic loss scaling kept in TrainState."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import ftrain as ft
from ftrain.precision import LossScaling, Precision, update_loss_scale

N, D_IN, D_OUT = 6, 8, 4


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 32), nn.Tanh(), nn.Linear(32, D_OUT))


def _batches(steps: int, target_scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(N, D_IN, generator=g), target_scale * torch.randn(N, D_OUT, generator=g))
        for _ in range(steps)
    ]


def _sse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return ((model(x).float() - y) ** 2).sum(), y.numel()


def _ft_run(precision: str | Precision, batches, *, max_norm=1.0, lr=1e-2):
    state = ft.TrainState.create(
        _model(), ft.optim.adamw(), strategy=ft.strategies.SingleDevice("cpu", precision=precision)
    )
    skipped, scales = [], []
    for b in batches:
        grads, stats = ft.accumulate_grads(state, [b], _sse)
        state, info = ft.clip_and_step(state, grads, lr=lr, max_norm=max_norm, stats=stats)
        skipped.append(bool(info.skipped))
        scales.append(None if state.scaler.scale is None else float(state.scaler.scale))
    return state, skipped, scales


def _raw_run(dtype: torch.dtype, batches, scaler: torch.amp.GradScaler | None, lr=1e-2):
    """The plain PyTorch loop: autocast, GradScaler, unscale, clip, step, update."""
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    skipped, scales = [], []
    for b in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss_sum, n = _sse(model, b)
        if scaler is None:
            loss_sum.backward()
            for p in params:
                p.grad.div_(n)
            nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            continue
        scaler.scale(loss_sum).backward()
        scaler.unscale_(opt)
        for p in params:
            p.grad.div_(n)
        nn.utils.clip_grad_norm_(params, 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        scales.append(scaler.get_scale())
    return model, skipped, scales


def test_names_and_validation():
    assert Precision.of(None) == Precision.of("fp32") == Precision.of("no") == Precision()
    assert Precision.of("bf16") == Precision(torch.bfloat16, None)
    assert Precision.of("fp16") == Precision(torch.float16, LossScaling())
    p = Precision(torch.float16, LossScaling(init_scale=8.0))
    assert Precision.of(p) is p
    with pytest.raises(ValueError, match="precision must be one of"):
        Precision.of("fp8")
    with pytest.raises(ValueError, match="dtype must be"):
        Precision(torch.float64)
    for bad in (
        {"init_scale": 0.0},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"growth_interval": 0},
    ):
        with pytest.raises(ValueError):
            LossScaling(**bad)
    assert "bf16" not in repr(ft.strategies.SingleDevice("cpu"))
    assert "bfloat16" in repr(ft.strategies.SingleDevice("cpu", precision="bf16"))


def test_update_loss_scale_follows_grad_scaler_rule_and_is_pure():
    rule = LossScaling(init_scale=8.0, growth_interval=2)
    scale, tracker = torch.tensor(8.0), torch.tensor(0, dtype=torch.int32)
    seen = []
    for inf in (0.0, 0.0, 0.0, 1.0, 0.0):
        new_scale, new_tracker = update_loss_scale(scale, tracker, torch.tensor(inf), rule)
        assert new_scale is not scale and new_tracker is not tracker
        scale, tracker = new_scale, new_tracker
        seen.append((float(scale), int(tracker)))
    assert seen == [(8.0, 1), (16.0, 0), (16.0, 1), (8.0, 0), (8.0, 1)]


def test_bf16_forward_runs_in_bf16_and_master_weights_stay_fp32():
    batches = _batches(8, target_scale=1.0)
    state = ft.TrainState.create(
        _model(), ft.optim.adamw(), strategy=ft.strategies.SingleDevice("cpu", precision="bf16")
    )
    out_dtypes = []
    state.model[0].register_forward_hook(lambda m, i, o: out_dtypes.append(o.dtype))
    assert state.scaler.scale is None and state.scaler.growth_tracker is None
    for b in batches:
        grads, stats = ft.accumulate_grads(state, [b], _sse)
        assert all(g.dtype == torch.float32 for g in grads.values())
        state, _ = ft.clip_and_step(state, grads, lr=1e-2, max_norm=1.0, stats=stats)
    assert set(out_dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in state.params.values())
    assert all(t.dtype == torch.float32 for t in state.opt_state.mu.values())
    # Evaluation runs under the same autocast.
    out_dtypes.clear()
    ft.evaluate(state, batches[:1], _sse)
    assert out_dtypes == [torch.bfloat16]


def test_bf16_equals_raw_autocast_loop():
    batches = _batches(10, target_scale=1.0)
    state, skipped, _ = _ft_run("bf16", batches)
    model, _, _ = _raw_run(torch.bfloat16, batches, scaler=None)
    assert not any(skipped)
    for name, p in model.named_parameters():
        torch.testing.assert_close(state.params[name], p, rtol=1e-5, atol=1e-6)
    # ... and bf16 really changed the numbers compared to float32.
    fp32, _, _ = _ft_run("fp32", batches)
    assert not torch.equal(fp32.params["0.weight"], state.params["0.weight"])


def test_fp16_loss_scaling_equals_grad_scaler():
    # Targets of ~100 make d(loss)/d(output) ~ 200: times the initial scale 2**16 it overflows
    # float16 in backward, so the first steps are skipped while the scale backs off; with
    # growth_interval=3 it grows again and overflows again.
    batches = _batches(24, target_scale=100.0)
    rule = LossScaling(growth_interval=3)
    state, skipped, scales = _ft_run(Precision(torch.float16, rule), batches)
    scaler = torch.amp.GradScaler("cpu", init_scale=rule.init_scale, growth_interval=3)
    model, raw_skipped, raw_scales = _raw_run(torch.float16, batches, scaler)
    assert skipped == raw_skipped
    assert scales == raw_scales
    assert 3 <= sum(skipped) < len(batches) - 3  # both overflow and real updates happened
    assert any(b > a for a, b in itertools.pairwise(scales))  # and it grew back
    for name, p in model.named_parameters():
        torch.testing.assert_close(state.params[name], p, rtol=1e-5, atol=1e-6)
    assert all(p.dtype == torch.float32 for p in state.params.values())
    assert state.scaler.scale.dtype == torch.float32
    assert state.scaler.growth_tracker.dtype == torch.int32
    # Adam counts only the updates that were applied, as torch.optim does under GradScaler.
    assert int(state.opt_state.steps) == len(batches) - sum(skipped)
    assert state.step == len(batches)


def test_fp16_skipped_step_leaves_parameters_unchanged():
    batches = _batches(1, target_scale=100.0)
    state = ft.TrainState.create(
        _model(), ft.optim.adamw(), strategy=ft.strategies.SingleDevice("cpu", precision="fp16")
    )
    before = {n: p.clone() for n, p in state.params.items()}
    grads, stats = ft.accumulate_grads(state, batches, _sse)
    state, info = ft.clip_and_step(state, grads, lr=1e-2, stats=stats, skip_nonfinite=False)
    assert bool(info.skipped)  # loss scaling skips overflows even with skip_nonfinite=False
    assert float(state.scaler.scale) == 2.0**15
    for n, p in state.params.items():
        assert torch.equal(p, before[n])


@pytest.mark.parametrize("compile", [False, True])
def test_fp16_a_step_that_counted_nothing_leaves_the_loss_scale_as_it_is(compile):
    """A step whose micro-batches counted no item is skipped, and measured nothing about
    overflow: it neither grows the scale nor counts toward growth (it counted toward it, so
    empty steps could double the scale without a single update that had not overflowed)."""
    rule = Precision(torch.float16, LossScaling(init_scale=2.0**10, growth_interval=2))
    state = ft.TrainState.create(
        _model(), ft.optim.adamw(), strategy=ft.strategies.SingleDevice("cpu", precision=rule)
    )
    empty = lambda model, b: (model(b[0]).float().sum() * 0.0, 0)  # noqa: E731
    for _ in range(3):
        grads, stats = ft.accumulate_grads(state, _batches(1, 1.0), empty)
        state, info = ft.clip_and_step(state, grads, lr=1e-2, stats=stats, compile=compile)
        assert bool(info.skipped)
        assert float(state.scaler.scale) == 2.0**10
        assert int(state.scaler.growth_tracker) == 0
    # A step that counted items still follows GradScaler's rule.
    for _ in range(2):
        grads, stats = ft.accumulate_grads(state, _batches(1, 1.0), _sse)
        state, info = ft.clip_and_step(state, grads, lr=1e-2, stats=stats, compile=compile)
        assert not bool(info.skipped)
    assert float(state.scaler.scale) == 2.0**11 and int(state.scaler.growth_tracker) == 0


def test_fp16_loss_scale_is_checkpointed_and_resume_is_exact(tmp_path):
    batches = _batches(12, target_scale=100.0)
    rule = Precision(torch.float16, LossScaling(growth_interval=3))

    def fresh():
        strategy = ft.strategies.SingleDevice("cpu", precision=rule)
        return ft.TrainState.create(_model(), ft.optim.adamw(), strategy=strategy)

    def train(state, part):
        for b in part:
            grads, stats = ft.accumulate_grads(state, [b], _sse)
            state, _ = ft.clip_and_step(state, grads, lr=1e-2, max_norm=1.0, stats=stats)
        return state

    full = train(fresh(), batches)
    half = train(fresh(), batches[:7])
    path = ft.save_checkpoint(half, tmp_path)
    saved_scale = float(half.scaler.scale)
    assert saved_scale != rule.loss_scaling.init_scale
    resumed = ft.load_checkpoint(path, fresh())
    assert float(resumed.scaler.scale) == saved_scale
    assert int(resumed.scaler.growth_tracker) == int(half.scaler.growth_tracker)
    resumed = train(resumed, batches[7:])
    for n, p in full.params.items():
        assert torch.equal(resumed.params[n], p)
    assert float(resumed.scaler.scale) == float(full.scaler.scale)

    # Switching precision on resume: an fp32 run ignores the saved scale, an fp16 run that
    # resumes an fp32 checkpoint starts from init_scale.
    plain = ft.load_checkpoint(path, ft.TrainState.create(_model(), ft.optim.adamw()))
    assert plain.scaler.scale is None and plain.step == 7
    fp32_path = ft.save_checkpoint(plain, tmp_path / "fp32")
    again = ft.load_checkpoint(fp32_path, fresh())
    assert float(again.scaler.scale) == rule.loss_scaling.init_scale


def test_snapshot_copies_the_loss_scale():
    state = ft.TrainState.create(
        _model(), ft.optim.adamw(), strategy=ft.strategies.SingleDevice("cpu", precision="fp16")
    )
    copy = ft.snapshot(state)
    assert copy.scaler.scale is not state.scaler.scale
    assert torch.equal(copy.scaler.scale, state.scaler.scale)


def test_loss_scale_and_strategy_must_agree():
    state = ft.TrainState.create(_model(), ft.optim.adamw())
    grads, _ = ft.accumulate_grads(state, _batches(1, 1.0), _sse)
    bad = state.replace(strategy=ft.strategies.SingleDevice("cpu", precision="fp16"))
    with pytest.raises(ValueError, match=r"loss scaling and state\.scaler disagree"):
        ft.clip_and_step(bad, grads, lr=1e-2)


def test_a_forged_loss_scale_is_refused(tmp_path):
    import hashlib
    import json

    strategy = ft.strategies.SingleDevice("cpu", precision="fp16")
    state = ft.TrainState.create(_model(), ft.optim.adamw(), strategy=strategy)
    path = ft.save_checkpoint(state, tmp_path)
    meta = json.loads((path / "state.json").read_text())
    meta["fields"]["scaler.scale"]["value"] = -1.0
    (path / "state.json").write_text(json.dumps(meta))
    digest = hashlib.sha256((path / "state.json").read_bytes()).hexdigest()
    (path / "COMMITTED").write_text(json.dumps({"state.json": digest}))
    fresh = ft.TrainState.create(_model(), ft.optim.adamw(), strategy=strategy)
    with pytest.raises(ft.CheckpointError, match=r"scaler\.scale"):
        ft.load_checkpoint(path, fresh)


def test_bf16_drift_across_batch_splits_is_bf16_rounding():
    """docs/strategies.md's order of magnitude: the same rows split as 2 or 4 ranks split them
    (here as micro-batches in one process) give gradients within ~1e-3 relative in bf16, and
    within ~1e-7 in fp32."""
    from helpers import ragged_rows, tiny_llama

    rows = ragged_rows(16, seed=3)

    def grads(precision, parts):
        torch.manual_seed(0)
        strategy = ft.strategies.SingleDevice("cpu", precision=precision)
        state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), strategy=strategy)
        (micro,) = ft.make_batches(rows, batch_size=16 // parts, accum=parts, shuffle=False)
        g, _ = ft.accumulate_grads(state, micro)
        return torch.cat([v.flatten() for v in g.values()])

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    for parts in (2, 4):
        assert rel(grads("fp32", parts), grads("fp32", 1)) < 1e-6
        assert 1e-4 < rel(grads("bf16", parts), grads("bf16", 1)) < 1e-2


def test_fp16_loss_scaling_refuses_float16_parameters():
    """The scaled float16 gradients of float16 parameters overflowed at the first scale: every
    step was skipped and the scale halved on (nan, inf, inf...), without an update. Refused
    now, as torch.amp.GradScaler refuses to unscale float16 gradients."""
    model = _model().half()
    with pytest.raises(ValueError, match=r"precision='fp16' \(loss scaling\) needs float32"):
        ft.TrainState.create(
            model, ft.optim.adamw(), strategy=ft.strategies.SingleDevice("cpu", precision="fp16")
        )
    frozen = _model()
    frozen[0].half().requires_grad_(False)  # frozen float16 weights are no master weights
    ft.TrainState.create(
        frozen, ft.optim.adamw(), strategy=ft.strategies.SingleDevice("cpu", precision="fp16")
    )


def test_a_float16_precision_built_by_dtype_scales_its_loss():
    """`Precision(torch.float16)` (the documented `Precision(dtype, loss_scaling)` with its
    default) had no loss scaling, unlike "fp16": gradients below float16's range flushed to
    zero in the backward and the run trained on zeros, silently. The default is now "auto"
    (LossScaling() for float16); loss_scaling=None still opts out."""
    assert Precision(torch.float16) == Precision.of("fp16")
    assert Precision(torch.bfloat16).loss_scaling is None and Precision().loss_scaling is None
    torch.manual_seed(0)
    x = torch.full((8, 4), 1e-6)

    def loss_fn(m, b):
        return (m(b).float() * 1e-3).sum(), torch.tensor(1.0)

    def grads_with(precision):
        state = ft.TrainState.create(
            nn.Linear(4, 1),
            ft.optim.adamw(),
            strategy=ft.strategies.SingleDevice(precision=precision),
        )
        grads, _ = ft.accumulate_grads(state, [x], loss_fn)
        return state, grads["weight"]

    state, scaled = grads_with(Precision(torch.float16))
    assert float(state.scaler.scale) == 2.0**16
    torch.testing.assert_close(scaled, torch.full((1, 4), 8e-9), rtol=5e-2, atol=0)
    state, unscaled = grads_with(Precision(torch.float16, loss_scaling=None))  # opted out
    assert state.scaler.scale is None and not unscaled.any()  # flushed to zero in float16
