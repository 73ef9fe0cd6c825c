"""Adapters: any `torch.optim.Optimizer` class, or a torchopt transformation, as an ft Optimizer."""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable
from typing import Any

import torch

from ftrain.optim._base import Grads, Optimizer, Params, Settings, _describes

__all__ = ["TorchOptimizerState", "from_torch", "from_torchopt"]


class TorchOptimizerState:
    """Holds a live `torch.optim.Optimizer`; `tensors()` gives its state keyed by parameter name."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
        self.optimizer = optimizer
        self._names = names

    def tensors(self) -> dict[str, dict[str, Any]]:
        """Per-parameter state (e.g. `exp_avg`), keyed by parameter name."""
        return {self._names[id(p)]: dict(s) for p, s in self.optimizer.state.items()}

    def load_tensors(self, state: dict[str, dict[str, Any]]) -> None:
        """Replace the per-parameter state with `state` (as returned by `tensors()`)."""
        by_name = {self._names[id(p)]: i for i, p in enumerate(_all_params(self.optimizer))}
        sd = self.optimizer.state_dict()
        sd["state"] = {by_name[n]: dict(s) for n, s in state.items()}
        self.optimizer.load_state_dict(sd)

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchOptimizerState:
        raise TypeError(
            "optimizers from ft.optim.from_torch hold a live torch optimizer bound to the "
            "model's parameters and cannot be snapshotted; use ft.optim.adamw/adam/sgd, or "
            "rebuild the state with TrainState.create on the copied model"
        )


def _all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # The order torch.optim's state_dict numbers parameters in.
    return [p for group in optimizer.param_groups for p in group["params"]]


def _skip_on_host(found_inf: torch.Tensor | None) -> bool:
    # Generic optimizers cannot be told to skip on the device; this is the one host sync
    # (as in torch.amp.GradScaler.step for non-fused optimizers).
    return found_inf is not None and bool(found_inf.item())


def from_torch(optimizer_cls: Callable[..., torch.optim.Optimizer], **kwargs: Any) -> Optimizer:
    """Wrap a torch optimizer class (or any callable `params -> Optimizer`) as an ft Optimizer.

    The learning rate given to each update is written into every param group. Skipping a
    non-finite step costs one host sync here, unlike the fused `adamw`/`adam`/`sgd`.

    Args:
        optimizer_cls: e.g. `torch.optim.RMSprop` or `bitsandbytes.optim.PagedAdamW`.
        **kwargs: its hyperparameters, except `lr` (each update's `lr` is the step's, from
            `clip_and_step(lr=...)`; passing one here raises rather than being ignored).

    Raises:
        TypeError: for an `optimizer_cls` that is not callable, or an `lr`.

    Example:
        >>> import torch, ftrain as ft
        >>> opt = ft.optim.from_torch(torch.optim.RMSprop, alpha=0.9)
        >>> p = {"w": torch.nn.Parameter(torch.ones(2))}
        >>> p["w"].grad = torch.ones(2)
        >>> s = opt.update({"w": p["w"].grad}, opt.init(p), p, lr=0.01, step=0)
        >>> sorted(s.tensors()["w"])
        ['square_avg', 'step']
    """
    if not callable(optimizer_cls):
        raise TypeError(f"optimizer_cls must be a torch optimizer class, got {optimizer_cls!r}")
    if "lr" in kwargs:
        raise TypeError(
            f"from_torch takes no lr (got lr={kwargs['lr']!r}): each update uses the lr given "
            "to clip_and_step(lr=...), e.g. a schedule's; drop lr="
        )

    def init(params: Params) -> TorchOptimizerState:
        names = {id(p): n for n, p in params.items()}
        optimizer = optimizer_cls(list(params.values()), lr=0.0, **kwargs)
        _check_groups(optimizer, names)
        return TorchOptimizerState(optimizer, names)

    def update(
        grads: Grads,
        state: TorchOptimizerState,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> TorchOptimizerState:
        if _skip_on_host(found_inf):
            return state
        names = state._names
        for group in state.optimizer.param_groups:
            group["lr"] = lr
            for p in group["params"]:
                # The step's gradient, or None for a parameter `grads` leaves out: torch.optim
                # then skips it (as adamw does), rather than stepping on a stale `.grad`.
                g = grads.get(names[id(p)])
                if p.grad is not g:
                    p.grad = g
        state.optimizer.step()
        return state

    _describes(update, lambda names: _torch_settings(optimizer_cls, kwargs))
    return Optimizer(init, update)


def _check_groups(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    """Refuse, at `init`, an optimizer (a factory's) that leaves a parameter out (it would
    never train), holds a tensor that is no trainable parameter, or gives a param group its
    own lr (each update writes the step's lr into every group)."""
    held = [id(p) for p in _all_params(optimizer)]
    missing = [n for i, n in names.items() if i not in held]
    if missing or len(held) != len(set(held)) or not set(held) <= names.keys():
        raise ValueError(
            f"from_torch: the optimizer must hold each trainable parameter once, got "
            f"{len(held)} tensors for {len(names)} parameters (missing: {missing[:5]}); "
            "to train only some parameters freeze the others (requires_grad=False), or give "
            "each group its own optimizer with ft.optim.partition"
        )
    lrs = [g.get("lr") for g in optimizer.param_groups]
    if any(lr != 0.0 for lr in lrs):
        raise ValueError(
            f"from_torch: param groups with their own lr {lrs} would be overwritten by each "
            "update's lr; use ft.optim.partition(..., lr_factors=...) for per-group lr"
        )


# How a torch optimizer runs, not what it computes: free to change across a resume.
_HOW = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _torch_settings(optimizer_cls: Callable[..., Any], kwargs: dict[str, Any]) -> Settings:
    """`from_torch`'s class and hyperparameters as JSON, its defaults filled in (so that
    `weight_decay=0` given and left out describe alike); a value JSON cannot hold by its type."""
    given = dict(kwargs)
    try:
        bound = inspect.signature(optimizer_cls).bind_partial(**given)
        bound.apply_defaults()
        given = {**bound.arguments, **bound.kwargs}
        for p in inspect.signature(optimizer_cls).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                given.pop(p.name, None)
    except (TypeError, ValueError):  # no signature to read (a C callable): as given
        pass
    # The class by its qualified name only: a class of the launch script is `__main__.X` when
    # the script runs and `script.X` when a launcher imports it, one optimizer either way.
    name = getattr(optimizer_cls, "__qualname__", type(optimizer_cls).__qualname__)
    settings = {k: _json(v) for k, v in given.items() if k not in _HOW | {"params", "lr"}}
    return {"kind": "torch", "class": name, "kwargs": settings}


def _json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    return f"<{type(value).__name__}>"  # e.g. a tensor or a function: its type only


def from_torchopt(tx: Any) -> Optimizer:
    """Wrap a torchopt `GradientTransformation` built with `lr=1.0` (ftrain supplies the lr).

    Updates are scaled by the step's lr (`clip_and_step(lr=...)`) and applied in place: the
    step's lr is the only one, so a transformation that scales by an lr of its own (torchopt's
    `adam(lr=1e-3)`, any constant `scale` other than ±1, or an lr schedule) is refused rather
    than applying two learning rates. Factors that are part of the algorithm (Adagrad's
    `lr_decay`) are kept. Skipping a non-finite step costs one host sync. Needs the `torchopt`
    extra.

    Raises:
        ImportError: when torchopt is not installed.
        TypeError: for a `tx` that is no GradientTransformation.
        ValueError: for a `tx` with an lr or lr schedule of its own.
    """
    try:
        import torchopt  # noqa: F401  (only checks that the extra is installed)
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("from_torchopt needs torchopt: pip install 'ftrain[torchopt]'") from e
    if not hasattr(tx, "init") or not hasattr(tx, "update"):
        raise TypeError(f"tx must be a torchopt GradientTransformation, got {tx!r}")
    _refuse_own_lr(tx)

    def init(params: Params) -> Any:
        return tx.init(tuple(params.values()))

    def update(
        grads: Grads,
        state: Any,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        if _skip_on_host(found_inf):
            return state
        if len(grads) != len(params):  # a torchopt update takes every parameter's gradient
            raise ValueError(
                f"from_torchopt: no gradient for {[n for n in params if n not in grads][:5]} "
                "this step; a torchopt transformation updates every parameter, so it cannot "
                "skip one as torch.optim does: use ft.optim.adamw/from_torch, or freeze them"
            )
        ps = tuple(params.values())
        gs = tuple(grads[n] for n in params)
        with torch.no_grad():
            updates, state = tx.update(gs, state, params=ps, inplace=True)
            torch._foreach_add_(list(ps), list(updates), alpha=lr)
        return state

    return Optimizer(init, update)


def _refuse_own_lr(tx: Any) -> None:
    """Refuse a torchopt transformation that scales by an lr of its own: each update also
    multiplies by `clip_and_step`'s lr, so `adam(lr=1e-3)` stepped by 1e-6 at lr=1e-3."""
    scales: list[float] = []
    schedules: list[str] = []
    _torchopt_scales(tx, set(), scales, schedules)
    if schedules:
        raise ValueError(
            "from_torchopt: tx has an lr schedule of its own, and each update is also "
            "multiplied by the lr given to clip_and_step(lr=...): build it with lr=1.0 and "
            "pass the schedule's value as clip_and_step's lr (e.g. an ft.schedules schedule)"
        )
    factor = abs(math.prod(scales))
    if factor != 1.0:
        raise ValueError(
            f"from_torchopt: tx scales its updates by {factor:g} (its own lr), and each update "
            f"is also multiplied by the lr given to clip_and_step(lr=...), so both would apply: "
            f"build it with lr=1.0 (e.g. torchopt.adam(lr=1.0)) and give the lr to clip_and_step"
        )


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018  # raises ValueError for an empty cell
    except ValueError:
        return False
    return True


def _torchopt_scales(obj: Any, seen: set[int], scales: list[float], schedules: list[str]) -> None:
    # torchopt keeps a transformation's hyperparameters in its functions' closures: a constant
    # `scale` (what `scale_by_neg_lr(lr)` builds) holds `step_size`, and an lr schedule is
    # wrapped by `_scale_by_neg_lr`'s `schedule_wrapper`. A transformation of your own that
    # scales otherwise is not seen.
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.FunctionType):
        cells = dict(zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True))
        # An empty cell (a variable assigned in one branch only) has no contents to read.
        values = {n: c.cell_contents for n, c in cells.items() if _filled(c)}
        if obj.__qualname__.startswith("_scale.<locals>") and "step_size" in values:
            scales.append(float(values["step_size"]))
        if obj.__qualname__.startswith("_scale_by_neg_lr.<locals>"):
            schedules.append(obj.__qualname__)
        for v in values.values():
            _torchopt_scales(v, seen, scales, schedules)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _torchopt_scales(v, seen, scales, schedules)
