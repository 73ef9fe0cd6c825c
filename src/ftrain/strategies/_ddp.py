"""DDP: torch DistributedDataParallel behind the Strategy protocol, and `from_env`.

Processes come from `torchrun` or `accelerate launch` (they set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT); `from_env()` joins the process group they describe. On CPU the
gloo backend runs everything, so 2-process tests run anywhere.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ftrain.precision import Precision
from ftrain.strategies._base import (
    SingleDevice,
    _precision_repr,
    local_grad_norm,
    move_to,
    uncompiled,
)

if TYPE_CHECKING:
    from ftrain.strategies._fsdp import FSDP

__all__ = ["DDP", "from_env"]


def _local_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


class _ProcessGroupStrategy:
    """What DDP and FSDP share: a process group, this rank's device, collectives on tensors."""

    def __init__(
        self,
        name: str,
        device: str | torch.device | None,
        group: Any,
        precision: str | Precision | None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"{name} needs an initialised process group: launch with torchrun (or "
                f"accelerate launch) and build the strategy with ft.strategies.from_env()"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.grad_reduce_factor = 1.0 / self.world_size  # both average over ranks
        self.device = torch.device(device) if device is not None else _local_device()
        self.precision = Precision.of(precision)

    def __repr__(self) -> str:
        name = type(self).__name__
        return (
            f"{name}(rank={self.rank}, world_size={self.world_size}, device='{self.device}'"
            f"{_precision_repr(self.precision)})"
        )

    def to_device(self, batch: Any) -> Any:
        return move_to(batch, self.device)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.precision.autocast(self.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        # Shapes first (one small all-gather and a host sync), then rows padded to the largest.
        # A rank without rows does not widen the other axes.
        dims = list(tensor.shape) if tensor.shape[0] else [0] * tensor.dim()
        shape = torch.tensor(dims, dtype=torch.int64, device=tensor.device)
        shapes = [torch.empty_like(shape) for _ in range(self.world_size)]
        dist.all_gather(shapes, shape, group=self.group)
        sizes = [s.tolist() for s in shapes]
        largest = [max(d) for d in zip(*sizes, strict=True)]
        padded = tensor.new_full(largest, 0 if tensor.dtype in (torch.bool, torch.uint8) else -100)
        padded[tuple(slice(0, d) for d in tensor.shape)] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        rest = tuple(slice(0, d) for d in largest[1:])
        return torch.cat([p[(slice(0, s[0]), *rest)] for p, s in zip(parts, sizes, strict=True)])


class DDP(_ProcessGroupStrategy):
    """Data parallelism with torch DDP: every rank holds the whole model.

    Gradients are all-reduced once per optimizer step, in the backward of the final
    micro-batch (`no_sync` around the others); `sync_every_micro=True` reduces after every
    micro-batch instead, trading traffic for not having to keep unsynchronised gradients.

    Args:
        device: this rank's device; `cuda:LOCAL_RANK` when CUDA is available, else the CPU.
        process_group: the group to reduce over; the default group when None.
        sync_every_micro: all-reduce in every micro-batch's backward.
        precision: "fp32" (default), "bf16" or "fp16" (with dynamic loss scaling), or an
            `ft.precision.Precision`; parameters and gradients stay float32.
        **ddp_kwargs: passed to `DistributedDataParallel` (e.g. `bucket_cap_mb`).

    Raises:
        RuntimeError: if no process group is initialised (use `ft.strategies.from_env()`).
    """

    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        process_group: Any = None,
        sync_every_micro: bool = False,
        precision: str | Precision | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__("DDP", device, process_group, precision)
        self.sync_every_micro = sync_every_micro
        self._kwargs = ddp_kwargs

    def setup(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=ids, process_group=self.group, **self._kwargs
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        return uncompiled(model.module if isinstance(model, DistributedDataParallel) else model)

    def clone_model(self, model: nn.Module) -> nn.Module:
        # Collective (DDP broadcasts parameters when it wraps): every rank must snapshot together.
        return self.setup(copy.deepcopy(self.unwrap(model)))

    def grad_sync(self, model: nn.Module, *, final: bool) -> contextlib.AbstractContextManager[Any]:
        if final or self.sync_every_micro or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        # After the final backward every rank holds the same (reduced) gradients.
        return local_grad_norm(grads)


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
        from ftrain.strategies._fsdp import FSDP

        return FSDP(**kwargs)
    return DDP(**kwargs)
