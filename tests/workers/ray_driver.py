"""One Ray session for tests/test_ray.py: every TorchTrainer case, then `ray.shutdown()`.

Usage: python tests/workers/ray_driver.py OUT TEMP_DIR
OUT receives Ray's storage, the staging folder, events.log (one line per worker event) and
results.json. Ray's own processes live under TEMP_DIR (keep it short: Unix sockets).

One run (examples/cluster/train_ray.py's trainer, the README loop of examples/cluster/train.py):
  fit 1  2 workers, FSDP (sharded checkpoints), to step HALF, a checkpoint reported every step:
         in the first attempt rank 1 gets SIGTERM after step PREEMPT (every rank saves the same
         step, Ray restarts the group); in the next, rank 0 SIGKILLs itself during the save of
         step KILL (Ray restarts the group again).
  fit 2  the same run (storage and name) with 1 worker, DDP, continues to TOTAL from Ray's
         sharded checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

# Ray Train reads these in the driver and passes them to its controller and workers: poll the
# workers every 0.5 s (a dead one is found at once), give a group 60 s to start.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples" / "cluster")]
from train_ray import trainer  # noqa: E402

TOTAL, PREEMPT, KILL, HALF = 10, 2, 5, 7


class Log:
    """A worker's `log`: append one line to OUT/events.log (O_APPEND: lines never interleave)."""

    def __init__(self, path: str, case: str) -> None:
        self.path, self.case = path, case

    def __call__(self, line: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{self.case} {line}\n".encode())
        finally:
            os.close(fd)


class Faults:
    """`on_step`: SIGTERM to rank 1 after step PREEMPT (once), then SIGKILL rank 0 during the
    save of step KILL (once); marker files say what already happened across attempts."""

    def __init__(self, markers: str, log: Log) -> None:
        self.markers, self.log = Path(markers), log

    def _once(self, name: str) -> bool:
        try:
            (self.markers / name).touch(exist_ok=False)
        except FileExistsError:
            return False
        return True

    def _after(self, done: str, name: str) -> bool:
        return (self.markers / done).exists() and self._once(name)

    def __call__(self, state) -> None:
        rank = state.strategy.rank
        if state.step == 1 and rank == 0 and self._once("config"):
            from ftrain.extras import ray as ray_ft  # save_and_report reads the ranking there

            config = ray_ft._run_checkpoint_config()
            self.log(f"rank 0: the run keeps {getattr(config, 'num_to_keep', 'no config')}")
        if state.step == PREEMPT and rank == 1 and self._once("preempted"):
            self.log(f"rank {rank}: SIGTERM after step {state.step}")
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets ftrain's flag
        elif state.step == KILL and rank == 0 and self._after("preempted", "killed"):
            self.log(f"rank {rank}: SIGKILL in the save of step {state.step}")
            delay = random.Random(KILL).uniform(0.0, 0.03)  # the save runs after this hook
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()


def main(out: Path, temp_dir: str) -> None:
    # Ray Train reads these in the driver and passes them to its controller and workers: poll
    # the workers every 0.5 s (a dead one is found at once), give a group 60 s to start.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60")
    sys.path[:0] = [str(ROOT / "examples" / "cluster")]

    (out / "markers").mkdir(parents=True)
    events = str(out / "events.log")
    pythonpath = [str(ROOT), str(ROOT / "examples" / "cluster"), str(ROOT / "tests" / "workers")]
    env = {"PYTHONPATH": os.pathsep.join(pythonpath), "OMP_NUM_THREADS": "1"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir,
             runtime_env={"env_vars": env})  # fmt: skip
    results = {}
    try:
        storage, staging = str(out / "storage"), str(out / "staging")
        t = time.monotonic()
        log = Log(events, "fit1")
        first = trainer(storage, "run", workers=2, strategy="fsdp", steps=HALF, save_every=1,
                        keep_last=2, max_failures=2, staging=staging,
                        on_step=Faults(str(out / "markers"), log), log=log).fit()  # fmt: skip
        results["fit1"] = {"checkpoint": first.checkpoint.path, "seconds": time.monotonic() - t}
        t = time.monotonic()
        log = Log(events, "fit2")
        second = trainer(storage, "run", workers=1, strategy="ddp", steps=TOTAL, save_every=1,
                         keep_last=None, max_failures=0, staging=staging,
                         log=log).fit()  # fmt: skip
        results["fit2"] = {"checkpoint": second.checkpoint.path, "seconds": time.monotonic() - t}
    finally:
        ray.shutdown()
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
