"""This process's rank in the job, for the sinks that act on rank 0 only."""

from __future__ import annotations

import operator
import os

import torch.distributed as dist


def _known_rank(rank: int | None) -> int | None:
    """`rank`, or this process's rank in the job when it is known now: the process group's
    when one is set up, else the launcher's `RANK` (torchrun, accelerate launch); None in a
    process without either (a single process, or one whose process group is set up later)."""
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
    return int(env) if env else None


def _process_rank(rank: int | None) -> int:
    """`_known_rank(rank)`, 0 when not known (no process group, no `RANK`: one process)."""
    known = _known_rank(rank)
    return 0 if known is None else known
