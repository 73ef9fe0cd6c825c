"""TrainState: one small frozen dataclass holding everything a training step reads and writes.

Fork this file rather than adding options to it: a research loop that needs another field can
subclass `TrainState` or carry the value next to it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ftrain.data import Cursor
from ftrain.strategies._base import SingleDevice, Strategy

if TYPE_CHECKING:
    from ftrain.optim._base import Optimizer

__all__ = ["ConsumedStateError", "TrainState", "next_epoch", "snapshot"]


class ConsumedStateError(RuntimeError):
    """Raised when the tensors of a state consumed (donated) by a step function are read."""


class _Lease:
    """Shared by every state that views the same parameter/optimizer tensors.

    A step function updates those tensors in place and marks the lease consumed, so that any
    stale state sharing them fails loudly instead of silently reading post-step values.
    """

    __slots__ = ("consumed_by",)

    def __init__(self) -> None:
        self.consumed_by: tuple[str, int] | None = None

    def check(self) -> None:
        if self.consumed_by is not None:
            fn, step = self.consumed_by
            raise ConsumedStateError(
                f"this TrainState was consumed by {fn} at step {step}; use the returned state, "
                "or pass donate=False"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class TrainState:
    """Everything one training step reads and writes, as an immutable value.

    Build it with `TrainState.create`, change it with `replace` or the step functions.
    The module owns its parameters (so DDP/FSDP hooks keep working); `params` is a read-only
    view of the trainable ones. Step functions update tensors in place and *consume* their
    input state: reading a consumed state's tensors raises `ConsumedStateError`.

    Plain values: `step` (optimizer updates done), `epoch`, `cursor` (micro-batches consumed in
    this epoch; on a stream it carries `data_position`, the stream position as JSON), `seed`,
    and the early-stopping fields `best_metric`, `best_step`,
    `patience_counter`. `tokens_seen` and `samples_seen` are 0-dim int64 tensors on the
    training device, so advancing them never waits for the device; `int(state.tokens_seen)`
    reads one (a host sync). With float16 loss scaling (a strategy with `precision="fp16"`),
    `loss_scale` (float32) and `growth_tracker` (int32) are 0-dim device tensors too; they are
    None otherwise. `batch_size` is the per-rank batch size `ft.data.find_batch_size` settled
    on (None until then), kept by checkpoints so that a resumed run uses it again.

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(), seed=0)
        >>> sorted(state.params), state.step
        (['bias', 'weight'], 0)
    """

    model_: nn.Module
    optimizer: Optimizer
    opt_state_: Any
    strategy: Strategy
    params_: Mapping[str, torch.Tensor]
    step: int = 0
    epoch: int = 0
    cursor: int = 0
    tokens_seen: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.zeros((), dtype=torch.int64)
    )
    samples_seen: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.zeros((), dtype=torch.int64)
    )
    seed: int = 0
    best_metric: float | None = None
    best_step: int | None = None
    patience_counter: int = 0
    loss_scale: torch.Tensor | None = None
    growth_tracker: torch.Tensor | None = None
    batch_size: int | None = None
    data_position: str | None = None
    lease_: _Lease = dataclasses.field(default_factory=_Lease, repr=False)

    def __post_init__(self) -> None:
        # A stream's position (JSON, saved in state.json like any plain field) rides on the
        # cursor, so the README loop's make_batches(start=state.cursor) resumes the stream.
        if self.data_position is not None and (
            getattr(self.cursor, "position", None) != self.data_position
        ):
            object.__setattr__(self, "cursor", Cursor(self.cursor, self.data_position))

    @classmethod
    def create(
        cls,
        model: nn.Module,
        optimizer: Optimizer,
        *,
        seed: int = 0,
        strategy: Strategy | None = None,
    ) -> TrainState:
        """Set up `model` with `strategy` and initialise the optimizer state.

        Args:
            model: the module; it keeps owning its parameters. Parameters with
                `requires_grad=False` are frozen and left out of `params`.
            optimizer: an `ft.optim.Optimizer`.
            seed: drives data order and dropout; resume is exact without saving RNG state.
            strategy: device/distribution strategy, `SingleDevice()` by default.

        Raises:
            TypeError: if `model` is not an `nn.Module` or `optimizer` not an `Optimizer`.
            ValueError: if the model has no trainable parameter.
        """
        from ftrain.optim._base import Optimizer

        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be an ft.optim.Optimizer, got {type(optimizer).__name__}; "
                "wrap torch optimizers with ft.optim.from_torch(torch.optim.X, **kw)"
            )
        if not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        strategy = SingleDevice() if strategy is None else strategy
        model = strategy.setup(model)
        params = _trainable(strategy.unwrap(model))
        if not params:
            raise ValueError("model has no trainable parameter (all have requires_grad=False)")
        device = strategy.device
        scaling = strategy.precision.loss_scaling
        if scaling is not None:
            loss_scale: dict[str, Any] = {
                "loss_scale": torch.tensor(scaling.init_scale, dtype=torch.float32, device=device),
                "growth_tracker": torch.zeros((), dtype=torch.int32, device=device),
            }
        else:
            loss_scale = {}
        return cls(
            model_=model,
            optimizer=optimizer,
            params_=MappingProxyType(params),
            opt_state_=optimizer.init(params),
            strategy=strategy,
            seed=seed,
            tokens_seen=torch.zeros((), dtype=torch.int64, device=device),
            samples_seen=torch.zeros((), dtype=torch.int64, device=device),
            **loss_scale,
        )

    # Tensor-holding fields are reached through properties so that a consumed state fails.
    @property
    def model(self) -> nn.Module:
        """The module (possibly wrapped by the strategy); it owns the parameters."""
        self.lease_.check()
        return self.model_

    @property
    def params(self) -> Mapping[str, torch.Tensor]:
        """Read-only mapping name -> trainable parameter (frozen ones excluded).

        Taken when the state is created: re-create the state after freezing or unfreezing.
        """
        self.lease_.check()
        return self.params_

    @property
    def opt_state(self) -> Any:
        """The optimizer state: a pytree of tensors keyed by parameter name."""
        self.lease_.check()
        return self.opt_state_

    @property
    def consumed(self) -> bool:
        """Whether a step function has consumed this state's tensors."""
        return self.lease_.consumed_by is not None

    def replace(self, **changes: Any) -> TrainState:
        """Return a copy with `changes` applied; it shares tensors (and donation) with `self`.

        Raises:
            TypeError: for a name that is not a field.
        """
        return dataclasses.replace(self, **self._fields(changes))

    def _fields(self, changes: dict[str, Any]) -> dict[str, Any]:
        renamed = {_PUBLIC_TO_FIELD.get(k, k): v for k, v in changes.items()}
        unknown = set(renamed) - _settable(type(self))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no settable field(s) {sorted(unknown)}")
        if "model_" in renamed:
            module = self.strategy.unwrap(renamed["model_"])
            renamed["params_"] = MappingProxyType(_trainable(module))
        return renamed

    def consume(self, by: str, **changes: Any) -> TrainState:
        """Mark this state consumed by `by`; return a fresh handle on the same tensors, with
        `changes` applied.

        Step functions call this after updating tensors in place; users rarely need it.
        """
        self.lease_.check()
        fields = self._fields(changes)
        self.lease_.consumed_by = (by, self.step)
        return dataclasses.replace(self, lease_=_Lease(), **fields)


_PUBLIC_TO_FIELD = {"model": "model_", "opt_state": "opt_state_"}


_SETTABLE: dict[type, frozenset[str]] = {}


def _settable(cls: type) -> frozenset[str]:
    """Field names `replace` accepts, for TrainState and its subclasses (cached per class)."""
    names = _SETTABLE.get(cls)
    if names is None:
        # params_ follows model_ and lease_ follows the tensors: neither is set by hand.
        fields = dataclasses.fields(cls)
        names = _SETTABLE[cls] = frozenset(f.name for f in fields) - {"lease_", "params_"}
    return names


def _trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def snapshot(state: TrainState) -> TrainState:
    """Return an independent deep copy of `state` (model, optimizer state and counters).

    The copy is not affected when `state` is later donated to a step function, and vice versa.

    Example:
        >>> import torch, ftrain as ft
        >>> s = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> c = ft.snapshot(s)
        >>> c.params["weight"] is s.params["weight"]
        False
    """
    state.lease_.check()
    model = state.strategy.clone_model(state.model_)
    old = dict(state.model_.named_parameters())
    new = dict(model.named_parameters())
    # Optimizer state may alias parameters (rare); map them onto the copy, clone the rest.
    memo = {id(old[n]): new[n] for n in old}
    opt_state = copy.deepcopy(state.opt_state_, memo)
    counters: dict[str, Any] = {  # tokens_seen, samples_seen, loss scale, a subclass's tensors
        f.name: v.clone()
        for f in dataclasses.fields(state)
        if f.name not in _TENSOR_HOLDERS and isinstance(v := getattr(state, f.name), torch.Tensor)
    }
    return dataclasses.replace(
        state,
        model_=model,
        params_=MappingProxyType(_trainable(state.strategy.unwrap(model))),
        opt_state_=opt_state,
        lease_=_Lease(),
        **counters,
    )


_TENSOR_HOLDERS = {"model_", "opt_state_", "params_"}


def next_epoch(state: TrainState) -> TrainState:
    """Return `state` at the start of the next epoch (`epoch + 1`, `cursor = 0`)."""
    return state.replace(epoch=state.epoch + 1, cursor=0, data_position=None)
