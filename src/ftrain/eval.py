"""evaluate: the global item-weighted loss over a dataset, plus user metrics."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ftrain.losses import LossFn, default_loss
from ftrain.state import TrainState
from ftrain.strategies._base import Strategy

__all__ = ["MetricsFn", "evaluate"]

MetricsFn = Callable[[nn.Module, Any], Mapping[str, tuple[torch.Tensor, torch.Tensor]]]


def _flatten(batches: Iterable[Any]) -> Iterable[Any]:
    # make_batches yields lists of micro-batches; a plain iterable of batches works too.
    for item in batches:
        if isinstance(item, list):
            yield from item
        else:
            yield item


def evaluate(
    state: TrainState,
    batches: Iterable[Any],
    loss_fn: LossFn | None = None,
    *,
    metrics_fn: MetricsFn | None = None,
    strategy: Strategy | None = None,
) -> dict[str, float]:
    """Return the loss over all `batches` as sum of item losses / number of items, over ranks.

    This is not a mean of batch means, so it does not depend on batch size or padding. The
    model runs in eval mode without gradients and gets its previous mode back afterwards.
    Reading the totals at the end is the one host sync.

    Args:
        state: the state to evaluate (not consumed).
        batches: e.g. `make_batches(val, batch_size=16, shuffle=False)`.
        loss_fn: `(model, batch) -> (loss_sum, num_items)`; `default_loss` if None.
        metrics_fn: `(model, batch) -> {name: (sum, count)}`; each metric is reported as its
            global sum / count (accuracy: `(correct, n)`), in bounded memory.
        strategy: overrides `state.strategy`.

    Returns:
        `{"eval_loss", "eval_ppl", "eval_items"}` plus `eval_<name>` per metric.
    """
    strategy = state.strategy if strategy is None else strategy
    loss_fn = default_loss if loss_fn is None else loss_fn
    model, device = state.model, strategy.device
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad(), strategy.autocast():
            for batch in _flatten(batches):
                batch = strategy.to_device(batch)
                loss, items = loss_fn(model, batch)
                parts = {"loss": (loss, items)}
                if metrics_fn is not None:
                    parts.update(metrics_fn(model, batch))
                for name, (s, n) in parts.items():
                    pair = torch.stack(
                        [
                            torch.as_tensor(s, device=device).double(),
                            torch.as_tensor(n, device=device).double(),
                        ]
                    )
                    sums[name] = sums[name] + pair if name in sums else pair
    finally:
        model.train(was_training)
    if not sums:
        raise ValueError("evaluate got no batches")
    names = sorted(sums)
    totals = strategy.all_reduce_sum(torch.stack([sums[n] for n in names])).tolist()  # host sync
    out = {f"eval_{n}": s / c if c else math.nan for n, (s, c) in zip(names, totals, strict=True)}
    n_items = totals[names.index("loss")][1]
    out["eval_ppl"] = math.exp(out["eval_loss"]) if out["eval_loss"] < 700 else math.inf
    out["eval_items"] = n_items
    return out
