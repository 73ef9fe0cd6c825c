"""Placement questions about one tensor, answered where placement is known: in `ft.strategies`.

Code with a strategy at hand asks it (`Strategy.local_view`, `Strategy.is_distributed`). Code
without one (an optimizer's `update` gets tensors, a loss gets a model and a batch) asks these
functions, so that nothing outside `ft.strategies` tests what kind of tensor it holds. A tensor
is *distributed* when it is a DTensor laid out over a device mesh (sharded by FSDP, split or
replicated by TP); every other tensor is whole and plain, and each function leaves it as it is.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gather_whole", "is_distributed", "local_part", "local_view", "local_views"]


def is_distributed(tensor: object) -> bool:
    """Whether `tensor` is laid out over several processes (a DTensor, sharded or replicated)
    rather than a whole plain tensor.

    Example:
        >>> import torch, ftrain as ft
        >>> ft.strategies.is_distributed(torch.ones(2))
        False
    """
    return hasattr(tensor, "device_mesh")


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of `tensor`, sharing its storage (in-place changes reach `tensor`);
    `tensor` itself when it is not distributed.

    Fused kernels run on these parts: not every kernel has a DTensor rule, and plain tensors
    skip DTensor dispatch.

    Example:
        >>> import torch, ftrain as ft
        >>> t = torch.ones(2)
        >>> ft.strategies.local_view(t) is t
        True
    """
    if type(tensor) in _PLAIN:
        return tensor  # no attribute lookup for a plain tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`[local_view(t) for t in tensors]`; the list itself when every tensor is plain (one
    type check each: optimizers ask for all their tensors every step, issue 30)."""
    if _PLAIN.issuperset(map(type, tensors)):
        return tensors
    return [local_view(t) for t in tensors]


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})  # the types that are never distributed


def gather_whole(local: torch.Tensor, *, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `local` is this process's part, laid out like `like`.

    Collective when `like` is distributed (an all-gather: every process of its mesh calls it);
    `local` itself otherwise.

    Args:
        local: this process's part, shaped like `local_view(like)`.
        like: the tensor whose layout `local` has (a parameter, its gradient, a state buffer).

    Returns:
        A plain tensor of `like.shape`, the same on every process.
    """
    if not is_distributed(like):
        return local
    from torch.distributed.tensor import DTensor

    dt: Any = like
    return DTensor.from_local(
        local, dt.device_mesh, dt.placements, shape=dt.shape, stride=dt.stride()
    ).full_tensor()


def local_part(whole: torch.Tensor, *, like: torch.Tensor) -> torch.Tensor:
    """This process's part of `whole` (held by every process), laid out like `like`.

    No communication: each process takes its own part. `whole` itself when `like` is not
    distributed. The inverse of `gather_whole`.

    Args:
        whole: a plain tensor of `like.shape`, equal on every process.
        like: the tensor whose layout the part should have.

    Returns:
        A plain tensor shaped like `local_view(like)`.
    """
    if not is_distributed(like):
        return whole
    from torch.distributed.tensor import distribute_tensor

    dt: Any = like
    return distribute_tensor(whole, dt.device_mesh, dt.placements, src_data_rank=None).to_local()
