"""Crash safety: SIGKILL a training process at random instants, often mid-save, and resume."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import torch

import ftrain as ft
from crash_loop import build
from helpers import opt_state_tensors

SCRIPT = Path(__file__).parent / "workers" / "crash_loop.py"
TOTAL = 10  # 2.5 epochs of the script's data


def launch(root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(root), str(TOTAL)], stdout=subprocess.PIPE, text=True
    )


def run_until_killed(root: Path, rng: random.Random, within: float) -> bool:
    """Start the loop and SIGKILL it 0..`within` seconds after its k-th "saving" line (k=1..2).

    A save takes tens of milliseconds, so short delays mostly land inside one. Returns True if
    the run finished before the kill.
    """
    k, delay, saves = rng.randrange(1, 3), rng.uniform(0.0, within), 0
    with launch(root) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("saving"):
                saves += 1
                if saves == k:
                    time.sleep(delay)
                    proc.kill()
                    break
        proc.wait(60)
    return proc.returncode == 0


def load_final(root: Path) -> ft.TrainState:
    path = ft.latest_checkpoint(root)
    assert path is not None and path.name == f"step-{TOTAL}"
    return ft.load_checkpoint(path, build())


def test_sigkill_anywhere_then_resume_equals_the_uninterrupted_run(tmp_path):
    clean = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "clean"), str(TOTAL)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert clean.returncode == 0, clean.stderr

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
    finish = subprocess.run(
        [sys.executable, str(SCRIPT), str(root), str(TOTAL)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finish.returncode == 0, finish.stderr
    assert kills >= 4 and mid_save >= 1, (kills, mid_save)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]

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
