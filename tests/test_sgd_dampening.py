"""`ft.optim.sgd` with momentum and dampening against `torch.optim.SGD`, per parameter.

torch starts a parameter's momentum buffer at its first update with the gradient itself
(`buf = clone(g)`) and damps only later updates (`buf = m * buf + (1 - d) * g`). ftrain once
started every buffer at zero and took "first" from the global step, so a parameter whose
gradients start late, or whose first update was skipped as non-finite, got `(1 - d) g`.
"""

import json
from typing import NamedTuple

import pytest
import torch

import ftrain as ft
from ftrain.checkpoint import CheckpointMismatchError

NAN = float("nan")


class _Two(torch.nn.Module):
    """Two heads: `b` has no gradient for the first steps (a second task's head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(3, 2, dtype=torch.float64)
        self.b = torch.nn.Linear(3, 2, dtype=torch.float64)


def _grads(names, step, nan=False):
    g = torch.Generator().manual_seed(step)
    shapes = {"weight": (2, 3), "bias": (2,)}
    out = {}
    for head in names:
        for kind, shape in shapes.items():
            out[f"{head}.{kind}"] = torch.randn(shape, generator=g, dtype=torch.float64)
    if nan:
        next(iter(out.values()))[0].fill_(NAN)
    return out


# (heads with a gradient, whether the step is non-finite) per step.
SCHEDULES = {
    # `b` starts at step 2; a skipped step in between; `a` has no gradient at the last step.
    "late": [("a", False), ("a", False), ("ab", False), ("ab", True), ("ab", False), ("b", False)],
    # The very first step is skipped: the next one is every parameter's first update.
    "skipped-first": [("ab", True), ("ab", False), ("ab", False)],
}
CONFIGS = {
    "damped": dict(momentum=0.9, dampening=0.5),
    "fully-damped-decay-maximize": dict(
        momentum=0.9, dampening=1.0, weight_decay=0.1, maximize=True, mask=["a.weight", "b.weight"]
    ),
}


def _torch_sgd(model, momentum, dampening, weight_decay=0.0, maximize=False, mask=None):
    named = dict(model.named_parameters())
    decayed = [p for n, p in named.items() if mask is None or n in mask]
    rest = [p for n, p in named.items() if not (mask is None or n in mask)]
    groups = [{"params": decayed, "weight_decay": weight_decay}]
    groups += [{"params": rest, "weight_decay": 0.0}] if rest else []
    return torch.optim.SGD(
        groups, lr=0.1, momentum=momentum, dampening=dampening, maximize=maximize
    )


def _compare(config, compile, steps):
    # Eager runs torch's own ops per parameter: equal to the bit. The compiled twin is fused
    # by inductor: float64 rounding.
    tol = dict(rtol=1e-12, atol=1e-12) if compile else dict(rtol=0, atol=0)
    ours, theirs = _Two(), _Two()
    state = ft.TrainState.create(ours, ft.optim.sgd(**config))
    opt = _torch_sgd(theirs, **config)
    named = dict(theirs.named_parameters())
    for k, (heads, nan) in enumerate(steps):
        grads = _grads(heads, k, nan)
        for n, p in named.items():
            p.grad = grads[n].clone() if n in grads else None
        if not nan:  # a non-finite step is skipped, as GradScaler skips optimizer.step()
            opt.step()
        state, info = ft.clip_and_step(state, grads, lr=0.1, compile=compile)
        assert bool(info.skipped) == nan
        for n, p in named.items():
            torch.testing.assert_close(state.params[n], p, **tol, msg=f"{n} after step {k}")
            buf = opt.state[p].get("momentum_buffer")
            ours_buf = state.opt_state.momentum[n]
            if buf is None:
                assert not ours_buf.any(), f"{n} has a buffer before its first update (step {k})"
            else:
                torch.testing.assert_close(ours_buf, buf, **tol, msg=f"{n} buffer, step {k}")
    return state


@pytest.mark.parametrize("steps", SCHEDULES.values(), ids=SCHEDULES.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_late_or_skipped_first_update_copies_the_gradient_as_torch_does(config, steps):
    state = _compare(config, compile=False, steps=steps)
    assert all(bool(s) for s in state.opt_state.started.values())


@pytest.mark.slow
@pytest.mark.parametrize("steps", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_the_compiled_step_starts_each_buffer_as_torch_does(steps):
    _compare(CONFIGS["fully-damped-decay-maximize"], compile=True, steps=steps)


def _run(state, steps, start=0):
    for k, (heads, nan) in enumerate(steps, start):
        state, _ = ft.clip_and_step(state, _grads(heads, k, nan), lr=0.1)
    return state


def _state_json(path):
    return json.loads((path / "state.json").read_text())


def _fresh(config=CONFIGS["damped"]):
    return ft.TrainState.create(_Two(), ft.optim.sgd(**config))


def test_the_damped_step_reads_no_flag_on_the_host():
    """Each buffer's start is picked on the device (`torch.where`), skipped steps too."""
    state = _run(_fresh(), SCHEDULES["late"][:1])  # `a` started, `b` not
    for nan in (True, False):
        state, _ = ft.testing.assert_no_host_sync(
            ft.clip_and_step, state, _grads("ab", 1, nan), lr=0.1
        )
    assert all(bool(s) for s in state.opt_state.started.values())


def test_the_started_flags_are_checkpointed_and_a_resume_is_exact(tmp_path):
    """Saved after `a` started and before `b` did (bool tensors in optimizer.safetensors):
    the resumed run starts `b` at its first gradient, as the uninterrupted one."""
    from safetensors.torch import load_file

    steps = SCHEDULES["late"]
    whole = _run(_fresh(), steps)
    half = _run(_fresh(), steps[:2])
    path = ft.save_checkpoint(half, tmp_path)
    saved = load_file(path / "optimizer.safetensors")
    assert saved["started/a.weight"].dtype == torch.bool
    assert saved["started/a.weight"] and not saved["started/b.weight"]
    resumed = _run(ft.load_checkpoint(path, _fresh()), steps[2:], start=2)
    for n, p in whole.params.items():
        assert torch.equal(resumed.params[n], p), n


def test_sgd_without_dampening_keeps_its_checkpoint_layout(tmp_path):
    """Only dampening makes a first update differ from one from a zero buffer: the other
    configurations keep `SGDState` and the files they wrote before the flags, which load."""
    configs = [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True)]
    for i, config in enumerate(configs):
        state = _run(_fresh(config), SCHEDULES["late"][:2])
        assert type(state.opt_state) is ft.optim.SGDState
        path = ft.save_checkpoint(state, tmp_path / str(i))
        entries = _state_json(path)["optimizer"]
        assert {k.split("/")[0] for k in entries} == {"", "momentum"}
        ft.load_checkpoint(path, _fresh(config))


def test_a_checkpoint_records_the_dampening_and_another_is_refused_naming_it(tmp_path):
    path = ft.save_checkpoint(_run(_fresh(), SCHEDULES["late"][:2]), tmp_path)
    settings = _state_json(path)["optimizer_settings"]
    assert settings == ft.optim.describe(ft.optim.sgd(**CONFIGS["damped"]), list(_fresh().params))
    with pytest.raises(
        CheckpointMismatchError, match=r"dampening: checkpoint has 0\.5, state has 0\.3"
    ):
        ft.load_checkpoint(path, _fresh(dict(momentum=0.9, dampening=0.3)))
    with pytest.raises(
        CheckpointMismatchError,
        match="checkpoint has tuple:DampedSGDState, state has tuple:SGDState",
    ):
        ft.load_checkpoint(path, _fresh(dict(momentum=0.9)))


class _SGDStateBefore(NamedTuple):  # a damped SGD state as checkpoints wrote it before `started`
    momentum: dict


_SGDStateBefore.__name__ = _SGDStateBefore.__qualname__ = "SGDState"


def test_a_damped_checkpoint_from_before_the_started_flags_resumes_exactly(tmp_path):
    """It has no `started` flags: a parameter whose saved buffer is nonzero has started, an
    all-zero one has not, so the resumed run continues as the uninterrupted one."""
    steps = SCHEDULES["late"]
    whole = _run(_fresh(), steps)
    state = _run(_fresh(), steps[:2])  # `a` started, `b` not
    old = state.replace(opt_state=_SGDStateBefore(state.opt_state.momentum))
    path = ft.save_checkpoint(old, tmp_path)
    assert "started" not in _state_json(path)["optimizer"]
    loaded = ft.load_checkpoint(path, _fresh())
    assert {n: bool(s) for n, s in loaded.opt_state.started.items()} == {
        "a.weight": True, "a.bias": True, "b.weight": False, "b.bias": False
    }  # fmt: skip
    resumed = _run(loaded, steps[2:], start=2)
    for n, p in whole.params.items():
        assert torch.equal(resumed.params[n], p), n


def test_an_sgd_update_refuses_a_state_of_the_other_layout():
    p = {"w": torch.zeros(2)}
    damped, plain = ft.optim.sgd(momentum=0.9, dampening=0.5), ft.optim.sgd(momentum=0.9)
    with pytest.raises(
        TypeError, match=r"dampening=0.5\) updates an ft.optim.DampedSGDState, got SGDState"
    ):
        damped.update({"w": torch.ones(2)}, plain.init(p), p, lr=0.1, step=0)
    with pytest.raises(
        TypeError, match=r"dampening=0.0\) updates an ft.optim.SGDState, got DampedSGDState"
    ):
        plain.update({"w": torch.ones(2)}, damped.init(p), p, lr=0.1, step=0)


@pytest.mark.parametrize("config", [dict(dampening=0.5), dict(dampening=1.0, weight_decay=0.1)])
def test_dampening_without_momentum_is_refused_naming_it(config):
    """torch.optim.SGD takes dampening with momentum=0 and ignores it (it damps a buffer that
    is never kept): ftrain's sgd took it too, equal to plain SGD, without a word."""
    with pytest.raises(ValueError, match=r"dampening=.* momentum=0 does not keep: it would be"):
        ft.optim.sgd(**config)
    # what it would have trained: torch's SGD with and without the ignored dampening agree
    ours, theirs = _Two(), _Two()
    kept = {k: v for k, v in config.items() if k != "dampening"}
    state = ft.TrainState.create(ours, ft.optim.sgd(**kept))
    opt = _torch_sgd(theirs, momentum=0.0, **config)
    named = dict(theirs.named_parameters())
    for k in range(3):
        grads = _grads("ab", k)
        for n, p in named.items():
            p.grad = grads[n].clone()
        opt.step()
        state, _ = ft.clip_and_step(state, grads, lr=0.1)
    for n, p in named.items():
        assert torch.equal(state.params[n], p), n
