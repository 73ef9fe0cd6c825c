"""Workers for tests/test_rl_attacks2.py's 2-process tests (spawned; importable module)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import ftrain as ft
import rl_workers as W


def same_index_on_both_ranks(rank: int, world: int, port: int, out: str) -> None:
    """Both ranks pass index=[0, 1] (their local row numbers): completion numbers 0..3 on both,
    so both would draw the same uniforms. Every rank must raise ftrain's error (none may wait
    for the other in the decode's all-reduce); distinct numbers sample."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    with ft.strategies.from_env("ddp") as strategy:
        state = ft.TrainState.create(W.model(), ft.optim.adamw(), seed=0, strategy=strategy)
        ids = W.PROMPTS[2 * rank : 2 * rank + 2] if rank == 0 else W.PROMPTS[1:]
        prompts = {"input_ids": ids, "attention_mask": (ids != 0).long()}
        try:
            ft.rl.sample(state, prompts, index=[0, 1], num_generations=2, max_new_tokens=3)
        except ValueError as e:
            Path(out, f"same-{rank}.txt").write_text(str(e))
        r = ft.rl.sample(
            state, prompts, index=[2 * rank, 2 * rank + 1], num_generations=2, max_new_tokens=3
        )
        Path(out, f"distinct-{rank}.txt").write_text(str(r.completion_index.tolist()))
