"""Shard files through torch.distributed.checkpoint (DCP), for the strategies' checkpoint seam.

DCP writes one safetensors file per rank (`HuggingFaceStorageWriter`, whose header records each
chunk's offset in the whole tensor; nothing is pickled) and reads them back into tensors of any
layout, resharding. It is imported here, when a checkpoint first needs it: importing it at
`import ftrain` time would cost about half a second.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

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
    groups: Sequence[Any],
    rank: int,
) -> Callable[[], None]:
    """Start `dcp.async_save` of this rank's shards of every `directory -> tensors` part, each
    over its own group of `groups` (process groups the training never uses: DCP writes in a
    thread of its own per save, and one group carries one save's collectives at a time).
    Every part is copied to host memory (DCP's `DefaultStager`) before the first write starts:
    a write running beside the copies would slow them down, and the caller waits for those.

    Return the rest, to run in a background thread on every rank: wait for the writes (DCP's
    save finishes on a rank only once every rank's files are written, and fails on every rank
    when one rank's write failed), run `commit` on rank 0, and agree on the outcome with one
    all-reduce, so that it raises on every rank when any rank's write or the commit failed.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

    class Staged(AsyncStager):  # hands the copies made below to async_save as they are
        _synchronize_after_execute = False

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return state_dict

        def synchronize_staging(self) -> None:
            return None

        def close(self) -> None:
            return None

    stager = DefaultStager(StagingOptions(torch.cuda.is_available(), False, False, False))
    try:  # synchronous staging: `stage` returns deep copies (DTensors keep their sharding)
        staged: dict[Path, Any] = {d: stager.stage(dict(t)) for d, t in parts.items() if t}
    finally:
        stager.close()
    futures = []
    for directory, group in zip(parts, groups, strict=True):
        directory.mkdir(parents=True, exist_ok=True)
        if directory in staged:
            writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
            future = dcp.async_save(
                staged[directory], storage_writer=writer, process_group=group, async_stager=Staged()
            )
            futures.append(cast(Future, future))  # a Future: staging is synchronous

    def write() -> None:
        error: BaseException | None = None
        try:
            with _plain_errors():
                # Every part's writer thread must be done before anyone votes or cleans up,
                # also when an earlier part failed: wait for all, then raise the first error.
                done = [future.exception() for future in futures]
                first = next((e for e in done if e is not None), None)
                if first is not None:
                    raise first
            if rank == 0:
                commit()
        except BaseException as e:  # every rank must reach the all-reduce below
            error = e
        failed = torch.tensor([0 if error is None else 1])
        dist.all_reduce(failed, group=groups[0])
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
