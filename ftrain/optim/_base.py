"""Optimizers as optax-shaped `(init, update)` pairs that run PyTorch's fused kernels in place.

`update` mutates the parameters it is given (they are donated by `clip_and_step`) and returns the
new optimizer state. The learning rate is an argument of every update, so schedules carry no
state, and `found_inf` lets a step skip itself on the device without a host sync.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple, Protocol

import torch

from ftrain.optim import _traceable
from ftrain.strategies import local_views

__all__ = [
    "AdamState",
    "ChainState",
    "DampedSGDState",
    "Optimizer",
    "SGDState",
    "Transform",
    "adam",
    "adamw",
    "chain",
    "describe",
    "sgd",
]

Params = Mapping[str, torch.Tensor]
Grads = Mapping[str, torch.Tensor]
Mask = Collection[str] | Callable[[str], bool] | None


class UpdateFn(Protocol):
    def __call__(
        self,
        grads: Grads,
        state: Any,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> Any: ...


class Optimizer(NamedTuple):
    """A pair of functions: `init(params) -> state` and `update(grads, state, params, *, lr,
    step, found_inf=None) -> state`.

    `update` applies the step to `params` in place (skipping it where `found_inf` is nonzero,
    without a host sync) and returns the new state. `step` is the number of updates done.
    """

    init: Callable[[Params], Any]
    update: UpdateFn


class Transform(NamedTuple):
    """A gradient transformation: `init(params) -> state`, `update(grads, state, params) ->
    (grads, state)`. Combine transforms with an optimizer through `chain`."""

    init: Callable[[Params], Any]
    update: Callable[[Grads, Any, Params], tuple[Grads, Any]]


class AdamState(NamedTuple):
    """State of `adam`/`adamw`: updates applied (`steps`), the two moments, and each
    parameter's own update count (`counts`), all keyed by name.

    As in `torch.optim.Adam` (its `state["step"]`), a parameter without a gradient in a step
    is neither updated nor counted, and its bias correction reads its own count: after four
    updates that alternate between two heads, `steps` is 4 and each head's count is 2.
    """

    steps: torch.Tensor
    mu: dict[str, torch.Tensor]
    nu: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor]


class SGDState(NamedTuple):
    """State of `sgd`: momentum buffers keyed by parameter name (empty without momentum).

    Without dampening a buffer's first update from zero, `momentum * 0 + g`, is the gradient
    itself, as torch's first update (`buf = clone(g)`): no per-parameter flag is needed.
    """

    momentum: dict[str, torch.Tensor]


class DampedSGDState(NamedTuple):
    """State of `sgd` with momentum and dampening: the buffers and whether each has `started`
    (a 0-dim bool per parameter), keyed by name.

    As in `torch.optim.SGD`, a parameter's first update sets its buffer to the gradient and
    only later ones are damped (`buf = momentum * buf + (1 - dampening) * g`). A parameter
    without a gradient in a step, or a step skipped as non-finite, starts nothing: a head
    whose gradients start at step 5 has its buffer set to its gradient at step 5.
    """

    momentum: dict[str, torch.Tensor]
    started: dict[str, torch.Tensor]


class ChainState(NamedTuple):
    """State of `chain`: the transforms' states, then the optimizer's."""

    transforms: tuple[Any, ...]
    inner: Any


Settings = dict[str, Any]  # an optimizer's hyperparameters as JSON (`describe`)
_DESCRIBE = "_ftrain_settings"  # the attribute of an `update` function that describes it


def describe(optimizer: Optimizer | Transform, names: Sequence[str]) -> Settings | None:
    """The hyperparameters of `optimizer`, applied to the parameters `names`, as JSON; None
    for an optimizer ftrain cannot describe (one you built yourself, `from_torchopt`).

    Checkpoints record it, and `load_checkpoint` refuses a state whose optimizer differs
    (adamw(weight_decay=0.1) saved, adam() loaded), naming the setting. `"kind"` names the
    optimizer; a mask is recorded as the names it leaves without weight decay (`no_decay`),
    so a predicate and the list it selects describe alike. The learning rate is not a setting:
    it is each step's argument, and a resume may change its schedule.

    Example:
        >>> import ftrain as ft
        >>> d = ft.optim.describe(ft.optim.adamw(weight_decay=0.1, mask=["w"]), ["w", "b"])
        >>> d["kind"], d["weight_decay"], d["no_decay"]
        ('adamw', 0.1, ['b'])
    """
    how = getattr(optimizer.update, _DESCRIBE, None)
    return None if how is None else how(list(names))


def _describes(update: Callable[..., Any], how: Callable[[list[str]], Settings | None]) -> None:
    """Attach `how` (names -> settings) to an `update` function, for `describe`."""
    setattr(update, _DESCRIBE, how)


def described(optimizer: Optimizer, how: Callable[[list[str]], Settings | None]) -> Optimizer:
    """Attach `how` (parameter names -> the settings as JSON) to an optimizer built from parts
    (`ft.func.sweep`), so that `describe` reports it and a checkpoint refuses a resume with
    other settings, as it does for ftrain's own optimizers. Returns `optimizer`."""
    _describes(optimizer.update, how)
    return optimizer


# An optimizer whose update decides from the gradients it is given which of its slices skip a
# step (`ft.func.sweep`: each member's own non-finite gradient). Inside `partition` each group
# would decide on its part of the gradients (a member skipping in one group, stepping in
# another); inside `ema` one skip would hold every average: neither is what separate runs do.
_SELF_SKIPPING = "_ftrain_self_skipping"


def self_skipping(optimizer: Optimizer) -> Optimizer:
    """Mark `optimizer` as deciding its own partial skips from its gradients (`ft.func.sweep`):
    `partition` and `ema` refuse to wrap it (`not_self_skipping`)."""
    setattr(optimizer.update, _SELF_SKIPPING, True)
    return optimizer


def not_self_skipping(optimizer: Optimizer, wrapper: str) -> None:
    """Refuse to wrap an optimizer `self_skipping` marked (see there)."""
    if getattr(optimizer.update, _SELF_SKIPPING, False):
        raise ValueError(
            f"{wrapper} of ft.func.sweep: the sweep skips a member whose gradient is not finite "
            "on its own, which "
            + ("each group would decide on its part of the gradients"
               if wrapper.startswith("partition") else "one average update for all cannot follow")
            + "; wrap each member's optimizer instead, e.g. ft.func.sweep([ft.optim.ema("
            "ft.optim.adamw()), ...]) or sweep([ft.optim.partition(...), ...])"
        )  # fmt: skip


def _no_decay(decays: Callable[[str], bool], names: list[str], weight_decay: float) -> Settings:
    """The names a mask leaves undecayed, as `describe` records them (none without decay)."""
    return {"no_decay": sorted(n for n in names if not decays(n))} if weight_decay else {}


def _counters(params: Params) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Adam's step count and each parameter's own, 0-dim float32 tensors: views of one vector
    when the parameters share a device, so that a step in which every parameter has a gradient
    counts them all in one op (`_shared_base`; issue 30: the fused kernel's count increments
    were one op per parameter on the CPU)."""
    devices = {p.device for p in params.values()}
    if len(devices) == 1:
        steps, *each = torch.zeros(len(params) + 1, device=devices.pop()).unbind()
        return steps, dict(zip(params, each, strict=True))
    first = next(iter(params.values()))
    steps = torch.zeros((), dtype=torch.float32, device=first.device)
    return steps, {
        n: torch.zeros((), dtype=torch.float32, device=p.device) for n, p in params.items()
    }


def _shared_base(state: AdamState, with_grads: int) -> torch.Tensor | None:
    """The vector `_counters` made, when this step counts every parameter and the counters are
    still its views (a `snapshot` or `replace` copy holds separate tensors: None then)."""
    base = state.steps._base
    counts = state.counts
    if base is None or with_grads != len(counts) or base.numel() != len(counts) + 1:
        return None
    # (In C, no generator frames: a small step notices each Python call.)
    return base if all(map(operator.is_, map(_BASE, counts.values()), repeat(base))) else None


_BASE = attrgetter("_base")


def _take(mapping: Mapping[str, Any], names: list[str]) -> list[Any]:
    """`[mapping[n] for n in names]`, in one C call (a fused step asks four times a group)."""
    got = itemgetter(*names)(mapping)
    return list(got) if len(names) > 1 else [got]


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This process's parts of `tensors` (shards under FSDP), the tensors themselves otherwise.

    The fused kernels update them in place, which updates the sharded parameters. `update` has
    no strategy at hand, so `ft.strategies.local_views` answers the placement question.
    """
    return local_views(tensors)


def _check(name: str, value: float, ok: bool, want: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {want}, got {value!r}")


def _number(name: str, value: Any, ok: Callable[[float], bool], want: str = "") -> None:
    """Refuse a hyperparameter that is not a finite Python number satisfying `ok` (`want`
    says which: "in [0, 1)").

    `True` is not 1 here, and a string or tensor would otherwise fail deep inside a kernel.
    """
    want = f" {want}" if want else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number{want}, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name} must be a finite number{want}, got {value!r}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _masker(mask: Mask) -> Callable[[str], bool]:
    if mask is None:
        return lambda name: True
    if callable(mask):
        return mask
    # A mapping would be taken for its keys, whatever its values say: refused.
    if isinstance(mask, (str, bytes, Mapping)) or not isinstance(mask, Collection):
        raise TypeError(
            f"mask must be None, a function name -> bool or a collection of parameter names, "
            f"got {mask!r}; e.g. mask=ft.optim.decay_mask(model)"
        )
    names = frozenset(mask)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"mask must hold parameter names (strings), got {sorted(map(repr, names))}")
    return names.__contains__


# Name prefixes of the wrappers whose parameters ftrain names without them: torch.compile's
# `_orig_mod.` and DDP's `module.` (TrainState.params holds the unwrapped module's names).
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class GroupParams(dict[str, torch.Tensor]):
    """The parameters of one group of `partition`, with `whole`, every parameter the state
    trains: what a group's mask is checked against (a model's decay mask may name none of one
    group's parameters, as meant)."""

    __slots__ = ("whole",)

    def __init__(self, group: Mapping[str, torch.Tensor], whole: Params) -> None:
        super().__init__(group)
        self.whole = whole


def check_mask_names(mask: Mask, params: Params, weight_decay: float = 1.0) -> None:
    """Refuse, at `init`, a mask that names parameters through a wrapper (`_orig_mod.0.weight`
    for `0.weight`), or (with weight decay) names none of the trainable parameters (taken
    from the model before `get_peft_model` wrapped it): no name would match, and weight decay
    would silently apply to none."""
    if mask is None or callable(mask):
        return
    for name in mask:
        if name in params:
            continue
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix) and name[len(prefix) :] in params:
                raise ValueError(
                    f"mask names {name!r}, but the parameter is {name[len(prefix) :]!r} (the "
                    f"state names the unwrapped model's parameters): build the mask from the "
                    f"model before torch.compile/DDP wraps it, e.g. ft.optim.decay_mask(model)"
                )
    pool = getattr(params, "whole", params)  # a partition group: the state's every parameter
    if weight_decay and len(mask) and pool and not any(n in pool for n in mask):
        named = ", ".join(repr(n) for n in sorted(mask)[:2])
        trainable = ", ".join(repr(n) for n in list(pool)[:2])
        raise ValueError(
            f"mask names none of the trainable parameters (it names {named}, ...; they are "
            f"{trainable}, ...): weight decay would apply to none. Build the mask from the model "
            "as it is trained, after get_peft_model or ft.lora.apply wrapped it "
            "(ft.optim.decay_mask(model)), or pass weight_decay=0"
        )


class _Groups:
    """Split (present) parameter names by device, dtype and decay; cached per set of names.

    The fused kernels take lists of same-device, same-dtype tensors; computing the split once
    keeps the per-step Python work to a dict lookup.
    """

    def __init__(self, decays: Callable[[str], bool]) -> None:
        self._decays = decays
        self._cache: dict[tuple[Any, ...], list[tuple[bool, list[str]]]] = {}
        self._layout: dict[str, tuple[torch.device, torch.dtype]] = {}
        self._by_layout = False

    def seen(self, params: Params) -> None:
        """Note, at `init`, where and in what dtype the parameters of a new state are.

        One optimizer object may serve several states (a float32 run, then the model converted
        to bfloat16 in part): a split cached by name alone would then group a bfloat16 tensor
        with float32 ones (the CPU's fused SGD leaves most of it untrained). From the first
        name met in another placement on, each step's key holds the layout too.
        """
        for n, p in params.items():
            where = (p.device, p.dtype)
            if self._layout.setdefault(n, where) != where:
                self._by_layout = True

    def __call__(self, grads: Grads, params: Params) -> list[tuple[bool, list[str]]]:
        key: tuple[Any, ...] = tuple(grads)
        if self._by_layout:
            key = (key, tuple((params[n].device, params[n].dtype) for n in key))
        groups = self._cache.get(key)
        if groups is None:
            split: dict[tuple[torch.device, torch.dtype, bool], list[str]] = {}
            for name in grads:
                p = params[name]
                split.setdefault((p.device, p.dtype, self._decays(name)), []).append(name)
            groups = [(decay, names) for (_, _, decay), names in split.items()]
            self._cache[key] = groups
        return groups


def _adam(
    decoupled: bool,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    mask: Mask,
    maximize: bool,
) -> Optimizer:
    _validate_adam(betas, eps, weight_decay)
    _flag("maximize", maximize)
    b1, b2 = betas
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    decays = _masker(mask)
    groups = _Groups(decays)

    def init(params: Params) -> AdamState:
        check_mask_names(mask, params, weight_decay)
        groups.seen(params)
        steps, counts = _counters(params)
        return AdamState(
            steps=steps,
            mu={
                n: torch.zeros_like(p, memory_format=torch.preserve_format)
                for n, p in params.items()
            },
            nu={
                n: torch.zeros_like(p, memory_format=torch.preserve_format)
                for n, p in params.items()
            },
            counts=counts,
        )

    def update(
        grads: Grads,
        state: AdamState,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> AdamState:
        # Counts go up by one before the kernel, which reads the post-increment count as
        # torch.optim's Adam does, and not for a skipped step (found_inf 1): taken back after,
        # or `keep` 0.
        split = [
            (decay, names, _take(state.counts, names)) for decay, names in groups(grads, params)
        ]
        base = _shared_base(state, len(grads))
        if base is not None:  # every parameter has a gradient: one op for all the counts,
            base.add_(1.0)  # and one to take a skipped step's back after the kernel
        else:  # a list of tensors: the scalar overloads loop through a slower path on the CPU
            keep = state.steps.new_ones(()) if found_inf is None else torch.rsub(found_inf, 1.0)
            counted = [state.steps, *(c for _, _, counts in split for c in counts)]
            torch._foreach_add_(counted, [keep] * len(counted))
        for decay, names, counts in split:
            kernel(
                _local(_take(params, names)),
                _local(_take(grads, names)),
                _local(_take(state.mu, names)),
                _local(_take(state.nu, names)),
                [],
                counts,
                lr=lr,
                beta1=b1,
                beta2=b2,
                weight_decay=weight_decay if decay else 0.0,
                eps=eps,
                amsgrad=False,
                maximize=maximize,
                grad_scale=None,
                found_inf=found_inf,
            )
        if base is not None and found_inf is not None:
            base.sub_(found_inf)
        return state

    twin = _traceable.adam_twin(
        decoupled=decoupled, betas=betas, eps=eps, weight_decay=weight_decay, groups=groups,
        maximize=maximize,
    )  # fmt: skip
    _traceable.register(update, twin)
    _describes(update, lambda names: {
        "kind": "adamw" if decoupled else "adam", "betas": [b1, b2], "eps": eps,
        "weight_decay": weight_decay, "maximize": maximize,
        **_no_decay(decays, names, weight_decay),
    })  # fmt: skip
    return Optimizer(init, update)


def _validate_adam(betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not (isinstance(betas, tuple) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        _number(f"betas[{i}]", b, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    _number("eps", eps, lambda v: v >= 0.0, ">= 0")
    _number("weight_decay", weight_decay, lambda v: v >= 0.0, ">= 0")


def adamw(
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Mask = None,
    maximize: bool = False,
) -> Optimizer:
    """AdamW (decoupled weight decay) on PyTorch's fused kernel; equals `torch.optim.AdamW`.

    Args:
        betas: moment decay rates.
        eps: added to the denominator.
        weight_decay: decoupled decay, multiplied by the step's lr.
        mask: parameter names (or a predicate on names) that get weight decay; all when None.
            `ft.optim.decay_mask(model)` gives HF's rule.
        maximize: ascend instead of descend.

    Example:
        >>> import torch, ftrain as ft
        >>> opt = ft.optim.adamw(weight_decay=0.1)
        >>> p = {"w": torch.ones(2)}
        >>> s = opt.update({"w": torch.ones(2)}, opt.init(p), p, lr=0.1, step=0)
        >>> [round(x, 4) for x in p["w"].tolist()]
        [0.89, 0.89]
    """
    return _adam(True, betas, eps, weight_decay, mask, maximize)


def adam(
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask = None,
    maximize: bool = False,
) -> Optimizer:
    """Adam (L2 weight decay added to the gradient) on the fused kernel; equals `torch.optim.Adam`.

    Args:
        betas: moment decay rates.
        eps: added to the denominator.
        weight_decay: L2 coefficient added to the gradient.
        mask: names (or a predicate) that get weight decay; all when None.
        maximize: ascend instead of descend.
    """
    return _adam(False, betas, eps, weight_decay, mask, maximize)


def sgd(
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Mask = None,
    maximize: bool = False,
) -> Optimizer:
    """SGD with optional (Nesterov) momentum on the fused kernel; equals `torch.optim.SGD`.

    As in torch, a parameter's first update sets its momentum buffer to the gradient itself
    and later ones compute `buf = momentum * buf + (1 - dampening) * g`; a parameter whose
    gradients start late, or whose first step is skipped as non-finite, starts at its first
    applied update. With `dampening` the state is a `DampedSGDState`, which records which
    buffers have started, and the update runs torch's own ops per parameter (the fused
    kernel's first step is one flag for all); otherwise an `SGDState` and the fused kernel.

    Args:
        momentum: momentum factor.
        dampening: dampening of the momentum (needs `momentum > 0`: without a momentum buffer
            it has nothing to damp, and `torch.optim.SGD` ignores it).
        nesterov: use Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
        weight_decay: L2 coefficient added to the gradient.
        mask: names (or a predicate) that get weight decay; all when None.
        maximize: ascend instead of descend.
    """
    _number("momentum", momentum, lambda v: v >= 0.0, ">= 0")
    _number("dampening", dampening, lambda v: v >= 0.0, ">= 0")
    _number("weight_decay", weight_decay, lambda v: v >= 0.0, ">= 0")
    _flag("nesterov", nesterov)
    _flag("maximize", maximize)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov=True needs momentum > 0 and dampening == 0, got momentum={momentum}, "
            f"dampening={dampening}"
        )
    if dampening != 0 and momentum == 0:
        # torch.optim.SGD takes it and does nothing with it: it damps the momentum buffer,
        # which momentum=0 does not keep.
        raise ValueError(
            f"dampening={dampening} damps the momentum buffer, which momentum=0 does not keep: "
            "it would be ignored; pass momentum > 0, or drop dampening"
        )
    decays = _masker(mask)
    groups = _Groups(decays)
    damped = bool(momentum) and dampening != 0

    def init(params: Params) -> SGDState | DampedSGDState:
        check_mask_names(mask, params, weight_decay)
        groups.seen(params)
        if momentum == 0:
            return SGDState(momentum={})
        buffers = {n: torch.zeros_like(p) for n, p in params.items()}
        if not damped:
            return SGDState(momentum=buffers)
        started = {n: torch.zeros((), dtype=torch.bool, device=p.device) for n, p in params.items()}
        return DampedSGDState(momentum=buffers, started=started)

    def update(
        grads: Grads,
        state: SGDState | DampedSGDState,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> SGDState | DampedSGDState:
        if isinstance(state, DampedSGDState) is not damped:
            _wrong_sgd_state(state, momentum, dampening)
        for decay, names in groups(grads, params):
            if isinstance(state, DampedSGDState):
                _damped_sgd(
                    _local(_take(params, names)),
                    _local(_take(grads, names)),
                    _local(_take(state.momentum, names)),
                    _take(state.started, names),
                    lr=lr, momentum=momentum, dampening=dampening,
                    weight_decay=weight_decay if decay else 0.0, maximize=maximize,
                    found_inf=found_inf,
                )  # fmt: skip
                continue
            ps = _local(_take(params, names))
            if ps[0].dtype in _HALF and ps[0].device.type == "cpu":  # see _plain_sgd
                _plain_sgd(
                    ps,
                    _local(_take(grads, names)),
                    _local(_take(state.momentum, names)) if momentum else [],
                    lr=lr, momentum=momentum, nesterov=nesterov,
                    weight_decay=weight_decay if decay else 0.0, maximize=maximize,
                    found_inf=found_inf,
                )  # fmt: skip
                continue
            torch._fused_sgd_(
                ps,
                _local(_take(grads, names)),
                _local(_take(state.momentum, names)) if momentum else [],
                weight_decay=weight_decay if decay else 0.0,
                momentum=momentum,
                lr=lr,
                dampening=dampening,
                nesterov=nesterov,
                maximize=maximize,
                is_first_step=step == 0 and bool(momentum),  # CUDA warns otherwise
                grad_scale=None,
                found_inf=found_inf,
            )
        return state

    twin = _traceable.sgd_twin(
        momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
        groups=groups, maximize=maximize,
    )  # fmt: skip
    _traceable.register(update, twin)
    _describes(update, lambda names: {
        "kind": "sgd", "momentum": momentum, "dampening": dampening, "nesterov": nesterov,
        "weight_decay": weight_decay, "maximize": maximize,
        **_no_decay(decays, names, weight_decay),
    })  # fmt: skip
    return Optimizer(init, update)


def _wrong_sgd_state(state: Any, momentum: float, dampening: float) -> None:
    want = "DampedSGDState" if momentum and dampening else "SGDState"
    raise TypeError(
        f"sgd(momentum={momentum}, dampening={dampening}) updates an ft.optim.{want}, got "
        f"{type(state).__name__}: build the state with this optimizer's init (TrainState.create)"
    )


# torch 2.13's CPU `_fused_sgd_` leaves the vectorised part of a float16/bfloat16 tensor
# unchanged (only the last numel % 16 elements move, `torch.optim.SGD(fused=True)` too): such
# groups take `_plain_sgd`, torch's for-loop update.
_HALF = frozenset({torch.float16, torch.bfloat16})


def _plain_sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    buffers: list[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    found_inf: torch.Tensor | None,
) -> None:
    """`torch.optim.SGD`'s update without dampening, op for op as its for-loop path (`buf`
    starts at zero, so its first update `momentum * 0 + g` is the gradient, as torch's clone);
    a step with `found_inf` nonzero changes nothing, without a host sync."""
    keep = None if found_inf is None else found_inf == 0
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        g = g.neg() if maximize else g
        g = g.add(p, alpha=weight_decay) if weight_decay else g
        if momentum:
            buf = buffers[i]
            new = buf.mul(momentum).add_(g)
            buf.copy_(new if keep is None else torch.where(keep, new, buf))
            g = g.add(new, alpha=momentum) if nesterov else new
        if keep is None:
            p.add_(g, alpha=-lr)
        else:
            p.copy_(torch.where(keep, p.add(g, alpha=-lr), p))


def _damped_sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    buffers: list[torch.Tensor],
    started: list[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    maximize: bool,
    found_inf: torch.Tensor | None,
) -> None:
    """`torch.optim.SGD`'s update with momentum and dampening, op for op as its for-loop
    path, where each parameter's `started` flag picks the first update (`buf = g`) on the
    device, without a host sync; a step with `found_inf` nonzero changes nothing."""
    keep = None if found_inf is None else found_inf == 0
    for p, g, buf, s in zip(params, grads, buffers, started, strict=True):
        g = g.neg() if maximize else g
        g = g.add(p, alpha=weight_decay) if weight_decay else g
        new = torch.where(s, buf.mul(momentum).add_(g, alpha=1 - dampening), g)
        if keep is None:
            buf.copy_(new)
            p.add_(new, alpha=-lr)
            s.fill_(True)
        else:
            buf.copy_(torch.where(keep, new, buf))
            p.copy_(torch.where(keep, p.add(new, alpha=-lr), p))
            s.logical_or_(keep)


def chain(*parts: Transform | Optimizer) -> Optimizer:
    """Run gradient `Transform`s in order, then the final `Optimizer`.

    Example:
        >>> import torch, ftrain as ft
        >>> opt = ft.optim.chain(ft.optim.clip(0.5), ft.optim.sgd())
        >>> p = {"w": torch.zeros(2)}
        >>> _ = opt.update({"w": torch.tensor([3.0, -0.1])}, opt.init(p), p, lr=1.0, step=0)
        >>> p["w"].tolist()
        [-0.5, 0.10000000149011612]
    """
    if not parts or not isinstance(parts[-1], Optimizer):
        raise TypeError("chain(...) must end with an ft.optim.Optimizer such as adamw() or sgd()")
    inner = parts[-1]
    transforms: list[Transform] = []
    for i, t in enumerate(parts[:-1]):
        if not isinstance(t, Transform):
            raise TypeError(
                f"chain argument {i} must be an ft.optim.Transform, got {type(t).__name__}"
            )
        transforms.append(t)

    def init(params: Params) -> ChainState:
        return ChainState(tuple(t.init(params) for t in transforms), inner.init(params))

    def update(
        grads: Grads,
        state: ChainState,
        params: Params,
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> ChainState:
        states = []
        for t, s in zip(transforms, state.transforms, strict=True):
            grads, s = t.update(grads, s, params)
            states.append(s)
        new_inner = inner.update(grads, state.inner, params, lr=lr, step=step, found_inf=found_inf)
        return ChainState(tuple(states), new_inner)

    _describes(update, lambda names: {
        "kind": "chain",
        "parts": [*(describe(t, names) for t in transforms), describe(inner, names)],
    })  # fmt: skip
    chained = Optimizer(init, update)
    return self_skipping(chained) if getattr(inner.update, _SELF_SKIPPING, False) else chained
