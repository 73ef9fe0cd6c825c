"""Fused linear cross-entropy GPU kernels behind `chunked_causal_lm_loss(kernel=...)`.

Liger-Kernel and Apple's Cut Cross-Entropy (CCE) are Triton kernels: CUDA only, optional,
imported when first asked for. Each adapter computes ftrain's convention, the *sum* of the
cross-entropy over labels that are not -100, with every extra of the library turned off
(Liger's z-loss, label smoothing, softcap; CCE's softcap and its gradient filtering, which
skips small softmax entries and is not exact), so loss and gradients equal `causal_lm_loss`'s
up to float rounding.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from ftrain.process_state import STATE

__all__ = ["KERNELS", "available", "pick", "run"]

# kernel -> (module to import, pip package)
KERNELS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "liger": ("liger_kernel.transformers.functional", "liger-kernel"),
        "cce": ("cut_cross_entropy", "cut-cross-entropy"),
    }
)


def _import_error(kernel: str) -> str | None:
    """None when the kernel's library imports, else why not (e.g. no triton on a CPU build);
    asked once per process (`process_state.STATE.kernel_import_errors`)."""
    errors = STATE.kernel_import_errors
    if kernel not in errors:
        errors[kernel] = _try_import(kernel)
    return errors[kernel]


def _try_import(kernel: str) -> str | None:
    try:
        importlib.import_module(KERNELS[kernel][0])
    except Exception as e:  # ImportError, or a library failing at import without a GPU stack
        return f"{type(e).__name__}: {e}"
    return None


def available(kernel: str) -> bool:
    """Whether `kernel`'s library imports in this environment."""
    return _import_error(kernel) is None


def require(kernel: str) -> None:
    """Raise ImportError naming the package when an explicitly chosen kernel cannot import."""
    err = _import_error(kernel)
    if err is not None:
        raise ImportError(
            f"kernel={kernel!r} needs the {KERNELS[kernel][1]} package, which does not import "
            f"here ({err}); pip install 'ftrain[kernels]' on a CUDA machine, or use "
            f"kernel='auto' (falls back to the chunked torch loss) or kernel='torch'"
        )


def pick(kernel: str, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The kernel that runs: `kernel` itself when explicit (checked), else auto's choice.

    "auto" takes Liger, then CCE, when installed and the head is on CUDA (CCE only without a
    bias and in half precision), else "torch". An explicit kernel that cannot run raises.
    """
    if kernel == "auto":
        if weight.device.type != "cuda":
            return "torch"
        if available("liger"):
            return "liger"
        return "cce" if _cce_fits(h, weight, bias) and available("cce") else "torch"
    if kernel != "torch":
        require(kernel)
        if kernel == "cce":
            _check_cce(h, weight, bias)
        if weight.device.type != "cuda":
            raise ValueError(
                f"kernel={kernel!r} runs on CUDA tensors, but the output head is on "
                f"{weight.device}; use kernel='auto' or 'torch' there"
            )
    return kernel


def _cce_fits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # CCE's backward asserts half-precision hidden states and accumulates the weight gradient
    # in their dtype; it has no bias term.
    return bias is None and _compute_dtype(h, weight) in (torch.float16, torch.bfloat16)


def _check_cce(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if bias is not None:
        raise ValueError("kernel='cce' has no bias term, but the output head has one; use "
                         "kernel='liger' or 'torch'")  # fmt: skip
    dtype = _compute_dtype(h, weight)
    if not _cce_fits(h, weight, None):
        raise ValueError(
            f"kernel='cce' computes gradients in bfloat16/float16 only (its backward asserts "
            f"it), but this loss would run in {dtype}; train with precision='bf16' (autocast), "
            f"or use kernel='liger' or 'torch'"
        )


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # What F.linear would compute in: the autocast dtype when autocast is on, as in the torch path.
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _liger(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor
) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    # Every extra off; float32 gradient accumulators for the weight (its default is the
    # weight's dtype: bf16 sums over tokens drift).
    out = liger_fused_linear_cross_entropy(
        h, w, y, bias=b, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
        reduction="sum", softcap=None, return_z_loss=False, accum_dtype=torch.float32,
    )  # fmt: skip
    return out.float()


def _cce(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy

    # filter_eps=None: CCE's default ("high") drops gradient entries whose softmax is below
    # eps / 32 of the dtype, an approximation; None computes every entry.
    out = linear_cross_entropy(
        h, w, y, ignore_index=-100, softcap=None, reduction="sum", shift=False,
        filter_eps=None, impl="cce",
    )  # fmt: skip
    return out.float()


_RUN: Mapping[str, Callable[..., torch.Tensor]] = MappingProxyType({"liger": _liger, "cce": _cce})


def run(
    kernel: str,
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
) -> torch.Tensor:
    """Summed cross-entropy of `h @ weight.T (+ bias)` against `labels` with `kernel`.

    Inputs are cast to the dtype `F.linear` would compute in (autocast's, or the weight's);
    the casts are differentiable, so gradients reach float32 master weights as float32.
    """
    dtype = _compute_dtype(h, weight)
    b = None if bias is None else bias.to(dtype)
    return _RUN[kernel](h.to(dtype).contiguous(), weight.to(dtype), b, labels.contiguous())
