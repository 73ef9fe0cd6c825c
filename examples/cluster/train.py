"""The README loop on a cluster: srun (SLURM, --requeue), a Kubeflow PyTorchJob, or torchrun.

    srun python examples/cluster/train.py RUN_DIR            # slurm.sbatch runs this
    torchrun --nproc-per-node 2 examples/cluster/train.py RUN_DIR
    python examples/cluster/train.py RUN_DIR                 # one process

RUN_DIR is the run folder every rank and every attempt shares (a shared filesystem, a
PersistentVolumeClaim): the run resumes from its newest committed checkpoint, saves every
`--save-every` steps and when SIGTERM / SIGUSR1 warns that the job is about to be killed (every
rank saves the same step), then touches RUN_DIR/.preempted and exits with 75 (EX_TEMPFAIL) so
that the scheduler's script requeues it (slurm.sbatch reads the marker: srun may report 137
when it ends the step at the first task's 75). The model and data are tiny and generated: swap
in yours.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import ftrain as ft
from ftrain.extras.cluster import export_launcher_env

GLOBAL_BATCH = 4
PREEMPTED = 75  # EX_TEMPFAIL: saved on a preemption notice; run me again


def build(strategy: ft.strategies.Strategy | None = None) -> ft.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    return ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.1), seed=3, strategy=strategy)


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g)
    return [{"x": x[i], "y": torch.tensor(i % 4)} for i in range(40)]


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")
    return loss, torch.tensor(len(batch["y"]))


def per_rank_batch(world: int) -> int:
    """Each rank's share of GLOBAL_BATCH; a world that does not divide it raises, rather than
    training a smaller global batch (4 // 3 = 1 row a rank is 3 rows, not 4) without a word."""
    if GLOBAL_BATCH % world:
        raise ValueError(
            f"GLOBAL_BATCH={GLOBAL_BATCH} rows cannot be split evenly over {world} ranks: start "
            f"a number of ranks that divides it, or change GLOBAL_BATCH"
        )
    return GLOBAL_BATCH // world


def loop(
    state: ft.TrainState,
    total: int,
    *,
    save: Callable[[ft.TrainState], object],
    save_every: int,
    preempt: ft.strategies.Preemption | None = None,
    on_step: Callable[[ft.TrainState], None] | None = None,
) -> ft.TrainState:
    """The README loop; `save(state)` every `save_every` steps, at the end and on preemption."""
    data, batch_size = rows(), per_rank_batch(state.strategy.world_size)
    while state.step < total and not (preempt is not None and preempt.requested):
        for micro in ft.make_batches(data, state, batch_size=batch_size, accum=2):
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2, max_norm=1.0)
            if on_step is not None:  # the tests' fault injection
                on_step(state)
            if ft.should_save(state, every=save_every, total_steps=total):  # also on preemption
                save(state)
            if state.step >= total or (preempt is not None and preempt.requested):
                break
        else:
            state = ft.next_epoch(state)
    return state


def main(
    argv: list[str] | None = None, on_step: Callable[[ft.TrainState], None] | None = None
) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    launcher = export_launcher_env()  # srun's SLURM_* -> RANK, WORLD_SIZE, MASTER_ADDR, ...
    with (
        ft.strategies.from_env(args.strategy) as strategy,
        ft.strategies.on_preemption() as preempt,  # SIGTERM (k8s, torchrun), SIGUSR1 (SLURM)
    ):
        state = build(strategy)
        # Committed ones only, and the same on every rank (a node-local folder raises).
        if (ckpt := ft.latest_checkpoint(args.run_dir, strategy=strategy)) is not None:
            state = ft.load_checkpoint(ckpt, state)
        start = state.step

        def save(s: ft.TrainState) -> None:
            ft.save_checkpoint(s, args.run_dir, keep_last=args.keep_last)

        state = loop(state, args.steps, save=save, save_every=args.save_every, preempt=preempt,
                     on_step=on_step)  # fmt: skip
        line = (
            f"rank {strategy.rank}/{strategy.world_size} ({launcher}): steps {start}..{state.step}"
        )
        print(line + (" preempted" if state.step < args.steps else ""), flush=True)
        if state.step < args.steps:  # every rank touches the marker before any rank exits
            (Path(args.run_dir) / ".preempted").touch()  # (srun may kill the rest at once)
            strategy.barrier()
            return PREEMPTED
        return 0


if __name__ == "__main__":
    sys.exit(main())
