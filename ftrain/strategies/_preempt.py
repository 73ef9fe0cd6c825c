"""Preemption: a signal becomes a flag that every rank agrees on at the next step.

Clusters warn a job before they kill it (SLURM: `--signal=USR1@60`; torchrun forwards SIGTERM
to its workers and SIGKILLs them 30 s later). The handler only sets a flag; `accumulate_grads`
sums it over every process next to the all-reduce of the step's counts (one small collective,
no host sync), so every rank learns at the same step that some rank was signalled, and
`should_save` then says yes on all of them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections import deque
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch

from ftrain.process_state import STATE

__all__ = ["Preemption", "active", "on_preemption"]


class Preemption(contextlib.AbstractContextManager["Preemption"]):
    """The flag `on_preemption` installs; `requested` is what every rank agreed on.

    Attributes:
        signals: the signals it handles.
        received: a signal reached this process (its rank alone may know).

    It also notes the step at which `should_save` said yes only because of the request (a
    step its cadence skips): `save_checkpoint` marks that checkpoint preemption-only, and the
    spike guard rolls back past it, as the run never stopped would have (`off_cadence`).
    """

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received = False
        self._agreed = False
        # The last two reduced flags (device tensors); on CUDA one step old is read (below).
        self._seen: deque[tuple[torch.Tensor, Any]] = deque(maxlen=2)
        self._previous: dict[signal.Signals, Any] = {}
        self._off_cadence: int | None = None  # the step of the last should_save, if off cadence

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.signals)
        return f"Preemption(signals=({names}), requested={self._agreed})"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True  # only a flag: the step in flight finishes, the loop saves

    def local_flag(self, device: torch.device) -> torch.Tensor:
        """This rank's vote as a float64 vector of one, for the step's all-reduce."""
        # A non-blocking host-to-device copy is no sync (a no-op on the CPU).
        return torch.tensor([float(self.received)], dtype=torch.float64).to(
            device, non_blocking=True
        )

    def observe(self, total: torch.Tensor) -> None:
        """Record the all-reduced vote of one step (how many ranks were signalled)."""
        if total.device.type == "cpu":
            self._seen.append((total, None))
            return
        # Reading a device value is a host sync: copy it out asynchronously and read it one
        # step later, when the copy has long finished (every rank reads the same step's vote).
        host = torch.empty(total.shape, dtype=total.dtype, pin_memory=True)
        host.copy_(total, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(total.device))  # the copy's device, not the current
        self._seen.append((host, event))

    @property
    def requested(self) -> bool:
        """True once every rank knows that some rank was signalled (sticky).

        On the CPU it holds after the step whose `accumulate_grads` saw the signal; on a GPU
        one step later, so that reading it never waits for the device.
        """
        if not self._agreed and self._seen:
            value, event = self._seen[-1]
            if event is not None:  # the vote of the step before, unless this is the first
                if len(self._seen) < 2:
                    return False
                value, event = self._seen[0]
                event.synchronize()
            self._agreed = bool(value.item() > 0)
        return self._agreed

    def note_save(self, step: int, *, on_cadence: bool) -> None:
        """Record why `should_save` said yes at `step` (called by it): on its cadence, or only
        because of the request. The last call wins, so each save follows its own predicate."""
        self._off_cadence = None if on_cadence else step

    def off_cadence(self, step: int) -> bool:
        """Whether the last `should_save` said yes at `step` only because of the request."""
        return self._off_cadence == step

    def close(self) -> None:
        """Restore the handlers that were installed before (idempotent)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if STATE.preemption is self:
            STATE.preemption = None

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def on_preemption(
    signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1),
) -> Preemption:
    """Turn `signals` into a request to save and stop that every rank agrees on.

    The handler sets a flag; the next `accumulate_grads` adds it to the all-reduce it already
    does (one process needs none), and from then on `should_save` is True and `requested`
    is True on every rank, at the same step. The loop saves and leaves:

        preempt = ft.strategies.on_preemption()  # SIGTERM, SIGUSR1
        while state.step < total and not preempt.requested:
            for micro in ft.make_batches(...):
                ...  # accumulate_grads, clip_and_step
                if ft.should_save(state, every=500, total_steps=total):  # also on preemption
                    ft.save_checkpoint(state, root)
                if state.step >= total or preempt.requested:
                    break

    Call it in the main thread (Python runs signal handlers there), before the loop; one
    handler is active at a time. `close()` (or leaving a `with` block) restores the previous
    handlers.

    Args:
        signals: the signals that mean "you are about to be killed".

    Returns:
        The `Preemption`, whose `requested` the loop reads.

    Raises:
        ValueError: if `signals` is empty or holds SIGKILL or SIGSTOP (which cannot be caught),
            a handler is already active, or this is not the main thread.
        TypeError: if `signals` is not an iterable of `signal.Signals`.

    Every signal is checked before any handler is installed; on an error none stays installed.

    Example:
        >>> import os, signal, torch, ftrain as ft
        >>> preempt = ft.strategies.on_preemption(signals=(signal.SIGUSR1,))
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> batch = {"input": torch.ones(1, 2), "target": torch.ones(1, 1)}
        >>> loss = lambda m, b: (((m(b["input"]) - b["target"]) ** 2).sum(), 1)
        >>> os.kill(os.getpid(), signal.SIGUSR1)
        >>> grads, stats = ft.accumulate_grads(state, [batch], loss)
        >>> state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
        >>> preempt.requested, ft.should_save(state, every=1000)
        (True, True)
        >>> preempt.close()
    """
    sigs = _checked(signals)
    if STATE.preemption is not None:
        raise ValueError(
            f"{STATE.preemption!r} is already active: close() it before installing another"
        )
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("on_preemption must be called in the main thread (signal handlers)")
    handler = Preemption(sigs)
    try:
        for s in sigs:
            handler._previous[s] = signal.signal(s, handler._handle)
    except BaseException:
        handler.close()  # all or nothing: a half-installed handler would outlive the error
        raise
    STATE.preemption = handler
    return handler


# The kernel delivers these without asking the process: no handler can be installed.
_UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})


def _checked(signals: Iterable[signal.Signals]) -> tuple[signal.Signals, ...]:
    """`signals` as a tuple without repeats, once every entry is a signal a handler can catch."""
    if isinstance(signals, (str, bytes)) or not isinstance(signals, Iterable):
        raise TypeError(
            f"signals must be an iterable of signal.Signals, e.g. (signal.SIGTERM,), got "
            f"{signals!r}"
        )
    sigs = tuple(dict.fromkeys(signals))  # a repeat would record our own handler as previous
    if not sigs:
        raise ValueError("signals is empty: pass e.g. (signal.SIGTERM, signal.SIGUSR1)")
    for s in sigs:
        if not isinstance(s, signal.Signals):
            raise TypeError(f"signals must hold signal.Signals members, got {s!r}")
    uncatchable = [s.name for s in sigs if s in _UNCATCHABLE]
    if uncatchable:
        raise ValueError(
            f"signals holds {', '.join(uncatchable)}, which no process can catch: a scheduler "
            "sends it to kill, after the catchable warning (SIGTERM, SIGUSR1) that "
            "on_preemption handles; drop it from signals"
        )
    return sigs


def active() -> Preemption | None:
    """The installed handler, if any (read by `accumulate_grads` and `should_save`)."""
    handler = STATE.preemption
    return handler if isinstance(handler, Preemption) else None
