"""Throughput and memory figures: HF's FLOPs-per-token estimate, MFU, peak memory."""

from __future__ import annotations

import math
import resource
import sys

import torch
from torch import nn

__all__ = ["flops_per_token", "peak_memory_mb"]


def flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token by HF's estimate: 6 * the non-embedding parameters.

    (2 for the forward multiply-add, 4 for the backward; attention's sequence-length term and
    the cheaper backward of frozen weights are ignored, as `PreTrainedModel.floating_point_ops`
    does.)

    Example:
        >>> import torch, ftrain as ft
        >>> m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
        >>> ft.logging.flops_per_token(m)
        60.0
    """
    count = getattr(model, "num_parameters", None)
    if callable(count):
        return 6.0 * count(exclude_embeddings=True)
    embedding = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    return 6.0 * sum(p.numel() for p in model.parameters() if id(p) not in embedding)


def peak_memory_mb(device: torch.device | str = "cpu") -> float:
    """Peak memory so far in MiB: the device's max allocated (CUDA, XPU, any device whose
    `torch.get_device_module` has `max_memory_allocated`), the process's peak RSS on CPU, and
    NaN on a device that keeps no peak (MPS): its memory is not the process's RSS, which was
    reported for every device but CUDA."""
    device = torch.device(device)
    if device.type == "cpu":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes.
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
    try:
        module = torch.get_device_module(device.type)
    except RuntimeError:  # a device type torch has no module for
        return math.nan
    max_allocated = getattr(module, "max_memory_allocated", None)
    if not callable(max_allocated):
        return math.nan
    return max_allocated(device) / 2**20
