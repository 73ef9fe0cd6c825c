"""The README loop under Ray Train's TorchTrainer: fault tolerance from reported checkpoints.

    python examples/cluster/train_ray.py STORAGE [--workers 2] [--strategy ddp|fsdp]
        [--steps 24] [--save-every 4] [--keep-last 2] [--max-failures 3]

Ray starts one worker per rank and sets up torch.distributed; `from_env` joins that group.
Every `--save-every` steps each rank calls `save_and_report`: the checkpoint is written into a
local staging folder and Ray uploads it (in the background) to `STORAGE/NAME/step-<N>`, keeping
what `checkpoint_config` says. When a worker dies, Ray restarts the group (up to
`--max-failures` times) and `restore` loads the newest checkpoint Ray registered; SIGTERM to a
worker makes every rank save the same step and leave, and Ray restarts from that checkpoint.

What must be shared: STORAGE (every node reads and writes it: NFS, or an s3:// / gs:// URI).
The staging folder must be seen by every worker of a sharded (FSDP) run (one node, or shared);
a DDP run's may be node-local. Nothing else is shared; RunConfig's name names the run, and a new
`fit` with the same STORAGE and name resumes it (with another number of workers too).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

import ftrain as ft
from ftrain.extras import ray as ray_ft

HERE = Path(__file__).resolve().parent


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import torch
    from train import build, loop  # examples/cluster/train.py: the model, data and loop

    torch.set_num_threads(1)
    total, log = config["steps"], config.get("log", print)
    with ft.strategies.from_env(config["strategy"]) as strategy:  # Ray's process group
        state = ray_ft.restore(build(strategy))  # ray.train.get_checkpoint(), if any
        start = state.step
        log(f"rank {strategy.rank}/{strategy.world_size}: start at step {start}")
        with ray_ft.on_preemption() as preempt:  # SIGTERM -> every rank saves the same step
            state = loop(
                state,
                total,
                save=lambda s: ray_ft.save_and_report(s, config["staging"], metrics={}),
                save_every=config["save_every"],
                preempt=preempt,
                on_step=config.get("on_step"),
            )
        log(f"rank {strategy.rank}/{strategy.world_size}: steps {start}..{state.step}")
        if state.step < total:  # preempted: the checkpoint of this step is reported
            ray_ft.wait_for_reports()  # registered by Ray before this group goes
            raise RuntimeError(f"preempted at step {state.step}; Ray restarts from it")


def trainer(
    storage: str,
    name: str,
    *,
    workers: int = 2,
    strategy: str = "ddp",
    steps: int = 24,
    save_every: int = 4,
    keep_last: int = 2,
    max_failures: int = 3,
    staging: str | None = None,
    **hooks: Callable[..., Any],
) -> TorchTrainer:
    """The TorchTrainer of this example (`hooks`: `on_step`, `log`, for the tests)."""
    if unknown := sorted(set(hooks) - {"on_step", "log"}):
        raise TypeError(f"trainer() got hooks {unknown}; the workers call on_step, log")
    config = {
        "steps": steps,
        "save_every": save_every,
        "strategy": strategy,
        "staging": staging or os.path.join(tempfile.gettempdir(), "ftrain-ray-staging", name),
        **hooks,
    }
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=workers),
        run_config=ray.train.RunConfig(
            storage_path=storage,
            name=name,
            checkpoint_config=ray_ft.checkpoint_config(keep_last=keep_last),  # Ray rotates
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("storage")
    parser.add_argument("--name", default="ftrain-ray")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--max-failures", type=int, default=3)
    args = parser.parse_args(argv)
    ray_ft.require_ray()  # a clear error for a Ray that cannot work
    # The workers import train.py from this folder.
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}})
    try:
        result = trainer(args.storage, args.name, workers=args.workers, strategy=args.strategy,
                         steps=args.steps, save_every=args.save_every, keep_last=args.keep_last,
                         max_failures=args.max_failures).fit()  # fmt: skip
        print(f"finished: {result.checkpoint}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
