"""FSDP: PyTorch's FSDP2 (`fully_shard`) behind the Strategy protocol.

Every parameter becomes a DTensor sharded over the ranks along dim 0; the optimizer state made
from them is sharded the same way, and PyTorch's fused kernels run on the local shards. Blocks
(by default the classes an HF model lists in `_no_split_modules`, e.g. `LlamaDecoderLayer`) are
sharded one by one so that only one block is gathered at a time, then the root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftrain.precision import Precision
from ftrain.strategies._base import uncompiled
from ftrain.strategies._group import ProcessGroupStrategy

__all__ = [
    "FSDP",
    "copy_whole",
    "drop_gathered",
    "full_state_dict",
    "gradient_sync",
    "hf_blocks",
    "local_shard",
    "reduce_unused",
]


def hf_blocks(model: nn.Module) -> Callable[[nn.Module], bool]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    return lambda m: type(m).__name__ in names


class FSDP(ProcessGroupStrategy):
    """Fully sharded data parallelism (FSDP2): parameters, gradients and optimizer state are
    split across the ranks.

    `setup` gives every rank global rank 0's parameters and buffers (one broadcast, as DDP's
    at wrap time) before sharding them.

    Gradients are reduce-scattered in the final micro-batch's backward only
    (`set_requires_gradient_sync(False)` for the others); `sync_every_micro=True` reduces after
    every micro-batch, keeping only the local gradient shard in between. The gradient norm for
    clipping is global: squared norms of the local shards are summed across ranks.

    Args:
        device: this rank's device; `cuda:LOCAL_RANK` when CUDA is available, else the CPU.
        shard: which submodules to shard separately; HF's `_no_split_modules` by default.
        sync_every_micro: reduce-scatter in every micro-batch's backward.
        precision: "fp32" (default), "bf16" or "fp16" (with dynamic loss scaling), or an
            `ft.precision.Precision`: the forward pass runs under autocast and the sharded
            parameters stay float32.
        replicate: HSDP: shard within groups of `world_size // replicate` ranks and replicate
            across `replicate` such groups (a 2-D device mesh), so that all-gathers stay
            inside a group (a node) and only gradients cross groups. 1 (default) shards across
            every rank.
        **fsdp_kwargs: passed to `fully_shard` (e.g. `reshard_after_forward`, `mesh`).

    Raises:
        RuntimeError: outside a launcher: with no process group initialised, the group is
            joined from the environment torchrun or `accelerate launch` set (RANK,
            WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and without those this names them.
        TypeError: for a `sync_every_micro` that is not a bool, a `replicate` that is not an
            int, or a `mesh` that is not a `DeviceMesh`.
        ValueError: for a `replicate` that does not divide the world size, both `replicate`
            and `mesh`, or a `mesh` that is not 1-D or 2-D over every rank (a 2-D `mesh` is
            HSDP, as `replicate=` makes: the clipping norm sums over its shard dimension).
            For an `mp_policy` with a float16 `param_dtype` or `reduce_dtype` without
            `precision="fp16"` (no loss scaling). In `setup`, for `ignored_params` holding a
            trainable parameter (FSDP would not reduce its gradient).
    """

    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        shard: Callable[[nn.Module], bool] | None = None,
        sync_every_micro: bool = False,
        precision: str | Precision | None = None,
        replicate: int = 1,
        **fsdp_kwargs: Any,
    ) -> None:
        if not isinstance(sync_every_micro, bool):  # a string such as "no" would be truthy
            raise TypeError(f"sync_every_micro must be True or False, got {sync_every_micro!r}")
        if type(replicate) is not int:  # True is not 1, nor is 1.0
            raise TypeError(f"replicate must be an int (replica groups), got {replicate!r}")
        _refuse_unscaled_half(fsdp_kwargs.get("mp_policy"), Precision.of(precision))
        super().__init__("FSDP", device, None, precision)
        self.sync_every_micro = sync_every_micro
        self._shard = shard
        self._kwargs = fsdp_kwargs
        self.replicate = replicate
        self._norm_group = None  # every rank holds a distinct shard
        with self._leaving_on_error():
            if replicate != 1:
                self._kwargs["mesh"], self._norm_group = self._hsdp_mesh(replicate)
            elif "mesh" in self._kwargs:
                self._norm_group = self._own_mesh(self._kwargs["mesh"])

    def _hsdp_mesh(self, replicate: int) -> tuple[Any, Any]:
        """The (replicate, shard) mesh, and the group the norm sums over: shards repeat across
        the replicate groups, so squared norms are summed within one group."""
        if not (replicate > 1 and self.world_size % replicate == 0):
            raise ValueError(
                f"replicate must divide the world size {self.world_size}, got {replicate!r}"
            )
        if "mesh" in self._kwargs:
            raise ValueError("pass either replicate or mesh, not both")
        from torch.distributed.device_mesh import init_device_mesh

        shape = (replicate, self.world_size // replicate)
        mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("replicate", "shard"))
        return mesh, mesh.get_group("shard")

    def _own_mesh(self, mesh: Any) -> Any:
        """The group the norm sums over for a `mesh=` of the caller's: None (every rank) for a
        1-D mesh; the shard dimension's group for a 2-D one, which `fully_shard` reads as HSDP
        (replicated over dim 0): summing over every rank would count each shard once per
        replica and inflate the clipping norm by sqrt(replicas)."""
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch DeviceMesh, got {mesh!r}")
        if mesh.ndim not in (1, 2) or mesh.size() != self.world_size:
            raise ValueError(
                f"mesh must be a 1-D (FSDP) or 2-D (HSDP: replicate x shard) mesh over all "
                f"{self.world_size} ranks, got shape {tuple(mesh.shape)}: the strategy sums "
                "losses and counts over every rank; or pass replicate=R instead of mesh"
            )
        return mesh.get_group(1) if mesh.ndim == 2 else None

    def setup(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        model = model.to(self.device)
        _refuse_trainable_ignored(model, self._kwargs.get("ignored_params"))
        from_rank0(model)
        is_block = self._shard or hf_blocks(model)
        for module in list(model.modules())[1:]:
            if is_block(module):
                fully_shard(module, **self._kwargs)
        fully_shard(model, **self._kwargs)
        reduce_unused(model)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return uncompiled(model)  # fully_shard changes the module in place; names stay

    def clone_model(self, model: nn.Module) -> nn.Module:
        raise TypeError(
            "FSDP states cannot be snapshotted (ft.snapshot, donate=False): the parameters are "
            "sharded across processes; save a checkpoint instead"
        )

    def grad_sync(self, model: nn.Module, *, final: bool) -> contextlib.AbstractContextManager[Any]:
        return gradient_sync(model, final or self.sync_every_micro)

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        # Sum of squares of the local shards, summed over ranks: the norm of the whole gradient.
        local = [local_shard(g) for g in grads]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if local:
            norms = torch._foreach_norm(local, 2.0)
            sq = torch.stack([n.float() for n in norms]).square().sum()
        if self._norm_group is None:
            return self.all_reduce_sum(sq).sqrt()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self._norm_group)
        return sq.sqrt()

    # Checkpoint layout: parameters and optimizer state are DTensors sharded over the ranks.
    checkpoint_sharded = True

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return full_state_dict(module)

    def copy_whole(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy_whole(dst, src)

    def drop_gathered(self, model: nn.Module) -> None:
        drop_gathered(model)


def _refuse_unscaled_half(policy: Any, precision: Precision) -> None:
    """A `MixedPrecisionPolicy` computing or reducing in float16 needs loss scaling, which
    ftrain ties to `precision="fp16"`: without it, gradients below float16's range became
    zero (and sums above it inf, skipped steps) without an error."""
    half = [
        f"{key}=torch.float16"
        for key in ("param_dtype", "reduce_dtype")
        if getattr(policy, key, None) == torch.float16
    ]
    if half and precision.loss_scaling is None:
        raise ValueError(
            f"FSDP(mp_policy=MixedPrecisionPolicy({', '.join(half)})) computes in float16 "
            f"without loss scaling (precision={precision!r}): small gradients would flush to "
            "zero; pass precision='fp16' (dynamic loss scaling) with it, or use torch.bfloat16"
        )


def _refuse_trainable_ignored(model: nn.Module, ignored: Any) -> None:
    """`fully_shard(ignored_params=...)` neither shards nor reduces those parameters: a
    trainable one kept each rank's own gradient (scaled for an average that never happened),
    and the replicas drifted apart (an error at the division only on small models)."""
    if not ignored:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = sorted(names.get(id(p), "?") for p in ignored if p.requires_grad)
    if trainable:
        raise ValueError(
            f"FSDP(ignored_params=...) holds trainable parameters {trainable[:3]}: FSDP does "
            "not reduce their gradients over the ranks, so each rank would apply its own and "
            "the replicas drift apart; freeze them (requires_grad=False) or let FSDP shard them"
        )


def from_rank0(model: nn.Module) -> None:
    """Give every process global rank 0's parameters and buffers (in place, one broadcast per
    tensor), as DDP does when it wraps and TP when it splits. `fully_shard` keeps each rank's
    own slice of its own tensors without communication: a model initialised differently on
    each rank (seeded by rank) became rank 0's rows of a weight stacked on rank 1's, and under
    HSDP the replicas kept different values for good, without an error."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        tensors = [*model.parameters(), *model.buffers()]
        works = [
            (t, c, dist.broadcast(c, src=0, async_op=True))
            for t in tensors
            if not hasattr(t, "device_mesh")  # distributed already: it refuses elsewhere
            for c in [t.detach() if t.is_contiguous() else t.detach().contiguous()]
        ]
        for t, c, work in works:
            work.wait()
            if c.data_ptr() != t.data_ptr():  # a contiguous copy: back into the tensor
                t.copy_(c)


def reduce_unused(model: nn.Module) -> None:
    """Have every `fully_shard`ed unit of `model` reduce-scatter a zero gradient for a
    parameter that got none on this rank. FSDP2 otherwise reduces only the gradients present:
    where ranks use different parameters (MoE experts, a branch taken on one rank), their
    reduce-scatters hold other tensors, and two parameters of one size (rank 0's expert 0,
    rank 1's expert 1) were summed into each other without an error."""
    setter = getattr(model, "set_reduce_scatter_unused_params", None)
    if setter is None:  # an older torch lacks it: there every parameter must get a gradient
        return
    setter(True)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """FSDP2 reduce-scatters gradients in this backward only when `sync`."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def drop_gathered(model: nn.Module) -> None:
    """Reshard every `fully_shard`ed module of `model`, freeing the whole parameters a forward
    gathered and kept: the root's (FSDP2 does not reshard the root after forward, as a
    training backward would gather them again at once), and every module's under
    `reshard_after_forward=False` or an int. The next forward all-gathers the shards as they
    are now. Local: no communication."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # not recursive; a no-op on a module already sharded


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with whole tensors on the CPU, gathered from DTensor shards."""
    with torch.no_grad():  # every rank takes part in gathering the whole tensors
        return {n: _full(t).detach().cpu() for n, t in module.state_dict().items()}


def copy_whole(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the whole `src` (on every rank) into `dst`, a DTensor shard or a plain tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(dst, DTensor) and not isinstance(src, DTensor):
        # Every rank holds the whole `src`: each takes its own shard, no communication.
        src = distribute_tensor(
            src.to(dst.device), dst.device_mesh, dst.placements, src_data_rank=None
        )
    dst.copy_(src)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # buffers are not sharded
    return full_tensor() if callable(full_tensor) else t
