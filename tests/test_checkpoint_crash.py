"""Crash safety: SIGKILL a training process at random instants, often mid-save, and resume."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

import ftrain as ft
import launch
from crash_loop import build, ranked
from helpers import opt_state_tensors

TOTAL = 10  # 2.5 epochs of the script's data


def run(root: Path) -> None:
    """The loop to TOTAL in a process forked from the suite's server (no kill)."""
    launch.run_ranks(ranked, str(root), TOTAL, str(root.parent / f"{root.name}.events"), world=1)


def run_until_killed(root: Path, rng: random.Random, within: float) -> bool:
    """Start the loop and SIGKILL it 0..`within` seconds after its k-th "saving" line (k=1..2).

    A save takes tens of milliseconds, so short delays mostly land inside one. The process is
    forked from the suite's server (torch and ftrain imported once, not per attempt); it appends
    its lines to an events file, which this polls. Returns True if the run finished before the
    kill.
    """
    k, delay = rng.randrange(1, 3), rng.uniform(0.0, within)
    events = root.parent / f"{root.name}.events"
    events.unlink(missing_ok=True)
    ctx = launch.start_ranks(ranked, str(root), TOTAL, str(events), world=1)
    (proc,) = ctx.processes
    try:
        deadline = time.monotonic() + 120
        while proc.is_alive() and time.monotonic() < deadline:
            lines = events.read_text().splitlines() if events.exists() else []
            if sum(line.startswith("saving") for line in lines) >= k:
                time.sleep(delay)
                proc.kill()
                break
            time.sleep(0.0005)
        proc.join(60)
    finally:
        launch.kill(ctx)
    assert proc.exitcode is not None, "the crash loop neither finished nor died within 120 s"
    return proc.exitcode == 0


def load_final(root: Path) -> ft.TrainState:
    path = ft.latest_checkpoint(root)
    assert path is not None and path.name == f"step-{TOTAL}"
    return ft.load_checkpoint(path, build())


def test_sigkill_anywhere_then_resume_equals_the_uninterrupted_run(tmp_path):
    run(tmp_path / "clean")

    root, rng = tmp_path / "killed", random.Random(0)
    kills = mid_save = 0
    for attempt in range(8):
        if run_until_killed(root, rng, within=0.01 if attempt % 2 else 0.1):
            break
        kills += 1
        if root.exists():
            mid_save += any(p.name.startswith(".tmp-") for p in root.iterdir())
        ckpt = ft.latest_checkpoint(root)
        if ckpt is not None:  # whatever the instant, the latest commit loads
            ft.load_checkpoint(ckpt, build())
    run(root)  # to the end
    assert kills >= 4 and mid_save >= 1, (kills, mid_save)
    # A half-written save never survives the next run's saves. A kill inside the rotation after
    # the final commit leaves the folder it was deleting (latest_checkpoint ignores it) when no
    # save follows, as here if that attempt had reached the last step: the next save removes it.
    leftovers = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert all(p.name.startswith(".tmp-deleting-") for p in leftovers), leftovers

    a, b = load_final(tmp_path / "clean"), load_final(root)
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n]), n
    ta, tb = opt_state_tensors(a.opt_state), opt_state_tensors(b.opt_state)
    assert all(torch.equal(ta[p], tb[p]) for p in ta)
    assert (a.epoch, a.data.cursor, int(a.data.samples_seen)) == (
        b.epoch,
        b.data.cursor,
        int(b.data.samples_seen),
    )
    if leftovers:
        ft.save_checkpoint(b.replace(step=TOTAL + 1), root)
        assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
