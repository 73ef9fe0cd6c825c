"""Probe: ftrain's Liger / CCE adapters (`ftrain.extras._lce_kernels.run`) against the plain summed
cross-entropy, on the CPU through Triton's interpreter (no GPU needed).

The kernels are Triton code; `TRITON_INTERPRET=1` runs them on CPU tensors (slowly), which is
enough to check that the adapters call each library with ftrain's convention (sum over labels
that are not -100, no z-loss, no softcap, no gradient filtering). The real-speed check on a GPU
is tests/test_kernels_gpu.py. Install the three wheels somewhere private, e.g.

    pip download --no-deps triton liger-kernel==0.8.5 cut-cross-entropy==25.1.1 -d w
    for f in w/*.whl; do unzip -q -o $f -d site; done
    TRITON_INTERPRET=1 PYTHONPATH=.:site python bench/probe_lce_kernels.py
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ftrain.extras import _lce_kernels


def _error(got: torch.Tensor | None, want: torch.Tensor) -> float:
    if got is None:
        return float("nan")
    scale = want.norm()
    return ((got - want).norm() / scale if scale > 0 else (got - want).abs().max()).item()


def _case(kernel: str, bias: bool, all_ignored: bool = False, bf16: bool = False) -> str:
    g = torch.Generator().manual_seed(0)
    n, hdim, vocab = 24, 16, 61
    h = torch.randn(n, hdim, generator=g, requires_grad=True)
    w = torch.randn(vocab, hdim, generator=g, requires_grad=True)
    b = torch.randn(vocab, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    y[[0, 3, 4, 17]] = -100
    if all_ignored:
        y[:] = -100
    leaves = [t for t in (h, w, b) if t is not None]
    # CCE computes gradients in half precision only: bf16 autocast for it, for both losses.
    half = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 or kernel == "cce")
    with half:
        logits = F.linear(h, w, b).float()
        want = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    want_g = torch.autograd.grad(want * 0.5, leaves, allow_unused=True)
    with half:
        got = _lce_kernels.run(kernel, h, w, b, y)
    got_g = torch.autograd.grad(got * 0.5, leaves, allow_unused=True)
    # Relative L2 error of each gradient (absolute where the gradient is zero): bf16 rounding
    # makes an absolute error scale-dependent.
    gd = max(_error(a, e) for a, e in zip(got_g, want_g, strict=True))
    return f"loss {got.item():.6f} vs plain {want.item():.6f}; gradient error {gd:.2e}"


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (Triton's CPU interpreter)")
    cases = [
        ("liger", False, False, False), ("liger", True, False, False),
        ("liger", False, True, False), ("liger", False, False, True),
        ("cce", False, False, True), ("cce", False, True, True),
    ]  # fmt: skip
    for kernel, bias, none, bf16 in cases:
        what = f"{kernel}{' + bias' if bias else ''}{', every label ignored' if none else ''}"
        what += ", bf16 autocast" if bf16 else ", float32"
        try:
            print(f"[{what}] {_case(kernel, bias, none, bf16)}", flush=True)
        except Exception as e:  # a probe reports every failure
            print(f"[{what}] FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
