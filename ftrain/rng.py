"""Seeds as pure functions of a position: what makes resume exact without saving RNG state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["default_generators", "dropout_seed", "restored"]

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
    h = 0
    for part in (seed, step, micro, rank):
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1  # torch.manual_seed wants a non-negative int64


def default_generators(device: torch.device) -> list[torch.Generator]:
    """The default generators that dropout on `device` draws from (the CPU one always)."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index or torch.cuda.current_device()])
    return gens


@contextlib.contextmanager
def restored(gens: list[torch.Generator]) -> Iterator[None]:
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
