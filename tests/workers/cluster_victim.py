"""examples/cluster/train.py with a fault: the rank VICTIM_RANK SIGKILLs itself at a random
instant (0-30 ms) of the save of step VICTIM_STEP, in attempt 0 only (SLURM_RESTART_COUNT).

The victim never gets past that save: on a loaded machine the timer thread may not run for a
while, and the other rank must not train (and save) the next step with it meanwhile.

`without_faults` is the same script's main without a fault, on the ranks of
`launch.run_ranks` (the tests' run to compare with)."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

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


def without_faults(rank: int, world: int, port: int, run_dir: str, *argv: str) -> None:
    """examples/cluster/train.py's main on a rank forked from the tests' fork server, with the
    variables a PyTorchJob sets in each pod (what cluster_launch.env_ranks sets for a fresh
    process): the run without faults that the cluster tests end bit-equal to."""
    from cluster_launch import base_env, load_example

    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   RANK=str(rank), LOCAL_RANK="0")  # fmt: skip
    os.environ.clear()
    os.environ.update(env)
    code = load_example("train").main([run_dir, *argv])
    if code != 0:
        raise RuntimeError(f"rank {rank}: examples/cluster/train.py returned {code}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "cluster"))
    import train

    ft.save_checkpoint = save_then_wait  # train.py looks it up on the module at each save
    sys.exit(train.main(on_step=on_step))
