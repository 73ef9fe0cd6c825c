"""One rank of test_checkpoint_ranks.py: ranks that see different checkpoints (node-local run
folders) must refuse to resume, all of them; ranks that see the same one resume together.

Each rank first writes its own checkpoint into its own folder (no process group yet, as on a
node-local disk), then joins the group and loads it. Prints one line per case."""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch

import ftrain as ft
from ftrain.checkpoint import _save

CASES = {  # case -> (step, parameter offset) that rank r writes
    "same checkpoint": lambda r: (5, 0.0),
    "step differs": lambda r: (5 + r, 0.0),
    "parameters differ": lambda r: (5, float(r)),
}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def main(tmp: Path, rank: int) -> None:
    for case, what in CASES.items():
        step, offset = what(rank)
        # Each rank alone, on purpose (node-local folders): said so, as WORLD_SIZE is 2.
        state = ft.TrainState.create(
            model(), ft.optim.adamw(), strategy=ft.strategies.SingleDevice()
        )
        with torch.no_grad():
            state.params["bias"].add_(offset)
        ft.save_checkpoint(state.replace(step=step), tmp / f"{case}-node{rank}")
    strategy = ft.strategies.from_env("ddp", timeout=timedelta(seconds=60))
    for case in CASES:
        state = ft.TrainState.create(model(), ft.optim.adamw(), strategy=strategy)
        ckpt = ft.latest_checkpoint(tmp / f"{case}-node{rank}")
        try:
            loaded = ft.load_checkpoint(ckpt, state)
            print(f"{case}: loaded step {loaded.step}", flush=True)
        except ft.CheckpointError as e:
            print(f"{case}: refused: {str(e).splitlines()[0]}", flush=True)
        del state
    # latest_checkpoint(strategy=...) agrees before anything is loaded: a rank whose folder
    # holds none would skip load_checkpoint, start afresh, and meet the others' collectives.
    (tmp / f"empty-node{rank}").mkdir()
    folders = {
        "latest agrees": "same checkpoint-node{r}",
        "latest on one rank": "same checkpoint-node0" if rank == 0 else "empty-node1",
        "latest step differs": "step differs-node{r}",
        "latest on no rank": "empty-node{r}",
    }
    for case, folder in folders.items():
        try:
            found = ft.latest_checkpoint(tmp / folder.format(r=rank), strategy=strategy)
            print(f"{case}: found {found.name if found else None}", flush=True)
        except ft.CheckpointError as e:
            print(f"{case}: refused: {str(e).splitlines()[0]}", flush=True)
    background_save_then_load(tmp / "shared", strategy)
    # close(), not a bare destroy_process_group(): a refused load's traceback can keep a DDP
    # model alive past the destroy, and a gloo group freed at interpreter exit aborts the
    # process ("terminate called without an active exception", seen once in CI).
    strategy.close()


def background_save_then_load(root: Path, strategy: ft.strategies.Strategy) -> None:
    """A run that went back saves step 5 again, in the background, and every rank loads it at
    once: with DDP only rank 0 writes (and waits for its save), while rank 1 read the folder
    before that save committed, the older step 5 (or, for a new step, no folder at all)."""
    state = ft.TrainState.create(model(), ft.optim.adamw(), strategy=strategy)
    ft.save_checkpoint(state.replace(step=5), root)  # the older step 5, committed
    with torch.no_grad():
        state.params["bias"].add_(1.0)
    want = state.params["bias"].tolist()
    release, real = threading.Event(), _save.write_safetensors

    def slow(tensors: dict, path: Path) -> None:  # rank 0's writer, held until released
        if threading.current_thread().name == "ftrain-checkpoint":
            release.wait(30)
        real(tensors, path)

    _save.write_safetensors = slow
    try:
        path = ft.save_checkpoint(state.replace(step=5), root, blocking=False)
        timer = threading.Timer(1.0, release.set)
        timer.start()
        fresh = ft.TrainState.create(model(), ft.optim.adamw(), strategy=strategy)
        try:
            got = ft.load_checkpoint(path, fresh).params["bias"].tolist()
            print(f"background save: {'new' if got == want else 'old'} weights", flush=True)
        except ft.CheckpointError as e:
            print(f"background save: refused: {str(e).splitlines()[0]}", flush=True)
        timer.join()
        ft.wait_for_checkpoint()
        release.clear()
        ft.save_checkpoint(state.replace(step=9), root, blocking=False)
        timer = threading.Timer(1.0, release.set)
        timer.start()
        try:
            found = ft.latest_checkpoint(root, strategy=strategy)
            print(f"latest with a background save: found {found.name if found else None}")
        except ft.CheckpointError as e:
            print(f"latest with a background save: refused: {str(e).splitlines()[0]}")
        timer.join()
        ft.wait_for_checkpoint()
    finally:
        _save.write_safetensors = real


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
