"""Worker functions for test_checkpoint_save.py's 2-process tests (spawned: importable module)."""

from __future__ import annotations

import gc
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

import ftrain as ft
from helpers import rank_env


def ddp_save_failure(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 cannot seal a blocking save: every rank's save_checkpoint raises, nothing is
    committed, and the next save works on every rank."""
    from ftrain.checkpoint import _save

    rank_env(rank, world, port)
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


def _fsdp(rank: int, world: int, port: int, model: torch.nn.Module | None = None):
    rank_env(rank, world, port)
    from helpers import tiny_llama

    strategy = ft.strategies.from_env("fsdp", timeout=timedelta(seconds=60))
    model = tiny_llama(dropout=0.0) if model is None else model
    return ft.TrainState.create(model, ft.optim.adamw(), seed=3, strategy=strategy)


def _slow_shard_writes(seconds: float) -> None:
    """Make the background thread's shard writes take `seconds` longer (training overlaps)."""
    import threading
    import time

    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    real = HuggingFaceStorageWriter.write_data

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        return real(*args, **kwargs)

    HuggingFaceStorageWriter.write_data = slow


def fsdp_async_saves(rank: int, world: int, port: int, out: str) -> None:
    """FSDP background saves: one equals a blocking save of the same state although training
    goes on while it is written; a failed shard write on rank 1, then a failed commit on rank
    0, raise CheckpointError on both ranks at the next save and commit nothing; a crash in the
    middle of a background save leaves the committed checkpoints only."""
    import signal
    import time

    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from dist_workers import train
    from ftrain.checkpoint import _save

    root = Path(out)
    state, _ = train(_fsdp(rank, world, port), steps=3, batch_size=2)
    ft.save_checkpoint(state, root / "blocking")
    _slow_shard_writes(0.5)
    ft.save_checkpoint(state, root / "async", blocking=False)
    state, _ = train(state, steps=5, batch_size=2)  # steps in place while the save writes
    done = ft.wait_for_checkpoint()
    outcomes: list = [done is not None and done.name]
    real_write, real_json = HuggingFaceStorageWriter.write_data, _save.write_json

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    for who, target in ((1, "write_data"), (0, "write_json")):
        if rank == who and target == "write_data":
            HuggingFaceStorageWriter.write_data = broken
        if rank == who and target == "write_json":
            _save.write_json = broken
        failed = f"background save of step {state.step} failed"
        ft.save_checkpoint(state, root / "failed", blocking=False)
        state, _ = train(state, steps=state.step + 2, batch_size=2)  # steps never look at saves
        outcomes.append("trained")
        try:
            ft.save_checkpoint(state, root / "failed", blocking=False)  # waits, reports
            outcomes.append("saved")
        except ft.CheckpointError as e:
            outcomes.append(f"{type(e).__name__}: {failed in str(e)}")
        HuggingFaceStorageWriter.write_data, _save.write_json = real_write, real_json
        outcomes.append(ft.latest_checkpoint(root / "failed") is None)
    (root / f"outcome-{rank}.json").write_text(json.dumps(outcomes))
    # Last, both ranks die (SIGKILL) while a background save (step 9) is being written.
    _slow_shard_writes(5.0)
    ft.save_checkpoint(state, root / "async", blocking=False)
    time.sleep(0.5)
    (root / f"killed-{rank}").write_text("")
    os.kill(os.getpid(), signal.SIGKILL)


def tp_async_save(rank: int, world: int, port: int, out: str) -> None:
    """Tensor parallelism: a background save while training goes on, and a blocking one."""
    from dist_workers import train
    from helpers import tiny_llama

    rank_env(rank, world, port)
    root = Path(out)
    strategy = ft.strategies.from_env("tp", timeout=timedelta(seconds=60))
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3, strategy=strategy)
    state, _ = train(state, steps=2, batch_size=2)
    ft.save_checkpoint(state, root / "blocking")
    _slow_shard_writes(0.5)
    ft.save_checkpoint(state, root / "async", blocking=False)
    state, _ = train(state, steps=4, batch_size=2)  # steps in place while the save writes
    (root / f"done-{rank}").write_text(ft.wait_for_checkpoint().name)
    strategy.close()


def failed_background_save_then_load(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0's background save failed before every rank loads an older checkpoint: each rank
    raises ftrain's error (rank 0 raised alone while rank 1 waited in the barrier)."""
    import time

    from ftrain.checkpoint import _save
    from ftrain.process_state import STATE

    rank_env(rank, world, port)
    strategy = ft.strategies.from_env("ddp", timeout=timedelta(seconds=60))
    state = ft.TrainState.create(torch.nn.Linear(4, 2), ft.optim.adamw(), strategy=strategy)
    older = ft.save_checkpoint(state.replace(step=1), out)
    real = _save.write_safetensors

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    _save.write_safetensors = disk_full
    ft.save_checkpoint(state.replace(step=2), out, blocking=False)  # DDP: rank 0 writes
    while rank == 0 and STATE.save_in_flight.error is None:
        time.sleep(0.05)  # failed, and finished, before the load
    _save.write_safetensors = real
    try:
        ft.load_checkpoint(older, state)
        outcome = "loaded"
    except ft.CheckpointError as e:
        outcome = str(e)
    (Path(out) / f"outcome-{rank}.json").write_text(json.dumps(outcome))
    loaded = ft.load_checkpoint(older, state)  # reported once: the next load goes on
    (Path(out) / f"step-{rank}.json").write_text(json.dumps(loaded.step))
    del state, loaded
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
