"""This process's rank in the job, for the sinks that act on rank 0 only."""

from __future__ import annotations

import os

import torch.distributed as dist


def _known_rank(rank: int | None) -> int | None:
    """`rank`, or this process's rank in the job when it is known now: the process group's
    when one is set up, else the launcher's `RANK` (torchrun, accelerate launch); None in a
    process without either (a single process, or one whose process group is set up later)."""
    if rank is not None:
        return rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ.get("RANK")
    return int(env) if env else None


def _process_rank(rank: int | None) -> int:
    """`_known_rank(rank)`, 0 when not known (no process group, no `RANK`: one process)."""
    known = _known_rank(rank)
    return 0 if known is None else known
