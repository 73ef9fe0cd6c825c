"""examples/cluster/train.py with a fault: the rank VICTIM_RANK SIGKILLs itself at a random
instant (0-30 ms) of the save of step VICTIM_STEP, in attempt 0 only (SLURM_RESTART_COUNT)."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "cluster"))
import train


def on_step(state) -> None:
    if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
        return
    step, victim = int(os.environ["VICTIM_STEP"]), int(os.environ["VICTIM_RANK"])
    if state.strategy.rank != victim:
        return
    if state.step == step:  # the save of this step runs right after this hook
        delay = random.Random(state.step).uniform(0.0, 0.03)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    elif state.step == step + 1:
        time.sleep(60)  # the kill lands before this ends: never save the step after


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "cluster"))
    import train

    sys.exit(train.main(on_step=on_step))
