"""TrainState: one small frozen dataclass holding everything a training step reads and writes.

Fork this file rather than adding options to it: a research loop that needs another field can
subclass `TrainState` or carry the value next to it.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ftrain.optim import Optimizer, ema_swapped
from ftrain.rng import _splitmix64
from ftrain.strategies import SingleDevice, Strategy, refuse_lone_process

__all__ = [
    "ConsumedStateError",
    "DataState",
    "EarlyStoppingState",
    "ScalerState",
    "TrainState",
    "next_epoch",
    "plain_values",
    "snapshot",
]


class ConsumedStateError(RuntimeError):
    """Raised when the tensors of a state consumed (donated) by a step function are read."""


class _Lease:
    """The donation mark, shared by everything that views the same tensors: states made from
    one another by `replace`, and a `Grads` mapping.

    A step function updates those tensors in place (or releases them) and marks the lease
    consumed, so that anything still holding them fails loudly instead of silently reading
    post-step values.
    """

    __slots__ = ("consumed_by", "what")

    def __init__(self, what: str = "this TrainState was") -> None:
        self.consumed_by: tuple[str, int] | None = None
        self.what = what

    def consume(self, by: str, step: int) -> None:
        self.check()
        self.consumed_by = (by, step)

    def check(self, fix: str = "use the returned state, or pass donate=False") -> None:
        if self.consumed_by is not None:
            fn, step = self.consumed_by
            raise ConsumedStateError(f"{self.what} consumed by {fn} at step {step}; {fix}")


def _replaced(obj: Any, changes: dict[str, Any]) -> Any:
    """`dataclasses.replace(obj, **changes)`, without running `__init__` where that changes
    nothing: a plain frozen dataclass (every field an `__init__` argument, no
    `__post_init__`, instances with a `__dict__`). Three times faster: the step functions
    replace a state and its data position every step (issue 30)."""
    cls = type(obj)
    fields = cls.__dataclass_fields__
    plain = cls in _PLAIN or (_plain(cls) and hasattr(obj, "__dict__"))
    if not (plain and fields.keys() >= changes.keys()):
        return dataclasses.replace(obj, **changes)  # its errors for a name that is no field
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


def _plain(cls: type) -> bool:
    """Whether `_replaced` may copy a `cls` instance's `__dict__` (see there)."""
    init = cls.__init__.__code__  # type: ignore[misc]
    return (
        init.co_filename == "<string>"  # dataclasses' generated __init__ ...
        and init.co_argcount + init.co_kwonlyargcount == len(cls.__dataclass_fields__) + 1  # type: ignore[attr-defined]  # ... of every field
        and not hasattr(cls, "__post_init__")
        # A slotted subclass's fields are slot descriptors, which hide a copied __dict__.
        and not any("__slots__" in vars(c) for c in cls.__mro__[:-1])
    )


class _SubState:
    """A small frozen group of related state values; `replace` returns a changed copy."""

    def replace(self, **changes: Any) -> Any:
        """Return a copy with `changes` applied (`state.data.replace(cursor=0)`)."""
        return _replaced(self, changes)


class _Tensors(NamedTuple):
    """The tensor holders of a state and their lease, reached only through checked properties."""

    model: nn.Module
    params: Mapping[str, torch.Tensor]
    opt_state: Any
    lease: _Lease
    # The model's parameters that were frozen at create: `accumulate_grads` refuses to run once
    # one of them requires a gradient (it would get gradients that are never applied).
    frozen: tuple[torch.Tensor, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class DataState(_SubState):
    """Where the training data stands, saved in every checkpoint.

    `cursor`: micro-batches of this epoch already consumed (global over data-parallel ranks).
    `position`: where the data stands after them, as JSON (`ft.data.check_position` reads
    it): for a stream its source position and fingerprint, for map-style data the row reached,
    the settings the cursor was counted in and a digest of a few rows, so a resume with another
    batch size continues exactly, and one over other data raises naming what changed. None
    before the first step of an epoch.
    `batch_size`: the per-rank batch size `ft.data.find_batch_size` settled on (None until
    then), kept so that a resumed run uses it again.
    `tokens_seen`, `samples_seen`: 0-dim int64 tensors on the training device, so advancing
    them never waits for the device; `int(state.data.tokens_seen)` reads one (a host sync).
    """

    cursor: int = 0
    position: str | None = None
    batch_size: int | None = None
    tokens_seen: torch.Tensor = dataclasses.field(default_factory=lambda: _zero(None))
    samples_seen: torch.Tensor = dataclasses.field(default_factory=lambda: _zero(None))


@dataclasses.dataclass(frozen=True)
class EarlyStoppingState(_SubState):
    """The best evaluation so far and HF's patience counter (`ft.track_best`, `ft.should_stop`).

    `best_metric` is the best value seen (None before the first evaluation), `best_step` the
    step it was seen at, `patience_counter` the evaluations since without improvement;
    `metric` and `mode` what they rank (`track_best`'s, recorded at the first evaluation; None
    in a checkpoint written before they were); `loss` the loss an `eval_loss` ranked was
    computed with (its `eval_loss_fn`, recorded likewise), so that a later evaluation with
    another loss (after a resume whose state does not know the training loss yet) is refused.
    """

    best_metric: float | None = None
    best_step: int | None = None
    patience_counter: int = 0
    metric: str | None = None
    mode: str | None = None
    loss: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ScalerState(_SubState):
    """Float16 dynamic loss scaling's state (a strategy with `precision="fp16"`): `scale`
    (float32) and `growth_tracker` (int32) are 0-dim device tensors, updated on the device;
    both are None when the run does not scale its loss."""

    scale: torch.Tensor | None = None
    growth_tracker: torch.Tensor | None = None


def _zero(device: torch.device | None) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


@dataclasses.dataclass(frozen=True, eq=False)
class TrainState:
    """Everything one training step reads and writes, as an immutable value.

    Build it with `TrainState.create`, change it with `replace` or the step functions.
    The module owns its parameters (so DDP/FSDP hooks keep working); `params` is a read-only
    view of the trainable ones. Step functions update tensors in place and *consume* their
    input state: reading a consumed state's tensors raises `ConsumedStateError`.

    Top-level values: `step` (optimizer updates done), `epoch`, `seed`, the `optimizer`, the
    `strategy` and `loss_fn`, the loss the state trains on (declared at `create`, else the one
    the last `clip_and_step` applied; None before: the default loss), which `accumulate_grads`
    and `evaluate` use when they get none. Related values are grouped in small frozen
    sub-states: `data` (`DataState`: cursor, data position, batch size, tokens and samples seen),
    `early_stopping` (`EarlyStoppingState`) and `scaler` (`ScalerState`). Change one with
    `state.replace(data=state.data.replace(cursor=0))`.

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(), seed=0)
        >>> sorted(state.params), state.step, state.data.cursor
        (['bias', 'weight'], 0, 0)
    """

    tensors_: _Tensors = dataclasses.field(repr=False)
    optimizer: Optimizer
    strategy: Strategy
    step: int = 0
    epoch: int = 0
    seed: int = 0
    data: DataState = DataState()
    early_stopping: EarlyStoppingState = EarlyStoppingState()
    scaler: ScalerState = ScalerState()
    loss_fn: Callable[..., Any] | None = None

    @classmethod
    def create(
        cls,
        model: nn.Module,
        optimizer: Optimizer,
        *,
        seed: int = 0,
        strategy: Strategy | None = None,
        loss_fn: Callable[..., Any] | None = None,
    ) -> TrainState:
        """Set up `model` with `strategy` and initialise the optimizer state.

        Args:
            model: the module; it keeps owning its parameters. Parameters with
                `requires_grad=False` are frozen and left out of `params`.
            optimizer: an `ft.optim.Optimizer`.
            seed: drives data order and dropout; resume is exact without saving RNG state.
            strategy: device/distribution strategy, `SingleDevice()` by default.
            loss_fn: the loss this state trains on, `(model, batch) -> (loss_sum, num_items)`:
                `accumulate_grads` and `evaluate` use it when they get no `loss_fn`, so the
                evaluation reports (and `track_best` ranks by) the training loss. None: the
                default loss (`ft.losses.loss_for(model)`), until a step applies another.

        Raises:
            TypeError: if `model` is not an `nn.Module`, `optimizer` not an `Optimizer` or
                `loss_fn` not callable.
            ValueError: if the model has no trainable parameter, or one not initialised yet
                (a `torch.nn.Lazy*` module before its first forward), `seed` is outside
                [0, 2**63), or other processes of the job got another `seed` (one small
                collective at setup); without `strategy` in a job of several processes (an
                initialised process group, a launcher's `WORLD_SIZE` above 1, or a process
                that `ft.strategies.refuse_lone_process` finds one of several: a srun task,
                an MPI rank, a pod started with `python`), where the default would train each
                process alone on every row.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be an ft.optim.Optimizer, got {type(optimizer).__name__}; "
                "wrap torch optimizers with ft.optim.from_torch(torch.optim.X, **kw)"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if not 0 <= seed < 2**63:  # what a data position holds, and no two seeds collide
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be an ft.strategies.Strategy, got {strategy!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a function (model, batch) -> ..., got {loss_fn!r}")
        _refuse_lazy(model)
        if strategy is None:
            _refuse_default_in_a_job()
            strategy = SingleDevice()
        _same_seed_on_every_process(seed, strategy)
        if strategy.precision.loss_scaling is not None:
            _refuse_half_masters(model)
        model = strategy.setup(model)
        params = _trainable(strategy.unwrap(model))
        if not params:
            raise ValueError("model has no trainable parameter (all have requires_grad=False)")
        device = strategy.device
        scaling = strategy.precision.loss_scaling
        scaler = ScalerState()
        if scaling is not None:
            scaler = ScalerState(
                scale=torch.tensor(scaling.init_scale, dtype=torch.float32, device=device),
                growth_tracker=torch.zeros((), dtype=torch.int32, device=device),
            )
        tensors = _Tensors(
            model, MappingProxyType(params), optimizer.init(params), _Lease(),
            _frozen(strategy.unwrap(model)),
        )  # fmt: skip
        return cls(
            tensors_=tensors,
            optimizer=optimizer,
            strategy=strategy,
            seed=seed,
            data=DataState(tokens_seen=_zero(device), samples_seen=_zero(device)),
            scaler=scaler,
            loss_fn=loss_fn,
        )

    # Tensor-holding values are reached through properties so that a consumed state fails.
    @property
    def model(self) -> nn.Module:
        """The module (possibly wrapped by the strategy); it owns the parameters."""
        self.tensors_.lease.check()
        return self.tensors_.model

    @property
    def params(self) -> Mapping[str, torch.Tensor]:
        """Read-only mapping name -> trainable parameter (frozen ones excluded).

        Taken when the state is created: re-create the state after freezing or unfreezing.
        """
        self.tensors_.lease.check()
        return self.tensors_.params

    @property
    def opt_state(self) -> Any:
        """The optimizer state: a pytree of tensors keyed by parameter name."""
        self.tensors_.lease.check()
        return self.tensors_.opt_state

    @property
    def consumed(self) -> bool:
        """Whether a step function has consumed this state's tensors."""
        return self.tensors_.lease.consumed_by is not None

    def replace(self, **changes: Any) -> TrainState:
        """Return a copy with `changes` applied; it shares tensors (and donation) with `self`.

        `model` and `opt_state` may be replaced too (`params` follows `model`).

        Raises:
            TypeError: for a name that is not a field, or a value of the wrong type for one of
                `TrainState`'s own fields (a sub-state that is not one, a bool step, ...).
            ValueError: for a new `optimizer` without the `opt_state` it updates.
        """
        _check_changes(self, changes)
        return _replaced(self, self._fields(changes, self.tensors_.lease))

    def _fields(self, changes: dict[str, Any], lease: _Lease) -> dict[str, Any]:
        changes = dict(changes)
        model = changes.pop("model", self.tensors_.model)
        opt_state = changes.pop("opt_state", self.tensors_.opt_state)
        fields = type(self).__dataclass_fields__
        unknown = {k for k in changes if k not in fields or k == "tensors_"}
        if unknown:
            raise TypeError(f"{type(self).__name__} has no settable field(s) {sorted(unknown)}")
        params, frozen = self.tensors_.params, self.tensors_.frozen
        if model is not self.tensors_.model:
            params = MappingProxyType(_trainable(self.strategy.unwrap(model)))
            frozen = _frozen(self.strategy.unwrap(model))
        changes["tensors_"] = _Tensors(model, params, opt_state, lease, frozen)
        return changes

    def consume(self, by: str, **changes: Any) -> TrainState:
        """Mark this state consumed by `by`; return a fresh handle on the same tensors, with
        `changes` applied.

        Step functions call this after updating tensors in place; users rarely need it.
        """
        lease = self.tensors_.lease
        lease.check()
        fields = self._fields(changes, _Lease())
        lease.consume(by, self.step)
        return _replaced(self, fields)


# ftrain's own states, checked once at import (the step functions replace two a step).
_PLAIN = frozenset(c for c in (TrainState, DataState, EarlyStoppingState, ScalerState) if _plain(c))

# The types of TrainState's own fields that `replace` checks (the step functions' `consume`
# does not: its values come from the library). Plain values are range-checked at save.
_COUNTERS = ("step", "epoch", "seed")
_SUBSTATES = MappingProxyType(
    {"data": DataState, "early_stopping": EarlyStoppingState, "scaler": ScalerState}
)


def _check_changes(state: TrainState, changes: dict[str, Any]) -> None:
    """Refuse a `replace` whose value cannot be what the field holds: it would otherwise be
    stepped on and saved (a `data=None` drops the data position from every checkpoint; a
    `True` step counts as 1)."""
    for name, value in changes.items():
        want = _SUBSTATES.get(name)
        if name in _COUNTERS and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if want is not None and not isinstance(value, want):
            raise TypeError(
                f"{name} must be an ft.state.{want.__name__}, got {type(value).__name__}; "
                f"change one of its values with state.replace({name}=state.{name}.replace(...))"
            )
    checks: list[tuple[str, Any, str]] = [
        ("model", nn.Module, "a torch.nn.Module"),
        ("optimizer", Optimizer, "an ft.optim.Optimizer"),
        ("strategy", Strategy, "an ft.strategies.Strategy"),
    ]
    for name, kind, what in checks:
        if name in changes and not isinstance(changes[name], kind):
            raise TypeError(f"{name} must be {what}, got {type(changes[name]).__name__}")
    fn = changes.get("loss_fn")
    if fn is not None and not callable(fn):
        raise TypeError(f"loss_fn must be a function (model, batch) -> ... or None, got {fn!r}")
    new = changes.get("optimizer", state.optimizer)
    if new is not state.optimizer and "opt_state" not in changes:
        raise ValueError(
            "replace(optimizer=...) without opt_state=: the state's optimizer state was built "
            "by the old optimizer, which the new one would update (or ignore); pass "
            "opt_state=optimizer.init(state.params) too, or build the state with "
            "TrainState.create"
        )


def _same_seed_on_every_process(seed: int, strategy: Strategy) -> None:
    """Refuse seeds that differ between the job's processes (`seed=base + rank`, a habit from
    per-rank augmentation): `make_batches` shuffles by `state.seed`, so each rank would draw
    its own permutation and ranks would read overlapping rows and skip others, silently.

    Sums (1, h, h**2) of a 20-bit hash h of the seed over every process: all equal exactly when
    n * sum(h**2) == sum(h)**2 (float64 is exact here up to 8192 processes). One small
    collective and host read, at setup; none with one process.
    """
    h = float(_splitmix64(seed) >> 44)
    moments = torch.tensor([1.0, h, h * h], dtype=torch.float64, device=strategy.device)
    n, s1, s2 = (int(x) for x in strategy.sum_over_processes(moments).tolist())  # host sync
    if n > 1 and n * s2 != s1 * s1:
        raise ValueError(
            f"TrainState.create got seed={seed} here and another seed on other processes of "
            "the job: make_batches shuffles by state.seed, so ranks would read overlapping "
            "rows; pass the same seed on every process (dropout already differs per rank: "
            "ft.rng.dropout_seed folds in the rank)"
        )


def _frozen(module: nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(p for p in module.parameters() if not p.requires_grad)


def unfrozen(state: TrainState) -> list[str]:
    """Names of the model's parameters that were frozen when `state` was created and now
    require a gradient (empty in the usual case: checked in C over the frozen ones only)."""
    frozen = state.tensors_.frozen
    if not (frozen and any(map(_REQUIRES_GRAD, frozen))):
        return []
    ids = {id(p) for p in frozen if p.requires_grad}
    module = state.strategy.unwrap(state.model)
    return [n for n, p in module.named_parameters() if id(p) in ids]


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _refuse_half_masters(model: nn.Module) -> None:
    """Float16 loss scaling keeps float32 parameters (autocast computes in float16): a
    float16 parameter gets the scaled gradient in float16, which overflows at the first scale
    (65536 times a gradient of 1 is inf), so every step was skipped and the scale halved on, with
    no update. `torch.amp.GradScaler` refuses them too."""
    half = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    if half:
        shown = ", ".join(repr(n) for n in half[:3]) + (" ..." if len(half) > 3 else "")
        raise ValueError(
            f"precision='fp16' (loss scaling) needs float32 trainable parameters, got float16 "
            f"{shown}: autocast computes in float16 while the weights and their gradients stay "
            "float32; build the model in float32 (model.float()), or train float16 weights "
            "with precision='fp32' and no scaling"
        )


def _refuse_lazy(model: nn.Module) -> None:
    """Refuse parameters a `torch.nn.Lazy*` module has not shaped yet: the optimizer state and
    `params` are taken at create (AdamW's moments failed inside `zeros_like`, a plain SGD state
    at the first step, from torch's own message)."""
    lazy = [n for n, p in model.named_parameters() if is_lazy(p)]
    if lazy:
        shown = ", ".join(repr(n) for n in lazy[:3]) + (" ..." if len(lazy) > 3 else "")
        raise ValueError(
            f"parameter {shown} is not initialised yet (a torch.nn.Lazy* module shapes it at its "
            "first forward): run the model once on a batch, then create the TrainState"
        )


def _trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def snapshot(state: TrainState) -> TrainState:
    """Return an independent deep copy of `state` (model, optimizer state and counters).

    The copy is not affected when `state` is later donated to a step function, and vice versa.

    Raises:
        ValueError: inside `ft.optim.swap_ema(state)`: the model holds the EMA average and the
            optimizer state the live weights until the block ends, and a copy would keep them
            exchanged for good.

    Example:
        >>> import torch, ftrain as ft
        >>> s = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> c = ft.snapshot(s)
        >>> c.params["weight"] is s.params["weight"]
        False
    """
    held = state.tensors_
    held.lease.check()
    if ema_swapped(state):  # the copy's EmaState is no longer the swapped one: never swapped back
        raise ValueError(
            "snapshot of a state inside ft.optim.swap_ema(state): its model holds the EMA average "
            "until the block ends, and the copy would keep the weights exchanged; snapshot before "
            "or after the block"
        )
    model = state.strategy.clone_model(held.model)
    old = dict(held.model.named_parameters())
    new = dict(model.named_parameters())
    # Optimizer state may alias parameters (rare); map them onto the copy, clone the rest.
    memo = {id(old[n]): new[n] for n in old}
    opt_state = copy.deepcopy(held.opt_state, memo)
    params = MappingProxyType(_trainable(state.strategy.unwrap(model)))
    frozen = _frozen(state.strategy.unwrap(model))
    return dataclasses.replace(
        state,
        tensors_=_Tensors(model, params, opt_state, _Lease(), frozen),
        **_cloned(state),
    )


def _cloned(obj: Any) -> dict[str, Any]:
    """The tensors of `obj`'s plain fields and sub-states, cloned (a subclass's too)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name == "tensors_":
            continue
        if isinstance(v, torch.Tensor):
            out[f.name] = v.clone()
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[f.name] = dataclasses.replace(v, **_cloned(v))
    return out


def plain_values(state: TrainState) -> dict[str, Any]:
    """The state's values by dotted name, sub-states walked: `step`, `data.cursor`,
    `early_stopping.best_metric`, `scaler.scale`, ... (a subclass's fields too); the tensors,
    the optimizer, the strategy and the loss function are left out. What a checkpoint's
    `state.json` holds.

    Example:
        >>> import torch, ftrain as ft
        >>> from ftrain.state import plain_values
        >>> s = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> plain_values(s)["data.cursor"], "optimizer" in plain_values(s)
        (0, False)
    """
    return _walk(state, "")


_NOT_PLAIN = frozenset({"tensors_", "optimizer", "strategy", "loss_fn"})


def _walk(obj: Any, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name in _NOT_PLAIN:
            continue
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out.update(_walk(v, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = v
    return out


def next_epoch(state: TrainState) -> TrainState:
    """Return `state` at the start of the next epoch (`epoch + 1`, cursor 0, no data position)."""
    return state.replace(epoch=state.epoch + 1, data=state.data.replace(cursor=0, position=None))


def _refuse_default_in_a_job() -> None:
    """Refuse the default `SingleDevice()` in a job of several processes: each would train
    alone on every row (no gradient sync, and `make_batches` shards by the state's strategy),
    silently. A process that means to train alone says so with `SingleDevice()`."""
    dist = torch.distributed
    grouped = dist.is_available() and dist.is_initialized()
    if grouped:
        world = dist.get_world_size()
    else:
        try:  # torchrun, srun via export_launcher_env, ...: the group is not set up yet
            world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            world = 1  # not ours to judge here: from_env reports a malformed WORLD_SIZE
    if world > 1:
        raise ValueError(
            f"TrainState.create got no strategy in a job of {world} processes: the default "
            "SingleDevice() would train each process alone on every row (no gradient sync, "
            "make_batches shards nothing); pass strategy=ft.strategies.from_env('ddp') (or "
            "'fsdp', ...), or strategy=ft.strategies.SingleDevice() to train each alone"
        )
    if grouped:
        return
    try:  # srun, mpirun, a pod's `python`: one of several processes that WORLD_SIZE does not count
        refuse_lone_process()
    except ValueError as err:
        raise ValueError(
            f"TrainState.create got no strategy, and the default SingleDevice() would train "
            f"this process alone: {err}. Pass strategy=ft.strategies.from_env('ddp') (or "
            "'fsdp', ...) once launched so, or strategy=ft.strategies.SingleDevice() to train "
            "each process alone"
        ) from None
