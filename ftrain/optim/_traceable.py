"""Traceable twins of the fused optimizer updates, for `clip_and_step(..., compile=True)`.

PyTorch's fused kernels (`torch._fused_adamw_`, ...) have no meta kernel, so `torch.compile`
cannot trace them. These twins write the same update as plain tensor ops, which inductor fuses
with the clipping into a few kernels. They take the learning rate as a 0-dim tensor, so a
schedule does not recompile, and skip on the device with `torch.where` where the fused kernels
take `found_inf`. They mutate the same state tensors as the fused update, so checkpoints are
the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch

from ftrain.process_state import STATE

Params = Mapping[str, torch.Tensor]
Split = list[tuple[bool, list[str]]]
GroupsFn = Callable[[Params, Params], Split]


class TraceableUpdate(Protocol):
    """`update(grads, state, params, split, *, lr, first, skip)`: in place, returns nothing.

    `split` is the optimizer's `(decay, names)` grouping, computed outside the graph (its cache
    is Python state that a trace would guard on); `lr` is a 0-dim tensor; `first` is True for
    the first update (`step == 0`); `skip` is a bool tensor, True to leave parameters and
    state as they are, or None.
    """

    def __call__(
        self,
        grads: Params,
        state: Any,
        params: Params,
        split: Split,
        *,
        lr: torch.Tensor,
        first: bool,
        skip: torch.Tensor | None,
    ) -> None: ...


class Twin(NamedTuple):
    """The traceable form of an optimizer update and the grouping it runs over."""

    groups: GroupsFn
    update: TraceableUpdate


def register(update: Callable[..., Any], twin: Twin) -> None:
    """Record `twin` as the traceable form of the optimizer update `update`."""
    STATE.optimizer_twins[update] = twin


def twin_of(update: Callable[..., Any]) -> Twin | None:
    """The traceable twin of an optimizer's `update`, or None when it has none.

    A twin (`groups`, `update`) writes the same update as plain tensor ops, which
    `torch.compile` can trace (the fused kernels cannot); `clip_and_step(compile=True)` runs
    it. `ft.optim.adamw`, `adam` and `sgd` have one.

    Example:
        >>> import ftrain as ft
        >>> ft.optim.twin_of(ft.optim.adamw().update) is not None
        True
        >>> ft.optim.twin_of(ft.optim.muon().update) is None
        True
    """
    return STATE.optimizer_twins.get(update)


def _keep(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return new if skip is None else torch.where(skip, old, new)


def _grad(g: torch.Tensor, p: torch.Tensor, l2: float, maximize: bool) -> torch.Tensor:
    """The gradient the update uses: negated to maximize, plus L2 weight decay `l2 * p`."""
    g = -g if maximize else g
    return g + l2 * p if l2 else g


def adam_twin(
    *,
    decoupled: bool,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    groups: GroupsFn,
    maximize: bool,
) -> Twin:
    """The update of `_fused_adam(w)_` (ATen's FusedAdamKernel) as traceable tensor ops, with
    each parameter's own count (`AdamState.counts`)."""
    b1, b2 = betas

    def update(
        grads: Params,
        state: Any,
        params: Params,
        split: Split,
        *,
        lr: torch.Tensor,
        first: bool,
        skip: torch.Tensor | None,
    ) -> None:
        keep = 1.0 if skip is None else 1.0 - skip.double()  # 0 where the step is skipped
        for decay, names in split:
            wd = weight_decay if decay else 0.0
            for n in names:
                count = state.counts[n].double() + 1  # the post-increment count, as the kernel
                step_size = lr / (1 - b1**count)
                bc2_sqrt = (1 - b2**count).sqrt()
                p, m, v = params[n], state.mu[n], state.nu[n]
                g = _grad(grads[n], p, 0.0 if decoupled else wd, maximize)
                m_new = m * b1 + g * (1 - b1)
                v_new = v * b2 + (g * g) * (1 - b2)
                p_new = p * (1 - lr * wd) if wd and decoupled else p
                p_new = p_new - step_size * m_new / (v_new.sqrt() / bc2_sqrt + eps)
                m.copy_(_keep(skip, m, m_new))
                v.copy_(_keep(skip, v, v_new))
                p.copy_(_keep(skip, p, p_new))
                state.counts[n].add_(keep)
        state.steps.add_(keep)

    return Twin(groups, update)


def sgd_twin(
    *,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    groups: GroupsFn,
    maximize: bool,
) -> Twin:
    """The update of `_fused_sgd_` as traceable tensor ops (first step: buffer = gradient).

    With dampening, each parameter's first update is its own (`DampedSGDState.started`, read
    on the device, as the eager update does); without, `first` (the buffer then starts from
    zero, where `momentum * 0 + g` is the gradient too).
    """
    damped = bool(momentum) and dampening != 0

    def update(
        grads: Params,
        state: Any,
        params: Params,
        split: Split,
        *,
        lr: torch.Tensor,
        first: bool,
        skip: torch.Tensor | None,
    ) -> None:
        for decay, names in split:
            wd = weight_decay if decay else 0.0
            for n in names:
                p = params[n]
                g = _grad(grads[n], p, wd, maximize)
                if damped:
                    buf, started = state.momentum[n], state.started[n]
                    b_new = torch.where(started, buf * momentum + g * (1 - dampening), g)
                    buf.copy_(_keep(skip, buf, b_new))
                    started.copy_(torch.ones_like(started) if skip is None else started | ~skip)
                    g = b_new  # (no Nesterov with dampening)
                elif momentum:
                    buf = state.momentum[n]
                    b_new = g if first else buf * momentum + g * (1 - dampening)
                    buf.copy_(_keep(skip, buf, b_new))
                    g = g + momentum * b_new if nesterov else b_new
                p.copy_(_keep(skip, p, p - lr * g))

    return Twin(groups, update)
