"""The `Strategy` seam: everything the core functions need to know about devices and ranks.

Core functions call these methods and never ask which backend they run on. `SingleDevice` is the
do-nothing default; DDP and FSDP implement the same protocol.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ftrain.precision import NO_CONTEXT, Precision
from ftrain.strategies import _dcp, _placement

__all__ = ["SingleDevice", "Strategy", "default_device"]


@runtime_checkable
class Strategy(Protocol):
    """How a training step is placed on devices and ranks.

    Attributes:
        device: where batches and counters live.
        rank: this process's data-parallel rank.
        world_size: number of data-parallel ranks.
        grad_reduce_factor: what the backend's gradient reduction multiplies the sum over ranks
            by (DDP averages: `1 / world_size`); `accumulate_grads` undoes it so that gradients
            are normalized by the global item count.
        precision: the mixed-precision policy: `autocast` dtype and loss scaling.
        checkpoint_sharded: the checkpoint layout (see "Checkpoint layout" below): True when
            each rank holds only shards of the parameters and optimizer state, so that every
            rank writes its own shards (`save_shards`); False when rank 0 holds whole tensors
            and writes them alone.

    Checkpoint layout: `checkpoint_sharded`, `to_host`, `save_shards`, `save_shards_async`,
    `load_shards`, `full_state_dict` and `copy_whole` are the only place that knows how and
    where tensors are placed.
    `ft.checkpoint` asks them and never inspects a tensor's type; a new layout (tensor
    parallelism) is a new strategy, not a new branch there. See docs/strategies.md.

    Placement: `local_view` and `is_distributed` answer what kind of tensor a caller holds;
    code without a strategy at hand (an optimizer's `update`, a loss) asks the functions of the
    same names in `ft.strategies`. Nothing outside `ft.strategies` inspects a tensor's layout.
    """

    device: torch.device
    rank: int
    world_size: int
    grad_reduce_factor: float
    precision: Precision
    checkpoint_sharded: bool
    # True where a micro-batch's forward or backward runs collectives (FSDP's gathers, TP's
    # reductions, DDP's with sync_every_micro): every process must then run as many
    # micro-batches a step, which accumulate_grads checks for batches not of one whole
    # make_batches group. A strategy without it is taken as False.
    micro_counts_must_match: bool
    # True where every forward runs collectives (FSDP's gathers, TP's reductions; not DDP's,
    # whose collectives are in the backward): `evaluate` and `predict` then check that every
    # process got as many batches. A strategy without it is taken as False.
    forward_collectives: bool

    @property
    def process_rank(self) -> int:
        """This process's rank among all the job's processes: process 0 writes what one
        process writes alone (state.json, the commit marker, an export). It is `rank` except
        where several processes hold one data-parallel rank (`TP`)."""
        ...

    def setup(self, model: nn.Module) -> nn.Module:
        """Move/wrap `model` for this strategy and return the module to train."""
        ...

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's module inside whatever `setup` wrapped it in."""
        ...

    def clone_model(self, model: nn.Module) -> nn.Module:
        """Return an independent copy of a set-up model (for `snapshot`)."""
        ...

    def to_device(self, batch: Any) -> Any:
        """Move a collated batch (tensors, dicts, lists of them) to `device`."""
        ...

    def grad_sync(self, model: nn.Module, *, final: bool) -> contextlib.AbstractContextManager[Any]:
        """Context for one micro-batch's backward; gradient sync happens only when `final`."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for the forward pass (mixed precision, when configured)."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a device tensor over data-parallel ranks (no host sync)."""
        ...

    def barrier(self) -> None:
        """Wait until every rank gets here (e.g. until rank 0 has committed a checkpoint)."""
        ...

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a device tensor over every process of the job, tensor-parallel ones included
        (for agreement between the processes that write a checkpoint); `all_reduce_sum`
        where each process is its own data-parallel rank."""
        ...

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of `grads` across shards and ranks, as a device tensor."""
        ...

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `tensor` (first axis; counts may differ), concatenated in rank
        order, on every rank. Other axes that differ between ranks are padded with -100."""
        ...

    def local_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's part of one of this strategy's tensors (a parameter, a gradient, an
        optimizer-state tensor), sharing its storage: in-place changes reach the tensor. The
        tensor itself where tensors are whole (see "Placement" below)."""
        ...

    def is_distributed(self, tensor: torch.Tensor) -> bool:
        """Whether one of this strategy's tensors is laid out over several processes (sharded
        or replicated), so that this process does not hold it as a whole plain tensor."""
        ...

    def to_host(
        self, tensors: Sequence[torch.Tensor], *, copy: bool
    ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Contiguous CPU versions of whole `tensors` for a checkpoint, and a `wait` that returns
        once they hold their values. `copy=False` may return CPU tensors themselves; `copy=True`
        (a background save) returns copies the next in-place step cannot change, and the caller
        never waits for the device: only `wait`, run by the writer, does."""
        ...

    def save_shards(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        """Write this rank's part of `tensors` into `directory` as shard files (safetensors,
        through torch.distributed.checkpoint); collective with several ranks."""
        ...

    def save_shards_async(
        self, parts: Mapping[Path, dict[str, torch.Tensor]], *, commit: Callable[[], None]
    ) -> Callable[[], None]:
        """Copy this rank's shards of every `directory -> tensors` part to the host now, and
        return the write: run in a background thread on every rank, it writes the parts over a
        process group the training never uses, calls `commit` on rank 0 once every rank's
        files are written, and raises on every rank when any rank's write or `commit` failed."""
        ...

    def load_shards(self, directory: Path, targets: dict[str, torch.Tensor]) -> None:
        """Fill `targets` (this strategy's tensors) from the shard files in `directory`,
        whatever number of ranks wrote them; collective with several ranks."""
        ...

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module.state_dict()` with whole tensors (gathered from the shards: collective)."""
        ...

    def copy_whole(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the whole tensor `src` into `dst`, one of this strategy's (maybe sharded)
        tensors; every rank holds `src`."""
        ...

    def drop_gathered(self, model: nn.Module) -> None:
        """Free the whole copies of sharded parameters that a set-up `model` gathered for a
        forward and kept (FSDP2's root keeps them until a backward), so that its next forward
        gathers them anew from the shards. Code that changes parameter shards in place outside
        a step (`swap_ema`, a load, a rollback) calls it afterwards: a forward would otherwise
        compute with the values from before. Local, no communication; a no-op where every
        process holds whole parameters."""
        ...


def default_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )


def _device(device: Any) -> torch.device:
    """`torch.device(device)`, with torch's errors for a bad one named as the argument."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"device must be a str, a torch.device or an int, got {device!r}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:  # "gpu", "", "cuda:x", an index without CUDA
        raise ValueError(f"device={device!r} is not a device here ({e}); e.g. 'cpu'") from e


class SingleDevice:
    """One process, one device: the default strategy.

    Args:
        device: where to train; the first GPU if there is one, else the CPU.
        precision: "fp32" (default), "bf16" or "fp16" (with dynamic loss scaling), or an
            `ft.precision.Precision`.

    Example:
        >>> import torch, ftrain as ft
        >>> s = ft.strategies.SingleDevice("cpu")
        >>> s.to_device({"x": torch.ones(2)})["x"].device.type
        'cpu'
    """

    rank = 0
    world_size = 1
    grad_reduce_factor = 1.0
    micro_counts_must_match = False
    forward_collectives = False

    def __init__(
        self, device: str | torch.device | None = None, *, precision: str | Precision | None = None
    ) -> None:
        self.device = _device(device) if device is not None else default_device()
        self.precision = Precision.of(precision)

    def __repr__(self) -> str:
        return f"SingleDevice({str(self.device)!r}{_precision_repr(self.precision)})"

    def setup(self, model: nn.Module) -> nn.Module:
        _refuse_distributed(model)
        return model.to(self.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return uncompiled(model)

    def clone_model(self, model: nn.Module) -> nn.Module:
        return copy.deepcopy(model)

    def to_device(self, batch: Any) -> Any:
        return move_to(batch, self.device)

    def grad_sync(self, model: nn.Module, *, final: bool) -> contextlib.AbstractContextManager[Any]:
        return NO_CONTEXT

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.precision.autocast(self.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        return local_grad_norm(grads)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def local_view(self, tensor: torch.Tensor) -> torch.Tensor:
        return _placement.local_view(tensor)

    def is_distributed(self, tensor: torch.Tensor) -> bool:
        return _placement.is_distributed(tensor)

    @property
    def process_rank(self) -> int:
        return self.rank

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    # Lifetime, as the process-group strategies have it: one process has nothing to tear down.
    def __enter__(self) -> SingleDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release with one process (`DDP`/`FSDP` leave their process group)."""

    def abort(self) -> None:
        """Nothing to release with one process."""

    # Checkpoint layout: whole tensors, one process.
    checkpoint_sharded = False

    def to_host(
        self, tensors: Sequence[torch.Tensor], *, copy: bool
    ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        return host_copies(tensors, copy=copy)

    def save_shards(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        _dcp.save_shards(tensors, directory, group=None, local=True)

    def save_shards_async(
        self, parts: Mapping[Path, dict[str, torch.Tensor]], *, commit: Callable[[], None]
    ) -> Callable[[], None]:
        staged = {d: {n: t.detach().clone() for n, t in ts.items()} for d, ts in parts.items()}

        def write() -> None:  # one process: no DCP thread, no group
            for directory, tensors in staged.items():
                self.save_shards(tensors, directory)
            commit()

        return write

    def load_shards(self, directory: Path, targets: dict[str, torch.Tensor]) -> None:
        _dcp.load_shards(directory, targets, group=None, local=True)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return module.state_dict()

    def copy_whole(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def drop_gathered(self, model: nn.Module) -> None:
        pass  # whole parameters: nothing gathered


def _refuse_distributed(model: nn.Module) -> None:
    """SingleDevice counts items on this process only: a model whose backward already reduces
    gradients over ranks (wrapped in DDP, or sharded / split into DTensors) would have every
    rank read all rows and its gradient divided by the local count instead of the global one."""
    inner = uncompiled(model)
    # By name: torch.distributed.fsdp is not imported to ask (nor needed when never used).
    wrapper = next((c.__name__ for c in type(inner).__mro__ if c.__name__ in _WRAPPERS), None)
    if wrapper is not None:
        raise TypeError(
            f"the model is wrapped in {wrapper}, which averages gradients over ranks, but the "
            "strategy is SingleDevice (every rank would read all rows and divide by its own "
            "item count): pass the bare model with strategy=ft.strategies.DDP() or FSDP() "
            "(or ft.strategies.from_env()), which wraps it"
        )
    if any(_placement.is_distributed(p) for p in inner.parameters()):
        raise TypeError(
            "the model's parameters are distributed tensors (sharded by fully_shard or split "
            "by parallelize_module), but the strategy is SingleDevice: pass the bare model with "
            "strategy=ft.strategies.FSDP() or TP(), which shards it and reduces over the ranks"
        )


_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel")


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside a `torch.compile(model)` wrapper, whose parameter names would
    otherwise gain an `_orig_mod.` prefix (in the state, checkpoints and exports)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def bare_module(model: nn.Module) -> nn.Module:
    """The module inside `torch.compile`'s and DDP's wrappers (nested either way), whose
    parameter names the state uses: names taken from the wrapper gain `_orig_mod.` or
    `module.` and match no parameter of the state."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, DistributedDataParallel):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


# Attribute readers for C-level checks over many tensors (a Python loop is microseconds a step).
_TENSOR = frozenset({torch.Tensor})
_DEVICE = attrgetter("device")
_PLACE = attrgetter("device", "dtype")


def move_to(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a nested dict/list/tuple to `device` (non-blocking)."""
    if (
        type(batch) is dict
        and type(device) is torch.device  # (a str's __eq__ would answer NotImplemented: truthy)
        and _TENSOR.issuperset(map(type, batch.values()))
        and all(map(device.__eq__, map(_DEVICE, batch.values())))
    ):
        return dict(batch)  # already there: no tensor copied (a loss may pop keys: new dict)
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a NamedTuple takes fields
        return type(batch)(*(move_to(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def host_copies(
    tensors: Sequence[torch.Tensor], *, copy: bool
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """`Strategy.to_host` for whole tensors. With `copy`, CUDA tensors are copied into pinned
    host memory without blocking, and `wait` synchronizes on one event per device, recorded on
    the stream the copies were queued on (that device's current stream, not the current
    device's: a model on cuda:1 with cuda:0 current)."""
    devices: set[torch.device] = set()  # where non-blocking copies are in flight

    def host(t: torch.Tensor) -> torch.Tensor:
        if copy and t.is_cuda:
            devices.add(t.device)
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        return t.to("cpu", copy=copy).contiguous()

    with torch.no_grad():
        out = [host(t) for t in tensors]
    events = [torch.cuda.Event() for _ in devices]
    for event, device in zip(events, devices, strict=True):
        event.record(torch.cuda.current_stream(device))

    def wait() -> None:
        for event in events:
            event.synchronize()

    return out, wait


def local_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all `grads`, computed like `torch.nn.utils.clip_grad_norm_` (no host sync)."""
    if not grads:
        return torch.zeros(())
    # One device and dtype: no per-tensor move. The check maps a C attribute reader over the
    # tensors (a Python loop is microseconds a step), which dynamo cannot trace: compiled
    # steps (`clip_and_step(compile=True)`) take the comprehension.
    places = (
        {(g.device, g.dtype) for g in grads}
        if torch.compiler.is_compiling()
        else set(map(_PLACE, grads))
    )
    if len(places) == 1:
        norms = list(torch._foreach_norm(list(grads), 2.0))
    else:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        first = grads[0].device
        norms = [n.to(first) for group in groups.values() for n in torch._foreach_norm(group, 2.0)]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _precision_repr(precision: Precision) -> str:
    return "" if precision == Precision() else f", precision={precision!r}"
