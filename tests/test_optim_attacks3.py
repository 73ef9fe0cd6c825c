"""Attacks on ft.optim (third session): each case was silently wrong before its fix."""

import pytest
import torch

import ftrain as ft


@pytest.mark.parametrize(
    "make",
    [lambda: ft.optim.sgd(momentum=0.9), lambda: ft.optim.sgd(nesterov=True, momentum=0.5)],
)
def test_one_optimizer_for_a_float32_state_then_a_partly_bfloat16_one_trains_every_element(make):
    # The (device, dtype) split was cached by name alone: the second state's bfloat16 "b" was
    # grouped with float32 "a", and the CPU's fused SGD moved only its last numel % 16 elements.
    opt, fresh = make(), make()
    with torch.no_grad():
        p1 = {"a": torch.ones(40), "b": torch.ones(40)}
        opt.update({n: torch.ones(40) for n in p1}, opt.init(p1), p1, lr=0.1, step=0)
        got = {"a": torch.ones(40), "b": torch.ones(40, dtype=torch.bfloat16)}
        want = {n: t.clone() for n, t in got.items()}
        s, r = opt.init(got), fresh.init(want)
        for step in range(2):
            g = {n: torch.full_like(t, 0.5) for n, t in got.items()}
            s = opt.update(g, s, got, lr=0.1, step=step)
            r = fresh.update({n: t.clone() for n, t in g.items()}, r, want, lr=0.1, step=step)
    assert not torch.equal(got["b"], torch.ones(40, dtype=torch.bfloat16))
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
