"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for 2-D hidden weights.

The arithmetic is `torch.optim.Muon`'s (torch 2.13, itself Keller Jordan's reference): the same
operations in the same order and dtypes, so the two agree step for step. Give Muon the hidden
matrices and AdamW the rest through `ft.optim.partition`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ftrain.optim._base import Grads, Optimizer, Params, _check, _describes, _flag, _number
from ftrain.strategies import gather_whole, local_part, local_view

__all__ = ["MuonState", "muon"]

# Keller Jordan's quintic coefficients (https://kellerjordan.github.io/posts/muon/), as torch.
_NS = (3.4445, -4.7750, 2.0315)


class MuonState(NamedTuple):
    """State of `muon`: the momentum buffer of each matrix, keyed by parameter name."""

    momentum: dict[str, torch.Tensor]


def newton_schulz(
    g: torch.Tensor, *, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Approximately orthogonalise the matrix `g` (bfloat16 result), as torch's Muon does."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _lr_ratio(shape: torch.Size, adjust_lr: str) -> float:
    rows, cols = shape[0], shape[1]
    if adjust_lr == "original":  # Keller Jordan: same update RMS for tall matrices
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))  # Moonshot (arXiv:2502.16982): AdamW's update RMS


def muon(
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.1,
    ns_coefficients: tuple[float, float, float] = _NS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr: str = "original",
) -> Optimizer:
    """Muon for 2-D parameters; equals `torch.optim.Muon` step for step.

    Per matrix W with gradient g: `B = lerp(B, g, 1 - momentum)`; the update direction is
    `lerp(g, B, momentum)` with `nesterov`, else `B`; `O = NS(direction)` (Newton-Schulz in
    bfloat16, `ns_steps` iterations); `W *= 1 - lr * weight_decay`; `W -= lr * r * O`, where
    `r = sqrt(max(1, rows / cols))` (`adjust_lr="original"`) or `0.2 * sqrt(max(rows, cols))`
    (`"match_rms_adamw"`). Use it inside `ft.optim.partition` for hidden matrices, with AdamW for
    embeddings, the head, norms and biases.

    Sharded (FSDP2) matrices are gathered one at a time for the iteration (an all-gather per
    matrix, done redundantly on every rank; each keeps its own shard of the result), so the
    update equals the unsharded one. A skipped step (`found_inf`) leaves matrix and momentum
    unchanged, without a host sync.

    Args:
        momentum: momentum factor in [0, 1).
        nesterov: Nesterov-style lookahead.
        weight_decay: decoupled decay, times the lr (not the adjusted lr), as in torch.
        ns_coefficients: (a, b, c) of the quintic iteration.
        ns_steps: iterations, 1 to 99.
        eps: floor of the norm the gradient is divided by.
        adjust_lr: "original" or "match_rms_adamw".

    Raises:
        ValueError: for a bad hyperparameter, or at `init` for a parameter that is not 2-D.
    """
    _number("momentum", momentum, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    _number("weight_decay", weight_decay, lambda v: v >= 0.0, ">= 0")
    ok_steps = type(ns_steps) is int and 0 < ns_steps < 100
    _check("ns_steps", ns_steps, ok_steps, "an int in [1, 99]")
    _number("eps", eps, lambda v: v > 0, "> 0")
    _flag("nesterov", nesterov)
    if adjust_lr not in ("original", "match_rms_adamw"):
        raise ValueError(f"adjust_lr must be 'original' or 'match_rms_adamw', got {adjust_lr!r}")
    if not (isinstance(ns_coefficients, (tuple, list)) and len(ns_coefficients) == 3):
        raise ValueError(f"ns_coefficients must be (a, b, c), got {ns_coefficients!r}")
    for name, c in zip("abc", ns_coefficients, strict=True):
        _number(f"ns_coefficients ({name})", c, lambda v: True)

    def init(params: Params) -> MuonState:
        stacked = [n for n, p in params.items() if getattr(p, "stacked_members", False) is True]
        if stacked:  # a (K, d) stack of biases is 2-D: Newton-Schulz would mix the members
            raise ValueError(
                f"muon got parameters of an ft.func.Ensemble {stacked[:3]} (dim 0 is the "
                "member): it would orthogonalise across members; give each member its own "
                "optimizer, ft.func.sweep([ft.optim.muon(), ...]) (in a partition per member)"
            )
        bad = {n: tuple(p.shape) for n, p in params.items() if p.dim() != 2}
        if bad:
            raise ValueError(
                f"muon updates 2-D matrices only, got {bad}; put these parameters in an "
                "AdamW group with ft.optim.partition"
            )
        return MuonState({n: torch.zeros_like(p) for n, p in params.items()})

    def update(
        grads: Grads,
        state: MuonState,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> MuonState:
        keep = None if found_inf is None else found_inf.bool()
        with torch.no_grad():
            for name, g in grads.items():
                _step_one(params[name], g, state.momentum[name], lr, keep)
        return state

    _describes(update, lambda names: {
        "kind": "muon", "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay,
        "ns_coefficients": list(ns_coefficients), "ns_steps": ns_steps, "eps": eps,
        "adjust_lr": adjust_lr,
    })  # fmt: skip

    def _step_one(
        p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float, keep: torch.Tensor | None
    ) -> None:
        # Sharded matrices: the iteration needs the whole one, so gather it, keep our part.
        p_l, g_l, buf_l = local_view(p), local_view(g), local_view(buf)
        new_buf = buf_l.lerp(g_l, 1 - momentum)
        direction = g_l.lerp(new_buf, momentum) if nesterov else new_buf
        whole = gather_whole(direction, like=p)
        o = newton_schulz(whole, coefficients=ns_coefficients, steps=ns_steps, eps=eps)
        o = local_part(o, like=p)
        ratio = _lr_ratio(p.shape, adjust_lr)
        new_p = p_l.mul(1 - lr * weight_decay).add_(o, alpha=-lr * ratio)
        if keep is not None:  # skip on the device: keep the old values where found_inf
            new_buf = torch.where(keep, buf_l, new_buf)
            new_p = torch.where(keep, p_l, new_p)
        buf_l.copy_(new_buf)
        p_l.copy_(new_p)

    return Optimizer(init, update)
