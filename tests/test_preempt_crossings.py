"""Preemption, the spike guard and background saves crossed with each other: a SIGTERM at each
point of a guarded step (between accumulate_grads and clip_and_step, inside the rollback's
load, right after a background save started), rollbacks while a save is in flight under
keep_last=1, a background save whose thread never starts, and preemption saves off the save
cadence (marked preemption-only: the resume loads them, the guard rolls back past them)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import pytest
import torch
from torch import nn

import ftrain as ft
import ftrain.extras.guard as guard_module
from ftrain import process_state
from ftrain.checkpoint import CheckpointError, retained

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

            def load(path, state, hook=hook, **kw):
                hook(state)
                return original_load(path, state, **kw)

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


def _marked(checkpoint) -> bool:
    """Whether save_checkpoint marked the checkpoint preemption-only (its state.json)."""
    meta = json.loads((checkpoint / "state.json").read_text())
    return meta.get("preemption_only", False)


def _first_step(seen: list[int]):
    def hook(state: ft.TrainState) -> None:
        seen.append(state.step)

    return hook


@pytest.mark.parametrize("keep_last", [None, 1])
def test_a_preemption_save_off_the_cadence_does_not_change_the_guards_rollback_target(
    tmp_path, caplog, keep_last
):
    """Before: the preemption save at step 7 (the cadence saves even steps) was the newest
    checkpoint after the resume, and the spike at step 7 rolled back to it instead of to
    step-6, as the run never stopped did: the two ended apart. With keep_last=1 the preemption
    save also rotated step-6 away, leaving the rollback nothing to load."""
    reference = _run(tmp_path / "ref", every=2, keep_last=keep_last)
    root = tmp_path / "run"
    fired, hook = _sigterm_once(6)  # saved at step 7, off the cadence; the spike comes at 7
    with ft.strategies.on_preemption() as preempt:
        stopped = _run(root, every=2, keep_last=keep_last, hooks={"after": hook}, preempt=preempt)
    assert fired and stopped.step == 7
    assert (_marked(root / "step-6"), _marked(root / "step-7")) == (False, True)
    assert ft.latest_checkpoint(root) == root / "step-7"  # what the resume loads
    assert ft.checkpoint.latest_cadence_checkpoint(root) == root / "step-6"  # the guard's
    seen: list[int] = []
    rolled: list[int] = []
    with caplog.at_level(logging.WARNING, logger="ftrain.extras.guard"):
        resumed = _run(root, every=2, keep_last=keep_last, hooks={"between": _first_step(seen)},
                       rolled=rolled)  # fmt: skip
    assert seen[0] == 7 and rolled == [7]  # resumed at the preemption save, rolled back past it
    assert f"(step 6), passing over the preemption-only {root / 'step-7'};" in caplog.text
    _assert_bit_equal(resumed, reference)


class _Killed(Exception):
    """Stands for a SIGKILL: the loop leaves at once, saving nothing (saves are blocking)."""


@pytest.mark.parametrize("where", ["load", "after", "sigterm"])
def test_a_run_resumed_from_a_preemption_save_and_stopped_again_ends_bit_equal(
    tmp_path, monkeypatch, where
):
    """After a preemption save off the cadence (step 7), the resumed run is killed inside the
    guard's rollback load ("load"), or once it trained step 7 again past the spike ("after",
    before the cadence saves step 8: the newest checkpoint is still the preemption save, so
    the next resume meets the spike again), or preempted again inside that load ("sigterm":
    a second preemption save at step 7, of the branch after the rollback, replaces the first).
    Each next resume loads the newest checkpoint, rolls back only to step-6, and ends
    bit-equal to the run never stopped."""
    reference = _run(tmp_path / "ref", every=2)
    root = tmp_path / "run"
    fired, hook = _sigterm_once(6)
    with ft.strategies.on_preemption() as preempt:
        _run(root, every=2, hooks={"after": hook}, preempt=preempt)
    assert fired and ft.latest_checkpoint(root) == root / "step-7"

    stops: list[int] = []

    def stop(state: ft.TrainState) -> None:
        if state.step == 7 and not stops:
            stops.append(state.step)
            if where == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise _Killed

    original_load = guard_module.load_checkpoint

    def load(path, state, **kw):
        assert path == root / "step-6"  # the guard's target, though step-7 is the newest
        if where != "after":
            stop(state)
        return original_load(path, state, **kw)

    monkeypatch.setattr(guard_module, "load_checkpoint", load)
    rolled: list[int] = []
    with ft.strategies.on_preemption() as preempt:
        if where == "sigterm":
            stopped = _run(root, every=2, preempt=preempt, rolled=rolled)
            assert stopped.step == 7 and _marked(root / "step-7")  # the new branch's step 7
        else:
            with pytest.raises(_Killed):
                _run(root, every=2, hooks={"after": stop}, rolled=rolled)
    assert stops and rolled == [7]
    assert ft.latest_checkpoint(root) == root / "step-7"
    monkeypatch.setattr(guard_module, "load_checkpoint", original_load)
    rolled.clear()
    _assert_bit_equal(_run(root, every=2, rolled=rolled), reference)
    assert rolled == ([] if where == "sigterm" else [7])  # the spike met again, unless skipped


def test_should_save_marks_the_saves_the_cadence_skips_and_rotation_keeps_the_cadences(tmp_path):
    """The mark follows the last should_save: off the cadence once preempted (blocking or not),
    not at a cadence step, nor on a save no predicate asked for; cadence saves' state.json
    holds no mark (as older checkpoints). keep_last=1 keeps the newest cadence checkpoint
    beside a newer preemption save, and drops the preemption save once the cadence saves."""
    state = ft.TrainState.create(nn.Linear(2, 1), ft.optim.sgd())
    saved = []
    with ft.strategies.on_preemption(signals=(signal.SIGUSR2,)) as preempt:
        for step in range(1, 6):
            s = state.replace(step=step)
            if step == 3:
                preempt.observe(torch.ones(1, dtype=torch.float64))  # every rank agreed
            if ft.should_save(s, every=2):
                ft.save_checkpoint(s, tmp_path, keep_last=1, blocking=step != 5)
                saved.append(step)
                ft.wait_for_checkpoint()
                kept = sorted(p.name for p in tmp_path.iterdir())
                want = {2: ["step-2"], 3: ["step-2", "step-3"], 4: ["step-4"]}
                assert kept == want.get(step, ["step-4", "step-5"]), step
        assert saved == [2, 3, 4, 5]
        assert (_marked(tmp_path / "step-4"), _marked(tmp_path / "step-5")) == (False, True)
        assert "preemption_only" not in json.loads((tmp_path / "step-4/state.json").read_text())
        assert ft.checkpoint.latest_cadence_checkpoint(tmp_path) == tmp_path / "step-4"
        ft.save_checkpoint(state.replace(step=6), tmp_path)  # asked by no predicate: a cadence's
    assert not _marked(tmp_path / "step-6")
    assert ft.checkpoint.latest_cadence_checkpoint(tmp_path) == tmp_path / "step-6"
    assert ft.checkpoint.latest_cadence_checkpoint(tmp_path / "none") is None


def test_retained_keeps_the_newest_checkpoint_that_is_not_preemption_only():
    def keep(**kw):
        ckpts = [(s, {}) for s in (10, 20, 25, 27)]
        return sorted(retained(ckpts, keep_last=1, keep_best=None, best_metric=None, mode="min",
                               **kw))  # fmt: skip

    assert keep() == [27]
    assert keep(preemption_only={27}) == [25, 27]
    assert keep(preemption_only={25, 27}) == [20, 27]
    assert keep(preemption_only={10, 20, 25, 27}) == [27]
