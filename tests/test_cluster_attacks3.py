"""The cluster engines read wrong, fourth round: a pod whose job asks for several processes
per pod but whose command is `python`; a one-node torchrun in each task of a srun step."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import ftrain as ft


def operator_pod(rank: int, *, pods: int = 2, per_pod: str = "2") -> dict[str, str]:
    """What Kubeflow's PyTorchJob operator sets in pod `rank` with `nprocPerNode: per_pod`:
    WORLD_SIZE counts processes (pods x nprocPerNode, 1 a pod for "auto"), RANK is the pod's."""
    world = pods * (int(per_pod) if per_pod.isdigit() else 1)
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": str(world),
            "RANK": str(rank), "PET_NNODES": str(pods), "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": per_pod, "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": "29999"}  # fmt: skip


def test_a_pytorchjob_pod_of_several_processes_started_with_python_is_refused_not_waited_on(
    environ,
):
    """nprocPerNode: 2 on 2 pods sets WORLD_SIZE=4 and RANK=<pod>; `python train.py` starts one
    process a pod, so from_env joined a group of 4 that only 2 ever reach: rank 0 waited for
    the collective timeout (10 minutes), then failed with torch's message, pod after pod."""
    environ({**operator_pod(0), "FTRAIN_COLLECTIVE_TIMEOUT": "5"})  # the old wait, bounded
    said = "WORLD_SIZE=4 counts PET_NPROC_PER_NODE=2 processes in each of PET_NNODES=2 pods"
    with pytest.raises(
        ValueError, match=re.escape(said + ", but this pod's command started one")
    ) as err:
        ft.strategies.from_env("ddp")
    assert "start the command with torchrun" in str(err.value)
    assert not dist.is_initialized()  # refused before joining


def test_a_trainjob_pod_of_several_processes_started_with_python_is_refused_not_one_process(
    environ,
):
    """A Trainer TrainJob sets only PET_* (numProcPerNode: 4 on one node): `python train.py`
    got SingleDevice and trained one process with a quarter of the global batch."""
    environ({"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "4",
             "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"})  # fmt: skip
    with pytest.raises(ValueError, match=r"PET_NPROC_PER_NODE=4 processes in it, but its command"):
        ft.strategies.from_env("ddp")


def test_a_pod_whose_processes_torchrun_started_or_of_one_process_is_taken(environ):
    """torchrun reads PET_* (its workers' WORLD_SIZE and RANK are its own); "auto" and 1 count
    one process a pod in the operator's WORLD_SIZE; WORLD_SIZE=1 says one process is meant."""
    from ftrain.strategies._env import _world_size

    environ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "auto"})
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)
    environ({"PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "1"})
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)
    environ({**operator_pod(0, per_pod="auto")})  # python in each pod: WORLD_SIZE=2, as meant
    assert _world_size() == 2
    environ({**operator_pod(0), "LOCAL_RANK": "0"})  # another launcher's process 0 of pod 0
    assert _world_size() == 4
    environ({**operator_pod(0), "RANK": "1", "TORCHELASTIC_RUN_ID": "job"})  # torchrun's worker
    assert _world_size() == 4


# What torchrun --standalone --nproc-per-node 1 gives its worker (measured, torch 2.13), inside
# task 1 of a srun step of 2 tasks (one a node).
STANDALONE = {"TORCHELASTIC_RUN_ID": "3166008c-dd9e-4aca-8490-563555f020f4", "RANK": "0",
              "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost",
              "MASTER_PORT": "36827"}  # fmt: skip
SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[01-02]"}  # fmt: skip


def test_a_standalone_torchrun_in_each_task_of_a_srun_step_is_refused_not_trained_n_times(
    environ,
):
    """`srun -N 2 torchrun --standalone train.py` (a one-node recipe on two nodes): each
    node's torchrun made a group of its own, from_env returned SingleDevice (or a one-node DDP)
    on both, and the two nodes trained the same run independently into one run folder."""
    environ({**STANDALONE, **SRUN_TASK})
    with pytest.raises(ValueError, match=r"one of SLURM_STEP_NUM_TASKS=2 that srun started, but"):
        ft.strategies.from_env("ddp")
    # --nnodes 1 --master-port 29500: the static rendezvous, on its default address
    environ({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    with pytest.raises(ValueError, match=r"GROUP_WORLD_SIZE=1, torchrun's own rendezvous"):
        ft.strategies.from_env("ddp")


def test_torchrun_across_the_steps_nodes_or_one_task_or_an_elastic_shrink_is_taken(environ):
    from ftrain.strategies._env import _world_size

    environ({**STANDALONE, **SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1"})  # srun -n 1 torchrun
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)
    # --nnodes 1:2 --rdzv-id $SLURM_JOB_ID --rdzv-endpoint node01:29500, a round of one node
    # (measured: torchrun gives MASTER_ADDR=localhost then)
    environ({"SLURM_STEP_NUM_TASKS": "2", "TORCHELASTIC_RUN_ID": "4242"})
    assert _world_size() == 1
    environ({"GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "node01"})  # both nodes
    assert _world_size() == 2


def test_a_standalone_torchrun_in_an_interactive_srun_shell_is_taken(environ, monkeypatch):
    """`srun -N1 --ntasks-per-node=2 --pty bash`, then `torchrun --standalone` in it (an
    interactive session on one node, the review's): srun started one shell, which inherits the
    step's SLURM_STEP_NUM_TASKS=2; it was refused as one torchrun per task. srun sets
    SLURM_PTY_PORT for a pseudo-terminal only. A plain `python` there is one process too."""
    import os

    pty = {**SRUN_TASK, "SLURM_PROCID": "0", "SLURM_PTY_PORT": "40123"}
    environ({**STANDALONE, **pty})
    # A srun started from that shell passes SLURM_PTY_PORT on to its tasks, whose standard input
    # is no terminal (the second review's): still one torchrun per task, refused.
    monkeypatch.setattr(os, "isatty", lambda fd: False)
    with pytest.raises(ValueError, match=r"one of SLURM_STEP_NUM_TASKS=2 that srun started"):
        ft.strategies.from_env("ddp")
    monkeypatch.setattr(os, "isatty", lambda fd: fd == 0)  # the shell's own terminal
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)
    for k in STANDALONE:  # the same shell, `python train.py`
        monkeypatch.delenv(k)
    assert isinstance(ft.strategies.from_env(), ft.strategies.SingleDevice)
    assert isinstance(ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).strategy,
                      ft.strategies.SingleDevice)  # fmt: skip


def test_ddp_built_by_hand_under_a_standalone_torchrun_per_srun_task_is_refused(environ):
    """`DDP()` joins the group itself (no from_env): it joined each node's own group."""
    environ({**STANDALONE, **SRUN_TASK})
    try:
        with pytest.raises(ValueError, match=r"one of SLURM_STEP_NUM_TASKS=2 that srun started"):
            ft.strategies.DDP()
        assert not dist.is_initialized()  # refused before joining
    finally:
        if dist.is_initialized():  # what the old code left
            dist.destroy_process_group()


def test_ddp_built_by_hand_in_a_pod_of_several_processes_started_with_python_is_refused(environ):
    """`DDP()` joins the operator's group itself: rank 0 waited for the timeout there too."""
    environ({**operator_pod(0), "FTRAIN_COLLECTIVE_TIMEOUT": "5"})  # the old wait, bounded
    try:
        with pytest.raises(ValueError, match=r"WORLD_SIZE=4 counts PET_NPROC_PER_NODE=2"):
            ft.strategies.DDP()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_world_size_that_is_no_number_in_a_pod_is_left_to_its_own_check(environ):
    """The pod check ran int(WORLD_SIZE) before anything validated it (DDP() by hand): a bare
    'invalid literal for int()' instead of from_env's message naming the variable."""
    from ftrain.strategies._group import refuse_pod_short_of_processes

    environ({**operator_pod(0), "WORLD_SIZE": "four"})
    refuse_pod_short_of_processes()  # not its question
    with pytest.raises(ValueError, match=r"WORLD_SIZE='four' in the environment is not an integer"):
        ft.strategies.from_env("ddp")
