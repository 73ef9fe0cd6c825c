"""`Logger`: the log step of the loop in one call (window, cadence, emit, sinks, progress)."""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ftrain.extras.logging._sinks import NullSink, ProgressBar, Sink, Sinks
from ftrain.extras.logging._window import _check_emit_args, emit, update, window
from ftrain.grads import Stats
from ftrain.predicates import should_log
from ftrain.state import TrainState
from ftrain.step import StepInfo

__all__ = ["Logger"]


class Logger:
    """Log a run with one call per step: `logger.step(state, stats, info)`.

    It folds each step into a log window on the device (no host sync), moves the progress bar,
    and on log steps (`should_log(state, every=..., total_steps=..., first=...)`, and the last
    step, `total_steps`) reads the window back in one sync and sends the record to the sinks.
    Records from elsewhere (eval metrics) go through `logger.log(record)`. `close()` emits the
    steps since the last record (a run that stopped early), unless it closes on an error
    (`with logger:` whose block raised, or `close(failed=True)`: the trackers then end their
    runs as failed). A state whose step is not past the last one logged (a guard rollback, a
    checkpoint reloaded in the loop) starts a new window at the restored state, as a resumed
    run does: the steps that were undone are in no record. So does a first step that does not
    follow the state the logger was built with (a checkpoint loaded after building it). The
    parts (`window`, `update`, `emit`, the sinks) stay public for anything this does not cover.

    Args:
        state: where training starts or resumes: the bar starts at `state.step`, and only
            rank 0 shows progress.
        every: log every `every` steps (a float in (0, 1): a fraction of `total_steps`).
        total_steps: the run's length, for the bar's ETA (and a fractional `every`).
        sinks: e.g. `[ft.logging.JSONLSink(path)]`; build them on rank 0 only.
        progress: add a `ProgressBar` (a bar in a terminal, printed lines otherwise);
            needs `total_steps`.
        first: also log step 1 (an early sign of life).
        epoch_size: micro-batches per epoch, for a fractional `epoch` (e.g.
            `ft.data.num_micro_batches(len(train), batch_size, world_size=W)`). None: learned
            from the state when the first epoch ends (the cursor of its last step); until then
            `epoch` is the whole number of epochs done, also in a run resumed mid-epoch (whose
            records then differ from the uninterrupted run's: pass it for equal ones).
        flops_per_token: passed to `emit` (adds `flops_per_second`).
        peak_flops: passed to `emit` (adds `mfu`, with `flops_per_token`).

    Raises:
        ValueError: for a bad `every`/`total_steps`, or `progress` without `total_steps`.
        TypeError: for a `progress` or `first` that is not a bool.
        ValueError: from `step`, for a state it saw already, or one that skips steps since the
            last (`logger.step` runs after every `clip_and_step`, not only on log steps).

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> logger = ft.logging.Logger(state, every=2, progress=False)
        >>> batch = [(torch.ones(4, 2), torch.zeros(4, 1))]
        >>> def loss_fn(model, b):
        ...     return ((model(b[0]) - b[1]) ** 2).sum(), torch.tensor(4)
        >>> for _ in range(4):
        ...     grads, stats = ft.accumulate_grads(state, batch, loss_fn)
        ...     state, info = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
        ...     record = logger.step(state, stats, info)
        ...     print(state.step, record is not None)
        1 True
        2 True
        3 False
        4 True
    """

    def __init__(
        self,
        state: TrainState,
        *,
        every: int | float,
        total_steps: int | None = None,
        sinks: Sequence[Sink] = (),
        progress: bool = True,
        first: bool = True,
        epoch_size: int | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        should_log(state, every=every, total_steps=total_steps)  # validates both, now
        for name, flag in (("progress", progress), ("first", first)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if progress and total_steps is None:
            raise ValueError("progress=True needs total_steps (for the ETA); or progress=False")
        _check_emit_args(epoch_size, flops_per_token, peak_flops)
        self.every, self.total_steps, self.first = every, total_steps, first
        self.epoch_size = epoch_size
        self._emit_kw = {"flops_per_token": flops_per_token, "peak_flops": peak_flops}
        bar: Sink = NullSink()
        if progress:
            bar = ProgressBar(
                total_steps or 0, rank=state.strategy.process_rank, initial=state.step
            )
        self.sink = Sinks(bar, *sinks)
        self.window = window(state)
        self._epoch, self._cursor = state.epoch, state.data.cursor
        self._state: TrainState | None = None  # the state of the last step folded in
        self._start_step = state.step  # the first step folded in should be the next one
        self._since = self.window.start_time  # when the last step folded in ended (or now)

    def step(self, state: TrainState, stats: Stats, info: StepInfo) -> dict[str, Any] | None:
        """Fold in the step that made `state`; on a log step emit and return its record."""
        if state is self._state:
            raise ValueError(f"logger.step got step {state.step} twice; call it once per step")
        last = self._start_step if self._state is None else self._state.step
        if state.step != last + 1:
            self._restart(state, stats, last)
        self.window = update(self.window, stats, info)  # device arithmetic, no host sync
        self._state = state
        self._learn_epoch_size(state)
        self.sink.step(state)
        due = should_log(state, every=self.every, total_steps=self.total_steps, first=self.first)
        record = None
        if due or state.step == self.total_steps:  # the last step's record too
            record = self.flush(state)  # the one host sync of a log step
        self._since = time.perf_counter()
        return record

    def _restart(self, state: TrainState, stats: Stats, last: int) -> None:
        """Open a new window where the step that made `state` started, after a discontinuity."""
        if self._state is not None and state.step > last:
            # Steps in between were never folded in: the loss would be the mean of the steps
            # that were, and the throughput would count tokens over time that is not theirs.
            raise ValueError(
                f"logger.step got step {state.step} after step {last}: call it after every "
                f"clip_and_step (steps {last + 1}..{state.step - 1} are in no log window)"
            )
        # The run went back (a rollback: the window holds undone steps), or this is the first
        # step and the state is not the one the logger was built with (a checkpoint loaded
        # after building it: the window counted tokens from that state's). Device
        # arithmetic, no host sync. The step's time runs from the end of the last call (or
        # the logger's start): a window opened now held the step's tokens over no time at
        # all, and its first record's tokens_per_second was thousands of times too high.
        self.window = window(state)._replace(
            start_time=self._since,
            start_tokens=state.data.tokens_seen - stats.num_tokens,
            start_samples=state.data.samples_seen - stats.num_samples,
        )

    def flush(self, state: TrainState) -> dict[str, Any] | None:
        """Emit the steps since the last record now (e.g. at an epoch's end), if there are any."""
        if self.window.steps == 0:
            return None
        record, self.window = emit(self.window, state, epoch_size=self.epoch_size, **self._emit_kw)
        self.sink.log(record)
        return record

    def log(self, record: Mapping[str, Any]) -> None:
        """Send another record (e.g. `{"step": state.step, **metrics}`) to the sinks."""
        if "step" not in record:
            raise ValueError(f"a record needs its 'step', got keys {sorted(record)}")
        step = record["step"]
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            # The sinks would truncate a float step (int(10.5) is 10) and log it there.
            raise TypeError(f"a record's 'step' must be an int >= 0, got {step!r}")
        self.sink.log(record)

    def close(self, *, failed: bool = False) -> None:
        """Emit the steps since the last record, if any (a run that stopped before a log step),
        then close the bar and every sink: the trackers end their runs as finished.

        Args:
            failed: the run ended on an error (what `with logger:` passes when its block
                raised): nothing is emitted (the last state may be half-updated) and the
                trackers end their runs as failed. Only this says so: a close that runs inside
                an `except` block of the caller's is a normal finish.
        """
        try:
            if not failed and self._state is not None:
                self.flush(self._state)
        except BaseException:
            self._close(failed=True)  # a record that could not be sent: the run did not finish
            raise
        self._close(failed=failed)

    def _close(self, *, failed: bool) -> None:
        self._state = None  # a second close emits nothing
        self.sink.close(failed=failed)

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(failed=kind is not None)

    def _learn_epoch_size(self, state: TrainState) -> None:
        # The epoch's last step left the cursor at the number of micro-batches in it.
        if self.epoch_size is None and state.epoch == self._epoch + 1 and self._cursor > 0:
            self.epoch_size = int(self._cursor)
        self._epoch, self._cursor = state.epoch, state.data.cursor
