"""`with ft.strategies.from_env(kind) as strategy:` around a loop, in 2 ranks (test_strategies).

Usage:
  RANK=.. WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python tests/workers/dist_lifetime.py KIND MODE
MODE "raise": rank 1 raises after one step while rank 0 trains on. "clean": both finish; the
state (and its DDP/FSDP model) stays alive after the block, and close() runs a second time.
"refuse" / "refuse-direct": `from_env` / the strategy's class refuses a layout the world size
cannot hold (FSDP `replicate=3`, TP `dp=3`) after joining the group: it leaves before raising.
A plain torch model keeps the start-up short (no transformers import).
"""

from __future__ import annotations

import sys

import torch

import ftrain as ft


def loss_fn(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(), torch.tensor(len(batch["x"]))


ROWS = [{"x": torch.full((4,), float(i)), "y": torch.ones(2)} for i in range(16)]


def train(state, steps):
    for (micro,) in ft.make_batches(ROWS, batch_size=2, seed=0, strategy=state.strategy):
        grads, stats = ft.accumulate_grads(state, [micro], loss_fn)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3)
        if state.step >= steps:
            break
    return state


def main(kind: str, mode: str) -> None:
    torch.set_num_threads(1)
    if mode.startswith("refuse"):  # "refuse": through from_env; "refuse-direct": the class
        bad = {"fsdp": {"replicate": 3}, "tp": {"dp": 3}}[kind]
        make = getattr(ft.strategies, kind.upper()) if mode == "refuse-direct" else None
        try:
            make(**bad) if make else ft.strategies.from_env(kind, **bad)
        except ValueError as e:
            print(f"refused: {e}; initialized={torch.distributed.is_initialized()}")
        return
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with ft.strategies.from_env(kind) as strategy:  # collective timeout: the default 10 min
        state = ft.TrainState.create(model, ft.optim.sgd(), seed=3, strategy=strategy)
        state = train(state, steps=1)
        if mode == "raise" and strategy.rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        state = train(state, steps=3)
    strategy.close()  # idempotent
    print(f"rank {strategy.rank} left: initialized={torch.distributed.is_initialized()}")


if __name__ == "__main__":
    main(*sys.argv[1:])
