"""What the process-group strategies (DDP, FSDP) share: joining the group, this rank's device,
collectives on device tensors. One place, imported by each strategy module; they never import
each other.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ftrain.precision import Precision
from ftrain.strategies import _dcp
from ftrain.strategies._base import _precision_repr, move_to

__all__ = ["ProcessGroupStrategy", "local_device"]

_S = TypeVar("_S", bound="ProcessGroupStrategy")


def local_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


class ProcessGroupStrategy:
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
        self.process_rank = self.rank  # each process is a data-parallel rank (not under TP)
        self.grad_reduce_factor = 1.0 / self.world_size  # both average over ranks
        self.device = torch.device(device) if device is not None else local_device()
        self.precision = Precision.of(precision)
        self.owns_group = False  # from_env sets it when it initialised the group
        self.closed = False
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # Background (sharded) saves talk over gloo groups of their own, made at the first.
        self._checkpoint_groups: list[Any] = []

    def __repr__(self) -> str:
        name = type(self).__name__
        return (
            f"{name}(rank={self.rank}, world_size={self.world_size}, device='{self.device}'"
            f"{_precision_repr(self.precision)})"
        )

    def to_device(self, batch: Any) -> Any:
        return move_to(batch, self.device)

    # --- lifetime ------------------------------------------------------------------------------

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def close(self) -> None:
        """Leave the process group together; safe on every rank, and idempotent.

        In this order: release what the set-up models hold of the group (a DDP model freed
        after `destroy_process_group` drops the last reference to a gloo group, whose
        destructor then deadlocks at exit, see docs/strategies.md), wait for every rank
        (a rank leaving while a peer still uses the group makes gloo abort the peer), and
        destroy the group if `from_env` created it. Models set up by this strategy cannot
        train afterwards: save and export before.
        """
        if self.closed:
            return
        self._finish_saves()
        self.closed = True
        self._release()
        if not dist.is_initialized():
            return
        try:
            self.barrier()
        finally:
            if self.owns_group:
                dist.destroy_process_group()

    def abort(self) -> None:
        """Leave after an error, without waiting for the other ranks (idempotent).

        A barrier here could wait forever on a peer that is itself stuck in a collective; this
        rank releases its models and destroys the group it created, so that the peers' next
        collective fails at once instead of after the timeout.
        """
        if self.closed:
            return
        self.closed = True
        self._release()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _track(self, model: nn.Module) -> nn.Module:
        self._models.add(model)
        return model

    def _release(self) -> None:
        for model in list(self._models):
            self.release_model(model)
        gc.collect()  # models the caller dropped go now, before the group does

    def release_model(self, model: nn.Module) -> None:
        """Drop what `model` (set up by this strategy) holds of the process group; a no-op
        unless the backend's wrapper keeps the group alive."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.precision.autocast(self.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(tensor)

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

    # Checkpoint layout: whole tensors on every rank (DDP); FSDP overrides what shards change.
    checkpoint_sharded = False

    def save_shards(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        _dcp.save_shards(tensors, directory, group=self.group, local=False)

    def save_shards_async(
        self, parts: Mapping[Path, dict[str, torch.Tensor]], *, commit: Callable[[], None]
    ) -> Callable[[], None]:
        # Over every process, as the shards are (TP's too); each is here, in this order.
        while len(self._checkpoint_groups) < len(parts):
            group = dist.new_group(backend="gloo", timeout=self._timeout())
            self._checkpoint_groups.append(group)
        groups, rank = self._checkpoint_groups, self.process_rank
        return _dcp.save_shards_async(parts, commit, groups=groups, rank=rank)

    def load_shards(self, directory: Path, targets: dict[str, torch.Tensor]) -> None:
        _dcp.load_shards(directory, targets, group=self.group, local=False)

    def _finish_saves(self) -> None:
        """Wait for a background save that writes over this strategy's checkpoint group."""
        if self._checkpoint_groups:
            from ftrain.checkpoint import wait_for_checkpoint

            wait_for_checkpoint()

    def _timeout(self) -> Any:
        """The training group's collective timeout (a dead peer fails a background save as
        soon as it fails a step), or None (torch's default) where torch does not say."""
        try:
            group = dist.distributed_c10d._get_default_group()
            return group._get_backend(self.device).options._timeout
        except (AttributeError, RuntimeError):
            return None

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return module.state_dict()

    def copy_whole(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
