"""Worker functions for the guard's multi-process tests (tests/test_guard.py)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch

import ftrain as ft
from helpers import rank_env


def rollback_after_a_background_save(rank: int, world: int, port: int, root: str, out: str) -> None:
    """DDP: two steps, each saved in the background, then a rollback at once. Rank 0 writes
    (slowly here: its commit comes after rank 1's wait has returned); both ranks must roll back
    to the same checkpoint, the newest. Each rank writes the step it rolled back to."""
    rank_env(rank, world, port)
    if rank == 0:
        import ftrain.checkpoint._save as save_module

        run = save_module._Job.run

        def slow(self, staged, strategy):
            time.sleep(0.5)
            return run(self, staged, strategy)

        save_module._Job.run = slow
    strategy = ft.strategies.from_env("ddp", timeout=timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        state = ft.guard.GuardedState.create(
            torch.nn.Linear(4, 2), ft.optim.adamw(), strategy=strategy, seed=0
        )  # fmt: skip
        x = torch.randn(4, 4)

        def loss(model, batch):
            return (model(batch) ** 2).sum(), torch.tensor(batch.shape[0])

        for _ in range(2):
            grads, stats = ft.accumulate_grads(state, [x], loss)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
            ft.save_checkpoint(state, root, blocking=False)
        state = ft.guard.SpikeGuard().rollback(state, root, skip=1)
        Path(out, f"rank{rank}").write_text(str(state.step))
    finally:
        strategy.close()
