"""Parameter partitions: one optimizer and learning-rate factor per group of parameters.

Like optax's `multi_transform`: a label per parameter name picks the optimizer that updates it.
Each group's state is the state its optimizer builds for the group's parameters (keyed by name,
as every ft optimizer state is), so checkpoints stay a tree of named tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ftrain.optim._base import (
    Grads,
    GroupParams,
    Optimizer,
    Params,
    Settings,
    _describes,
    _number,
    describe,
    not_self_skipping,
)

__all__ = ["PartitionState", "layerwise_lr_decay", "partition"]

Labels = Mapping[str, str] | Callable[[str], str]


class PartitionState(NamedTuple):
    """State of `partition`: each label's optimizer state, keyed by label."""

    groups: dict[str, Any]


def _labeler(labels: Labels) -> Callable[[str], str]:
    if callable(labels):
        return labels
    if isinstance(labels, Mapping):
        table = dict(labels)

        def lookup(name: str) -> str:
            if name not in table:
                raise KeyError(
                    f"partition labels have no entry for parameter {name!r}; give every "
                    "trainable parameter a label (or pass a function name -> label)"
                )
            return table[name]

        return lookup
    raise TypeError(f"labels must be a mapping or a function name -> label, got {labels!r}")


def _validate(optimizers: Mapping[str, Optimizer], lr_factors: Mapping[str, float]) -> None:
    for name, value in (("optimizers", optimizers), ("lr_factors", lr_factors)):
        if not isinstance(value, Mapping):
            raise TypeError(f"{name} must be a mapping label -> value, got {value!r}")
    if not optimizers:
        raise ValueError("optimizers is empty: partition needs at least one {label: optimizer}")
    for label, opt in optimizers.items():
        if not isinstance(label, str) or "/" in label:
            raise ValueError(f"partition labels must be strings without '/', got {label!r}")
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"partition optimizer for label {label!r} must be an ft.optim.Optimizer, "
                f"got {type(opt).__name__}"
            )
    for label, f in lr_factors.items():
        if label not in optimizers:
            raise ValueError(
                f"lr_factors has label {label!r} that is not in optimizers {sorted(optimizers)}"
            )
        _number(f"lr_factors[{label!r}]", f, lambda v: v >= 0, ">= 0")


def partition(
    optimizers: Mapping[str, Optimizer],
    labels: Labels,
    *,
    lr_factors: Mapping[str, float] | None = None,
) -> Optimizer:
    """Update each group of parameters with its own optimizer and learning-rate factor.

    Parameter `name` belongs to group `labels(name)` (or `labels[name]`); the group's
    optimizer sees only its parameters and gets `lr * lr_factors[label]` (factor 1 when not
    given). Groups keep their own hyperparameters (weight decay, betas, Muon vs AdamW). The
    state is `PartitionState(groups={label: state})`, each keyed by parameter name, so it is
    checkpointed and resumed like any optimizer state.

    Args:
        optimizers: label -> optimizer. One optimizer object may serve several labels (each
            label still gets its own state).
        labels: parameter name -> label, as a mapping or a function.
        lr_factors: label -> factor on the step's learning rate.

    Raises:
        ValueError, TypeError: for an unknown label, a label without parameters, a bad factor.
        KeyError: at `init`, for a parameter the `labels` mapping does not cover.

    Example:
        >>> import torch, ftrain as ft
        >>> p = {"w": torch.ones(2), "b": torch.ones(2)}
        >>> opt = ft.optim.partition({"w": ft.optim.sgd(), "b": ft.optim.sgd()},
        ...                          lambda n: n, lr_factors={"b": 0.0})
        >>> s = opt.update({"w": torch.ones(2), "b": torch.ones(2)}, opt.init(p), p,
        ...                lr=0.5, step=0)
        >>> p["w"].tolist(), p["b"].tolist()
        ([0.5, 0.5], [1.0, 1.0])
    """
    factors = {} if lr_factors is None else lr_factors
    _validate(optimizers, factors)
    for label, opt in optimizers.items():
        not_self_skipping(opt, f"partition group {label!r}")
    factors = dict(factors)
    label_of = _labeler(labels)
    split_cache: dict[tuple[str, ...], dict[str, list[str]]] = {}

    def split(names: tuple[str, ...]) -> dict[str, list[str]]:
        groups = split_cache.get(names)
        if groups is None:
            groups = {}
            for name in names:
                label = label_of(name)
                if label not in optimizers:
                    raise ValueError(
                        f"parameter {name!r} has label {label!r}, which is not one of the "
                        f"partition's labels {sorted(optimizers)}"
                    )
                groups.setdefault(label, []).append(name)
            split_cache[names] = groups
        return groups

    def init(params: Params) -> PartitionState:
        groups = split(tuple(params))
        empty = sorted(set(optimizers) - set(groups))
        if empty:
            raise ValueError(
                f"partition labels {empty} have no trainable parameter; drop them from "
                "optimizers (a typo in a label would otherwise leave parameters untrained)"
            )
        return PartitionState(
            {
                label: optimizers[label].init(
                    GroupParams({n: params[n] for n in groups[label]}, params)
                )
                for label in optimizers
            }
        )

    def update(
        grads: Grads,
        state: PartitionState,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> PartitionState:
        new = dict(state.groups)
        # Each group's optimizer gets all its parameters, as clip_and_step gives a state's
        # optimizer, and the gradients it has: given only those with a gradient, `ema` failed
        # on the others and `from_torchopt` matched the gradients to other parameters' state.
        whole = split(tuple(params))
        for label, names in split(tuple(grads)).items():
            new[label] = optimizers[label].update(
                {n: grads[n] for n in names},
                state.groups[label],
                {n: params[n] for n in whole[label]},
                lr=lr * factors.get(label, 1.0),
                step=step,
                found_inf=found_inf,
            )
        return PartitionState(new)

    def settings(names: list[str]) -> Settings:
        groups = split(tuple(names))  # (which parameter is in which group: the state's keys)
        return {
            "kind": "partition",
            "groups": {
                label: describe(optimizers[label], groups.get(label, [])) for label in optimizers
            },
            "lr_factors": {label: factors.get(label, 1.0) for label in optimizers},
        }

    _describes(update, settings)
    return Optimizer(init, update)


_LAYER = re.compile(r"\.(?:layers|layer|h|blocks|block)\.(\d+)\.")
_EMBED = re.compile(r"embed|wte|wpe|word_embeddings|position_embeddings|token_type")


def layerwise_lr_decay(
    model: nn.Module, *, decay: float, num_layers: int | None = None
) -> tuple[dict[str, str], dict[str, float]]:
    """Labels and lr factors for layer-wise learning-rate decay (LLRD) of an HF transformer.

    Depth 0 holds the embeddings, depth `i + 1` transformer block `i` (names with
    `.layers.i.`, `.layer.i.`, `.h.i.` or `.blocks.i.`), depth `L + 1` everything after the
    blocks (final norm, head). The group at depth `d` gets factor `decay ** (L + 1 - d)`, so the
    head trains at the full lr and the embeddings at `decay ** (L + 1)` (as in ELECTRA and
    BEiT fine-tuning). Labels are `"depth_<d>"`; give them to `partition`.

    Args:
        model: the (unwrapped) model whose trainable parameters are labelled.
        decay: factor per layer, in (0, 1].
        num_layers: L; by default one more than the largest block index found.

    Returns:
        `(labels, lr_factors)`: parameter name -> label, label -> factor.

    Raises:
        TypeError, ValueError: for a bad `decay` or `num_layers`, a `num_layers` below a block
            index of the model (that block would get a factor above 1), or blocks numbered
            in several sequences (encoder and decoder, vision and text towers, stages), which
            one depth per index would mix: label those by hand.

    Example:
        >>> import ftrain as ft
        >>> from transformers import BertConfig, BertForSequenceClassification
        >>> m = BertForSequenceClassification(BertConfig(hidden_size=8, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=8, vocab_size=10))
        >>> labels, factors = ft.optim.layerwise_lr_decay(m, decay=0.5)
        >>> labels["bert.embeddings.word_embeddings.weight"], factors["depth_0"]
        ('depth_0', 0.125)
        >>> opt = ft.optim.partition({k: ft.optim.adamw() for k in factors}, labels,
        ...                          lr_factors=factors)
    """
    _number("decay", decay, lambda v: 0 < v <= 1, "in (0, 1]")
    if num_layers is not None and type(num_layers) is not int:
        raise TypeError(f"num_layers must be None or an int >= 1, got {num_layers!r}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be None or an int >= 1, got {num_layers!r}")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    found = _block_indices(names)
    if num_layers is None:
        if not found:
            raise ValueError(
                "layerwise_lr_decay found no transformer block index in the parameter names "
                "(.layers.<i>., .layer.<i>., .h.<i>., .blocks.<i>.); pass num_layers or label "
                "the parameters yourself"
            )
        num_layers = max(found) + 1
    elif found and max(found) >= num_layers:  # its depth would pass the head's: factor > 1
        raise ValueError(
            f"num_layers={num_layers}, but the model has block {max(found)}; pass "
            f"num_layers={max(found) + 1} (or None to count them)"
        )
    labels: dict[str, str] = {}
    for n in names:
        labels[n] = f"depth_{_depth(n, num_layers)}"
    factors = {
        f"depth_{d}": float(decay ** (num_layers + 1 - d))
        for d in sorted({int(v.removeprefix("depth_")) for v in labels.values()})
    }
    return labels, factors


def _block_indices(names: list[str]) -> list[int]:
    """The block index of each name that has one; refuses blocks numbered in several sequences.

    An encoder-decoder (`encoder.block.<i>`, `decoder.block.<i>`), a vision tower beside a
    language model, or stages of blocks (`stages.<s>.layers.<i>`) number their blocks from 0
    each: one depth per index would put unrelated blocks at one depth.
    """
    found, sequences = [], set()
    for n in names:
        m = _LAYER.search(f".{n}")
        if m is not None:
            found.append(int(m.group(1)))
            sequences.add(f".{n}"[: m.start(1)].strip("."))
    if len(sequences) > 1:
        raise ValueError(
            f"model numbers its blocks in {len(sequences)} sequences ({sorted(sequences)[:4]}): "
            "layerwise_lr_decay gives one depth per block index, which would mix them; label "
            "the parameters yourself and pass the labels to ft.optim.partition"
        )
    return found


def _depth(name: str, num_layers: int) -> int:
    m = _LAYER.search(f".{name}")
    if m is not None:
        return int(m.group(1)) + 1
    return 0 if _EMBED.search(name) else num_layers + 1
