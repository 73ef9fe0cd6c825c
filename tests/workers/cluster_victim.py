"""examples/cluster/train.py with a fault: the rank VICTIM_RANK SIGKILLs itself at a random
instant (0-30 ms) of the save of step VICTIM_STEP, in attempt 0 only (SLURM_RESTART_COUNT).

The victim never gets past that save: on a loaded machine the timer thread may not run for a
while, and the other rank must not train (and save) the next step with it meanwhile."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "cluster"))

import ftrain as ft

ARMED = threading.Event()
_save = ft.save_checkpoint


def save_then_wait(*args, **kwargs):
    out = _save(*args, **kwargs)
    if ARMED.is_set():
        time.sleep(60)  # the kill lands before this ends: never train or save the step after
    return out


def on_step(state) -> None:
    if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
        return
    step, victim = int(os.environ["VICTIM_STEP"]), int(os.environ["VICTIM_RANK"])
    if state.strategy.rank == victim and state.step == step:  # its save runs right after this
        delay = random.Random(state.step).uniform(0.0, 0.03)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ARMED.set()


if __name__ == "__main__":
    import train

    ft.save_checkpoint = save_then_wait  # train.py looks it up on the module at each save
    sys.exit(train.main(on_step=on_step))
