"""`from_env`: the strategy that the launcher's environment describes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from ftrain.precision import Precision
from ftrain.strategies._base import SingleDevice
from ftrain.strategies._ddp import DDP
from ftrain.strategies._fsdp import FSDP
from ftrain.strategies._group import (
    collective_timeout,
    group_timeout,
    interactive_srun_shell,
    join_group,
    refuse_one_node_torchrun_per_srun_task,
    refuse_pod_short_of_processes,
)
from ftrain.strategies._tp import TP

__all__ = ["from_env", "refuse_lone_process"]


def from_env(
    kind: str = "ddp", *, timeout: timedelta | None = None, **kwargs: Any
) -> SingleDevice | DDP | FSDP | TP:
    """The strategy that the launcher's environment describes.

    Under `torchrun --nproc_per_node N` or `accelerate launch` (WORLD_SIZE > 1) this joins the
    process group (NCCL with CUDA, gloo on CPU) unless it is already initialised, and returns a
    `DDP` (`FSDP` for kind="fsdp", `TP` for kind="tp"); in a plain `python` run it returns
    `SingleDevice(device, precision=precision)`.

    Use it as a context manager, so that the run leaves the process group in the right order
    on every rank, also when the loop raised (`close()` / `abort()` do the same by hand):

        with ft.strategies.from_env("ddp", precision="bf16") as strategy:
            state = ft.TrainState.create(model, ft.optim.adamw(), strategy=strategy)
            ...  # the loop

    Args:
        kind: "ddp", "fsdp" or "tp".
        timeout: how long a collective may wait before the process fails (default: the
            FTRAIN_COLLECTIVE_TIMEOUT environment variable in seconds, else 10 minutes), so
            that one rank's crash ends the others instead of hanging them (one process has
            no collectives to time out). Applies when this call creates the group; with a
            group initialised before, a timeout other than the group's raises.
        **kwargs: passed to the strategy. In one process `device` and `precision` go to
            `SingleDevice`; the kind's own `sync_every_micro` (ddp, fsdp), `replicate=1` (fsdp),
            `dp=1` and a valid `plan` (tp) mean nothing there (the whole model is in the one
            process) and are accepted; any other keyword raises rather than being dropped.

    Raises:
        ValueError: for an unknown `kind` or a non-positive timeout, or a timeout other than
            that of a process group initialised before (it cannot change); WORLD_SIZE or RANK that
            are not integers, a world below 1 or a rank outside it; without WORLD_SIZE, a srun
            step of several tasks (each would train alone: call
            `ftrain.extras.cluster.export_launcher_env()` first), the batch script of an
            allocation of several tasks (start it with srun), a pod with PET_NNODES above 1 or
            JOB_COMPLETION_INDEX (start it with torchrun), a process of several that an MPI
            launcher started (OMPI_COMM_WORLD_SIZE, PMI_SIZE or MV2_COMM_WORLD_SIZE above 1);
            a pod whose job asks for PET_NPROC_PER_NODE processes (above 1) in it, started
            without torchrun (no WORLD_SIZE, or the operator's PET_NNODES x PET_NPROC_PER_NODE);
            a torchrun of a one-node group of its own (GROUP_WORLD_SIZE=1, its own rendezvous:
            --standalone) in each task of a srun step of several.
            Under `accelerate launch`: a `precision` other than its `--mixed_precision`
            (ACCELERATE_MIXED_PRECISION, which is taken when `precision` is not passed), fp8,
            `--use_deepspeed`, or `--use_fsdp` with a `kind` other than "fsdp".
        TypeError: for a keyword `SingleDevice` cannot honour in a one-process run.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'ddp', 'fsdp' or 'tp', got {kind!r}")
    if timeout is not None:  # refused in one process too, not first under torchrun
        collective_timeout(timeout)
    kwargs = _accelerate_settings(kind, kwargs)
    if not dist.is_initialized() and _world_size() <= 1:  # a group made by hand is taken
        return _single(kind, kwargs)
    if timeout is not None and dist.is_initialized():
        _refuse_other_timeout(timeout)
    owns = join_group(f"from_env({kind!r})", timeout=timeout)
    try:
        strategy = _KINDS[kind](**kwargs)
    except BaseException:  # never returned to be closed: leave the group joined above
        if owns and dist.is_initialized():
            dist.destroy_process_group()
        raise
    strategy.owns_group = owns  # close() destroys the group only if from_env created it
    return strategy


def _accelerate_settings(kind: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the mixed precision `accelerate launch` was given (`--mixed_precision`,
    or its config file), which it passes as ACCELERATE_MIXED_PRECISION (always set; "no" is its
    default): taken when `precision` is not passed, refused when another one is. The launch
    said bf16 and the run trained in float32 without a word. A launch for FSDP or DeepSpeed
    (`--use_fsdp`, `--use_deepspeed`) that `kind` would not honour raises too."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise ValueError(
            "accelerate launch was told to use DeepSpeed (ACCELERATE_USE_DEEPSPEED=true, from "
            "--use_deepspeed or its config), which ftrain has no strategy for: its ZeRO "
            "settings would be ignored; launch without DeepSpeed and use from_env('fsdp') "
            f"{_CONFIG}"
        )
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true" and kind != "fsdp":
        raise ValueError(
            f"accelerate launch was told to use FSDP (ACCELERATE_USE_FSDP=true, from --use_fsdp "
            f"or its config), but from_env({kind!r}) would not shard the model: call "
            f"from_env('fsdp') (its options are FSDP's keywords; accelerate's FSDP_* variables "
            f"are not read), or launch without FSDP {_CONFIG}"
        )
    # Only a launch's: transformers 4's TrainingArguments sets ACCELERATE_MIXED_PRECISION in
    # its own process too; `accelerate launch` always sets ACCELERATE_DYNAMO_BACKEND beside it.
    if "ACCELERATE_DYNAMO_BACKEND" not in env:
        return kwargs
    launched = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launched == "no":
        return kwargs
    if launched not in ("bf16", "fp16"):
        raise ValueError(
            f"accelerate launch was told --mixed_precision {launched} "
            f"(ACCELERATE_MIXED_PRECISION={launched!r}), which ftrain's strategies do not "
            f"implement (they take 'fp32', 'bf16' or 'fp16'); launch with one of those {_CONFIG}"
        )
    given = kwargs.get("precision")
    if given is None:
        return {**kwargs, "precision": launched}
    if Precision.of(given).dtype != Precision.of(launched).dtype:
        raise ValueError(
            f"precision={given!r} differs from accelerate launch's --mixed_precision "
            f"{launched} (ACCELERATE_MIXED_PRECISION, from the command line or its config): "
            "pass the same, or drop one of them"
        )
    return kwargs


_CONFIG = "(`accelerate config` or the launch flags)"


def _refuse_other_timeout(timeout: timedelta) -> None:
    """A group initialised before keeps the timeout it was made with: a different `timeout`
    here was dropped without a word (a dead peer then hung the survivors for the group's 30
    minutes, not the seconds asked for)."""
    current = group_timeout()
    if current is not None and current != timeout:
        raise ValueError(
            f"timeout={timeout!r} cannot apply: the process group was initialised before "
            f"from_env, with a collective timeout of {current!r}; pass timeout= to "
            "torch.distributed.init_process_group instead, or drop it here"
        )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} in the environment is not an integer") from None


def _world_size() -> int:
    """WORLD_SIZE as the launcher set it (1 when unset), checked against RANK and the scheduler.

    Without WORLD_SIZE, a process that the scheduler meant as one rank of several would run a
    one-process training of its own, all of them writing to the same run folder: a srun task
    of several (no `export_launcher_env()`, or a script never written for SLURM), the batch
    script of an allocation of several tasks (srun never started), a pod with torchrun's PET_*
    arguments or a JobSet's index whose command is `python`, not torchrun. Those raise; a Ray
    worker (RAY_RAYLET_PID) is none of them, whatever SLURM variables its raylet passed on.
    """
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world} in the environment: a world has at least 1 process")
    rank = _env_int("RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} in the environment is outside WORLD_SIZE={world}")
    refuse_lone_process()
    return world


def refuse_lone_process() -> None:
    """Raise if the launcher's environment says this process is one of several that would each
    train alone: the checks `from_env` makes before it returns `SingleDevice` for a world of 1.

    `TrainState.create` without a strategy makes them too. A srun task of a step of several
    without WORLD_SIZE, the batch script (or salloc shell) of an allocation of several tasks, a
    pod of a multi-node job or with PET_NPROC_PER_NODE above 1 started with `python`, one of
    several processes an MPI launcher started, and a one-node torchrun in each task of a srun
    step raise; a Ray worker, a torchrun worker, a single srun task and a plain `python` run
    pass. WORLD_SIZE and RANK themselves are `from_env`'s to check.

    Raises:
        ValueError: naming the variables that tell and how to launch instead.

    Example:
        >>> import ftrain as ft
        >>> ft.strategies.refuse_lone_process()  # a plain `python` run: nothing to refuse
    """
    if "WORLD_SIZE" not in os.environ and "RAY_RAYLET_PID" not in os.environ:
        _refuse_lone_slurm_task()
        _refuse_lone_pod()
        _refuse_lone_mpi_rank()
    refuse_pod_short_of_processes()
    refuse_one_node_torchrun_per_srun_task()


_ALONE = "or set WORLD_SIZE=1 if independent one-process runs are what you mean"


def _refuse_lone_slurm_task() -> None:
    if "SLURM_STEP_NUM_TASKS" not in os.environ:  # srun sets it in every task it starts
        tasks = _env_int("SLURM_NTASKS", 1)
        if tasks > 1:
            raise ValueError(
                "this is the batch script (or salloc shell) of a SLURM allocation of "
                f"SLURM_NTASKS={tasks} tasks "
                "(SLURM_STEP_NUM_TASKS is unset: srun did not start this process), so it would "
                "train as one process: start the script with srun (`srun python train.py`, "
                f"calling ftrain.extras.cluster.export_launcher_env() first) or torchrun, {_ALONE}"
            )
        return
    tasks = _env_int("SLURM_STEP_NUM_TASKS", 1) if "SLURM_PROCID" in os.environ else 1
    if tasks > 1 and not interactive_srun_shell():  # `srun --pty bash` runs one shell
        raise ValueError(
            f"this is task {os.environ['SLURM_PROCID']} of a srun step of "
            f"SLURM_STEP_NUM_TASKS={tasks}, but WORLD_SIZE is unset: each task would train "
            "alone; call ftrain.extras.cluster.export_launcher_env() first (it sets RANK, "
            f"WORLD_SIZE, MASTER_ADDR/PORT from SLURM's variables), {_ALONE}"
        )


def _refuse_lone_pod() -> None:
    """A pod of a multi-node job whose command is `python`: PET_NNODES (torchrun's --nnodes,
    "N" or "MIN:MAX") above 1, or JOB_COMPLETION_INDEX (a JobSet's or Indexed Job's pod) with a
    rendezvous address (MASTER_ADDR or PET_MASTER_ADDR): without one, a sweep's pod."""
    found = [k for k in ("PET_NNODES", "JOB_COMPLETION_INDEX") if k in os.environ]
    nodes = os.environ.get("PET_NNODES", "").rpartition(":")[2]  # the most nodes
    if nodes.isascii() and nodes.isdigit() and int(nodes) <= 1:
        found.remove("PET_NNODES")  # one node: `python` is what torchrun would start once
    # An Indexed Job's pods are a sweep of independent runs as often as one training: only a
    # rendezvous address (or torchrun's node count) makes them one.
    group = {"MASTER_ADDR", "PET_MASTER_ADDR", "PET_NNODES"} & (set(found) | os.environ.keys())
    if "JOB_COMPLETION_INDEX" in found and not group:
        found.remove("JOB_COMPLETION_INDEX")
    if found:
        names = ", ".join(f"{k}={os.environ[k]}" for k in found)
        raise ValueError(
            f"this pod has {names} but WORLD_SIZE is unset: it is one of several pods, "
            "started with `python`, not torchrun (which reads PET_* as its arguments and sets "
            "WORLD_SIZE), so it would train alone; start the command with "
            f"`torchrun --nproc-per-node=N train.py`, {_ALONE}"
        )


# The world size each MPI launcher gives its processes: Open MPI's mpirun (and LSF's jsrun),
# MPICH's and Intel MPI's mpiexec (PMI), MVAPICH2's mpirun_rsh.
_MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _refuse_lone_mpi_rank() -> None:
    """A process that `mpirun -np N python train.py` started: MPI's variables say it is one of
    N, torch's are unset, so each trained alone on every row into the same run folder."""
    for name in _MPI_SIZES:
        size = os.environ.get(name, "")
        if size.isascii() and size.isdigit() and int(size) > 1:
            raise ValueError(
                f"this process is one of {name}={size} processes an MPI launcher (mpirun, "
                "mpiexec) started, but WORLD_SIZE is unset: each would train alone; launch "
                "with torchrun (one per node), or export torch's RANK, WORLD_SIZE, MASTER_ADDR "
                f"and MASTER_PORT from the launcher's, {_ALONE}"
            )


_KINDS: Mapping[str, type[DDP | FSDP | TP]] = MappingProxyType({"ddp": DDP, "fsdp": FSDP, "tp": TP})


def _single(kind: str, kwargs: dict[str, Any]) -> SingleDevice:
    # Multi-process settings that one process satisfies as it is (there is nothing to sync).
    own = {"ddp": ("sync_every_micro",), "fsdp": ("sync_every_micro", "replicate")}.get(
        kind, ("plan", "dp")
    )
    moot: set[str] = {k for k in ("sync_every_micro", "plan") if k in kwargs and k in own}
    # The int 1 only: True == 1 and 1.0 == 1, which the multi-process strategies refuse.
    moot |= {k for k in ("replicate", "dp") if _is_one(kwargs.get(k)) and k in own}
    flag = kwargs.get("sync_every_micro", False) if "sync_every_micro" in moot else False
    if not isinstance(flag, bool):  # refused under torchrun too: a string is not a flag
        raise TypeError(f"sync_every_micro must be True or False, got {flag!r}")
    if "plan" in moot:
        from ftrain.strategies._tp import _check_plan

        _check_plan(kwargs["plan"])
    unknown = sorted(set(kwargs) - moot - {"device", "precision"})
    if unknown:
        raise TypeError(
            f"from_env({kind!r}) in a one-process run (WORLD_SIZE=1) returns SingleDevice, which "
            f"cannot honour {unknown}; pass them only under torchrun, or launch with torchrun"
        )
    return SingleDevice(kwargs.get("device"), precision=kwargs.get("precision"))


def _is_one(value: Any) -> bool:
    return type(value) is int and value == 1
