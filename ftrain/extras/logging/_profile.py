"""A sink that captures a `torch.profiler` trace of chosen optimizer steps."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ftrain.extras.logging._rank import _known_rank, _process_rank
from ftrain.state import TrainState

__all__ = ["Profiler"]


class Profiler:
    """Profile optimizer steps `first..last` (inclusive, counted like `state.step`) of the loop.

    Use it as a sink: its `step(state)`, called after every `clip_and_step`, drives torch's
    wait/warmup/active schedule from `state.step`, so a resumed run profiles the same steps.
    The profiler starts `warmup` steps before `first` (their events are discarded: the first
    steps after starting a profiler are distorted by its own setup) and writes one trace when
    step `last` is done, with `torch.profiler.tensorboard_trace_handler`:
    `<logdir>/<worker>.<time>.pt.trace.json`, a Chrome trace that TensorBoard's profiler plugin
    (`tensorboard --logdir <logdir>`) and Perfetto (ui.perfetto.dev) open. Recorded steps are
    marked `ProfilerStep#<k>` in the trace, k counted from the profiler's start (step `first` is
    `ProfilerStep#<warmup>`).

    Args:
        logdir: folder for the trace.
        steps: `(first, last)` optimizer steps to record; `first` must be at least
            `warmup + 2`, since profiling starts at the `step()` call after step
            `first - warmup - 1`.
        warmup: steps run under the profiler before recording.
        rank: names the trace's worker (`rank<k>`); build one per rank to profile each.
            None: the job's rank (the process group's, else the launcher's `RANK`, else 0),
            taken when profiling starts if neither is set up when the profiler is built.
        **profile_kwargs: passed on to `torch.profiler.profile` (e.g. `record_shapes=True`,
            `profile_memory=True`, `with_stack=True`, `activities=[...]`).

    A run resumed inside the window (its first `step()` is after step `first - warmup - 1`)
    does not crash on every automatic restart: resumed during the warmup, it records steps
    `first..last` after the warmup steps that are left (step `first` is then an earlier
    `ProfilerStep#`); resumed once a step of `first..last` ran unprofiled, it writes no trace
    of the window. Both warn (`RuntimeWarning`).

    Raises:
        ValueError: on an impossible window.

    Example:
        >>> import ftrain as ft
        >>> prof = ft.logging.Profiler("runs/x/profile", steps=(10, 12))
        >>> prof.window
        (9, 12)
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        steps: tuple[int, int],
        warmup: int = 1,
        rank: int | None = None,
        **profile_kwargs: Any,
    ) -> None:
        if not (isinstance(steps, (tuple, list)) and len(steps) == 2 and all(map(_int, steps))):
            # A float step never equals state.step: the profiler would silently never start.
            raise TypeError(f"steps must be (first, last), two ints, got {steps!r}")
        first, last = steps
        if not _int(warmup) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        if not 2 + warmup <= first <= last:
            raise ValueError(
                f"steps must be (first, last) with warmup + 2 <= first <= last, got {steps} "
                f"with warmup={warmup}: the profiler starts after a step, so step 1 cannot be "
                "profiled; pass later steps or a smaller warmup"
            )
        self.logdir, self.first, self.last, self.warmup = Path(logdir), first, last, warmup
        self.window = (first - warmup, last)
        # None until the profiler starts when the rank is not known yet (a process group set
        # up after building it): every rank named its trace rank0 then.
        self.rank, self.profile_kwargs = _known_rank(rank), profile_kwargs
        self.done = False
        self._prof: Any = None
        self._seen = False

    def step(self, state: TrainState) -> None:
        done_step = state.step  # a Python int: reading it is no host sync
        if not self._seen:
            self._seen = True
            if self.first - self.warmup - 1 < done_step <= self.last:
                self._resumed_inside(done_step)
                return
        if self._prof is None:
            if not self.done and done_step == self.first - self.warmup - 1:
                self._start(self.warmup)
            return
        self._prof.step()  # step `done_step` ends; at `last` torch writes the trace
        if done_step >= self.last:
            self.close()

    def _resumed_inside(self, done_step: int) -> None:
        """The first step seen is inside the window (a run resumed from a checkpoint there):
        record `first..last` after what is left of the warmup, or, once a step of them ran
        unprofiled, skip the window with a warning. It raised before: a job restarted
        automatically resumed from the same checkpoint and crashed there on every restart."""
        window = f"steps {self.first}..{self.last}, warmup from step {self.window[0]}"
        if done_step < self.first:
            left = self.first - 1 - done_step
            warnings.warn(
                f"Profiler: first called after step {done_step} (a run resumed inside the "
                f"profile window: {window}); profiling steps {self.first}..{self.last} after "
                f"{left} warmup step(s) instead of {self.warmup} (the first recorded step may "
                f"include the profiler's own start-up), as ProfilerStep#{left} onwards",
                RuntimeWarning,
                stacklevel=3,
            )
            self._start(left)
            return
        self.done = True  # no trace of this window: a partial one would pass for it
        warnings.warn(
            f"Profiler: first called after step {done_step} (a run resumed inside the profile "
            f"window: {window}): steps {self.first}..{done_step} ran unprofiled, so this run "
            f"writes no trace of the window (an earlier attempt may have written one in "
            f"{self.logdir}); choose later steps to profile the resumed run",
            RuntimeWarning,
            stacklevel=3,
        )

    def _start(self, warmup: int) -> None:
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.rank = _process_rank(self.rank)
        with warnings.catch_warnings():
            if warmup < self.warmup:  # said above; torch warns of a warmup of 0 on its own
                warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(
                wait=0, warmup=warmup, active=self.last - self.first + 1, repeat=1
            )
        handler = torch.profiler.tensorboard_trace_handler(
            str(self.logdir), worker_name=f"rank{self.rank}"
        )
        self._prof = torch.profiler.profile(
            schedule=schedule, on_trace_ready=handler, **self.profile_kwargs
        )
        self._prof.start()

    def log(self, record: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        """Stop profiling; a window cut short by the end of training is still written."""
        if self._prof is not None:
            self._prof.stop()
            self._prof, self.done = None, True

    def traces(self) -> list[Path]:
        """The trace files written so far."""
        return sorted(self.logdir.glob(f"rank{_process_rank(self.rank)}.*.pt.trace.json"))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
