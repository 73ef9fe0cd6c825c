"""`from_env`: the strategy that the launcher's environment describes."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftrain.strategies._base import SingleDevice
from ftrain.strategies._ddp import DDP
from ftrain.strategies._fsdp import FSDP

__all__ = ["from_env"]


def from_env(
    kind: str = "ddp", *, timeout: timedelta | None = None, **kwargs: Any
) -> SingleDevice | DDP | FSDP:
    """The strategy that the launcher's environment describes.

    Under `torchrun --nproc_per_node N` or `accelerate launch` (WORLD_SIZE > 1) this joins the
    process group (NCCL with CUDA, gloo on CPU) unless it is already initialised, and returns a
    `DDP` (or `FSDP` for kind="fsdp"); in a plain `python` run it returns `SingleDevice()`.

    Args:
        kind: "ddp" or "fsdp".
        timeout: how long a collective may wait before the process fails (default 10 minutes),
            so that one rank's crash ends the others instead of hanging them.
        **kwargs: passed to the strategy.

    Raises:
        ValueError: for an unknown `kind`.
    """
    if kind not in ("ddp", "fsdp"):
        raise ValueError(f"kind must be 'ddp' or 'fsdp', got {kind!r}")
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not dist.is_initialized():
        return SingleDevice()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timeout or timedelta(minutes=10))
    if kind == "fsdp":
        return FSDP(**kwargs)
    return DDP(**kwargs)
