"""Preemption, the spike guard and background saves crossed with each other: a SIGTERM at each
point of a guarded step (between accumulate_grads and clip_and_step, inside the rollback's
load, right after a background save started), rollbacks while a save is in flight under
keep_last=1, and a background save whose thread never starts."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from torch import nn

import ftrain as ft
import ftrain.extras.guard as guard_module
from ftrain import process_state
from ftrain.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")

TOTAL = 16
POISON = (14, 15)  # rows that spike the loss: micro-batch 7 at batch size 2


def _rows() -> list[dict[str, torch.Tensor]]:
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
    return [{"x": x[i], "i": torch.tensor(i)} for i in range(40)]


def _loss(model: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss = ((model(b["x"]).squeeze(-1) - 1.0) ** 2).sum()
    hit = torch.isin(b["i"], torch.tensor(POISON)).any()
    return torch.where(hit, loss * 1000, loss), torch.tensor(len(b["i"]))


def _run(root, *, every=1, blocking=True, keep_last=None, hooks=None, preempt=None, rolled=None):
    """The README loop with the guard; resumes from `root`; `hooks[where](state)` run at
    "between" (accumulate_grads and clip_and_step) and "after" (the step's save)."""
    hooks = hooks or {}
    guard = ft.guard.SpikeGuard(factor=10.0, warmup=3, beta=0.9)
    torch.manual_seed(0)
    state = ft.guard.GuardedState.create(nn.Linear(4, 1), ft.optim.adamw(), seed=0)
    if (ckpt := ft.latest_checkpoint(root)) is not None:
        state = ft.load_checkpoint(ckpt, state)
    data = _rows()
    while state.step < TOTAL and not (preempt and preempt.requested):
        for micro in ft.make_batches(data, state, batch_size=2, shuffle=False):
            grads, stats = ft.accumulate_grads(state, micro, _loss)
            hooks.get("between", lambda s: None)(state)
            state, verdict = guard.observe(state, stats)
            if verdict.rollback:
                if rolled is not None:
                    rolled.append(state.step)
                state = guard.rollback(state, root, skip=micro)
                break
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
            if ft.should_save(state, every=every, total_steps=TOTAL):
                ft.save_checkpoint(state, root, keep_last=keep_last, blocking=blocking)
            hooks.get("after", lambda s: None)(state)
            if state.step >= TOTAL or (preempt and preempt.requested):
                break
        else:
            state = ft.next_epoch(state)
    ft.wait_for_checkpoint()
    return state


def _assert_bit_equal(a: ft.TrainState, b: ft.TrainState) -> None:
    assert (a.step, a.epoch, a.data.cursor, a.rollbacks) == (b.step, b.epoch, b.data.cursor,
                                                              b.rollbacks)  # fmt: skip
    for n, p in a.params.items():
        assert torch.equal(p, b.params[n]), n


def _sigterm_once(at: int) -> tuple[list[int], object]:
    fired: list[int] = []

    def hook(state: ft.TrainState) -> None:
        if state.step == at and not fired:
            fired.append(state.step)
            os.kill(os.getpid(), signal.SIGTERM)

    return fired, hook


def test_sigterm_anywhere_around_a_rollback_with_background_saves_resumes_bit_equal(tmp_path):
    """SIGTERM between accumulate_grads and clip_and_step, right after a background save
    started (keep_last=1: the rollback's only target is the save in flight), or inside the
    guard's rollback load: the loop saves, leaves, and the resumed run equals the run never
    stopped, which equals the one with blocking saves."""
    rolled: list[int] = []
    reference = _run(tmp_path / "ref", rolled=rolled)
    assert rolled == [7]  # the poisoned micro-batch, rolled back to step-7 and skipped
    _assert_bit_equal(_run(tmp_path / "bg", blocking=False, keep_last=1), reference)
    original_load = guard_module.load_checkpoint
    for i, (where, at) in enumerate([("between", 6), ("after", 6), ("after", 7), ("load", 7)]):
        root = tmp_path / f"{where}-{at}"
        fired, hook = _sigterm_once(at)
        hooks = {where: hook}
        if where == "load":  # the signal lands while the rollback reads the checkpoint

            def load(path, state, hook=hook):
                hook(state)
                return original_load(path, state)

            guard_module.load_checkpoint = load  # restored below
        try:
            with ft.strategies.on_preemption() as preempt:
                stopped = _run(root, blocking=bool(i % 2), keep_last=1, hooks=hooks,
                               preempt=preempt)  # fmt: skip
        finally:
            guard_module.load_checkpoint = original_load
        assert fired and stopped.step < TOTAL, where
        assert ft.latest_checkpoint(root) == root / f"step-{stopped.step}"
        _assert_bit_equal(_run(root, blocking=False, keep_last=1), reference)


def test_a_background_save_whose_thread_cannot_start_raises_and_is_not_left_in_flight(
    tmp_path, monkeypatch
):
    """Before: the unstarted save stayed recorded as in flight; its writer never set its Event,
    so every later checkpoint call (a guard's rollback too) and the interpreter's exit waited
    for it forever."""
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name == "ftrain-checkpoint":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    state = ft.TrainState.create(nn.Linear(2, 1), ft.optim.sgd())
    try:
        with pytest.raises(CheckpointError, match="starting the background save of step 0 fail"):
            ft.save_checkpoint(state, tmp_path, blocking=False)
        assert process_state.snapshot().save_in_flight is None
    finally:  # before the fix: forget the unstarted save, or the suite's exit would hang on it
        if (bg := process_state.STATE.save_in_flight) is not None and bg.is_alive():
            process_state.STATE.save_in_flight = None
    monkeypatch.setattr(threading.Thread, "start", start)
    assert ft.latest_checkpoint(tmp_path) is None  # returns: nothing left to wait for
    assert ft.save_checkpoint(state, tmp_path, blocking=False) == tmp_path / "step-0"
    assert ft.wait_for_checkpoint() == tmp_path / "step-0"
    assert [p.name for p in tmp_path.iterdir()] == ["step-0"]  # no temporary folder left


@pytest.mark.xfail(
    strict=True,
    reason="known defect: a preemption save at a step the save cadence skips becomes the guard's "
    "rollback target after the resume; the run never stopped rolled back to the older cadence "
    "checkpoint (fix needs should_save to mark preemption-only saves: see docs/guarantees.md)",
)
def test_a_preemption_save_off_the_cadence_does_not_change_the_guards_rollback_target(tmp_path):
    reference = _run(tmp_path / "ref", every=2)
    fired, hook = _sigterm_once(6)  # saved at step 7, off the cadence; the spike comes at 7
    with ft.strategies.on_preemption() as preempt:
        stopped = _run(tmp_path / "run", every=2, hooks={"after": hook}, preempt=preempt)
    assert fired and stopped.step == 7
    _assert_bit_equal(_run(tmp_path / "run", every=2), reference)
