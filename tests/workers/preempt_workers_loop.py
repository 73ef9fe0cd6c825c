"""The README loop with DataLoader workers, under `on_preemption` (test_preemption).

Usage: python tests/workers/preempt_workers_loop.py ROOT TOTAL NUM_WORKERS stream|map. Prints
"step N" after each step (the test then sends SIGTERM to the whole process group, as SLURM
does), "saved N" after each save, and "stopped at N" when the loop leaves.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import ftrain as ft

ROWS = 10_000


def row(i: int) -> dict[str, torch.Tensor]:
    """Slow to read, so that the workers are busy when the signal comes."""
    time.sleep(0.002)
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(8, generator=g), "y": torch.tensor(i % 4)}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (row(i) for i in range(ROWS))


class Table(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return row(i)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")
    return loss, torch.tensor(len(batch["y"]))


def main(root: str, total: int, num_workers: int, kind: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=3)
    data = Stream() if kind == "stream" else Table()
    with ft.strategies.on_preemption() as preempt:
        while state.step < total and not preempt.requested:
            for micro in ft.make_batches(
                data, state, batch_size=4, accum=2, num_workers=num_workers
            ):
                grads, stats = ft.accumulate_grads(state, micro, loss_fn)
                state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
                print(f"step {state.step}", flush=True)
                if ft.should_save(state, every=1000, total_steps=total):  # and when preempted
                    ft.save_checkpoint(state, root, keep_last=2)
                    print(f"saved {state.step}", flush=True)
                if state.step >= total or preempt.requested:
                    break
            else:
                state = ft.next_epoch(state)
    print(f"stopped at {state.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
