"""Small optax-style gradient transformations and HF's weight-decay rule."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ftrain.optim._base import (
    Grads,
    Mask,
    Params,
    Settings,
    Transform,
    _describes,
    _masker,
    _no_decay,
    _number,
    check_mask_names,
)
from ftrain.strategies import bare_module, local_grad_norm

__all__ = ["add_decayed_weights", "clip", "clip_by_global_norm", "decay_mask", "scale"]


def _stateless(
    fn: Callable[[Grads, Params], Grads],
    settings: Callable[[list[str]], Settings],
    init: Callable[[Params], Any] = lambda params: (),
) -> Transform:
    """A transform without state (`init` may check the parameters); `settings` describes it
    (`ft.optim.describe`)."""

    def update(grads: Grads, state: Any, params: Params) -> tuple[Grads, Any]:
        return fn(grads, params), state

    _describes(update, settings)
    return Transform(init, update)


def scale(factor: float) -> Transform:
    """Multiply every gradient by `factor` (a finite number: a NaN would reach the parameters
    after the step's non-finite check)."""
    _number("factor", factor, lambda v: True)

    def apply(grads: Grads, params: Params) -> Grads:
        torch._foreach_mul_(list(grads.values()), float(factor))
        return grads

    return _stateless(apply, lambda names: {"kind": "scale", "factor": factor})


def clip(max_abs: float) -> Transform:
    """Clamp every gradient element to `[-max_abs, max_abs]`."""
    _number("max_abs", max_abs, lambda v: v > 0, "> 0")

    def apply(grads: Grads, params: Params) -> Grads:
        for g in grads.values():
            g.clamp_(-max_abs, max_abs)
        return grads

    return _stateless(apply, lambda names: {"kind": "clip", "max_abs": max_abs})


def clip_by_global_norm(max_norm: float) -> Transform:
    """Scale gradients so that their global L2 norm is at most `max_norm` (single process).

    `clip_and_step(max_norm=...)` does the same across shards and ranks and reports the norm;
    this transform is for optimizer recipes that clip inside a chain. The parameters of an
    `ft.func.Ensemble` (dim 0 is the member) are clipped member by member, each by its own
    norm, as K separate runs clip.
    """
    _number("max_norm", max_norm, lambda v: v > 0, "> 0")

    def apply(grads: Grads, params: Params) -> Grads:
        gs = list(grads.values())
        if gs and all(_stacked(params[n]) for n in grads):
            # One norm over all members would clip each by the others' gradients.
            norms = [g.reshape(g.shape[0], -1).norm(dim=1) for g in gs]
            coef = torch.clamp(max_norm / (torch.stack(norms, 1).norm(dim=1) + 1e-6), max=1.0)
            for g in gs:
                g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
            return grads
        coef = torch.clamp(max_norm / (local_grad_norm(gs) + 1e-6), max=1.0)
        torch._foreach_mul_(gs, coef)
        return grads

    return _stateless(apply, lambda names: {"kind": "clip_by_global_norm", "max_norm": max_norm})


def _stacked(param: torch.Tensor) -> bool:
    """Whether `param` stacks the members of an `ft.func.Ensemble` on dim 0."""
    return getattr(param, "stacked_members", False) is True  # its class's, or its own (sharded)


def add_decayed_weights(weight_decay: float, *, mask: Mask = None) -> Transform:
    """Add `weight_decay * param` to each gradient (L2 regularisation), for names in `mask`
    (parameter names or a predicate on names, as `adamw`'s; all when None)."""
    _number("weight_decay", weight_decay, lambda v: v >= 0.0, ">= 0")
    decays = _masker(mask)  # a string would match its substrings: refused

    def apply(grads: Grads, params: Params) -> Grads:
        names = [n for n in grads if decays(n)]
        torch._foreach_add_(
            [grads[n] for n in names], [params[n] for n in names], alpha=weight_decay
        )
        return grads

    def init(params: Params) -> tuple[()]:
        check_mask_names(mask, params, weight_decay)
        return ()

    return _stateless(apply, lambda names: {
        "kind": "add_decayed_weights", "weight_decay": weight_decay,
        **_no_decay(decays, names, weight_decay),
    }, init)  # fmt: skip


# HF Trainer's rule (Trainer.get_decay_parameter_names): no decay inside LayerNorm modules, nor
# for names that look like biases or norm weights.
_NO_DECAY = tuple(
    re.compile(p)
    for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)


def decay_mask(model: nn.Module) -> frozenset[str]:
    """Names of the parameters that get weight decay under HF Trainer's rule.

    Biases, parameters of `nn.LayerNorm` modules and parameters whose name contains a norm
    pattern (`layernorm`, `rmsnorm`, `.norm.`, `_norm`) are excluded.

    Example:
        >>> import torch, ftrain as ft
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> sorted(ft.optim.decay_mask(m))
        ['0.weight']
    """
    model = bare_module(model)
    names = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            continue
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if not any(p.search(full.lower()) for p in _NO_DECAY):
                names.add(full)
    return frozenset(names)
