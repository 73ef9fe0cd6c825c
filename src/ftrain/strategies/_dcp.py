"""Shard files through torch.distributed.checkpoint (DCP), for the strategies' checkpoint seam.

DCP writes one safetensors file per rank (`HuggingFaceStorageWriter`, whose header records each
chunk's offset in the whole tensor; nothing is pickled) and reads them back into tensors of any
layout, resharding. It is imported here, when a checkpoint first needs it: importing it at
`import ftrain` time would cost about half a second.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_shards", "save_shards"]


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
