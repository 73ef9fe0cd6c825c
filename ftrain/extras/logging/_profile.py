"""A sink that captures a `torch.profiler` trace of chosen optimizer steps."""

from __future__ import annotations

import os
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

    Raises:
        ValueError: on an impossible window; from `step()`, when the loop is already inside
            the window the first time it calls `step()` (a run resumed mid-window).

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
            # Step `last` done first (a checkpoint at last - 1) is inside the window too: its
            # steps ran unprofiled, and no trace was written, without a word.
            if self.first - self.warmup - 1 < done_step <= self.last:
                raise ValueError(
                    f"the profile window starts at step {self.first - self.warmup} but the loop "
                    f"is past step {done_step} (a resumed run?); choose later steps"
                )
        if self._prof is None:
            if not self.done and done_step == self.first - self.warmup - 1:
                self._start()
            return
        self._prof.step()  # step `done_step` ends; at `last` torch writes the trace
        if done_step >= self.last:
            self.close()

    def _start(self) -> None:
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.rank = _process_rank(self.rank)
        schedule = torch.profiler.schedule(
            wait=0, warmup=self.warmup, active=self.last - self.first + 1, repeat=1
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
