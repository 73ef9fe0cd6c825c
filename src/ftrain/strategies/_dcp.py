"""Shard files through torch.distributed.checkpoint (DCP), for the strategies' checkpoint seam.

DCP writes one safetensors file per rank (`HuggingFaceStorageWriter`, whose header records each
chunk's offset in the whole tensor; nothing is pickled) and reads them back into tensors of any
layout, resharding. It is imported here, when a checkpoint first needs it: importing it at
`import ftrain` time would cost about half a second.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_shards", "save_shards", "save_shards_async"]


def save_shards(
    tensors: dict[str, torch.Tensor], directory: Path, *, group: Any, local: bool
) -> None:
    """Write this rank's shards of `tensors` into `directory`: collective over `group`, or,
    when `local`, one process writing whole tensors as a single shard file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if not tensors:
        directory.mkdir(parents=True, exist_ok=True)
        return
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    with _plain_errors():
        dcp.save(dict(tensors), storage_writer=writer, process_group=group, no_dist=local)


def save_shards_async(
    parts: Mapping[Path, dict[str, torch.Tensor]],
    commit: Callable[[], None],
    *,
    group: Any,
    rank: int,
) -> Callable[[], None]:
    """Stage host copies of this rank's shards of every `directory -> tensors` part now
    (DCP's `DefaultStager`, the staging half of `dcp.async_save`); return the write half.

    The write, run in a background thread on every rank of `group` (a process group the
    training never uses), saves the parts in order, runs `commit` on rank 0 once every rank's
    files are written (DCP's save returns only then), and agrees on the outcome with one
    all-reduce: it raises on every rank when any rank's write or the commit failed.
    `dcp.async_save` itself is not used: each call starts its own thread, so the two parts'
    collectives would race on one group, and the commit must follow both.
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    pinned = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(pinned, False, False, False))
    try:  # synchronous staging: `stage` returns deep copies (DTensors keep their sharding)
        staged: dict[Path, Any] = {d: stager.stage(dict(t)) if t else {} for d, t in parts.items()}
    finally:
        stager.close()

    def write() -> None:
        import torch.distributed as dist

        error: BaseException | None = None
        try:
            for directory, tensors in staged.items():
                save_shards(tensors, directory, group=group, local=group is None)
            if rank == 0:
                commit()
        except BaseException as e:  # every rank must reach the all-reduce below
            error = e
        failed = torch.tensor([0 if error is None else 1])
        if group is not None:
            dist.all_reduce(failed, group=group)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError("the background save failed on another rank")

    return write


def load_shards(
    directory: Path, targets: dict[str, torch.Tensor], *, group: Any, local: bool
) -> None:
    """Fill `targets` (tensors of any layout) from the shard files in `directory`; DCP
    reshards. Collective over `group` unless `local`."""
    if not targets:
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory))
    with _plain_errors():
        dcp.load(dict(targets), storage_reader=reader, process_group=group, no_dist=local)


@contextlib.contextmanager
def _plain_errors() -> Iterator[None]:
    """DCP's CheckpointException is a BaseException: re-raise it as a RuntimeError, which
    the checkpoint code turns into a CheckpointError like any other failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # DCP warns whenever it runs without a process group, which is the point of `local`.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            yield
    except CheckpointException as e:
        raise RuntimeError(str(e)) from e
