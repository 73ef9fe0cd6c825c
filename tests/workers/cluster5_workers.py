"""Ranks for tests/test_*_cluster5.py: runs staged through ftrain.extras.ray with Ray's worker
API faked (no cluster), and the preemption handler installed on some ranks only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ftrain as ft
from helpers import rank_env


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
