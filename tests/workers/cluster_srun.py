"""A stand-in for SLURM's `srun` on one machine (tests/test_cluster_env.py puts it on PATH).

    srun [--kill-on-bad-exit=1] [--other=flags] COMMAND ARGS...

Starts SLURM_NTASKS tasks of COMMAND with the variables srun sets for each task (SLURM_PROCID,
SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_ID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST); the
job's own (SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_RESTART_COUNT, ...) come from the caller.
With --kill-on-bad-exit=1 a task that exits with any status but 0 (75 included, as srun(1) says)
or is killed by a signal gets the others SIGKILLed. FAKE_SLURM_SIGNAL_WHEN=PATH: once PATH
exists, SIGUSR1 goes to every task, as `--signal=USR1@T` makes slurmd do T seconds before the
time limit. Exits with the largest task status (128 + N for a signal N).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    n = next((i for i, a in enumerate(argv) if not a.startswith("--")), len(argv))
    flags, command = argv[:n], argv[n:]
    kill_on_bad_exit = "--kill-on-bad-exit=1" in flags
    ntasks = int(os.environ["SLURM_NTASKS"])
    step = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"]}  # fmt: skip
    tasks = [
        subprocess.Popen(command, env={**os.environ, **step, "SLURM_PROCID": str(i),
                                       "SLURM_LOCALID": str(i), "SLURM_NODEID": "0"})
        for i in range(ntasks)
    ]  # fmt: skip
    when, signalled = os.environ.get("FAKE_SLURM_SIGNAL_WHEN"), False
    codes: dict[int, int] = {}
    while len(codes) < ntasks:
        for i, t in enumerate(tasks):
            if i not in codes and t.poll() is not None:
                codes[i] = t.returncode if t.returncode >= 0 else 128 - t.returncode
                if kill_on_bad_exit and codes[i] != 0:
                    for other in tasks:
                        if other.poll() is None:
                            other.send_signal(signal.SIGKILL)
        if when and not signalled and os.path.exists(when):
            signalled = True
            for t in tasks:
                if t.poll() is None:
                    t.send_signal(signal.SIGUSR1)
        time.sleep(0.002)
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
