"""The tensor work of `clip_and_step` (norm, skip, clip, update) as one `torch.compile`d call.

Used by `clip_and_step(..., compile=True)`. One compiled function per optimizer (its traceable
twin, `ft.optim.twin_of`); the learning rate and `max_norm` enter as 0-dim tensors (the lr
refilled each step, `max_norm` when it changes), so a schedule of either does not recompile.
What may recompile: the first step of SGD with momentum and no dampening (its buffer starts
from the gradient; with dampening each buffer's start is a device flag), `max_norm` None or
not, `skip_nonfinite`, `stats` given or not, or another set of parameters with gradients. Past
dynamo's recompile limit of such variants of one optimizer, the step raises (`compiled_update`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ftrain.optim import TraceableUpdate, twin_of
from ftrain.process_state import STATE

Tensors = Mapping[str, torch.Tensor]


def skip_flag(overflow: torch.Tensor | None, num_items: torch.Tensor | None) -> torch.Tensor | None:
    """True where the update must be skipped on the device: a non-finite norm (when checked) or
    a step that counted no item (nothing was learned, so no weight decay nor moment decay
    either); None when nothing is checked. A bool tensor: the optimizers take `.float()`."""
    empty = None if num_items is None else num_items == 0
    if overflow is None:
        return empty
    return overflow if empty is None else overflow | empty


def _step_math(
    grad_norm: Callable[[Sequence[torch.Tensor]], torch.Tensor],
    update: TraceableUpdate,
    grads: Tensors,
    opt_state: Any,
    params: Tensors,
    split: list[tuple[bool, list[str]]],  # the optimizer's (decay, names) grouping
    lr: torch.Tensor,
    max_norm: torch.Tensor | None,
    check_finite: bool,
    num_items: torch.Tensor | None,
    first: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    g = list(grads.values())
    norm = grad_norm(g)
    overflow = ~torch.isfinite(norm) if check_finite else None
    skip = skip_flag(overflow, num_items)
    if max_norm is not None and g:
        torch._foreach_mul_(g, torch.clamp(max_norm.to(norm.dtype) / (norm + 1e-6), max=1.0))
    update(grads, opt_state, params, split, lr=lr, first=first, skip=skip)
    return norm, overflow, skip


class _Compiled:
    """The compiled step of one optimizer and its persistent learning-rate tensor."""

    def __init__(self) -> None:
        # Dynamo caches graphs on the code object, with a recompile limit (8) per code object:
        # a copy per optimizer keeps a sweep over many optimizers from hitting it.
        own = types.FunctionType(_step_math.__code__.replace(), _step_math.__globals__)
        # fullgraph: a graph break would silently run part of the step eagerly; fail instead.
        # No size asserts: dynamo's guards already check every input's sizes and strides, and
        # the asserts cost ~35 us per call on a 16-parameter model (a fifth of the call).
        self.fn = torch.compile(own, fullgraph=True, dynamic=False, options={"size_asserts": False})
        self.lr: torch.Tensor | None = None
        # max_norm as a tensor too: a Python float is a constant of the graph, and a schedule
        # of it recompiled at each new value until dynamo's limit failed the step. Refilled
        # only when it changes (the common constant max_norm costs no op).
        self.max_norm: torch.Tensor | None = None
        self.max_norm_value: float | None = None

    def lr_tensor(self, lr: float, device: torch.device) -> torch.Tensor:
        if self.lr is None or self.lr.device != device:
            self.lr = torch.zeros((), dtype=torch.float64, device=device)
        return self.lr.fill_(lr)  # a kernel with a scalar argument: no copy, no sync

    def max_norm_tensor(self, max_norm: float | None, device: torch.device) -> torch.Tensor | None:
        if max_norm is None:
            return None
        if self.max_norm is None or self.max_norm.device != device:
            self.max_norm = torch.zeros((), dtype=torch.float64, device=device)
            self.max_norm_value = None
        if self.max_norm_value != max_norm:
            self.max_norm.fill_(max_norm)
            self.max_norm_value = max_norm
        return self.max_norm


def compiled_update(
    state: Any,
    grads: Tensors,
    *,
    lr: float,
    max_norm: float | None,
    check_finite: bool,
    num_items: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the norm, skip, clip and update of `state` in one compiled call (in place).

    Returns `(norm, overflow, skip)` like the eager path; the optimizer state is updated in
    place (the same tensors as the eager update), so `state.opt_state` stays what it is.
    """
    update = state.optimizer.update
    twin = twin_of(update)
    if twin is None:
        raise ValueError(
            "clip_and_step(compile=True) supports the optimizers ft.optim.adamw, adam and sgd; "
            f"state.optimizer is another one ({getattr(update, '__qualname__', update)!r}): "
            "drop compile=True or use one of those"
        )
    strategy = state.strategy
    if strategy.checkpoint_sharded:
        raise ValueError(
            f"clip_and_step(compile=True) does not support a strategy with sharded parameters "
            f"({type(strategy).__name__}); drop compile=True"
        )
    entry = STATE.compiled_steps.get(update)
    if entry is None:
        entry = STATE.compiled_steps[update] = _Compiled()
    params = state.params
    device = next(iter(params.values())).device
    lr_t = entry.lr_tensor(lr, device)
    try:
        return entry.fn(
            strategy.grad_norm,
            twin.update,
            dict(grads),
            state.opt_state,
            dict(params),
            twin.groups(grads, params),
            lr_t,
            entry.max_norm_tensor(max_norm, device),
            check_finite,
            num_items,
            state.step == 0,
        )
    # (Looked up only when something is raised: torch._dynamo is imported by torch.compile, not
    # by `import ftrain`.) Raised while compiling: nothing was changed yet.
    except Exception as e:
        if not _past_recompile_limit(e):
            raise
        config = torch._dynamo.config
        limit = getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", "")
        raise ValueError(
            "clip_and_step(compile=True) compiled more variants of this optimizer's step than "
            f"torch._dynamo's recompile limit ({limit}) allows: each set of parameters with "
            "gradients, max_norm None or not, skip_nonfinite and stats given or not compiles "
            "its own (TORCH_LOGS=recompiles says which changed); drop compile=True, or raise "
            "the limit"
        ) from e


def _past_recompile_limit(e: Exception) -> bool:
    """Whether `e` is dynamo's recompile-limit failure (its name differs across torch
    releases: FailOnRecompileLimitHit, FailOnCacheLimitHit before)."""
    exc = getattr(getattr(torch, "_dynamo", None), "exc", None)
    kinds = tuple(
        k
        for k in (getattr(exc, n, None) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit"))
        if isinstance(k, type)
    )
    return bool(kinds) and isinstance(e, kinds)
