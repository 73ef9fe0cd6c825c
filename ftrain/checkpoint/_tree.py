"""Optimizer state as flat `path -> leaf` maps, and back onto a template of the same structure.

Paths join keys with "/" (`mu/lm_head.weight`, `0/count`). Containers are recorded too (as a
type name), so a checkpoint of another optimizer differs at its root instead of at every leaf.
Restoring is template-driven: the fresh state built by `TrainState.create` says what types to
rebuild, so loading never constructs a type named by the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ftrain.checkpoint._io import CheckpointError
from ftrain.optim import TorchOptimizerState

__all__ = ["Node", "describe", "flatten_tree", "unflatten"]

Scalar = bool | int | float | str | None
_SCALARS = (bool, int, float, str, type(None))


def _node(obj: Any) -> str:
    if isinstance(obj, TorchOptimizerState):
        return f"torch:{type(obj.optimizer).__name__}"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return f"tuple:{type(obj).__name__}"
    return type(obj).__name__


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, TorchOptimizerState):
        return list(obj.tensors().items())
    if isinstance(obj, Mapping):
        keys = [str(k) for k in obj]
        if any("/" in k for k in keys) or len(set(keys)) != len(keys):
            raise CheckpointError(f"cannot checkpoint optimizer state with keys {keys[:5]}")
        return [(str(k), v) for k, v in obj.items()]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return list(zip(obj._fields, obj, strict=True))
    if isinstance(obj, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(obj)]
    raise CheckpointError(
        f"cannot checkpoint optimizer state of type {type(obj).__name__}: use tensors, plain "
        "numbers, and dict/list/tuple/NamedTuple containers"
    )


def flatten_tree(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Map every path in `tree` (an optimizer state) to its leaf, as checkpoints name them.

    Leaves are tensors and plain scalars; each container (dict, list, tuple, NamedTuple, a
    torch optimizer's state) maps to a marker holding its type name. Paths join keys with "/"
    (`mu/lm_head.weight`), under `prefix`.

    Raises:
        CheckpointError: for a container or leaf a checkpoint cannot store.

    Example:
        >>> import torch, ftrain as ft
        >>> tree = {"mu": {"w": torch.zeros(2)}, "count": 3}
        >>> sorted(ft.checkpoint.flatten_tree(tree))
        ['', 'count', 'mu', 'mu/w']
    """
    if isinstance(tree, (torch.Tensor, *_SCALARS)):
        return {prefix: tree}
    out: dict[str, Any] = {prefix: Node(_node(tree))}
    for key, child in _children(tree):
        out.update(flatten_tree(child, f"{prefix}/{key}" if prefix else key))
    return out


class Node(str):
    """A container's type name inside a flattened tree (distinct from a string leaf)."""


def describe(leaf: Any) -> str:
    """Human-readable type of one flattened entry, as used in mismatch reports."""
    if isinstance(leaf, Node):
        return str(leaf)
    if isinstance(leaf, torch.Tensor):
        return f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}"
    return type(leaf).__name__


def unflatten(
    template: Any,
    values: Mapping[str, Any],
    copy: Callable[[torch.Tensor, torch.Tensor], None],
    prefix: str = "",
) -> Any:
    """Rebuild `template` with leaves from `values`; tensors are copied into the template's
    with `copy(dst, src)` (the strategy's `copy_whole`, as `dst` may be a shard).

    Values must already have been checked against `flatten_tree(template)`. A live torch optimizer
    has its state loaded through `load_state_dict`.
    """
    if isinstance(template, torch.Tensor):
        if values[prefix] is not template:
            copy(template, values[prefix])
        return template
    if isinstance(template, _SCALARS):
        return values[prefix]
    if isinstance(template, TorchOptimizerState):
        template.load_tensors(_subtree(values, prefix))
        return template
    items = [
        (k, unflatten(v, values, copy, f"{prefix}/{k}" if prefix else k))
        for k, v in _children(template)
    ]
    if isinstance(template, Mapping):
        cls: Any = type(template)
        return cls(zip(template.keys(), (v for _, v in items), strict=True))
    rebuilt = [v for _, v in items]
    return type(template)(*rebuilt) if hasattr(template, "_fields") else type(template)(rebuilt)


def _subtree(values: Mapping[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """Regroup `prefix/<param>/<key>` leaves into {param: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    head = prefix + "/" if prefix else ""
    for path, v in values.items():
        if path.startswith(head) and not isinstance(v, Node):
            rest = path[len(head) :]
            if rest.count("/") == 1:
                name, key = rest.split("/")
                out.setdefault(name, {})[key] = v
    return out
