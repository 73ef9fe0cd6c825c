"""A 2-rank run in which rank 1 fails after one step (see test_distributed).

Usage:
  RANK=.. WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python tests/workers/dist_fail.py crash|hang
  or `launch.exit_codes(dist_fail.ranked, "crash"|"hang", wait_for=[0])` (the test's way).
"crash" raises on rank 1 (its process exits); "hang" raises and then keeps the process alive
without joining any collective, as a notebook or a retry loop would.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch

import ftrain as ft
from dist_workers import train
from helpers import tiny_llama


def main(mode: str) -> None:
    torch.set_num_threads(1)
    strategy = ft.strategies.from_env(timeout=timedelta(seconds=5))
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), seed=3, strategy=strategy)
    state, _ = train(state, steps=1, batch_size=2)
    if strategy.rank == 1:
        try:
            raise RuntimeError("rank 1 fails on purpose")
        finally:
            if mode == "hang":
                time.sleep(60)
    start = time.monotonic()
    try:
        train(state, steps=3, batch_size=2)
    except Exception as e:  # test_distributed checks this line (not gloo's wording)
        print(f"rank 0: the step raised {type(e).__name__}", flush=True)
        raise
    finally:
        print(f"rank 0 stopped after {time.monotonic() - start:.1f}s", flush=True)


def ranked(rank: int, world: int, port: int, mode: str) -> None:
    """`main` in a rank forked by launch.start_ranks, with the environment torchrun would set."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )  # fmt: skip
    main(mode)


if __name__ == "__main__":
    main(sys.argv[1])
