"""DDP: torch DistributedDataParallel behind the Strategy protocol.

Processes come from `torchrun` or `accelerate launch` (they set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT); `ft.strategies.from_env()` joins the process group they describe.
On CPU the gloo backend runs everything, so 2-process tests run anywhere.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ftrain.precision import NO_CONTEXT, Precision
from ftrain.strategies._base import local_grad_norm, uncompiled
from ftrain.strategies._group import ProcessGroupStrategy

__all__ = ["DDP"]


class DDP(ProcessGroupStrategy):
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
        RuntimeError: outside a launcher: with no process group initialised, the group is
            joined from the environment torchrun or `accelerate launch` set (RANK,
            WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and without those this names them.
        TypeError: for a `sync_every_micro` that is not a bool.
        ValueError: for a `device_mesh` in `ddp_kwargs` (torch's DDP would reduce over the
            mesh's group, while the data split, losses and counts follow `process_group`); for
            a `process_group` this process is not a member of; at a non-final
            micro-batch, for `static_graph=True` without `sync_every_micro` (torch's
            `no_sync` fails an internal assert there).
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
        if not isinstance(sync_every_micro, bool):  # a string such as "no" would be truthy
            raise TypeError(f"sync_every_micro must be True or False, got {sync_every_micro!r}")
        if ddp_kwargs.get("device_mesh") is not None:  # checked before joining a group
            raise ValueError(
                "DDP got device_mesh=: torch's DDP would average gradients over the mesh's "
                "group, while make_batches splits the rows, and the losses and item counts are "
                "summed, over process_group (the default group when None), so ranks would read "
                "rows they do not reduce with and replicas drift apart. Pass the group to "
                "average over as process_group= (its ranks are the data-parallel ranks), or "
                "ft.strategies.TP(dp=...) for tensor x data parallelism"
            )
        super().__init__("DDP", device, process_group, precision)
        self.sync_every_micro = sync_every_micro
        # DDP reduces in the final backward only (no_sync around the others): uneven counts
        # give the gradient of every rank's micro-batches, as they should.
        self.micro_counts_must_match = sync_every_micro
        self.forward_collectives = False  # its reductions run in the backward
        self._kwargs = ddp_kwargs

    def setup(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return self._track(
            DistributedDataParallel(model, device_ids=ids, process_group=self.group, **self._kwargs)
        )

    def release_model(self, model: nn.Module) -> None:
        # The reducer (and the logger holding it) keep the C++ process group alive.
        for name in ("logger", "reducer"):
            if hasattr(model, name):
                delattr(model, name)
        if isinstance(model, DistributedDataParallel):
            model.process_group = None  # type: ignore[assignment]

    def unwrap(self, model: nn.Module) -> nn.Module:
        return uncompiled(model.module if isinstance(model, DistributedDataParallel) else model)

    def next_forward_collective(self, model: nn.Module) -> bool:
        """Whether `model`'s next forward runs a collective: DDP broadcasts the module's
        buffers from rank 0 before the first forward after a training one (`broadcast_buffers`,
        its default, and a module that has buffers); the forwards after it run none. `evaluate`
        and `predict` agree over the ranks before such a forward only (a rank with no batch
        never joined it; one predicting alone without it must not wait for the others)."""
        # any DDP module inside (`modules()` goes through torch.compile's wrappers and one's own)
        return any(
            isinstance(m, DistributedDataParallel) and bool(m.will_sync_module_buffers())
            for m in model.modules()
        )

    def clone_model(self, model: nn.Module) -> nn.Module:
        # Collective (DDP broadcasts parameters when it wraps): every rank must snapshot together.
        return self.setup(copy.deepcopy(self.unwrap(model)))

    def grad_sync(self, model: nn.Module, *, final: bool) -> contextlib.AbstractContextManager[Any]:
        if not isinstance(model, DistributedDataParallel):
            return NO_CONTEXT
        if final or self.sync_every_micro:
            return _reduced(model)
        if self._kwargs.get("static_graph"):  # torch's reducer fails an internal assert there
            raise ValueError(
                "DDP(static_graph=True) cannot skip the gradient sync of the non-final "
                "micro-batches (no_sync): pass sync_every_micro=True, or one micro-batch a step"
            )
        return model.no_sync()

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        # After the final backward every rank holds the same (reduced) gradients.
        return local_grad_norm(grads)

    def drop_gathered(self, model: nn.Module) -> None:
        pass  # every rank holds whole parameters: nothing gathered


@contextlib.contextmanager
def _reduced(model: DistributedDataParallel) -> Iterator[None]:
    """Around a backward that reduces: afterwards, raise unless DDP reduced every bucket.

    A parameter that got no gradient on this rank (a branch or an MoE expert this rank's rows
    did not take) leaves its bucket unreduced without `find_unused_parameters=True`: this rank
    kept its own gradients, or its peers reduced other tensors with it, and torch only raised
    at the next forward, after the wrong update. A local flag check: no collective, no sync."""
    yield
    check = getattr(model.reducer, "_check_reducer_finalized", None)  # private: torch 2.x
    if check is None:
        return
    try:
        check()
    except RuntimeError as e:
        raise RuntimeError(
            "DDP: some parameters got no gradient in this backward on this rank (unused in "
            "the forward, e.g. a branch or an MoE expert its rows did not take), so their "
            "gradients were not averaged over the ranks; pass find_unused_parameters=True to "
            "ft.strategies.DDP (or from_env), or make every parameter take part in the loss"
        ) from e
