"""This process's rank in the job, for the sinks that act on rank 0 only."""

from __future__ import annotations

import multiprocessing
import operator
import os

import torch.distributed as dist


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


# Variables of launchers that start several processes without torchrun's RANK.
_SIZES = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _alone() -> bool:
    """Whether this process is a job of its own: no Python parent started it (`mp.spawn`'s
    workers set up their process group after building their sinks), no launcher said it is
    one of several, and no `MASTER_ADDR` names a group to join."""
    if multiprocessing.parent_process() is not None or os.environ.get("MASTER_ADDR"):
        return False
    for name in _SIZES:
        try:
            if int(os.environ.get(name) or 1) > 1:
                return False
        except ValueError:
            return False  # a launcher's value that is not a count: not known to be alone
    return True


def _process_rank(rank: int | None) -> int:
    """`_known_rank(rank)`, 0 when not known (no process group, no `RANK`: one process)."""
    known = _known_rank(rank)
    return 0 if known is None else known
