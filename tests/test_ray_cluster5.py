"""ftrain.extras.ray against what clusters do (fifth round): runs that share a staging root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ftrain as ft
import launch
from cluster5_workers import ray_fallback_save

pytest.importorskip("ray.train")


def test_two_default_named_runs_in_one_second_stage_apart_where_ray_has_no_run_id(tmp_path):
    """Without Ray's run id, the staging folder was the run's name, and Ray's default name
    (`ray_train_run-<date>`) is to the second: a second run saving the same step replaced or
    refused the first's staged checkpoint while Ray still uploaded it."""
    root = tmp_path / "staging"
    for seed in (1, 2):  # two runs: two processes, one name
        launch.run_ranks(
            ray_fallback_save, str(root), seed, str(tmp_path / f"{seed}.json"), world=1
        )
    one, two = (json.loads((tmp_path / f"{s}.json.0").read_text()) for s in (1, 2))
    assert one["path"] != two["path"]
    for run in (one, two):
        state = ft.TrainState.create(torch.nn.Linear(3, 2), ft.optim.sgd())
        loaded = ft.load_checkpoint(run["path"], state)
        assert loaded.params["weight"].tolist() == run["weight"]  # each run's own weights
        assert loaded.step == 3


def test_the_ranks_of_one_run_stage_into_one_folder_where_ray_has_no_run_id(tmp_path):
    """The fallback folder names the group's rank 0 process: every rank stages there (a sharded
    checkpoint is one folder every rank writes into)."""
    launch.run_ranks(ray_fallback_save, str(tmp_path / "staging"), 0, str(tmp_path / "run"))
    paths = {json.loads((tmp_path / f"run.{r}").read_text())["path"] for r in (0, 1)}
    (path,) = paths
    assert ft.latest_checkpoint(Path(path).parent) == Path(path)
