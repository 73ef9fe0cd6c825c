"""Losses as `loss_fn(model, batch) -> (loss_sum, num_items)`.

A loss is a *sum* over items together with the item count, so that `accumulate_grads` can divide
by the global count over all micro-batches and ranks: that is what makes gradient accumulation
exact with ragged padding (the 2024 HF gradient-accumulation bug came from averaging means).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "IGNORE_INDEX",
    "LossFn",
    "causal_lm_loss",
    "classification_loss",
    "default_loss",
    "model_logits",
    "upcast",
]

IGNORE_INDEX = -100


class LossFn(Protocol):
    """`loss_fn(model, batch) -> (loss_sum, num_items)`, both device tensors."""

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


def upcast(t: torch.Tensor) -> torch.Tensor:
    """Return `t` in float32 when it is float16 or bfloat16, else unchanged.

    Half-precision logits lose too much in log-softmax; every loss here upcasts them first, and
    a loss of your own should too.

    Example:
        >>> import torch, ftrain as ft
        >>> ft.losses.upcast(torch.zeros(2, dtype=torch.bfloat16)).dtype
        torch.float32
        >>> ft.losses.upcast(torch.zeros(2, dtype=torch.float64)).dtype
        torch.float64
    """
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def model_logits(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Run `model` on a dict batch without its `labels` and return the logits.

    The batch's other keys are the keyword arguments. The output's `.logits` (HF models), else
    its first element when it is a tuple, else the output itself. Labels stay out so that an HF
    model does not compute a (mean) loss of its own.

    Example:
        >>> import torch, ftrain as ft
        >>> class Lm(torch.nn.Module):
        ...     def forward(self, input_ids):
        ...         return torch.zeros(*input_ids.shape, 5)
        >>> batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
        >>> ft.losses.model_logits(Lm(), batch).shape
        torch.Size([1, 3, 5])
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


def causal_lm_loss(*, label_smoothing: float = 0.0) -> LossFn:
    """Next-token cross-entropy summed over label tokens that are not -100, after the shift.

    Logits at position t predict `labels[t + 1]`, as in HF causal LMs. With `label_smoothing`
    eps the per-token loss is `(1 - eps) * nll + eps * mean_v(-log p_v)`, HF's `LabelSmoother`.

    Args:
        label_smoothing: eps in [0, 1).

    Example:
        >>> import torch, ftrain as ft
        >>> class Uniform(torch.nn.Module):
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return torch.zeros(*input_ids.shape, 4)
        >>> batch = {"input_ids": torch.tensor([[0, 1, 2]]), "labels": torch.tensor([[0, 1, -100]])}
        >>> loss, n = ft.losses.causal_lm_loss()(Uniform(), batch)
        >>> round(loss.item(), 4), int(n)    # one counted token: log(4)
        (1.3863, 1)
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")

    def loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if "labels" not in batch:
            raise KeyError("causal_lm_loss needs 'labels' in the batch (use input_ids as labels)")
        logits = model_logits(model, batch)[:, :-1]
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(
            upcast(logits.reshape(-1, logits.shape[-1])),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            label_smoothing=label_smoothing,
        )
        return loss, (labels != IGNORE_INDEX).sum()

    return loss_fn


def classification_loss(*, label_smoothing: float = 0.0) -> LossFn:
    """Cross-entropy summed over samples (or squared error when the model has one output).

    Args:
        label_smoothing: eps in [0, 1), as in `causal_lm_loss`.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")

    def loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model_logits(model, batch)
        labels = batch["labels"]
        if logits.shape[-1] == 1:  # regression head, as HF's num_labels == 1
            loss = F.mse_loss(upcast(logits.squeeze(-1)), labels.to(logits.dtype), reduction="sum")
            return loss, torch.tensor(labels.numel(), device=labels.device)
        loss = F.cross_entropy(
            upcast(logits),
            labels,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            label_smoothing=label_smoothing,
        )
        return loss, (labels != IGNORE_INDEX).sum()

    return loss_fn


_CAUSAL = causal_lm_loss()
_CLASSIFY = classification_loss()


def _causal_items(batch: Any) -> torch.Tensor | None:
    """The label tokens `causal_lm_loss` counts in `batch` (after the shift), read from the
    labels alone; None when `batch` is not a dict with 2-D `labels`."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        return None
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def _items_before_forward(loss_fn: LossFn, batch: Any) -> torch.Tensor | None:
    """The item count `loss_fn` will report for `batch`, known without running the model
    (the default loss on a causal-LM batch, issue 12); None when it is not known in advance."""
    return _causal_items(batch) if loss_fn is default_loss or loss_fn is _CAUSAL else None


def default_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss `accumulate_grads` uses when none is given, for HF models with `labels`.

    Labels of shape (batch,) mean sequence classification (`classification_loss`); labels of
    shape (batch, seq) mean a causal LM (`causal_lm_loss`, with the shift). For anything else
    pass a `loss_fn`.

    Raises:
        KeyError: when the batch has no `labels`.
    """
    if not isinstance(batch, Mapping) or "labels" not in batch:
        raise KeyError(
            "the default loss needs a dict batch with 'labels'; pass loss_fn=... for other data"
        )
    return (_CLASSIFY if batch["labels"].dim() == 1 else _CAUSAL)(model, batch)
