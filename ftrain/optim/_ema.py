"""An exponential moving average of the parameters, kept as optimizer state.

The average lives in the optimizer state (keyed by parameter name), so checkpoints save and
restore it with everything else, and sharded (FSDP) parameters get sharded averages.
`swap_ema(state)` puts the average into the model for evaluation or export and restores the
live weights afterwards; `live_tensors(state)` says where each is meanwhile (checkpoints save
the live weights, inside the block too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ftrain.optim._base import (
    Grads,
    Optimizer,
    Params,
    _describes,
    _local,
    _number,
    describe,
    not_self_skipping,
)
from ftrain.process_state import STATE

if TYPE_CHECKING:
    from ftrain.state import TrainState

__all__ = ["EmaState", "ema", "ema_decay", "ema_swapped", "live_tensors", "swap_ema"]

_HALF = frozenset({torch.float16, torch.bfloat16})


class EmaState(NamedTuple):
    """State of `ema`: the wrapped optimizer's state and the average of each parameter."""

    inner: Any
    ema: dict[str, torch.Tensor]


def ema_decay(step: int, *, decay: float, warmup: bool = True, gamma: float = 1.0,
              power: float = 2 / 3) -> float:  # fmt: skip
    """The decay used by the EMA update made together with optimizer update number `step`.

    With `warmup`, `min(decay, 1 - (1 + step / gamma) ** -power)`: timm's `ModelEmaV3.get_decay`
    (timm/utils/model_ema.py, `warmup_gamma`, `warmup_power`) with its step counted from 0, so
    the first update copies the parameters and early averages are not dominated by the random
    initialisation. Without warmup, `decay` at every step.

    Example:
        >>> import ftrain as ft
        >>> ft.optim.ema_decay(0, decay=0.999), round(ft.optim.ema_decay(7, decay=0.999), 4)
        (0.0, 0.75)

    Raises:
        ValueError: for a `step` that is not an int >= 0.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0 (updates done before this one), got {step!r}")
    if not warmup:
        return decay
    return min(decay, 1.0 - (1.0 + step / gamma) ** -power)


def ema(
    optimizer: Optimizer,
    *,
    decay: float = 0.9999,
    warmup: bool = True,
    gamma: float = 1.0,
    power: float = 2 / 3,
) -> Optimizer:
    """Wrap `optimizer` so that each update also advances an EMA of the parameters.

    After the inner update, `ema = d * ema + (1 - d) * param` with `d = ema_decay(step, ...)`
    (`step`: updates done before this one). A skipped update (`found_inf`) leaves the average
    unchanged, without a host sync. Evaluate or export the average inside `swap_ema(state)`.

    Args:
        optimizer: the optimizer that trains the live parameters.
        decay: the decay once warmed up, in [0, 1).
        warmup: use timm's warmup (see `ema_decay`); False uses `decay` from the first step.
        gamma: timm's `warmup_gamma`, > 0 (with `warmup` only).
        power: timm's `warmup_power`, > 0 (2/3 for runs of ~1M steps, 3/4 for shorter ones;
            with `warmup` only).

    Example:
        >>> import torch, ftrain as ft
        >>> opt = ft.optim.ema(ft.optim.sgd(), decay=0.5, warmup=False)
        >>> p = {"w": torch.zeros(1)}
        >>> s = opt.update({"w": torch.ones(1)}, opt.init(p), p, lr=1.0, step=0)
        >>> p["w"].item(), s.ema["w"].item()    # the average moved half-way to -1
        (-1.0, -0.5)
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be an ft.optim.Optimizer (ema wraps one), got "
            f"{type(optimizer).__name__}"
        )
    not_self_skipping(optimizer, "ema")
    _number("decay", decay, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    _number("gamma", gamma, lambda v: v > 0, "> 0")
    _number("power", power, lambda v: v > 0, "> 0")
    if not isinstance(warmup, bool):
        raise TypeError(f"warmup must be True or False, got {warmup!r}")
    if not warmup and (gamma != 1.0 or power != 2 / 3):  # they shape the warmup alone
        raise ValueError(
            f"gamma={gamma!r} and power={power!r} shape the warmup, which warmup=False turns "
            "off: they would be ignored; drop them or pass warmup=True"
        )

    weight_dtypes: dict[tuple[Any, ...], torch.dtype] = {}
    dtypes_seen: dict[str, torch.dtype] = {}  # each name's dtype at `init`, over all states
    by_dtypes = False  # set once a name came back in another dtype

    def weight_dtype(
        names: list[str], averages: list[torch.Tensor], found_inf: torch.Tensor
    ) -> torch.dtype:
        # The skip-aware weight is a tensor: in float32 it would round 1 - decay (2.5e-8 off
        # at 0.9999), which float64 averages would see. The widest dtype, cached per names and
        # dtypes: one optimizer that trained a float32 model and then a float64 one with the
        # same names weighed the float64 average in float32. The first average's dtype keys
        # the common case; a name `init` met in two dtypes (a float32 "a" and "b", then a
        # float32 "a" with a float64 "b") keys them all.
        first = averages[0].dtype if averages else None
        layout = tuple(a.dtype for a in averages) if by_dtypes else first
        key = (tuple(names), layout, found_inf.dtype)
        dtype = weight_dtypes.get(key)
        if dtype is None:
            dtype = found_inf.dtype
            for a in averages:
                dtype = torch.promote_types(dtype, a.dtype)
            weight_dtypes[key] = dtype
        return dtype

    def init(params: Params) -> EmaState:
        half = {n: str(p.dtype) for n, p in params.items() if p.dtype in _HALF}
        if half:  # (1 - decay) * (param - ema) is mostly below their rounding step
            raise ValueError(
                f"ema averages each parameter in its own dtype, and a float16/bfloat16 average "
                f"stalls (most updates round away): {dict(list(half.items())[:5])}; train "
                f"float32 parameters (precision='bf16' autocasts them) to use ema"
            )
        nonlocal by_dtypes
        for n, p in params.items():
            by_dtypes |= dtypes_seen.setdefault(n, p.dtype) != p.dtype
        average = {n: p.detach().clone() for n, p in params.items()}
        return EmaState(optimizer.init(params), average)

    def update(
        grads: Grads,
        state: EmaState,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> EmaState:
        inner = optimizer.update(grads, state.inner, params, lr=lr, step=step, found_inf=found_inf)
        d = ema_decay(step, decay=decay, warmup=warmup, gamma=gamma, power=power)
        names = list(state.ema)
        averages = _local([state.ema[n] for n in names])
        live = _local([params[n].detach() for n in names])
        with torch.no_grad():
            if found_inf is None:
                torch._foreach_lerp_(averages, live, 1.0 - d)
            else:  # a 0-dim device weight, zero when skipped: no host sync
                keep = 1.0 - found_inf.to(weight_dtype(names, averages, found_inf))
                weight = keep * (1.0 - d)  # (torch's stubs lack this overload)
                torch._foreach_lerp_(averages, live, weight)  # type: ignore[call-overload]
        return EmaState(inner, state.ema)

    # Without warmup, gamma and power are not recorded: a checkpoint from before they were
    # refused records the values then accepted and ignored, and a setting recorded on one side
    # only is not compared, so it loads into ema(warmup=False) as it is now spelled.
    shape = {"gamma": gamma, "power": power} if warmup else {}
    _describes(update, lambda names: {
        "kind": "ema", "decay": decay, "warmup": warmup, **shape,
        "inner": describe(optimizer, names),
    })  # fmt: skip
    return Optimizer(init, update)


def _find(opt_state: Any) -> EmaState:
    if isinstance(opt_state, EmaState):
        return opt_state
    if isinstance(opt_state, tuple) and any(isinstance(s, EmaState) for s in opt_state):
        # ft.func.sweep([ema(...), ...]): the advice below (wrap in ema) is what sweep refuses.
        raise TypeError(
            "swap_ema swaps one ft.optim.ema average, and this state's optimizer holds one per "
            "member (ft.func.sweep of ema optimizers): swapping them in is not supported; "
            "evaluate a member's average from its EmaState.ema"
        )
    raise TypeError(
        f"swap_ema needs a state whose optimizer is ft.optim.ema(...), got an optimizer state "
        f"of type {type(opt_state).__name__}; wrap the optimizer: ft.optim.ema(ft.optim.adamw())"
    )


def _running_stats(model: torch.nn.Module) -> list[str]:
    """The buffers that training updates in the forward (BatchNorm's running statistics):
    those of every module that tracks running statistics, by their names in `model`."""
    return [
        f"{prefix}.{b}" if prefix else b
        for prefix, m in model.named_modules()
        if getattr(m, "track_running_stats", False) is True
        for b in ("running_mean", "running_var")
        if isinstance(getattr(m, b, None), torch.Tensor)
    ]


@contextlib.contextmanager
def swap_ema(state: TrainState, *, live_buffers: bool = False) -> Iterator[TrainState]:
    """Put the EMA weights into the model for the block, then the live weights back.

    Inside, `ft.evaluate(state, ...)` evaluates and `ft.export_pretrained(state, dir)` exports
    the averaged model, while `ft.save_checkpoint(state, ...)` still saves the live weights and
    the average (a resume trains on from the live weights). The swap is local to each rank
    (every DDP rank holds the same average; under FSDP each rank swaps its own shards and drops
    the whole parameters a forward gathered and kept, `Strategy.drop_gathered`), needs no
    communication and only one parameter-sized buffer at a time. Every forward inside computes
    with the average, every one after with the live weights; they come back even when the
    block raises.

    `ema` averages the trainable parameters only (its optimizer never sees the buffers), so a
    model with running statistics (BatchNorm) would evaluate the average with the statistics of
    the live weights; timm's `ModelEmaV2` averages them instead. Such a model is refused unless
    `live_buffers=True` says that the live buffers are meant (or that the block recomputes them,
    e.g. with `torch.optim.swa_utils.update_bn`, which changes the live ones too).

    Args:
        state: a state whose optimizer is `ft.optim.ema(...)`.
        live_buffers: accept the live buffers (running statistics) beside the averaged
            parameters.

    Raises:
        TypeError: when the state's optimizer is not wrapped in `ft.optim.ema`.
        ValueError: inside another `swap_ema` of the same state (it would swap back); for a
            model with running statistics without `live_buffers=True`.

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.ema(ft.optim.sgd()))
        >>> with ft.optim.swap_ema(state):
        ...     pass  # evaluate or export here
    """
    average = _find(state.opt_state).ema
    if not isinstance(live_buffers, bool):
        raise TypeError(f"live_buffers must be True or False, got {live_buffers!r}")
    stats = [] if live_buffers else _running_stats(state.strategy.unwrap(state.model))
    if stats:
        raise ValueError(
            f"swap_ema: ft.optim.ema averages the parameters, not the buffers, and the model's "
            f"running statistics {stats[:4]} are the live weights' (timm's ModelEmaV2 averages "
            f"them): the evaluation would not be the averaged model's. Pass "
            f"swap_ema(state, live_buffers=True) to use them anyway, or to recompute them for "
            f"the average inside the block (torch.optim.swa_utils.update_bn)"
        )
    if _swapped(average):
        raise ValueError(
            "swap_ema(state) is already active for this state: the model holds the average "
            "until that block ends; a nested swap would put the live weights back"
        )
    strategy = state.strategy
    local = strategy.local_view  # this rank's shards (FSDP), whole tensors otherwise
    pairs = [(local(state.params[n]), local(average[n])) for n in average]
    # Registered whenever the model may hold the average (an interrupt between the swap and
    # the registration would leave it unregistered).
    STATE.ema_swapped.append(average)
    try:
        _swap(pairs)
    except BaseException:
        _unregister(average)  # all or none: nothing was swapped
        raise
    try:
        # Whole parameters an earlier forward gathered and kept (FSDP2's root) hold the live
        # values: dropped, the next forward gathers the average (and after the block the live).
        strategy.drop_gathered(state.model)
        yield state
    finally:
        try:
            _swap(pairs)
        except BaseException as e:
            # The model still holds the average: registered, steps and loads refuse it and a
            # save writes the live weights from the EmaState, where they are.
            e.add_note(_STUCK)
            raise
        _unregister(average)
        strategy.drop_gathered(state.model)


_STUCK = (
    "swap_ema could not put the live weights back at the end of its block: the model still "
    "holds the EMA average and state.opt_state.ema the live weights, so ema_swapped(state) "
    "stays True and clip_and_step and load_checkpoint refuse the state; save_checkpoint(state) "
    "still saves the live weights: load that checkpoint into a new TrainState to go on"
)


def _unregister(average: dict[str, torch.Tensor]) -> None:
    STATE.ema_swapped[:] = [a for a in STATE.ema_swapped if a is not average]


def _swapped(average: dict[str, torch.Tensor]) -> bool:
    return any(a is average for a in STATE.ema_swapped)


def ema_swapped(state: TrainState) -> bool:
    """Whether `state`'s model holds its EMA average: inside `swap_ema` of it (or of a state
    sharing its tensors).

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.ema(ft.optim.sgd()))
        >>> with ft.optim.swap_ema(state):
        ...     inside = ft.optim.ema_swapped(state)
        >>> inside, ft.optim.ema_swapped(state)
        (True, False)
    """
    if not STATE.ema_swapped:  # no swap_ema block open (each step asks: no state read then)
        return False
    opt_state = state.opt_state
    return isinstance(opt_state, EmaState) and _swapped(opt_state.ema)


def live_tensors(state: TrainState) -> tuple[Mapping[str, torch.Tensor], Any]:
    """The state's `(params, opt_state)` as they are outside `swap_ema`, without copying.

    Inside `swap_ema(state)` the parameters hold the average and the `EmaState` the live
    weights: this returns, by name, the tensors that hold the live weights, and an `EmaState`
    whose averages are the tensors that hold them. Outside a swap (or without `ema`) it returns
    `(state.params, state.opt_state)`. Checkpoints save what it returns.

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.ema(ft.optim.sgd()))
        >>> with ft.optim.swap_ema(state):
        ...     params, opt_state = ft.optim.live_tensors(state)
        >>> params["weight"] is state.opt_state.ema["weight"]
        True
    """
    params, opt_state = state.params, state.opt_state
    if not ema_swapped(state):
        return params, opt_state
    live = MappingProxyType({**params, **opt_state.ema})
    return live, EmaState(opt_state.inner, {n: params[n] for n in opt_state.ema})


def _swap(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exchange the values of each pair, all or none: a failure part-way (an out-of-memory
    error, a KeyboardInterrupt, an average of another shape) swaps back the pairs already
    exchanged before it propagates, so the model never mixes live and averaged tensors.

    The temporaries, one per (device, dtype) of the largest tensor's size, are allocated
    before anything moves (no allocation can fail midway) and bound the extra memory.
    """
    bad = [(tuple(p.shape), tuple(a.shape)) for p, a in pairs if p.shape != a.shape]
    if bad:
        raise ValueError(
            f"swap_ema: an EMA average's shape differs from its parameter's {bad[:3]} (the "
            "optimizer state was changed after the state was created); nothing was swapped"
        )
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for p, _ in pairs:
        key = (p.device, p.dtype)
        sizes[key] = max(sizes.get(key, 0), p.numel())
    room = {k: torch.empty(n, dtype=k[1], device=k[0]) for k, n in sizes.items()}
    done, stage = 0, 0
    with torch.no_grad():
        try:
            for p, a in pairs:
                tmp = room[(p.device, p.dtype)][: p.numel()].view(p.shape)
                stage = 0
                tmp.copy_(p)
                stage = 1
                p.copy_(a)
                stage = 2
                a.copy_(tmp)
                done, stage = done + 1, 0  # (no call in between: no interrupt lands there)
        except BaseException:
            _undo(pairs, room, done, stage)
            raise


def _undo(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    room: dict[tuple[torch.device, torch.dtype], torch.Tensor],
    done: int,
    stage: int,
) -> None:
    """Put back what `_swap` exchanged before it failed at pair `done`, in `stage` (1: the
    temporary holds the parameter, which may hold the average; 2: the parameter holds the
    average, and the average holds the parameter if an interrupt came after that copy, or
    itself if the copy failed)."""
    if stage:
        p, a = pairs[done]
        if stage == 2 and not torch.equal(a, p):
            # The copy into the average failed, or wrote and then failed (an inference
            # tensor): put the average back if it can be written; the error follows anyway.
            with contextlib.suppress(Exception):
                a.copy_(p)
        p.copy_(room[(p.device, p.dtype)][: p.numel()].view(p.shape))
    for p, a in pairs[:done]:
        tmp = room[(p.device, p.dtype)][: p.numel()].view(p.shape)
        tmp.copy_(p)
        p.copy_(a)
        a.copy_(tmp)
