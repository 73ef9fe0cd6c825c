"""The cluster engines read wrong, fifth round: the README loop (`TrainState.create` without a
strategy) started by srun, mpirun or a pod's `python`; the trackers' rank in a pod of several
processes started with `python`; Ray's staging root shared by two runs."""

from __future__ import annotations

import pytest

import ftrain as ft
from helpers import LAUNCHER_VARS, rank_rule_over


def _create(**kwargs):
    import torch

    return ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(), **kwargs)


# Each one of several processes, WORLD_SIZE unset: what from_env refuses, by the variable.
LONE = {
    "srun task": {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
    "batch script": {"SLURM_NTASKS": "4"},
    "mpirun": {"OMPI_COMM_WORLD_SIZE": "4"},
    "trainjob pod": {"PET_NPROC_PER_NODE": "4", "PET_NNODES": "1"},
    "multi-node pod": {"PET_NNODES": "2", "PET_NODE_RANK": "1"},
    "standalone torchrun per srun task": {
        "TORCHELASTIC_RUN_ID": "3166008c-dd9e-4aca-8490-563555f020f4", "RANK": "0",
        "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost",
        "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
    },
}  # fmt: skip


@pytest.mark.parametrize("where", LONE)
def test_the_readme_loop_without_a_strategy_is_refused_where_from_env_is(environ, where):
    """`TrainState.create(model, opt)` read only WORLD_SIZE: in each task of `srun -n 2`, each
    process of `mpirun -np 4` and a TrainJob pod's `python` it took SingleDevice, and N
    processes each trained alone on every row into one run folder, without a word."""
    environ(LONE[where])
    with pytest.raises(ValueError, match=r"^TrainState\.create got no strategy") as err:
        _create()
    assert "strategy=ft.strategies.SingleDevice() to train each process alone" in str(err.value)
    with pytest.raises(ValueError):
        ft.strategies.from_env("ddp")  # the same line
    alone = ft.strategies.SingleDevice()  # saying so trains this process alone
    assert _create(strategy=alone).strategy is alone


TAKEN = {
    "plain python": {},
    "srun -n 1": {"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
    "srun -n 1 in an allocation of 4": {"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0",
                                        "SLURM_NTASKS": "4"},
    "ray worker": {"RAY_RAYLET_PID": "1", "SLURM_NTASKS": "4", "PET_NNODES": "2"},
    "torchrun of one": {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0", "PET_NPROC_PER_NODE": "4"},
    "one-process pod": {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1"},
    "WORLD_SIZE=1 said": {"WORLD_SIZE": "1", "SLURM_NTASKS": "4", "OMPI_COMM_WORLD_SIZE": "4"},
}  # fmt: skip


@pytest.mark.parametrize("where", TAKEN)
def test_the_readme_loop_without_a_strategy_is_taken_where_from_env_takes_one_process(
    environ, where
):
    environ(TAKEN[where])
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)
    assert isinstance(_create().strategy, ft.strategies.SingleDevice)


def test_a_tracker_in_a_pod_from_env_takes_for_one_of_several_waits_for_its_rank(
    environ, monkeypatch
):
    """A TrainJob pod whose job asks for PET_NPROC_PER_NODE=4 processes, started with
    `python`: from_env refuses it, but the trackers' rank took it for a job of one and opened a
    run when the sink was built (one of them opened, then the loop was refused). Over the pod
    variables, every environment from_env takes for one of several (it refuses it, or its
    WORLD_SIZE is above 1) must leave the rank to be taken later."""
    values = {
        "WORLD_SIZE": [None, "1", "2", "4"],
        "PET_NNODES": [None, "1", "2", "1:2"],
        "PET_NODE_RANK": [None, "0"],
        "PET_NPROC_PER_NODE": [None, "1", "2", "4", "auto"],
        "PET_MASTER_ADDR": [None, "10.0.0.1"],
        "JOB_COMPLETION_INDEX": [None, "0"],
        "LOCAL_RANK": [None, "0"],
        "RAY_RAYLET_PID": [None, "1"],
        "SLURM_STEP_NUM_TASKS": [None, "2"],
    }
    several, alone, refused = rank_rule_over(monkeypatch, values, LAUNCHER_VARS)
    for env, message in refused:
        assert "WORLD_SIZE" in message, (env, message)
    pods = sum(env.get("PET_NPROC_PER_NODE") == "4" for env, _ in refused)
    assert several > 1000 and alone > 50 and pods > 50  # every kind was met


def test_two_runs_staging_into_one_root_keep_their_own_checkpoints(tmp_path, monkeypatch):
    """docs/strategies.md staged every run into "/local/staging": two runs (Tune trials) on one
    node saving step 5 wrote one `report-5/step-5`, the second replacing the first while Ray's
    asynchronous upload of the first still read it: run A's reported checkpoint held run B's
    weights. Each run (Ray's run id) now stages into a folder of its own."""
    import ray.train
    import torch
    from ray.train.v2._internal.execution import context as ray_context

    from ftrain.extras import ray as ray_ft
    from ftrain.process_state import STATE

    reports = []
    monkeypatch.setattr(STATE, "ray_reported", None)
    worker = {"get_world_rank": int, "get_experiment_name": staticmethod(lambda: "default")}
    monkeypatch.setattr(ray.train, "get_context", lambda: type("C", (), worker))
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kw: reports.append(kw))
    states = {}
    for run, fill in (("a" * 32, 1.0), ("b" * 32, 2.0)):
        # Each run's workers are processes of their own: none reported anything yet.
        monkeypatch.setattr(STATE, "ray_reported", None)
        run_context = type("T", (), {"run_id": run})
        train_context = type("X", (), {"train_run_context": run_context})
        monkeypatch.setattr(ray_context, "get_train_context", lambda c=train_context: c)
        model = torch.nn.Linear(2, 1)
        torch.nn.init.constant_(model.weight, fill)
        states[run] = ft.TrainState.create(
            model, ft.optim.sgd(), strategy=ft.strategies.SingleDevice("cpu")
        ).replace(step=5)
        ray_ft.save_and_report(states[run], tmp_path, metrics={})  # A's upload still pending
    for kw, (run, state) in zip(reports, states.items(), strict=True):
        loaded = ft.load_checkpoint(kw["checkpoint"].path, _create())
        assert torch.equal(loaded.params["weight"], state.params["weight"]), run
        assert kw["checkpoint"].path == str(tmp_path / run / "report-5" / "step-5")
        assert kw["checkpoint_dir_name"] == "step-5"  # Ray's storage layout is unchanged
