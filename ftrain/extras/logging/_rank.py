"""This process's rank in the job, for the sinks that act on rank 0 only."""

from __future__ import annotations

import multiprocessing
import operator
import os

import torch.distributed as dist

from ftrain.strategies import refuse_lone_process


def _known_rank(rank: int | None) -> int | None:
    """`rank`, or this process's rank in the job when it is known now: the process group's
    when one is set up, else the launcher's `RANK` (torchrun, accelerate launch), else 0 in a
    job of one process; None in a process that may be one of several whose group is set up
    later (an `mp.spawn` worker, a launcher's task without `RANK`)."""
    if rank is not None:
        # rank="0" (os.environ["RANK"] passed as is) is no 0: the sink did nothing on any rank.
        # An integer of another type (numpy's, a 0-dim integer tensor) is one: operator.index.
        try:
            index = None if isinstance(rank, bool) else operator.index(rank)
        except TypeError:
            index = None
        if index is None or index < 0:
            raise TypeError(
                f"rank must be an int >= 0 (e.g. state.strategy.process_rank) or None, got {rank!r}"
            )
        return index
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ.get("RANK")
    if env:
        return int(env)
    # A job of one process (a plain script): rank 0 now, so a tracker opens its run when built
    # (its run_id known, a wrong tracking URI or login failing before the model loads). Only a
    # process that may be one of several (a Python child, as mp.spawn starts; a launcher's
    # task) waits for its process group.
    return 0 if _alone() else None


# Variables of launchers that start several processes without torchrun's RANK. Every variable
# by which `ft.strategies.from_env` takes a process for one of several (ftrain/strategies/_env.py:
# `_world_size` and the `_refuse_lone_*` it calls) must make it so here too, or each such
# process took itself for rank 0 and opened a tracker run of its own when the sink was built.
# The core cannot import this, nor this the core's private names: tests/test_trackers_close.py
# (`test_every_process_from_env_takes_for_one_of_several_waits_for_its_rank`) binds the two;
# what from_env refuses without WORLD_SIZE is asked of it (`refuse_lone_process`) below.
# srun sets SLURM_STEP_NUM_TASKS (the step's tasks) in each task, SLURM_NTASKS in the batch
# script; Open MPI (and LSF's jsrun), MPICH / Intel MPI (PMI) and MVAPICH2 their world sizes.
_SIZES = (
    "WORLD_SIZE",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
)


def _alone() -> bool:
    """Whether this process is a job of its own: no Python parent started it (`mp.spawn`'s
    workers set up their process group after building their sinks), no launcher said it is
    one of several, no `MASTER_ADDR` names a group to join, and it is no pod of several."""
    if multiprocessing.parent_process() is not None or os.environ.get("MASTER_ADDR"):
        return False
    for name in _SIZES:
        try:
            if int(os.environ.get(name) or 1) > 1:
                return False
        except ValueError:
            return False  # a launcher's value that is not a count: not known to be alone
    return not _pod_of_several() and not _refused_alone()


def _refused_alone() -> bool:
    """Whether `from_env` refuses this process as one of several that would each train alone
    (a pod whose job asks for PET_NPROC_PER_NODE processes, started with `python`, ...)."""
    try:
        refuse_lone_process()
    except ValueError:
        return True
    return False


def _pod_of_several() -> bool:
    """A pod that `from_env` takes for one of several (started with `python`, not torchrun):
    torchrun's PET_NNODES ("N" or "MIN:MAX") above 1 or not a count, or a JobSet's (Indexed
    Job's) JOB_COMPLETION_INDEX beside a rendezvous (PET_MASTER_ADDR or PET_NNODES; MASTER_ADDR
    is read above). Without the rendezvous, an indexed pod is one run of a sweep."""
    env = os.environ
    if "PET_NNODES" in env:
        most = env["PET_NNODES"].rpartition(":")[2]
        if not (most.isascii() and most.isdigit() and int(most) <= 1):
            return True
    return "JOB_COMPLETION_INDEX" in env and ("PET_MASTER_ADDR" in env or "PET_NNODES" in env)


def _process_rank(rank: int | None) -> int:
    """`_known_rank(rank)`, 0 when not known (no process group, no `RANK`: one process)."""
    known = _known_rank(rank)
    return 0 if known is None else known
