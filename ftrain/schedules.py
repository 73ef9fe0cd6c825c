"""Learning-rate schedules as pure `step -> lr` functions, equal to `transformers.get_scheduler`.

`step` is the number of optimizer updates already done (`state.step`), so `lr(0)` is the rate of
the first update, exactly as HF's `LambdaLR`-based schedulers give it. Every schedule returns
`peak_lr * factor(step)` with HF's factor formula, hence the same floats.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

__all__ = [
    "Plateau",
    "PlateauState",
    "Schedule",
    "constant",
    "cosine_warmup_with_min_lr",
    "cosine_with_min_lr",
    "from_name",
    "schedule_lr",
    "warmup_constant",
    "warmup_cosine",
    "warmup_cosine_restarts",
    "warmup_inverse_sqrt",
    "warmup_linear",
    "warmup_polynomial",
    "warmup_stable_decay",
]


class Schedule(Protocol):
    """`schedule(step) -> lr`, pure."""

    def __call__(self, step: int) -> float: ...


@dataclasses.dataclass(frozen=True)
class _Sched:
    name: str
    peak_lr: float
    factor: Callable[..., float]
    kwargs: dict[str, Any]

    def __call__(self, step: int) -> float:
        if type(step) is not int:  # the common case (state.step) takes no call
            step = _index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.peak_lr * self.factor(step, **self.kwargs)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}(peak_lr={self.peak_lr!r}, {args})"


def _index(step: Any) -> int:
    # operator.index refuses a float tensor, which hasattr(step, "__index__") let through: a
    # fractional step gave a fractional lr (lr(torch.tensor(2.5))).
    try:
        if isinstance(step, bool):
            raise TypeError
        return operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int (updates done, state.step), got {step!r}") from None


def _warm(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _f_constant(step: int) -> float:
    return 1.0


def _f_warmup_constant(step: int, *, warmup_steps: int) -> float:
    return step / float(max(1.0, warmup_steps)) if step < warmup_steps else 1.0


def _f_linear(step: int, *, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return _warm(step, warmup_steps)
    return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))


def _progress(step: int, warmup_steps: int, total_steps: int) -> float:
    return float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))


def _f_cosine(
    step: int, *, warmup_steps: int, total_steps: int, num_cycles: float, min_lr_rate: float = 0.0
) -> float:
    if step < warmup_steps:
        return _warm(step, warmup_steps)
    progress = _progress(step, warmup_steps, total_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    if min_lr_rate:
        return max(0, factor * (1 - min_lr_rate) + min_lr_rate)
    return max(0.0, factor)


def _f_restarts(step: int, *, warmup_steps: int, total_steps: int, num_cycles: int) -> float:
    if step < warmup_steps:
        return _warm(step, warmup_steps)
    progress = _progress(step, warmup_steps, total_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _f_polynomial(
    step: int, *, warmup_steps: int, total_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    if step < warmup_steps:
        return _warm(step, warmup_steps)
    if step > total_steps:
        return lr_end / lr_init
    remaining = 1 - (step - warmup_steps) / (total_steps - warmup_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _f_inverse_sqrt(step: int, *, warmup_steps: int, timescale: int) -> float:
    if step < warmup_steps:
        return _warm(step, warmup_steps)
    return 1.0 / math.sqrt((step + timescale - warmup_steps) / timescale)


def _f_cosine_rate(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    num_cycles: float,
    min_lr_rate: float,
    warmup_lr_rate: float | None,
) -> float:
    s, w, t = float(step), float(warmup_steps), float(total_steps)
    if s < w:
        if warmup_lr_rate is None:
            return (s + 1.0) / max(1.0, w)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * s / max(1, w - 1)
    progress = (s - w + 1.0) / max(1.0, t - w)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


_SHAPES: Mapping[str, Callable[[float], float]] = MappingProxyType(
    {
        "linear": lambda p: p,
        "cosine": lambda p: 0.5 * (1.0 - math.cos(math.pi * p)),
        "1-sqrt": lambda p: 1.0 - math.sqrt(1.0 - p),
    }
)
_DECAYS: Mapping[str, Callable[[float, float], float]] = MappingProxyType(
    {
        "linear": lambda p, c: 1.0 - p,
        "cosine": lambda p, c: 0.5 * (1.0 + math.cos(math.pi * float(c) * 2.0 * p)),
        "1-sqrt": lambda p, c: 1.0 - math.sqrt(p),
    }
)


def _f_wsd(
    step: int,
    *,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if step < warmup_steps:
        factor = _SHAPES[warmup_type](float(step) / float(max(1, warmup_steps)))
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < warmup_steps + stable_steps:
        return 1.0
    if step < warmup_steps + stable_steps + decay_steps:
        p = float(step - warmup_steps - stable_steps) / float(max(1, decay_steps))
        factor = _DECAYS[decay_type](p, num_cycles)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


def _check_common(
    peak_lr: float, warmup_steps: int, total_steps: int | None, *, needs_total: str = ""
) -> None:
    _check_nonnegative(peak_lr=peak_lr)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        hint = " (a ratio of total_steps goes to ft.schedules.from_name)"
        raise ValueError(
            f"warmup_steps must be an int >= 0, got {warmup_steps!r}"
            + (hint if isinstance(warmup_steps, float) else "")
        )
    if total_steps is None:
        if needs_total:
            raise ValueError(f"{needs_total} needs total_steps (an int >= 1), got None")
    elif isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # True is not 1.0


def _check_nonnegative(**values: float) -> None:
    for name, value in values.items():
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_steps(low: int = 0, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def constant(peak_lr: float) -> Schedule:
    """`lr(step) = peak_lr` (HF "constant")."""
    _check_common(peak_lr, 0, None)
    return _Sched("constant", peak_lr, _f_constant, {})


def warmup_constant(peak_lr: float, warmup_steps: int) -> Schedule:
    """Linear warmup `peak_lr * step / warmup_steps` (0 at step 0), then constant
    (HF "constant_with_warmup")."""
    _check_common(peak_lr, warmup_steps, None)
    return _Sched("warmup_constant", peak_lr, _f_warmup_constant, {"warmup_steps": warmup_steps})


def warmup_linear(peak_lr: float, warmup_steps: int, total_steps: int) -> Schedule:
    """Linear warmup from 0, then linear decay to 0 at `total_steps` and 0 after (HF "linear").

    Example:
        >>> import ftrain as ft
        >>> lr = ft.schedules.warmup_linear(1.0, warmup_steps=2, total_steps=4)
        >>> [lr(s) for s in range(6)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _check_common(peak_lr, warmup_steps, total_steps, needs_total="warmup_linear")
    return _Sched(
        "warmup_linear",
        peak_lr,
        _f_linear,
        {"warmup_steps": warmup_steps, "total_steps": total_steps},
    )


def warmup_cosine(
    peak_lr: float, warmup_steps: int, total_steps: int, *, num_cycles: float = 0.5
) -> Schedule:
    """Linear warmup from 0, then `0.5 * (1 + cos(pi * 2 * num_cycles * progress))` where
    `progress = (step - warmup) / (total - warmup)`, floored at 0 (HF "cosine").

    Example:
        >>> import ftrain as ft
        >>> lr = ft.schedules.warmup_cosine(1.0, warmup_steps=1, total_steps=3)
        >>> [round(lr(s), 3) for s in range(4)]
        [0.0, 1.0, 0.5, 0.0]
    """
    _check_common(peak_lr, warmup_steps, total_steps, needs_total="warmup_cosine")
    _check_nonnegative(num_cycles=num_cycles)
    return _Sched(
        "warmup_cosine",
        peak_lr,
        _f_cosine,
        {"warmup_steps": warmup_steps, "total_steps": total_steps, "num_cycles": num_cycles},
    )


def warmup_cosine_restarts(
    peak_lr: float, warmup_steps: int, total_steps: int, *, num_cycles: int = 1
) -> Schedule:
    """Warmup, then `num_cycles` hard-restarted cosine decays; 0 from `total_steps` on
    (HF "cosine_with_restarts")."""
    _check_common(peak_lr, warmup_steps, total_steps, needs_total="warmup_cosine_restarts")
    _check_steps(1, num_cycles=num_cycles)
    return _Sched(
        "warmup_cosine_restarts",
        peak_lr,
        _f_restarts,
        {"warmup_steps": warmup_steps, "total_steps": total_steps, "num_cycles": num_cycles},
    )


def warmup_polynomial(
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    *,
    lr_end: float = 1e-7,
    power: float = 1.0,
) -> Schedule:
    """Warmup, then `(peak - lr_end) * (1 - progress) ** power + lr_end`, and `lr_end` after
    `total_steps` (HF "polynomial").

    Raises:
        ValueError: unless `peak_lr > lr_end >= 0`, `power >= 0` and `total_steps >
            warmup_steps`.
    """
    _check_common(peak_lr, warmup_steps, total_steps, needs_total="warmup_polynomial")
    _check_nonnegative(lr_end=lr_end, power=power)
    if not peak_lr > lr_end:
        raise ValueError(f"lr_end ({lr_end}) must be smaller than peak_lr ({peak_lr})")
    if total_steps <= warmup_steps:  # the decay would divide by total - warmup = 0
        raise ValueError(
            f"total_steps ({total_steps}) must be > warmup_steps ({warmup_steps}) for a "
            "polynomial decay"
        )
    return _Sched(
        "warmup_polynomial",
        peak_lr,
        _f_polynomial,
        {
            "warmup_steps": warmup_steps,
            "total_steps": total_steps,
            "lr_end": lr_end,
            "power": power,
            "lr_init": peak_lr,
        },
    )


def warmup_inverse_sqrt(
    peak_lr: float, warmup_steps: int, *, timescale: int | None = None
) -> Schedule:
    """Warmup, then `1 / sqrt((step + timescale - warmup) / timescale)`; `timescale` defaults
    to `warmup_steps or 10_000` (HF "inverse_sqrt")."""
    _check_common(peak_lr, warmup_steps, None)
    timescale = (warmup_steps or 10_000) if timescale is None else timescale
    _check_steps(1, timescale=timescale)
    return _Sched(
        "warmup_inverse_sqrt",
        peak_lr,
        _f_inverse_sqrt,
        {"warmup_steps": warmup_steps, "timescale": timescale},
    )


def _min_rate(peak_lr: float, min_lr: float | None, min_lr_rate: float | None) -> float:
    if (min_lr is None) == (min_lr_rate is None):
        raise ValueError("give exactly one of min_lr or min_lr_rate")
    if min_lr_rate is not None:
        _check_nonnegative(min_lr_rate=min_lr_rate)
        if min_lr_rate > 1:  # the "decay" would rise from peak_lr to min_lr_rate * peak_lr
            raise ValueError(f"min_lr_rate must be in [0, 1], got {min_lr_rate!r}")
        return float(min_lr_rate)
    _check_nonnegative(min_lr=min_lr)  # type: ignore[arg-type]
    if peak_lr == 0 and min_lr:
        raise ValueError(f"min_lr={min_lr!r} needs peak_lr > 0 (got 0): pass min_lr_rate")
    if min_lr > peak_lr:  # type: ignore[operator]
        raise ValueError(
            f"min_lr ({min_lr}) must be <= peak_lr ({peak_lr}): the schedule would rise to it"
        )
    return min_lr / peak_lr if peak_lr else 0.0  # type: ignore[operator]


def cosine_with_min_lr(
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    *,
    num_cycles: float = 0.5,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
) -> Schedule:
    """Like `warmup_cosine` but decaying to `min_lr` (or `min_lr_rate * peak_lr`)
    (HF "cosine_with_min_lr")."""
    _check_common(peak_lr, warmup_steps, total_steps, needs_total="cosine_with_min_lr")
    _check_nonnegative(num_cycles=num_cycles)
    rate = _min_rate(peak_lr, min_lr, min_lr_rate)
    return _Sched(
        "cosine_with_min_lr",
        peak_lr,
        _f_cosine,
        {
            "warmup_steps": warmup_steps,
            "total_steps": total_steps,
            "num_cycles": num_cycles,
            "min_lr_rate": rate,
        },
    )


def cosine_warmup_with_min_lr(
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    *,
    num_cycles: float = 0.5,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
    warmup_lr_rate: float | None = None,
) -> Schedule:
    """HF "cosine_warmup_with_min_lr": warmup starts at `(step + 1) / warmup` (or at
    `warmup_lr_rate`), and the cosine is one step ahead of `cosine_with_min_lr`."""
    _check_common(peak_lr, warmup_steps, total_steps, needs_total="cosine_warmup_with_min_lr")
    _check_nonnegative(num_cycles=num_cycles)
    rate = _min_rate(peak_lr, min_lr, min_lr_rate)
    if warmup_lr_rate is not None and not (_is_number(warmup_lr_rate) and 0 <= warmup_lr_rate <= 1):
        raise ValueError(
            f"warmup_lr_rate must be None or a number in [0, 1], got {warmup_lr_rate!r}"
        )
    return _Sched(
        "cosine_warmup_with_min_lr",
        peak_lr,
        _f_cosine_rate,
        {
            "warmup_steps": warmup_steps,
            "total_steps": total_steps,
            "num_cycles": num_cycles,
            "min_lr_rate": rate,
            "warmup_lr_rate": warmup_lr_rate,
        },
    )


def _wsd_stable_steps(warmup: int, decay: int, total: int | None, stable: int | None) -> int:
    """The stable phase's length: `stable` if given (it must agree with `total` when both are
    given: HF only warns and ignores `total`), else what `total` leaves after the other phases."""
    if stable is not None:
        _check_steps(num_stable_steps=stable)
        if total is not None and warmup + stable + decay != total:
            raise ValueError(
                f"total_steps ({total}) != warmup_steps ({warmup}) + num_stable_steps ({stable}) "
                f"+ num_decay_steps ({decay}): pass one of total_steps and num_stable_steps, "
                "or values that agree"
            )
        return stable
    if total is None:
        raise ValueError("warmup_stable_decay needs total_steps or num_stable_steps")
    if total - warmup - decay < 0:
        raise ValueError(
            f"total_steps ({total}) < warmup_steps ({warmup}) + num_decay_steps "
            f"({decay}): no room for the phases"
        )
    return total - warmup - decay


def warmup_stable_decay(
    peak_lr: float,
    warmup_steps: int,
    total_steps: int | None = None,
    *,
    num_decay_steps: int,
    num_stable_steps: int | None = None,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> Schedule:
    """Warmup, a stable phase at `peak_lr`, then a decay to `min_lr_ratio * peak_lr`
    (HF "warmup_stable_decay"); the stable phase lasts `num_stable_steps`, or what remains of
    `total_steps`.

    Raises:
        ValueError: if both `total_steps` and `num_stable_steps` are given and
            `warmup_steps + num_stable_steps + num_decay_steps != total_steps` (HF warns and
            keeps `num_stable_steps`; one of the two would be ignored).
    """
    _check_common(peak_lr, warmup_steps, total_steps)
    _check_steps(num_decay_steps=num_decay_steps)
    stable = _wsd_stable_steps(warmup_steps, num_decay_steps, total_steps, num_stable_steps)
    _check_nonnegative(num_cycles=num_cycles)
    if not (_is_number(min_lr_ratio) and 0 <= min_lr_ratio <= 1):
        raise ValueError(f"min_lr_ratio must be a number in [0, 1], got {min_lr_ratio!r}")
    for name, kind in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if kind not in _SHAPES:
            raise ValueError(f"{name} must be one of {sorted(_SHAPES)}, got {kind!r}")
    return _Sched(
        "warmup_stable_decay",
        peak_lr,
        _f_wsd,
        {
            "warmup_steps": warmup_steps,
            "stable_steps": stable,
            "decay_steps": num_decay_steps,
            "warmup_type": warmup_type,
            "decay_type": decay_type,
            "min_lr_ratio": min_lr_ratio,
            "num_cycles": num_cycles,
        },
    )


# name -> (builder, whether it needs total_steps, HF's scheduler-specific keywords)
_BY_NAME: Mapping[str, tuple[Callable[..., Schedule], bool, tuple[str, ...]]] = MappingProxyType(
    {
        "constant": (lambda peak_lr, warmup_steps, total_steps: constant(peak_lr), False, ()),
        "constant_with_warmup": (
            lambda peak_lr, warmup_steps, total_steps: warmup_constant(peak_lr, warmup_steps),
            False,
            (),
        ),
        "linear": (warmup_linear, True, ()),
        "cosine": (warmup_cosine, True, ("num_cycles",)),
        "cosine_with_restarts": (warmup_cosine_restarts, True, ("num_cycles",)),
        "polynomial": (warmup_polynomial, True, ("lr_end", "power")),
        "inverse_sqrt": (
            lambda peak_lr, warmup_steps, total_steps, **kw: warmup_inverse_sqrt(
                peak_lr, warmup_steps, **kw
            ),
            False,
            ("timescale",),
        ),
        "cosine_with_min_lr": (cosine_with_min_lr, True, ("num_cycles", "min_lr", "min_lr_rate")),
        "cosine_warmup_with_min_lr": (
            cosine_warmup_with_min_lr,
            True,
            ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
        ),
        "warmup_stable_decay": (
            warmup_stable_decay,
            False,
            (
                "num_decay_steps",
                "num_stable_steps",
                "warmup_type",
                "decay_type",
                "min_lr_ratio",
                "num_cycles",
            ),
        ),
    }
)


def _warmup_from_ratio(where: str, warmup_steps: float, total_steps: int | None) -> int:
    # transformers 5 (TrainingArguments.get_warmup_steps): a float < 1 is a ratio, rounded up.
    if not (_is_number(warmup_steps) and math.isfinite(warmup_steps)):
        raise ValueError(
            f"{where}: warmup_steps must be an int >= 0 or a float ratio in [0, 1), "
            f"got {warmup_steps!r}"
        )
    if isinstance(warmup_steps, int) or warmup_steps >= 1:
        if warmup_steps < 0 or not float(warmup_steps).is_integer():
            raise ValueError(
                f"{where}: warmup_steps must be an int >= 0 or a float ratio in [0, 1), "
                f"got {warmup_steps!r}"
            )
        return int(warmup_steps)
    if warmup_steps < 0:
        raise ValueError(f"{where}: warmup_steps must be >= 0, got {warmup_steps!r}")
    if total_steps is None:
        raise ValueError(
            f"{where}: warmup_steps={warmup_steps} is a ratio of total_steps; pass total_steps"
        )
    return math.ceil(total_steps * warmup_steps)


def from_name(
    name: str,
    *,
    peak_lr: float,
    warmup_steps: int | float = 0,
    total_steps: int | None = None,
    **hf_kwargs: Any,
) -> Schedule:
    """Build a schedule from HF's `lr_scheduler_type` name and `lr_scheduler_kwargs`.

    `warmup_steps` is a count, or a float in [0, 1) that is a ratio of `total_steps`, rounded
    up: transformers 5's `TrainingArguments(warmup_steps=0.1)` (its old `warmup_ratio`).

    Example:
        >>> import ftrain as ft
        >>> lr = ft.schedules.from_name("linear", peak_lr=1.0, warmup_steps=0.1, total_steps=95)
        >>> [lr(5), lr(10)]  # warmup: ceil(0.1 * 95) = 10 steps
        [0.5, 1.0]

    Raises:
        ValueError: for an unknown name (the message lists the known ones), a missing
            `total_steps` where the schedule decays, a warmup for "constant" (which has none:
            HF ignores it; use "constant_with_warmup"), or a bad value.
        TypeError: for a keyword that schedule does not take (the message lists those it does).
    """
    return _by_name(f"from_name({name!r})", name, peak_lr, warmup_steps, total_steps, hf_kwargs)


def _by_name(
    where: str,
    name: str,
    peak_lr: float,
    warmup_steps: int | float,
    total_steps: int | None,
    hf_kwargs: dict[str, Any],
) -> Schedule:
    # `where` is the call the user wrote (from_name or schedule_lr), for the error messages.
    if not isinstance(name, str) or name not in _BY_NAME:
        hint = " (use ft.schedules.Plateau)" if name == "reduce_lr_on_plateau" else ""
        raise ValueError(f"unknown schedule name={name!r}{hint}; known: {sorted(_BY_NAME)}")
    build, needs_total, known = _BY_NAME[name]
    for key in hf_kwargs:
        if key not in known:
            hint = "; warmup_steps=0.1 is a ratio of total_steps" if key == "warmup_ratio" else ""
            raise TypeError(
                f"{where} got an unexpected keyword {key!r}; {name!r} takes "
                f"{list(known) or 'none'} besides peak_lr, warmup_steps, total_steps{hint}"
            )
    if needs_total and total_steps is None:
        raise ValueError(f"{where} needs total_steps (an int >= 1), got None")
    warmup = _warmup_from_ratio(where, warmup_steps, total_steps)
    if name == "constant" and warmup:
        raise ValueError(
            f"{where}: 'constant' has no warmup, got warmup_steps={warmup_steps!r}: use "
            "'constant_with_warmup', or warmup_steps=0 (HF's 'constant' ignores it)"
        )
    return build(peak_lr, warmup, total_steps, **hf_kwargs)


def schedule_lr(
    step: int,
    *,
    name: str,
    peak_lr: float,
    warmup_steps: int | float = 0,
    total_steps: int | None = None,
    **hf_kwargs: Any,
) -> float:
    """The learning rate of update `step` under HF's schedule `name`.

    Example:
        >>> import ftrain as ft
        >>> ft.schedule_lr(50, name="linear", peak_lr=1.0, warmup_steps=0, total_steps=100)
        0.5
    """
    where = f"schedule_lr(name={name!r})"
    return _by_name(where, name, peak_lr, warmup_steps, total_steps, hf_kwargs)(step)


class PlateauState(NamedTuple):
    """State of the plateau rule: current `lr`, `best` metric, bad evaluations in a row, and the
    remaining cooldown."""

    lr: float
    best: float
    num_bad: int
    cooldown_left: int


@dataclasses.dataclass(frozen=True)
class Plateau:
    """Reduce the lr when a metric stops improving, as a pure state transition.

    Same rule as `torch.optim.lr_scheduler.ReduceLROnPlateau` (HF "reduce_lr_on_plateau").
    The `PlateauState` is yours to carry, and no checkpoint holds it unless you put it in one:
    a resumed run that calls `init` again starts over at the initial lr. Keep its four values
    as plain fields of a `TrainState` subclass (checkpoints save a subclass's plain fields, as
    for `ft.guard.GuardedState`; a `PlateauState` field itself is refused) and rebuild it with
    `PlateauState(lr, best, num_bad, cooldown_left)` after `load_checkpoint`.

    Example:
        >>> import ftrain as ft
        >>> rule = ft.schedules.Plateau(patience=1, factor=0.5)
        >>> s = rule.init(1.0)
        >>> for loss in [1.0, 1.0, 1.0]:
        ...     s = rule.update(s, loss)
        >>> s.lr
        0.5
    """

    mode: str = "min"
    factor: float = 0.1
    patience: int = 10
    threshold: float = 1e-4
    threshold_mode: str = "rel"
    cooldown: int = 0
    min_lr: float = 0.0
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if self.threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold_mode must be 'rel' or 'abs', got {self.threshold_mode!r}")
        if not (_is_number(self.factor) and 0.0 < self.factor < 1.0):
            raise ValueError(f"factor must be a number in (0, 1), got {self.factor!r}")
        _check_steps(patience=self.patience, cooldown=self.cooldown)
        _check_nonnegative(threshold=self.threshold, min_lr=self.min_lr, eps=self.eps)

    def init(self, lr: float) -> PlateauState:
        """The state before any evaluation, at learning rate `lr`.

        Raises:
            ValueError: for an `lr` that is not a finite number >= 0 (a NaN lr never
                reduced, a string failed at the first reduction).
        """
        _check_nonnegative(lr=lr)
        return PlateauState(lr, math.inf if self.mode == "min" else -math.inf, 0, 0)

    def _better(self, a: float, best: float) -> bool:
        t = self.threshold
        if self.mode == "min":
            return a < (best * (1.0 - t) if self.threshold_mode == "rel" else best - t)
        return a > (best * (t + 1.0) if self.threshold_mode == "rel" else best + t)

    def update(self, state: PlateauState, metric: float) -> PlateauState:
        """Fold one evaluation `metric` into `state`; the new lr is `result.lr`."""
        lr, best, num_bad, cooldown_left = state
        metric = float(metric)
        if self._better(metric, best):
            best, num_bad = metric, 0
        else:
            num_bad += 1
        if cooldown_left > 0:
            cooldown_left, num_bad = cooldown_left - 1, 0
        if num_bad > self.patience:
            new_lr = max(lr * self.factor, self.min_lr)
            if lr - new_lr > self.eps:
                lr = new_lr
            cooldown_left, num_bad = self.cooldown, 0
        return PlateauState(lr, best, num_bad, cooldown_left)
