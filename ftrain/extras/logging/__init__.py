"""Logging (`ft.logging`): one call per step (`Logger`), log windows with HF's definitions,
sinks, trackers, profiler, throughput, plots."""

from ftrain.extras.logging._logger import Logger as Logger
from ftrain.extras.logging._perf import flops_per_token as flops_per_token
from ftrain.extras.logging._perf import peak_memory_mb as peak_memory_mb
from ftrain.extras.logging._plot import plot_metrics as plot_metrics
from ftrain.extras.logging._plot import read_jsonl as read_jsonl
from ftrain.extras.logging._profile import Profiler as Profiler
from ftrain.extras.logging._sinks import JSONLSink as JSONLSink
from ftrain.extras.logging._sinks import NullSink as NullSink
from ftrain.extras.logging._sinks import ProgressBar as ProgressBar
from ftrain.extras.logging._sinks import Sink as Sink
from ftrain.extras.logging._sinks import Sinks as Sinks
from ftrain.extras.logging._sinks import TensorBoardSink as TensorBoardSink
from ftrain.extras.logging._trackers import MLflowSink as MLflowSink
from ftrain.extras.logging._trackers import WandbSink as WandbSink
from ftrain.extras.logging._window import LogWindow as LogWindow
from ftrain.extras.logging._window import emit as emit
from ftrain.extras.logging._window import update as update
from ftrain.extras.logging._window import window as window

__all__ = [
    "JSONLSink",
    "LogWindow",
    "Logger",
    "MLflowSink",
    "NullSink",
    "Profiler",
    "ProgressBar",
    "Sink",
    "Sinks",
    "TensorBoardSink",
    "WandbSink",
    "emit",
    "flops_per_token",
    "peak_memory_mb",
    "plot_metrics",
    "read_jsonl",
    "update",
    "window",
]
