"""Workers for the 2-process generation test (spawned; they must live in an importable module)."""

from __future__ import annotations

import gc
import json
import os
import random
from pathlib import Path

import torch

import ftrain as ft
from helpers import tiny_llama

# 9 prompts at 2 per rank: the last global batch has one row, so rank 1 runs a stand-in.
PROMPTS = [
    {"input_ids": [random.Random(i).randrange(3, 61) for _ in range(2 + i % 5)]} for i in range(9)
]
KWARGS = {"max_new_tokens": 5, "do_sample": False}


def model(seed: int = 0) -> torch.nn.Module:
    # float64: batched (left-padded) and one-prompt greedy decoding pick the same argmax.
    return tiny_llama(dtype=torch.float64, seed=seed)


def gather(rank: int, world: int, port: int, out: str) -> None:
    """ft.generate under DDP and under FSDP; rank r writes what it got, gathered and not."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )  # fmt: skip
    torch.set_num_threads(1)
    got = {}
    for kind in ("ddp", "fsdp"):
        strategy = ft.strategies.from_env(kind)
        state = ft.TrainState.create(model(), ft.optim.sgd(), strategy=strategy)

        def batches(strategy=strategy):
            return ft.make_batches(PROMPTS, batch_size=2, shuffle=False, strategy=strategy)

        got[kind] = [b["token_ids"] for b in ft.generate(state, batches(), **KWARGS)]
        local = ft.generate(state, batches(), gather=False, **KWARGS)
        got[f"{kind}-local"] = [b["token_ids"] for b in local]
        del state
        gc.collect()
    Path(out, f"generate-{rank}.json").write_text(json.dumps(got))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
