"""Seeds as pure functions of a position: what makes resume exact without saving RNG state."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

__all__ = [
    "DeviceGenerator",
    "default_generators",
    "disable_dropout",
    "dropout_seed",
    "dropout_seeds",
    "dropout_sites",
    "restored",
]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def dropout_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """The RNG seed for one micro-batch's forward/backward: a pure function of its position.

    Because dropout masks depend only on `(seed, step, micro, rank)`, a resumed run draws the
    same masks as the uninterrupted one without saving any RNG state.
    """
    return _micro_seed(_step_part(seed, step), micro, rank)


def dropout_seeds(seed: int, step: int, rank: int, count: int) -> list[int]:
    """`[dropout_seed(seed, step, i, rank) for i in range(count)]`, the `(seed, step)` part
    hashed once.

    Example:
        >>> from ftrain.rng import dropout_seed, dropout_seeds
        >>> dropout_seeds(0, 5, 1, 3)[2] == dropout_seed(0, 5, 2, 1)
        True
    """
    h = _step_part(seed, step)
    rank &= _MASK64
    m, seeds = _MASK64, []
    for i in range(count):  # _micro_seed with both _splitmix64 rounds inlined (issue 30)
        x = ((h ^ i) + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        x = ((x ^ (x >> 31) ^ rank) + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        seeds.append((x ^ (x >> 31)) >> 1)
    return seeds


def _step_part(seed: int, step: int) -> int:
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def _micro_seed(h: int, micro: int, rank: int) -> int:
    # >> 1: torch.manual_seed wants a non-negative int64.
    return _splitmix64(_splitmix64(h ^ (micro & _MASK64)) ^ (rank & _MASK64)) >> 1


class DeviceGenerator(Protocol):
    """What `default_generators` returns: a `torch.Generator`, or a device's module-level
    generator (MPS keeps one behind `torch.mps.manual_seed`/`get_rng_state`)."""

    def manual_seed(self, seed: int) -> Any: ...

    def get_state(self) -> torch.Tensor: ...

    def set_state(self, new_state: torch.Tensor) -> Any: ...


class _ModuleGenerator:
    """A device module's one default generator (`torch.mps`) as a `DeviceGenerator`."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def manual_seed(self, seed: int) -> None:
        self.module.manual_seed(seed)

    def get_state(self) -> torch.Tensor:
        return self.module.get_rng_state()

    def set_state(self, new_state: torch.Tensor) -> None:
        self.module.set_rng_state(new_state)


def default_generators(device: torch.device) -> list[DeviceGenerator]:
    """The default generators that dropout on `device` draws from: the CPU one always, and
    the accelerator's (CUDA, XPU, MTIA, MPS, ... through `torch.get_device_module`).

    A device whose module has no default generator gets only the CPU one, with a
    `RuntimeWarning`: dropout there is neither seeded nor restored, so a resumed run does not
    draw the masks of the uninterrupted one.
    """
    gens: list[DeviceGenerator] = [torch.default_generator]
    if device.type in ("cpu", "meta"):  # meta tensors draw nothing
        return gens
    try:
        module: Any = torch.get_device_module(device.type)
    except RuntimeError:
        module = None
    own = getattr(module, "default_generators", None)
    if own is not None:
        # (device.index or ...) took the current device for index 0, which need not be 0.
        index = device.index if device.index is not None else module.current_device()
        if index >= len(own) and callable(getattr(module, "init", None)):
            module.init()  # the generators are made when the device is first used
            own = module.default_generators
        gens.append(own[index])
    elif all(callable(getattr(module, f, None)) for f in _MODULE_RNG):
        gens.append(_ModuleGenerator(module))  # MPS: one device, one generator
    else:
        warnings.warn(
            f"ftrain.rng.default_generators: device type {device.type!r} has no default "
            "generator that ftrain can seed (torch.get_device_module gives none with "
            "default_generators or manual_seed/get_rng_state/set_rng_state): dropout on it is "
            "neither seeded nor restored, so resume is not exact and each run draws other "
            "masks; only the CPU generator is seeded",
            RuntimeWarning,
            stacklevel=2,
        )
    return gens


_MODULE_RNG = ("manual_seed", "get_rng_state", "set_rng_state")


@contextlib.contextmanager
def restored(gens: Sequence[DeviceGenerator]) -> Iterator[None]:
    """Run the block, then put `gens` back in the state they had (the caller's stream)."""
    # Restore the generators afterwards, so the caller's random stream is untouched. (Seeding
    # the generators directly, not torch.manual_seed, avoids its lazy-CUDA bookkeeping, which
    # captures a stack trace per call: 0.1 ms a micro-batch.)
    saved = [g.get_state() for g in gens]
    try:
        yield
    finally:
        for g, s in zip(gens, saved, strict=True):
            g.set_state(s)


_DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def _rates(holder: object) -> list[tuple[str, float]]:
    """Functional dropout rates above 0 that a module (or its HF `config`) holds: float
    attributes named like a drop rate (HF's `attention_dropout`, `dropout` and
    `activation_dropout` in T5/BART layers, `hidden_dropout`, `layerdrop`, GPT-2's `*_pdrop`,
    timm's `drop_prob`), which a forward passes to a functional dropout."""
    return [
        (k, v)
        for k, v in vars(holder).items()
        if "drop" in k and type(v) is float and v > 0 and not k.startswith("_")
    ]


def _holders(model: nn.Module) -> Iterator[tuple[str, object]]:
    """(name, object) of each training-mode module that is no dropout module, and of each HF
    config such a module reads at forward time (Falcon reads `self.config.attention_dropout`
    there), each config once."""
    configs: set[int] = set()
    for name, module in model.named_modules():
        if not module.training or isinstance(module, _DROPOUTS):
            continue
        yield name, module
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, nn.Module) and id(config) not in configs:
            configs.add(id(config))
            yield (f"{name}.config" if name else "config"), config


def dropout_sites(model: nn.Module) -> list[str]:
    """Where `model` drops out in its training-mode forward: dropout modules of p > 0 and
    drop rates above 0 that a module's forward passes to a functional dropout (HF's
    `attention_dropout`, T5's and BART's `dropout`), as "name (p=...)"; modules in eval mode
    are not listed. Empty when the forward is deterministic in training mode (as far as
    modules say: a forward that calls `torch.rand` itself is not seen).

    Example:
        >>> import torch
        >>> from ftrain.rng import disable_dropout, dropout_sites
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
        >>> dropout_sites(model)
        ["'1' (p=0.1)"]
        >>> dropout_sites(disable_dropout(model))
        []
    """
    sites = [
        f"{name!r} (p={m.p})"
        for name, m in model.named_modules()
        if m.training and isinstance(m, _DROPOUTS) and m.p > 0
    ]
    for name, holder in _holders(model):
        sites += [f"{name + '.' if name else ''}{k} (p={v})" for k, v in _rates(holder)]
    return sites


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every rate `dropout_sites` finds to 0 (the model's HF config's rates too), in
    place, and return `model` (TRL's `disable_dropout`): for post-training whose log-probs
    are compared with ones computed without dropout (`ft.rl.policy_loss`,
    `ft.preference.preference_loss` with a reference).
    """
    for module in model.modules():
        if isinstance(module, _DROPOUTS):
            module.p = 0.0
    for _, holder in _holders(model):
        for k, _ in _rates(holder):
            setattr(holder, k, 0.0)
    return model
