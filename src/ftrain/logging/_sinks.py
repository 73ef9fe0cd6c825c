"""Sinks: where log records go. A small `Protocol` with a do-nothing default, and composable.

A sink's `step(state)` runs after every step and must not read device tensors (it may move a
progress bar); `log(record)` receives each emitted record (train or eval: a dict with `step`);
`close()` flushes. Build sinks on the main rank only (`state.strategy.rank == 0`), or rely on
`ProgressBar`, which turns itself off elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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
        for s in self.sinks:
            s.step(state)

    def log(self, record: Mapping[str, Any]) -> None:
        for s in self.sinks:
            s.log(record)

    def close(self) -> None:
        for s in self.sinks:
            s.close()

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JSONLSink:
    """Appends each record as one JSON line to `path` (flushed, so a crash loses at most one).

    A resumed run appends to the same file; readers such as `python -m ftrain plot` keep the
    last record written for each step.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def step(self, state: TrainState) -> None:
        pass

    def log(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(_plain(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ProgressBar:
    """A tqdm progress bar over optimizer steps with ETA, and the last loss and lr.

    Off when stderr is not a terminal or on a non-main rank, unless `enabled` says otherwise.

    Args:
        total: total optimizer steps.
        enabled: force on or off; None decides from the terminal and `rank`.
        rank: this process's data-parallel rank.
    """

    def __init__(self, total: int, *, enabled: bool | None = None, rank: int = 0) -> None:
        if enabled is None:
            enabled = rank == 0 and sys.stderr.isatty()
        self.enabled = enabled
        self._bar: Any = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError as e:  # pragma: no cover - exercised only without the extra
                raise ImportError("ProgressBar needs tqdm: pip install 'ftrain[progress]'") from e
            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def step(self, state: TrainState) -> None:
        if self._bar is not None and state.step > self._bar.n:
            self._bar.update(state.step - self._bar.n)

    def log(self, record: Mapping[str, Any]) -> None:
        if self._bar is None:
            return
        shown = {k: record[k] for k in ("loss", "eval_loss", "learning_rate") if k in record}
        self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class TensorBoardSink:
    """Writes every numeric field of each record as a TensorBoard scalar at its `step`.

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

    def step(self, state: TrainState) -> None:
        pass

    def log(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._writer.add_scalar(_tag(k), v, step)

    def close(self) -> None:
        self._writer.close()


def _tag(key: str) -> str:
    # eval_loss -> eval/loss, loss -> train/loss: TensorBoard groups by the prefix.
    return key.replace("eval_", "eval/", 1) if key.startswith("eval_") else f"train/{key}"


def _plain(record: Mapping[str, Any]) -> dict[str, Any]:
    # Strict JSON (readable by jq and friends) has no NaN or Infinity: they become null.
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
