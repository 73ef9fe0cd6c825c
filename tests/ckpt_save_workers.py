"""Worker functions for test_checkpoint_save.py's 2-process tests (spawned: importable module)."""

from __future__ import annotations

import gc
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

import ftrain as ft


def ddp_save_failure(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 cannot seal a blocking save: every rank's save_checkpoint raises, nothing is
    committed, and the next save works on every rank."""
    from ftrain.checkpoint import _save

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )  # fmt: skip
    torch.set_num_threads(1)
    strategy = ft.strategies.from_env("ddp", timeout=timedelta(seconds=60))
    state = ft.TrainState.create(torch.nn.Linear(4, 2), ft.optim.adamw(), strategy=strategy)
    real = _save.write_json

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    outcomes = []
    if rank == 0:
        _save.write_json = disk_full
    try:
        ft.save_checkpoint(state, out)
        outcomes.append("saved")
    except Exception as e:
        outcomes.append(type(e).__name__)
    _save.write_json = real
    outcomes.append(ft.latest_checkpoint(out) is None)
    outcomes.append(ft.save_checkpoint(state.replace(step=1), out).name)
    (Path(out) / f"outcome-{rank}.json").write_text(json.dumps(outcomes))
    del state
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
