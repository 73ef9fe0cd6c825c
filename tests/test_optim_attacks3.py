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


def test_one_ema_for_a_float32_state_then_a_float64_one_weighs_the_float64_average_in_float64():
    # The weight's dtype was cached by the names and the first average's dtype: after a state
    # with a float32 "b", a float64 "b" (behind a float32 "a") was weighed with float32's
    # 1 - decay (2.5e-8 off at 0.9999).
    def run(opt):
        with torch.no_grad():
            p = {"a": torch.zeros(1), "b": torch.zeros(1, dtype=torch.float64)}
            s = opt.init(p)
            g = {"a": torch.zeros(1), "b": torch.full((1,), -1.0, dtype=torch.float64)}
            for step in range(3):
                s = opt.update(g, s, p, lr=1.0, step=step, found_inf=torch.zeros(()))
        return s.ema["b"]

    reused = ft.optim.ema(ft.optim.sgd(), decay=0.9999, warmup=False)
    with torch.no_grad():
        p1 = {"a": torch.zeros(1), "b": torch.zeros(1)}
        s1 = reused.init(p1)
        reused.update(
            {n: torch.zeros(1) for n in p1}, s1, p1, lr=1.0, step=0, found_inf=torch.zeros(())
        )
    want = torch.zeros(1, dtype=torch.float64)
    for step in range(3):
        want = 0.9999 * want + (1 - 0.9999) * (step + 1.0)
    torch.testing.assert_close(run(reused), want, rtol=0, atol=1e-17)
