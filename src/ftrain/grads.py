"""accumulate_grads: forward/backward over micro-batches, gradients of one big batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ftrain.data import weighted
from ftrain.losses import LossFn, default_loss
from ftrain.state import TrainState
from ftrain.strategies._base import Strategy

__all__ = ["Stats", "accumulate_grads", "dropout_seed"]

_MASK64 = (1 << 64) - 1


class Stats(NamedTuple):
    """What `accumulate_grads` measured, global over ranks.

    `loss` (mean per item), `num_items` (items the loss counts, e.g. label tokens),
    `num_tokens` (non-padding input tokens) and `num_samples` are device tensors; reading them
    is a host sync. `num_micro` is this step's micro-batch count, a host int. `position` is
    the stream position after these micro-batches (JSON; None for map-style data), which
    `clip_and_step` keeps in the state.
    """

    loss: torch.Tensor
    num_items: torch.Tensor
    num_tokens: torch.Tensor
    num_samples: torch.Tensor
    num_micro: int
    position: str | None = None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def dropout_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """The RNG seed for one micro-batch's forward/backward: a pure function of its position.

    Because dropout masks depend only on `(seed, step, micro, rank)`, a resumed run draws the
    same masks as the uninterrupted one without saving any RNG state.
    """
    h = 0
    for part in (seed, step, micro, rank):
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1  # torch.manual_seed wants a non-negative int64


def _generators(device: torch.device) -> list[torch.Generator]:
    """The default generators that dropout on `device` draws from (the CPU one always)."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index or torch.cuda.current_device()])
    return gens


@contextlib.contextmanager
def _rng_scope(gens: list[torch.Generator]) -> Iterator[None]:
    # Restore the generators afterwards, so the caller's random stream is untouched. (Seeding
    # the generators directly, not torch.manual_seed, avoids its lazy-CUDA bookkeeping, which
    # captures a stack trace per call: 0.1 ms a micro-batch.)
    saved = [g.get_state() for g in gens]
    try:
        yield
    finally:
        for g, s in zip(gens, saved, strict=True):
            g.set_state(s)


def _count(batch: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """(non-padding tokens as a device tensor, samples as a host int) of one micro-batch."""
    if isinstance(batch, Mapping):
        if "attention_mask" in batch:
            mask = batch["attention_mask"]
            return mask.sum(), mask.shape[0]
        if "input_ids" in batch:
            ids = batch["input_ids"]
            return torch.full((), ids.numel(), device=device), ids.shape[0]
        first = next(iter(batch.values()))
    else:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
    n = first.shape[0] if isinstance(first, torch.Tensor) else len(first)
    # An integer tensor of rank >= 2 first in the batch is token ids (e.g. an (x, y) pair of
    # windows); anything else counts one token per sample.
    tokens = first.numel() if isinstance(first, torch.Tensor) and _is_ids(first) else n
    return torch.full((), tokens, device=device), n


def _is_ids(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def accumulate_grads(
    state: TrainState,
    micro: Sequence[Any],
    loss_fn: LossFn | None = None,
    *,
    strategy: Strategy | None = None,
) -> tuple[dict[str, torch.Tensor], Stats]:
    """Run forward/backward over `micro` and return the gradients of one batch holding them all.

    Each `loss_fn` returns a *sum* and an item count; the gradient is divided by the item count
    summed over every micro-batch and rank, so ragged padding and uneven ranks do not change
    it. With float16 loss scaling the loss is multiplied by `state.loss_scale` before backward
    and the gradients are divided by it. Non-final micro-batches skip the strategy's gradient
    sync. Dropout randomness is
    `dropout_seed(state.seed, state.step, i, rank)` for micro-batch i. No host sync.

    The returned gradients are the parameters' `.grad` tensors (not copies); the model is put
    in training mode.

    Args:
        state: the current state (not consumed).
        micro: the micro-batches of one optimizer step, as yielded by `make_batches`.
        loss_fn: `(model, batch) -> (loss_sum, num_items)`; `ft.losses.default_loss` if None.
        strategy: overrides `state.strategy`.

    Returns:
        `(grads, stats)`: name -> gradient for trainable parameters that received one, and
        `Stats` with the global mean loss and counts.

    Raises:
        ValueError: if `micro` is empty.
    """
    if len(micro) == 0:
        raise ValueError("micro is empty: pass the list of micro-batches yielded by make_batches")
    strategy = state.strategy if strategy is None else strategy
    loss_fn = default_loss if loss_fn is None else loss_fn
    model, params, device = state.model, state.params, strategy.device
    if not model.training:
        model.train()
    for p in params.values():
        p.grad = None
    # float16 training scales the loss up so small gradients survive backward (ft.precision).
    scale = state.loss_scale
    losses, items, tokens, samples = [], [], [], 0
    last = len(micro) - 1
    gens = _generators(device)
    with _rng_scope(gens):
        for i, batch in enumerate(micro):
            # A ZeroWeight stand-in runs so that this rank joins the collectives, and counts 0.
            batch, weight = weighted(batch)
            batch = strategy.to_device(batch)
            seed = dropout_seed(state.seed, state.step, i, strategy.rank)
            for g in gens:
                g.manual_seed(seed)
            with strategy.grad_sync(model, final=i == last):
                with strategy.autocast():
                    loss_sum, num_items = loss_fn(model, batch)
                    loss_sum = loss_sum * weight
                (loss_sum if scale is None else loss_sum * scale).backward()
            losses.append(loss_sum.detach())
            items.append(torch.as_tensor(num_items, device=device) * weight)
            n_tok, n_samples = _count(batch, device)
            tokens.append(n_tok * weight)
            samples += n_samples if weight else 0
    # One collective for all four totals; float64 keeps counts exact far beyond 2**24.
    totals = strategy.all_reduce_sum(
        torch.stack(
            [
                torch.stack(losses).double().sum(),
                torch.stack(items).double().sum(),
                torch.stack(tokens).double().sum(),
                torch.full((), float(samples), dtype=torch.float64, device=device),
            ]
        )
    )
    loss_total, num_items_t, num_tokens_t, num_samples_t = totals.unbind()
    denom = num_items_t.clamp(min=1.0)
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    if grads:
        # Backends that average over ranks (DDP) have multiplied by grad_reduce_factor; undo it,
        # and the loss scale.
        norm = denom * strategy.grad_reduce_factor
        torch._foreach_mul_(list(grads.values()), 1.0 / (norm if scale is None else norm * scale))
    stats = Stats(
        loss=(loss_total / denom).float(),
        num_items=num_items_t.long(),
        num_tokens=num_tokens_t.long(),
        num_samples=num_samples_t.long(),
        num_micro=len(micro),
        position=getattr(micro, "position", None),  # a stream group's (ft.data.Group)
    )
    return grads, stats
