"""Sinks: where log records go. A small `Protocol` with a do-nothing default, and composable.

A sink's `step(state)` runs after every step and must not read device tensors (it may move a
progress bar); `log(record)` receives each emitted record (train or eval: a dict with `step`);
`close()` flushes. A `close` that takes `failed` (`close(self, *, failed=False)`, or `**kwargs`:
a wrapper forwarding to a tracker sink) is told how the run ended: `failed=True` when a
`Logger` (or `Sinks`) `with` block raised or `logger.close(failed=True)` was called, False
otherwise; a `close(self)` without it is called without it. Build sinks on the main rank only
(`state.strategy.rank == 0`), or rely on `ProgressBar`, which turns itself off elsewhere
(built without `rank=`, it shows once it is first used, on the job's rank 0).
`ft.logging.Logger` drives them all with one call per step.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

import numpy as np
import torch

from ftrain.extras.logging._plot import RESTART
from ftrain.extras.logging._rank import _known_rank, _process_rank
from ftrain.state import TrainState

__all__ = ["JSONLSink", "NullSink", "ProgressBar", "Sink", "Sinks", "TensorBoardSink"]


@runtime_checkable
class Sink(Protocol):
    """Receives log records; see the module docstring."""

    def step(self, state: TrainState) -> None: ...

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Discards everything: the default."""

    def step(self, state: TrainState) -> None:
        pass

    def log(self, record: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class Sinks:
    """Several sinks as one: every call goes to each, in order.

    Example:
        >>> import ftrain as ft
        >>> sink = ft.logging.Sinks(ft.logging.NullSink(), ft.logging.NullSink())
        >>> sink.log({"step": 1, "loss": 2.0})
    """

    def __init__(self, *sinks: Sink) -> None:
        for s in sinks:
            if not isinstance(s, Sink):
                raise TypeError(f"{s!r} is not a Sink (needs step, log and close)")
        self.sinks = sinks

    def step(self, state: TrainState) -> None:
        """Call every sink's `step`, also when one raises (the first error is raised after)."""
        _each(self.sinks, lambda s: s.step(state))

    def log(self, record: Mapping[str, Any]) -> None:
        """Send `record` to every sink, also when one raises (a tracker that is down): the sinks
        after it lost the record before. The first error is raised after the rest have it."""
        _each(self.sinks, lambda s: s.log(record))

    def close(self, *, failed: bool = False) -> None:
        """Close every sink, also when one raises (the first error is raised after the rest
        are closed), passing `failed` to those whose `close` takes it."""
        _close_all(self.sinks, failed)

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(failed=kind is not None)


def _each(sinks: tuple[Sink, ...], call: Callable[[Sink], None]) -> None:
    """`call` every sink; the first error is raised once every sink was called."""
    error: Exception | None = None
    for s in sinks:
        try:
            call(s)
        except Exception as e:
            error = error or e
    if error is not None:
        raise error


def _close_all(sinks: tuple[Sink, ...], failed: bool) -> None:
    # One sink that failed to close (a full disk, a tracker server down) left those after it
    # open: an MLflow run stayed RUNNING. The rest are closed before its error is raised.
    _each(sinks, lambda s: _close_sink(s, failed=failed))


def _close_sink(sink: Sink, *, failed: bool) -> None:
    """Close `sink`: with `failed=failed` when its `close` takes a `failed` argument or any
    keyword (`**kwargs`: a wrapper forwarding to a tracker sink), positionally when its
    `failed` is positional-only, else without arguments (the plain `close(self)` protocol)."""
    how = _takes_failed(sink.close)
    if how == "keyword":
        sink.close(failed=failed)  # type: ignore[call-arg]
    elif how == "positional":
        sink.close(failed)  # type: ignore[call-arg]
    else:
        sink.close()


def _takes_failed(close: Any) -> str | None:
    try:
        params = inspect.signature(close).parameters
    except (TypeError, ValueError):  # a callable without a signature (a builtin)
        return None
    param = params.get("failed")
    if param is not None and param.kind is inspect.Parameter.POSITIONAL_ONLY:
        return "positional"
    if param is not None and param.kind is not inspect.Parameter.VAR_POSITIONAL:
        return "keyword"
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return "keyword"
    return None


class JSONLSink:
    """Appends each record as one JSON line to `path` (flushed, so a crash loses at most one).

    A resumed run appends to the same file; readers such as `python -m ftrain plot` keep the
    last record written for each step. A line that a killed run left cut short is ended first,
    so the resumed run's first record starts a line of its own (readers skip the cut one).

    As `TensorBoardSink` does, the first `step(state)` of a sink that appends to records, and
    every `step(state)` that is not past the previous one (a guard rollback), writes a restart
    line, `{"ftrain_restart": true, "step": s}`: `read_jsonl` drops what was written before it
    at step s or later (steps the resumed run makes again, or that a rollback undid and the
    run may never reach again). `ft.logging.Logger` calls `step`, then `log` for that step's
    record; a loop of your own that calls both must keep that order (a record logged before
    the `step(state)` that restarts at its step is dropped with the undone ones). Records sent
    only through `log` are kept as written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._last: int | None = None  # the step of the last `step(state)`
        self._appends = self._file.tell() > 0  # to a run's records: its first step restarts
        if _cut_short(self.path):  # else the next record would be glued to it and lost too
            self._file.write("\n")
            self._file.flush()

    def step(self, state: TrainState) -> None:
        back = self._last is not None and state.step <= self._last
        if back or (self._last is None and self._appends):
            if self._file.closed:
                raise ValueError(_CLOSED.format(type(self).__name__))
            self._file.write(json.dumps({RESTART: True, "step": state.step}) + "\n")
            self._file.flush()
        self._last = state.step

    def log(self, record: Mapping[str, Any]) -> None:
        if self._file.closed:  # Python's "I/O operation on closed file" named no sink
            raise ValueError(_CLOSED.format(type(self).__name__))
        plain = _plain({**record, "step": _step(record)})
        self._file.write(json.dumps(plain, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


_CLOSED = "{} is closed: log before close(), e.g. the final evaluation before logger.close()"


def _cut_short(path: Path) -> bool:
    """Whether the file's last line has no newline (a run killed while writing it)."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class ProgressBar:
    """Progress over optimizer steps: a tqdm bar in a terminal, printed lines elsewhere.

    The bar shows the rate and ETA, and the latest value of each of `loss`, `learning_rate`
    and `eval_loss` (an eval record does not hide the train loss). It starts at `initial`
    (the resumed step), so the rate and ETA are right from the first step after a resume.
    Where stderr is not a terminal (nohup, CI, SLURM logs) each logged record is printed as
    one line instead, with the elapsed time. Only rank 0 shows anything by default.

    Args:
        total: total optimizer steps.
        enabled: force on or off; None: on for `rank` 0 only.
        rank: this process's rank (`state.strategy.process_rank`). None: the job's rank (the
            process group's, else the launcher's `RANK`, else 0 in a job of one process),
            taken when the bar is first used in a process that may be one of several whose
            group is not set up yet (as the trackers' `rank`).
        initial: the step training starts or resumes at (`state.step`).
        lines: print one line per record instead of a bar; None: when stderr is not a
            terminal.
        file: where lines go (`sys.stdout` by default).

    Example:
        >>> import io, ftrain as ft
        >>> out = io.StringIO()
        >>> bar = ft.logging.ProgressBar(100, lines=True, file=out)
        >>> bar.log({"step": 10, "loss": 2.5, "learning_rate": 1e-3, "grad_norm": 0.5})
        >>> out.getvalue().split("  ")[:3]
        ['step 10/100', 'loss 2.5', 'learning_rate 0.001']
    """

    def __init__(
        self,
        total: int,
        *,
        enabled: bool | None = None,
        rank: int | None = None,
        initial: int = 0,
        lines: bool | None = None,
        file: TextIO | None = None,
    ) -> None:
        self.total, self._file, self._start = total, file, time.perf_counter()
        self._initial, self._enabled, self._lines = initial, enabled, lines
        self._rank = _known_rank(rank)
        self._shown: dict[str, float] = {}
        self._bar: Any = None
        self._on: tuple[bool, bool] | None = None  # (enabled, lines), once the rank is known
        if enabled is not None or self._rank is not None:
            self._resolve()

    def _resolve(self) -> tuple[bool, bool]:
        # Without rank= (and before the process group is set up, no RANK set) every process
        # took rank 0's default and showed a bar: the rank is taken when the bar is first used.
        if self._on is None:
            on = _process_rank(self._rank) == 0 if self._enabled is None else self._enabled
            lines = on and (not sys.stderr.isatty() if self._lines is None else self._lines)
            self._on = (on, lines)
            if on and not lines:
                try:
                    from tqdm.auto import tqdm
                except ImportError as e:  # pragma: no cover - exercised only without the extra
                    raise ImportError(
                        "ProgressBar needs tqdm: pip install 'ftrain[progress]'"
                    ) from e
                self._bar = tqdm(
                    total=self.total, initial=self._initial, unit="step", dynamic_ncols=True
                )
        return self._on

    # Both were plain attributes, which a script may set (`bar.enabled = False`): assigning
    # one decides it before the rank is known, and changes it after.
    @property
    def enabled(self) -> bool:
        """Whether this process shows progress."""
        return self._resolve()[0]

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if self._on is None:
            self._enabled = bool(value)
            return
        if not value and self._bar is not None:
            self._bar.close()
            self._bar = None
        self._on = (bool(value), self._on[1] and bool(value))

    @property
    def lines(self) -> bool:
        """Whether records are printed as lines (no bar)."""
        return self._resolve()[1]

    @lines.setter
    def lines(self, value: bool) -> None:
        if self._on is None:
            self._lines = bool(value)
        else:
            self._on = (self._on[0], bool(value))

    def step(self, state: TrainState) -> None:
        self._resolve()
        if self._bar is not None and state.step > self._bar.n:
            self._bar.update(state.step - self._bar.n)

    def log(self, record: Mapping[str, Any]) -> None:
        if self.lines:
            line = _line(record, self.total, time.perf_counter() - self._start)
            print(line, file=self._file or sys.stdout, flush=True)
        if self._bar is None:
            return
        self._shown.update({k: record[k] for k in _BAR_KEYS if _is_number(record.get(k))})
        self._bar.set_postfix({k: f"{v:.4g}" for k, v in self._shown.items()}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_BAR_KEYS = ("loss", "eval_loss", "learning_rate")
_LINE_KEYS = ("loss", "learning_rate", "grad_norm")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _line(record: Mapping[str, Any], total: int, elapsed: float) -> str:
    keys = [k for k in _LINE_KEYS if k in record]
    keys += [k for k in record if k.startswith("eval_") and k != "eval_items"]
    parts = [f"step {record.get('step')}/{total}"]
    parts += [f"{k} {record[k]:.4g}" if _is_number(record[k]) else f"{k} {record[k]}" for k in keys]
    return "  ".join([*parts, f"{elapsed:.1f}s"])


class TensorBoardSink:
    """Writes every numeric field of each record as a TensorBoard scalar at its `step` (a
    nested dict's fields under `outer/inner`; strings and lists are not scalars: left out).

    A resumed run (or a guard rollback) writes its steps again: the first `step(state)` of
    the sink, and every `step(state)` that is not past the previous one, marks a restart at
    `state.step` (a `SessionLog.START` event, what `SummaryWriter(purge_step=...)` writes), and
    TensorBoard drops the events written before it at that step or later, so each step shows the
    values of the run that was kept, once. `ft.logging.Logger` calls `step`; records sent only
    through `log` are kept as written.

    Needs the `tensorboard` extra (`pip install 'ftrain[tensorboard]'`).
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                "TensorBoardSink needs tensorboard: pip install 'ftrain[tensorboard]'"
            ) from e
        self._writer = SummaryWriter(log_dir=str(logdir))
        self._last: int | None = None  # the step of the last `step(state)`
        self._closed = False

    def step(self, state: TrainState) -> None:
        if self._last is None or state.step <= self._last:
            # Events written at this step or later (by the run this one resumes, or by steps a
            # rollback undid) are stale: without the mark TensorBoard shows both curves.
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            start = SessionLog(status=SessionLog.START)
            writer = self._writer.file_writer  # None only once closed
            if writer is not None:
                writer.add_event(Event(step=state.step, session_log=start))
        self._last = state.step

    def log(self, record: Mapping[str, Any]) -> None:
        if self._closed:  # the writer would open a new events file for it, quietly
            raise ValueError(_CLOSED.format(type(self).__name__))
        step = _step(record)
        for k, v in _scalars(record).items():
            self._writer.add_scalar(_tag(k), v, step)
        # The writer queues events and writes them every 2 minutes: a killed run would lose
        # records that no resume replays (those before its last checkpoint). One write per
        # record, like JSONLSink's flushed line.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        self._closed = True


def _step(record: Mapping[str, Any]) -> int:
    """The record's `step`, an int >= 0: a float one was truncated by the trackers (10.5 logged
    at 10) and written as is to JSONL, where `read_jsonl` skips the line."""
    step = record.get("step")
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step.item())
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise TypeError(f"a record's 'step' must be an int >= 0, got {step!r}")
    return int(step)


def _tag(key: str) -> str:
    # eval_loss -> eval/loss, loss -> train/loss: TensorBoard groups by the prefix.
    return key.replace("eval_", "eval/", 1) if key.startswith("eval_") else f"train/{key}"


def _scalar(key: str, value: Any) -> float | int | None:
    """A record's value as a Python number, or None for one that is no number (a string such as
    `eval_loss_fn`, None). 0-dim tensors and numpy scalars are numbers too: the trackers skipped
    them before, silently (`logger.log({"step": s, "reward": rewards.mean()})`)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        # A numpy array was skipped by the trackers (while json.dumps refused it): one value
        # is a number, more are refused as a tensor's are.
        kind, size = (
            ("an array", value.size)
            if isinstance(value, np.ndarray)
            else ("a tensor", value.numel())
        )
        if size != 1:
            raise TypeError(
                f"record[{key!r}] is {kind} of shape {tuple(value.shape)}; log a number"
            )
        value = value.item()  # a host sync: a log record is where one belongs
    elif isinstance(value, numbers.Real) and hasattr(value, "item"):
        value = value.item()  # a numpy scalar
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _scalars(
    record: Mapping[str, Any], prefix: str = "", out: dict[str, float] | None = None
) -> dict[str, float]:
    """Every numeric field of `record` but `step`, as floats (what the trackers log). A nested
    dict's fields are logged under `outer/inner` (`{"tasks": {"a": 0.5}}` as `tasks/a`): they
    were dropped unseen before, while the JSONL log kept them.

    Raises:
        ValueError: when two fields get one name (`"tasks/a"` beside `{"tasks": {"a": ...}}`):
            the trackers kept one of the values.
    """
    out = {} if out is None else out
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            _scalars(v, f"{key}/", out)
            continue
        x = _scalar(key, v) if key != "step" else None
        if x is not None:
            if key in out:
                raise ValueError(
                    f"the record holds two values named {key!r} (a key and a nested dict's "
                    "field): the trackers would keep one; rename one of them"
                )
            out[key] = float(x)
    return out


def _plain(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    # Strict JSON (readable by jq and friends) has no NaN or Infinity: they become null, also
    # inside a nested dict or list (json.dumps raised on those, losing the record mid-run).
    return {k: _plain_value(f"{prefix}{k}", v) for k, v in record.items()}


def _plain_value(key: str, v: Any) -> Any:
    if isinstance(v, Mapping):
        return _plain(v, f"{key}/")
    if isinstance(v, (list, tuple)):
        return [_plain_value(key, x) for x in v]
    x = _scalar(key, v)
    v = v if x is None else x
    return None if isinstance(v, float) and not math.isfinite(v) else v
