"""A training loop that the crash tests kill with SIGKILL and restart (see test_checkpoint_crash).

Usage: python tests/workers/crash_loop.py ROOT TOTAL_STEPS, or `ranked` in a process forked by
tests/workers/launch.py. Says "saving N" just before each save and "done" at the end (printed,
or appended to an events file), so the test can time its kills.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

import ftrain as ft


def build() -> ft.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 1024), nn.GELU(), nn.Dropout(0.2), nn.Linear(1024, 1024), nn.Linear(1024, 4)
    )
    return ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.1), seed=3)


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(45, 64, generator=g)
    return [{"x": x[i], "y": torch.tensor(i % 4)} for i in range(45)]


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["x"])
    loss = nn.functional.cross_entropy(logits, batch["y"], reduction="sum")
    return loss, torch.tensor(len(batch["y"]))


def main(root: str, total: int, say: Callable[[str], None] = print) -> None:
    torch.set_num_threads(1)
    data, state = rows(), build()
    if (ckpt := ft.latest_checkpoint(root)) is not None:
        state = ft.load_checkpoint(ckpt, state)
    while state.step < total:
        for micro in ft.make_batches(data, state, batch_size=4, accum=3):
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3, max_norm=1.0)
            say(f"saving {state.step}")
            ft.save_checkpoint(state, root, keep_last=2)
            if state.step >= total:
                break
        else:
            state = ft.next_epoch(state)
    say("done")


def ranked(rank: int, world: int, port: int, root: str, total: int, events: str) -> None:
    """`main` in a process of launch.start_ranks (world 1), its lines appended to `events`."""
    with open(events, "a", buffering=1) as f:  # line-buffered: each line is written at once
        main(root, total, say=lambda line: print(line, file=f))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), say=lambda line: print(line, flush=True))
