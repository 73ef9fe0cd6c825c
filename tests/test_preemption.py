"""Preemption (issue 14): a signal becomes a flag every rank agrees on; the loop saves, leaves,
and the run continues from that checkpoint bit-equal (2 ranks: tests/test_elastic.py)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

import ftrain as ft
from elastic_loop import build, preemptible, resume, train
from helpers import opt_state_tensors

TOTAL = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def assert_bit_equal(a: ft.TrainState, b: ft.TrainState) -> None:
    assert (a.step, a.epoch, a.data.cursor) == (b.step, b.epoch, b.data.cursor)
    for n, p in b.params.items():
        assert torch.equal(a.params[n], p), n
    reference = opt_state_tensors(b.opt_state)
    for n, t in opt_state_tensors(a.opt_state).items():
        assert torch.equal(t, reference[n]), n


def test_sigterm_at_random_steps_saves_then_the_run_continues_bit_equal(tmp_path):
    """16 tries in one process (no collective: the flag is this rank's own): SIGTERM at a random
    step, the loop saves that step's successor and leaves; resuming ends bit-equal."""
    reference = train(build(), None, TOTAL)
    rng = random.Random(0)
    for i in range(16):
        root, at = tmp_path / str(i), rng.randrange(TOTAL - 1)
        stopped = preemptible(build(), str(root), TOTAL, signal_at=at)
        assert stopped.step == at + 1  # the signalled step's own all-reduce carried the flag
        assert ft.latest_checkpoint(root) == root / f"step-{at + 1}"
        assert_bit_equal(preemptible(resume(str(root)), str(root), TOTAL), reference)


def test_on_preemption_restores_the_previous_handlers_and_checks_its_arguments():
    before = signal.getsignal(signal.SIGUSR1)
    state = build()
    with ft.strategies.on_preemption(signals=(signal.SIGUSR1,)) as preempt:
        assert signal.getsignal(signal.SIGUSR1) == preempt._handle
        assert not preempt.requested and not ft.should_save(state, every=5)
        with pytest.raises(ValueError, match="already active"):
            ft.strategies.on_preemption()
    assert signal.getsignal(signal.SIGUSR1) == before
    preempt.close()  # idempotent
    with pytest.raises(ValueError, match="signals is empty"):
        ft.strategies.on_preemption(signals=())
    with pytest.raises(TypeError, match=r"signal\.Signals"):
        ft.strategies.on_preemption(signals=(15,))
    errors: list[BaseException] = []

    def in_a_thread() -> None:
        try:
            ft.strategies.on_preemption()
        except ValueError as e:
            errors.append(e)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(10)
    assert len(errors) == 1 and "main thread" in str(errors[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_flag_is_read_one_step_late_without_a_sync():
    import os

    state = ft.TrainState.create(
        torch.nn.Linear(2, 1), ft.optim.sgd(), strategy=ft.strategies.SingleDevice("cuda")
    )
    batch = {"x": torch.ones(2, 2)}

    def loss(model, b):
        return model(b["x"]).sum(), 2

    with ft.strategies.on_preemption(signals=(signal.SIGUSR1,)) as preempt:
        os.kill(os.getpid(), signal.SIGUSR1)
        seen = []
        for _ in range(3):
            grads, stats = ft.accumulate_grads(state, [batch], loss)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
            seen.append(preempt.requested)
    assert seen == [False, True, True]


@pytest.mark.parametrize("kind", ["stream", "map"])
def test_sigterm_to_the_process_group_saves_and_the_loader_workers_end_cleanly(tmp_path, kind):
    """SLURM signals the whole process group, DataLoader workers included (issue 27): the loop
    saves the next step, leaves with status 0, and its workers end with it."""
    script = Path(__file__).parent / "workers" / "preempt_workers_loop.py"
    root = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), "100000", "2", kind],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends at EOF if the loop dies first
            if line.startswith("step 2"):
                workers = psutil.Process(proc.pid).children(recursive=True)
                os.killpg(proc.pid, signal.SIGTERM)  # what SLURM and most schedulers do
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    saved = [int(line.split()[1]) for line in out.splitlines() if line.startswith("saved")]
    assert len(saved) == 1 and saved[0] > 2 and f"stopped at {saved[0]}" in out
    assert ft.latest_checkpoint(root) == root / f"step-{saved[0]}"
    assert len(workers) == 2
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []


def test_on_preemption_checks_every_signal_before_installing_any(monkeypatch):
    """(SIGTERM, SIGKILL) raised a raw OSError and left the SIGTERM handler installed."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    for bad in ((signal.SIGTERM, signal.SIGKILL), (signal.SIGUSR1, signal.SIGSTOP)):
        with pytest.raises(ValueError, match=r"signals holds SIG(KILL|STOP), which no process"):
            ft.strategies.on_preemption(signals=bad)
    for bad in (signal.SIGTERM, "SIGTERM", None, (signal.SIGTERM, 10), (signal.SIGTERM, None)):
        with pytest.raises(TypeError, match="signals must"):
            ft.strategies.on_preemption(signals=bad)  # type: ignore[arg-type]
    assert {s: signal.getsignal(s) for s in before} == before
    assert ft.strategies.active_preemption() is None

    install = signal.signal  # the second install fails: the first is undone

    def failing(s, handler):
        if s == signal.SIGUSR1 and callable(handler) and handler not in before.values():
            raise OSError(22, "Invalid argument")
        return install(s, handler)

    monkeypatch.setattr(signal, "signal", failing)
    with pytest.raises(OSError):
        ft.strategies.on_preemption(signals=(signal.SIGTERM, signal.SIGUSR1))
    monkeypatch.undo()
    assert {s: signal.getsignal(s) for s in before} == before
    assert ft.strategies.active_preemption() is None
    # A repeated signal is installed once, and close() restores what was there before.
    with ft.strategies.on_preemption(signals=(signal.SIGUSR1, signal.SIGUSR1)) as preempt:
        assert preempt.signals == (signal.SIGUSR1,)
    assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]
