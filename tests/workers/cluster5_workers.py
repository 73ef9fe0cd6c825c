"""Ranks for tests/test_*_cluster5.py: runs staged through ftrain.extras.ray with Ray's worker
API faked (no cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ftrain as ft
from helpers import rank_env, tiny_llama


def ray_fallback_save(rank: int, world: int, port: int, root: str, seed: int, out: str) -> None:
    """One Ray run's rank 0 where Ray's run id is not found (the fallback): a default-named
    run (`ray_train_run-<date>`, to the second) saves step 3 into the staging `root`; Ray's
    async upload has not yet taken the staged copy away."""
    import ray.train

    from ftrain.extras import ray as ray_ft

    worker = {
        "get_world_rank": staticmethod(lambda: rank),
        "get_world_size": staticmethod(lambda: world),
        "get_experiment_name": staticmethod(lambda: "ray_train_run-2026-11-27_17-00-00"),
    }
    ray.train.get_context = lambda: type("C", (), worker)
    ray.train.report = lambda metrics, **kw: None
    rank_env(rank, world, port)
    with ft.strategies.from_env("ddp") if world > 1 else ft.strategies.SingleDevice() as s:
        torch.manual_seed(seed)
        state = ft.TrainState.create(torch.nn.Linear(3, 2), ft.optim.sgd(), strategy=s)
        path = ray_ft.save_and_report(state.replace(step=3), root)
        weight = state.params["weight"].tolist()
    Path(f"{out}.{rank}").write_text(json.dumps({"path": str(path), "weight": weight}))


def fsdp_reshard(rank: int, world: int, port: int, src: str, dst: str) -> None:
    """FSDP over `world` ranks: load the newest checkpoint of `src` and save it into `dst`."""
    rank_env(rank, world, port)
    with ft.strategies.from_env("fsdp") as strategy:
        state = ft.TrainState.create(
            tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3, strategy=strategy
        )
        state = ft.load_checkpoint(ft.latest_checkpoint(src, strategy=strategy), state)
        ft.save_checkpoint(state, dst)
        del state


def fsdp_node_local_save(
    rank: int, world: int, port: int, base: str, out: str, blocking: bool
) -> None:
    """FSDP ranks saving into a root that is node-local: each rank's `run` folder is its own
    (the same path on two machines, simulated as two folders)."""
    rank_env(rank, world, port)
    root = Path(base) / f"node{rank}" / "run"
    outcome = "saved"
    with ft.strategies.from_env("fsdp") as strategy:
        state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), strategy=strategy)
        try:
            ft.save_checkpoint(state, root, blocking=blocking)
            ft.wait_for_checkpoint()  # a background save's outcome
        except ft.CheckpointError as e:
            outcome = f"CheckpointError: {e}"
        del state
    Path(f"{out}.{rank}").write_text(outcome)
