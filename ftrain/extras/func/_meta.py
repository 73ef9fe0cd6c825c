"""Differentiable optimization: inner optimizer steps that autograd can differentiate through.

`ft.optim`'s optimizers update parameters in place with fused kernels, which autograd cannot
see through. The optimizers here are the same update rules written out of place, so the
adapted parameters stay functions of the initial ones (MAML) and of the learning rate
(hyperparameter gradients). Losses are evaluated with `torch.func.functional_call`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.func import functional_call

from ftrain.extras.func._common import _LossModule, check_int, check_model, check_number
from ftrain.losses import LossFn, default_loss

__all__ = [
    "InnerOptimizer",
    "functional_loss",
    "inner_adam",
    "inner_loop",
    "inner_sgd",
    "maml_loss",
]

Params = dict[str, torch.Tensor]
LR = float | torch.Tensor


class InnerOptimizer(NamedTuple):
    """`init(params) -> state`; `update(grads, state, params, *, lr, step) -> (params, state)`,
    out of place, so the result is differentiable in `params`, `grads` and `lr`."""

    init: Callable[[Params], Any]
    update: Callable[..., tuple[Params, Any]]


def inner_sgd(*, momentum: float = 0.0, weight_decay: float = 0.0) -> InnerOptimizer:
    """SGD as `torch.optim.SGD` computes it (L2 decay added to the gradient; the first step
    sets the momentum buffer to the gradient), out of place."""
    check_number("momentum", momentum)
    check_number("weight_decay", weight_decay)

    def init(params: Params) -> Params:
        return {}

    def update(grads: Params, state: Params, params: Params, *, lr: LR, step: int) -> Any:
        new_params, new_state = {}, {}
        for n, p in params.items():
            d = grads[n] + weight_decay * p if weight_decay else grads[n]
            if momentum:
                d = d if step == 0 else momentum * state[n] + d
                new_state[n] = d
            new_params[n] = p - lr * d
        return new_params, new_state

    return InnerOptimizer(init, update)


def inner_adam(
    *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
) -> InnerOptimizer:
    """AdamW (decoupled weight decay) as `torch.optim.AdamW` computes it, out of place."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    b1, b2 = betas
    check_number("betas[0]", b1, below=1)
    check_number("betas[1]", b2, below=1)
    check_number("eps", eps)
    check_number("weight_decay", weight_decay)

    def init(params: Params) -> tuple[Params, Params]:
        return {n: torch.zeros_like(p) for n, p in params.items()}, {
            n: torch.zeros_like(p) for n, p in params.items()
        }

    def update(grads: Params, state: Any, params: Params, *, lr: LR, step: int) -> Any:
        mu, nu = state
        t = step + 1
        new_params, new_mu, new_nu = {}, {}, {}
        for n, p in params.items():
            g = grads[n]
            new_mu[n] = b1 * mu[n] + (1 - b1) * g
            new_nu[n] = b2 * nu[n] + (1 - b2) * g * g
            denom = _sqrt(new_nu[n] / (1 - b2**t)) + eps
            p = p * (1 - lr * weight_decay) if weight_decay else p
            new_params[n] = p - lr * (new_mu[n] / (1 - b1**t)) / denom
        return new_params, (new_mu, new_nu)

    return InnerOptimizer(init, update)


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """`v.sqrt()` whose derivative at 0 is 0, not inf: an entry whose gradient is exactly zero
    (a dead ReLU unit, an unused embedding row) has `v = 0` and `dv/dg = 0`, and inf * 0 made
    the whole meta-gradient NaN (every MAML step skipped). 0 is the derivative of
    `sqrt(g^2) = |g|` that autograd gives `abs` at 0."""
    positive = v > 0
    return torch.where(positive, torch.where(positive, v, 1.0).sqrt(), 0.0)


def functional_loss(
    model: nn.Module, params: Mapping[str, torch.Tensor], batch: Any, loss_fn: LossFn | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`loss_fn(model, batch)` evaluated with `params` in place of the model's parameters."""
    lm = _LossModule(model, default_loss if loss_fn is None else loss_fn)
    loss, n = functional_call(lm, {f"model.{k}": v for k, v in params.items()}, (batch,))
    return loss, torch.as_tensor(n, device=loss.device)


def inner_loop(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    batches: Iterable[Any],
    loss_fn: LossFn | None = None,
    *,
    optimizer: InnerOptimizer,
    lr: LR,
    first_order: bool = False,
) -> Params:
    """Take one differentiable optimizer step per batch, starting from `params`.

    Each step minimises the batch's mean loss (`loss_sum / num_items`). The returned
    parameters are functions of `params` (and of `lr` when it is a tensor that requires grad):
    a loss on them backpropagates through every step (second-order MAML). `first_order=True`
    treats each step's gradient as a constant (first-order MAML: cheaper, no second
    derivatives).

    Args:
        model: the module whose parameters `params` stand in for (it is not changed).
        params: name -> starting tensor, e.g. `dict(state.params)`.
        batches: one batch per inner step.
        loss_fn: `(model, batch) -> (loss_sum, num_items)`; `ft.losses.default_loss` if None.
        optimizer: `inner_sgd()` or `inner_adam()`.
        lr: inner learning rate, a number or a tensor (for hyperparameter gradients).
        first_order: drop second derivatives.

    Returns:
        The adapted parameters, name -> tensor.

    Raises:
        TypeError, ValueError: for an `lr` that is neither a tensor nor a finite number >= 0.
    """
    if not isinstance(lr, torch.Tensor):  # a tensor lr is a hyperparameter being learned
        check_number("lr", lr)
    check_model(model)
    current = dict(params)
    state = optimizer.init(current)
    for step, batch in enumerate(batches):
        loss, n = functional_loss(model, current, batch, loss_fn)
        names = list(current)
        grads = torch.autograd.grad(
            loss / n, [current[k] for k in names], create_graph=not first_order
        )
        current, state = optimizer.update(
            dict(zip(names, grads, strict=True)), state, current, lr=lr, step=step
        )
    return current


def maml_loss(
    loss_fn: LossFn | None = None,
    *,
    inner_steps: int,
    inner_lr: float,
    optimizer: InnerOptimizer | None = None,
    first_order: bool = False,
) -> LossFn:
    """A loss for `accumulate_grads` whose batches are tasks: MAML (Finn et al. 2017).

    A task is a dict `{"support": batch, "query": batch}`. The model's parameters take
    `inner_steps` differentiable steps on the support batch; the returned loss is the query
    loss of the adapted parameters, `(loss_sum, num_items)`. Its gradient, which
    `accumulate_grads` computes with plain autograd, is the meta-gradient with respect to the
    initial parameters: the README loop then meta-trains the initialization. Under
    `torch.no_grad` (`evaluate`) the support steps still take gradients, and the loss is the
    query loss after adaptation.

    Args:
        loss_fn: the per-task loss; `ft.losses.default_loss` if None.
        inner_steps: adaptation steps on the support batch (>= 1).
        inner_lr: their learning rate.
        optimizer: `inner_sgd()` (the default) or `inner_adam()`.
        first_order: first-order MAML.
    """
    check_int("inner_steps", inner_steps, low=1)
    check_number("inner_lr", inner_lr)
    opt = inner_sgd() if optimizer is None else optimizer

    def fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        task = batch
        if not (isinstance(task, Mapping) and {"support", "query"} <= set(task)):
            raise KeyError("maml_loss needs tasks as dicts with 'support' and 'query' batches")
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # Adaptation needs gradients also where the caller has none (`evaluate` runs under
        # no_grad, and raised "does not require grad"): evaluated, the loss is the query loss
        # after adaptation, as in training; the query loss itself runs in the caller's mode.
        meta = torch.is_grad_enabled()
        with torch.enable_grad():
            adapted = inner_loop(
                model, params, [task["support"]] * inner_steps, loss_fn,
                optimizer=opt, lr=inner_lr, first_order=first_order or not meta,
            )  # fmt: skip
        return functional_loss(model, adapted, task["query"], loss_fn)

    return fn
