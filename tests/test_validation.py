"""Argument validation of the core loop's public functions, as a property (hypothesis): any wrong
type or value of any argument gives a `TypeError` or `ValueError` whose message names the
argument, in bounded time. Never a raw error from deep inside (`AttributeError`, `KeyError`,
`IndexError`, a `RuntimeError` from torch, `ZeroDivisionError`, `OverflowError`), a hang, or a
silent default.

`TABLE` has one row per (function, argument, kind of bad value); `KINDS` says what each kind
draws. Every other argument of the call is valid (`CALLS`), so the bad one is the only reason to
refuse it. A call that returns an iterator (`make_batches`) is also asked for its first item:
validation must not wait for the loop to start and then fail deep inside it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import ftrain as ft
from helpers import Hung, within


class Opaque:
    """An object of no type any argument takes."""

    def __repr__(self) -> str:
        return "Opaque()"


_junk = st.one_of(
    st.text(max_size=4), st.none(), st.just(Opaque()), st.lists(st.integers(), max_size=2)
)
_finite = st.floats(allow_nan=False, allow_infinity=False)

# What each kind of bad value draws.
KINDS: dict[str, st.SearchStrategy[Any]] = {
    # types
    "not-a-number": st.one_of(_junk, st.just(1 + 2j)),
    "not-an-int": st.one_of(_junk, st.sampled_from([2.5, 2.0, "3", math.nan])),
    # where None means the default
    "not-an-int-nor-none": st.one_of(
        st.text(max_size=4), st.just(Opaque()), st.sampled_from([2.5, 2.0, "3", math.nan, [1]])
    ),
    "tensor": st.just(torch.tensor(0.5)),  # a device tensor where a Python number is wanted
    "bool": st.booleans(),  # where a number is wanted: True is not 1
    "not-a-bool": st.one_of(
        st.text(min_size=1, max_size=4), st.just(Opaque()), st.sampled_from([0.5, 2, [], [True]])
    ),
    "not-a-str": st.one_of(st.integers(), st.just(Opaque()), st.sampled_from([b"min", ["min"]])),
    "not-callable": st.one_of(st.integers(), st.text(max_size=4), st.just(Opaque())),
    "not-a-mapping": st.one_of(
        st.integers(),
        st.text(min_size=1, max_size=4),
        st.just(Opaque()),
        st.sampled_from([[("a", 1.0)], (1.0,)]),
    ),
    "not-a-path": st.one_of(
        st.integers(), st.none(), st.just(Opaque()), st.sampled_from([[], 1.5])
    ),
    "not-a-state": st.one_of(
        st.integers(),
        st.text(max_size=4),
        st.just(Opaque()),
        st.sampled_from([{}, nn.Linear(1, 1)]),
    ),
    "not-a-strategy": st.one_of(st.integers(), st.sampled_from(["cpu", "ddp", Opaque()])),
    "not-a-module": st.one_of(st.integers(), st.sampled_from(["model", None, [nn.Linear(1, 1)]])),
    "not-an-optimizer": st.sampled_from([None, "adamw", torch.optim.AdamW, Opaque(), (1, 2)]),
    "not-data": st.sampled_from([None, 3, 2.5, Opaque()]),
    "not-a-list": st.sampled_from([None, 3, Opaque(), {"x": torch.ones(2)}]),
    # values
    "negative": st.one_of(st.integers(max_value=-1), _finite.filter(lambda f: f <= -1e-300)),
    "negative-int": st.integers(max_value=-1),
    "zero": st.sampled_from([0, 0.0]),
    "nan": st.just(math.nan),
    "inf": st.sampled_from([math.inf, -math.inf]),
    "above-one": st.floats(min_value=1.0, exclude_min=True, allow_infinity=False),
    "choice": st.sampled_from(["", "mean", "MIN", "linear ", "bf32", "gpu", "cuda:x"]),
    "empty": st.sampled_from([[], {}, ()]),
    # containers with one bad item
    "bad-items": st.one_of(
        st.tuples(_junk, st.just(0.5)),
        st.tuples(st.just(0.5), st.sampled_from([math.nan, math.inf, True, -1.0])),
    ),
    "bad-values": st.dictionaries(
        st.just("a"),
        st.one_of(_junk, st.sampled_from([math.nan, math.inf, True, -1.0])),
        min_size=1,
    ),
    # Metrics may be NaN, infinite or negative (a diverged loss, a reward): only a value that is
    # no number at all (or a bool) is refused.
    "non-number-values": st.dictionaries(st.just("a"), st.one_of(_junk, st.just(True)), min_size=1),
}

# Arguments whose default is None: None is a valid value there.
NONE_OK: dict[str, set[str]] = {
    "TrainState.create": {"strategy"},
    "make_batches": {"seed", "epoch", "start", "strategy", "collate_fn", "prefetch_factor"},
    "accumulate_grads": {"loss_fn", "strategy"},
    "clip_and_step": {"max_norm", "stats"},
    "save_checkpoint": {"metrics", "keep_last", "keep_best", "best_metric"},
    "should_log": {"total_steps"},
    "evaluate": {"loss_fn", "metrics_fn", "perplexity", "strategy"},
    "optim.adamw": {"mask"},
    "optim.adam": {"mask"},
    "optim.sgd": {"mask"},
    "optim.partition": {"lr_factors"},
    "schedules.warmup_inverse_sqrt": {"timescale"},
    "schedules.cosine_warmup_with_min_lr": {"warmup_lr_rate"},
    "schedules.warmup_stable_decay": {"num_stable_steps"},
    "strategies.SingleDevice": {"device", "precision"},
}


class Row(NamedTuple):
    function: str
    argument: str
    kind: str


def _state(**kw: Any) -> ft.TrainState:
    torch.manual_seed(0)
    return ft.TrainState.create(nn.Linear(2, 1), ft.optim.sgd(), **kw)


def _rows(n: int = 6) -> list[dict[str, Any]]:
    return [{"x": torch.full((2,), float(i)), "y": torch.tensor([float(i)])} for i in range(n)]


def _batch() -> dict[str, torch.Tensor]:
    return ft.pad_collate()(_rows(2))


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(), batch["y"].shape[0]


def _grads(state: ft.TrainState) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(p) for n, p in state.params.items()}


_SCRATCH: list[Path] = []


@pytest.fixture(autouse=True, scope="module")
def _scratch(tmp_path_factory):
    """A folder for the checkpoints the calls write (pytest removes old ones)."""
    _SCRATCH.append(tmp_path_factory.mktemp("validation"))
    yield
    _SCRATCH.pop()


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(dir=_SCRATCH[-1]))


def _saved() -> tuple[Path, ft.TrainState]:
    root = _tmp()
    return ft.save_checkpoint(_state(), root), _state()


def _stream() -> Any:
    return ft.data.IterableRows([{"input_ids": [1, 2, 3]}] * 4)


def _clip_and_step(**kw: Any) -> Any:
    state = _state()
    grads, stats = ft.accumulate_grads(state, [_batch()], _loss)
    args = {"state": state, "grads": grads, "lr": 0.1, "max_norm": 1.0, "stats": stats, **kw}
    return ft.clip_and_step(**args)


def _sched(fn: Callable[..., Any], **base: Any) -> Callable[..., Any]:
    return lambda **kw: fn(**{**base, **kw})


_W = {"peak_lr": 1.0, "warmup_steps": 2, "total_steps": 10}

# How each function is called: valid arguments, overridden by the bad one.
CALLS: dict[str, Callable[..., Any]] = {
    "TrainState.create": lambda **kw: ft.TrainState.create(
        **{"model": nn.Linear(2, 1), "optimizer": ft.optim.sgd(), **kw}
    ),
    "make_batches": lambda **kw: ft.make_batches(**{"data": _rows(), "batch_size": 2, **kw}),
    "make_batches(state)": lambda **kw: ft.make_batches(
        **{"data": _rows(), "state": _state(), "batch_size": 2, **kw}
    ),
    "accumulate_grads": lambda **kw: ft.accumulate_grads(
        **{"state": _state(), "micro": [_batch()], "loss_fn": _loss, **kw}
    ),
    "clip_and_step": _clip_and_step,
    "save_checkpoint": lambda **kw: ft.save_checkpoint(**{"state": _state(), "root": _tmp(), **kw}),
    "load_checkpoint": lambda **kw: ft.load_checkpoint(
        **dict(zip(("path", "state"), _saved(), strict=True)), **kw
    ),
    "latest_checkpoint": lambda **kw: ft.latest_checkpoint(**{"root": _tmp(), **kw}),
    "should_log": lambda **kw: ft.should_log(**{"state": _state(), "every": 2, **kw}),
    "should_eval": lambda **kw: ft.should_eval(**{"state": _state(), "every": 2, **kw}),
    "should_save": lambda **kw: ft.should_save(**{"state": _state(), "every": 2, **kw}),
    "track_best": lambda **kw: ft.track_best(
        **{"state": _state(), "metrics": {"eval_loss": 1.0}, **kw}
    ),
    "should_stop": lambda **kw: ft.should_stop(**{"state": _state(), "patience": 2, **kw}),
    "evaluate": lambda **kw: ft.evaluate(
        **{"state": _state(), "batches": [_batch()], "loss_fn": _loss, **kw}
    ),
    "optim.adamw": lambda **kw: ft.optim.adamw(**kw),
    "optim.adam": lambda **kw: ft.optim.adam(**kw),
    "optim.sgd": lambda **kw: ft.optim.sgd(**kw),
    "optim.muon": lambda **kw: ft.optim.muon(**kw),
    "optim.partition": lambda **kw: ft.optim.partition(
        **{"optimizers": {"a": ft.optim.sgd()}, "labels": lambda n: "a", **kw}
    ),
    "optim.ema": lambda **kw: ft.optim.ema(**{"optimizer": ft.optim.sgd(), **kw}),
    "schedules.constant": _sched(ft.schedules.constant, peak_lr=1.0),
    "schedules.warmup_constant": _sched(ft.schedules.warmup_constant, peak_lr=1.0, warmup_steps=2),
    "schedules.warmup_linear": _sched(ft.schedules.warmup_linear, **_W),
    "schedules.warmup_cosine": _sched(ft.schedules.warmup_cosine, **_W),
    "schedules.warmup_cosine_restarts": _sched(ft.schedules.warmup_cosine_restarts, **_W),
    "schedules.warmup_polynomial": _sched(ft.schedules.warmup_polynomial, **_W),
    "schedules.warmup_inverse_sqrt": _sched(
        ft.schedules.warmup_inverse_sqrt, peak_lr=1.0, warmup_steps=2
    ),
    "schedules.cosine_with_min_lr": _sched(ft.schedules.cosine_with_min_lr, **_W, min_lr=0.1),
    "schedules.cosine_warmup_with_min_lr": _sched(
        ft.schedules.cosine_warmup_with_min_lr, **_W, min_lr_rate=0.1
    ),
    "schedules.warmup_stable_decay": _sched(
        ft.schedules.warmup_stable_decay, **_W, num_decay_steps=3
    ),
    "schedules.from_name": _sched(ft.schedules.from_name, name="linear", **_W),
    "schedules.Plateau": lambda **kw: ft.schedules.Plateau(**kw),
    "schedule(step)": lambda **kw: ft.schedules.warmup_cosine(**_W)(**kw),
    "schedule_lr": _sched(ft.schedule_lr, step=3, name="linear", **_W),
    "data.stream": lambda **kw: ft.data.stream(**{"data": _stream(), **kw}),
    "data.pack": lambda **kw: ft.data.pack(**{"data": _stream(), "block_size": 2, **kw}),
    "data.mix": lambda **kw: ft.data.mix(
        **{"sources": [_stream(), _stream()], "weights": [1.0, 1.0], **kw}
    ),
    "strategies.SingleDevice": lambda **kw: ft.strategies.SingleDevice(**{"device": "cpu", **kw}),
}

NUMBER = ("not-a-number", "bool", "nan", "inf")  # every number: finite, and a number
INT = ("not-an-int", "bool")  # every int argument

# fmt: off
TABLE: tuple[Row, ...] = (
    # --- TrainState.create
    Row("TrainState.create", "model", "not-a-module"),
    Row("TrainState.create", "optimizer", "not-an-optimizer"),
    *(Row("TrainState.create", "seed", k) for k in INT),
    Row("TrainState.create", "strategy", "not-a-strategy"),
    # --- make_batches
    Row("make_batches", "data", "not-data"),
    Row("make_batches(state)", "state", "not-a-state"),
    *(Row("make_batches", "batch_size", k) for k in (*INT, "zero", "negative-int")),
    *(Row("make_batches", "accum", k) for k in (*INT, "zero", "negative-int")),
    *(Row("make_batches", "seed", k) for k in INT),
    *(Row("make_batches", "epoch", k) for k in (*INT, "negative-int")),
    *(Row("make_batches", "start", k) for k in (*INT, "negative-int")),
    Row("make_batches", "strategy", "not-a-strategy"),
    *(Row("make_batches", flag, "not-a-bool") for flag in
      ("shuffle", "drop_last", "group_by_length", "pin_memory")),
    Row("make_batches", "collate_fn", "not-callable"),
    *(Row("make_batches", "num_workers", k) for k in (*INT, "negative-int")),
    Row("make_batches", "prefetch_factor", "not-an-int"),
    # --- accumulate_grads
    Row("accumulate_grads", "state", "not-a-state"),
    Row("accumulate_grads", "micro", "not-a-list"),
    Row("accumulate_grads", "micro", "empty"),
    Row("accumulate_grads", "loss_fn", "not-callable"),
    Row("accumulate_grads", "strategy", "not-a-strategy"),
    # --- clip_and_step
    Row("clip_and_step", "state", "not-a-state"),
    Row("clip_and_step", "grads", "not-a-mapping"),
    *(Row("clip_and_step", "lr", k) for k in (*NUMBER, "negative", "tensor")),
    *(Row("clip_and_step", "max_norm", k) for k in ("not-a-number", "bool", "nan", "zero",
                                                     "negative")),
    Row("clip_and_step", "stats", "not-a-state"),
    *(Row("clip_and_step", flag, "not-a-bool") for flag in
      ("skip_nonfinite", "donate", "compile")),
    # --- checkpoints
    Row("save_checkpoint", "state", "not-a-state"),
    Row("save_checkpoint", "root", "not-a-path"),
    *(Row("save_checkpoint", "metrics", k) for k in ("not-a-mapping", "non-number-values")),
    *(Row("save_checkpoint", "keep_last", k) for k in (*INT, "negative-int")),
    *(Row("save_checkpoint", "keep_best", k) for k in (*INT, "zero", "negative-int")),
    Row("save_checkpoint", "best_metric", "not-a-str"),
    Row("save_checkpoint", "mode", "choice"),
    *(Row("save_checkpoint", flag, "not-a-bool") for flag in ("checksum", "blocking")),
    Row("load_checkpoint", "path", "not-a-path"),
    Row("load_checkpoint", "state", "not-a-state"),
    *(
        Row("load_checkpoint", flag, "not-a-bool")
        for flag in ("strict", "verify", "allow_other_base")
    ),
    Row("latest_checkpoint", "root", "not-a-path"),
    # --- cadence and early stopping
    *(Row(fn, "state", "not-a-state") for fn in ("should_log", "should_eval", "should_save")),
    *(Row(fn, "every", k) for fn in ("should_log", "should_eval", "should_save")
      for k in ("not-a-number", "bool", "nan", "inf", "zero", "negative")),
    *(Row("should_log", "total_steps", k) for k in (*INT, "zero", "negative-int")),
    Row("should_log", "first", "not-a-bool"),
    Row("track_best", "state", "not-a-state"),
    Row("track_best", "metrics", "not-a-number"),
    Row("track_best", "metric", "not-a-str"),
    Row("track_best", "mode", "choice"),
    *(Row("track_best", "threshold", k) for k in (*NUMBER, "negative")),
    Row("should_stop", "state", "not-a-state"),
    *(Row("should_stop", "patience", k) for k in (*INT, "zero", "negative-int")),
    # --- evaluate
    Row("evaluate", "state", "not-a-state"),
    Row("evaluate", "batches", "not-data"),
    Row("evaluate", "loss_fn", "not-callable"),
    Row("evaluate", "metrics_fn", "not-callable"),
    Row("evaluate", "perplexity", "not-a-bool"),
    Row("evaluate", "strategy", "not-a-strategy"),
    # --- optimizers
    *(Row(fn, "betas", k) for fn in ("optim.adamw", "optim.adam")
      for k in ("not-a-number", "empty", "bad-items")),
    *(Row(fn, arg, k) for fn in ("optim.adamw", "optim.adam") for arg in ("eps", "weight_decay")
      for k in (*NUMBER, "negative")),
    *(Row(fn, "mask", "not-a-list") for fn in ("optim.adamw", "optim.adam", "optim.sgd")),
    *(Row(fn, "maximize", "not-a-bool") for fn in ("optim.adamw", "optim.adam", "optim.sgd")),
    *(Row("optim.sgd", arg, k) for arg in ("momentum", "dampening", "weight_decay")
      for k in (*NUMBER, "negative")),
    Row("optim.sgd", "nesterov", "not-a-bool"),
    *(Row("optim.muon", arg, k) for arg in ("momentum", "weight_decay", "eps")
      for k in (*NUMBER, "negative")),
    Row("optim.muon", "momentum", "above-one"),
    Row("optim.muon", "nesterov", "not-a-bool"),
    *(Row("optim.muon", "ns_steps", k) for k in (*INT, "zero", "negative-int")),
    *(Row("optim.muon", "ns_coefficients", k) for k in ("not-a-number", "bad-items")),
    Row("optim.muon", "adjust_lr", "choice"),
    Row("optim.partition", "optimizers", "not-a-mapping"),
    Row("optim.partition", "optimizers", "empty"),
    Row("optim.partition", "labels", "not-a-mapping"),
    *(Row("optim.partition", "lr_factors", k) for k in ("not-a-mapping", "bad-values")),
    Row("optim.ema", "optimizer", "not-an-optimizer"),
    *(Row("optim.ema", arg, k) for arg in ("decay", "gamma", "power")
      for k in (*NUMBER, "negative")),
    Row("optim.ema", "decay", "above-one"),
    Row("optim.ema", "warmup", "not-a-bool"),
    # --- schedules
    *(Row(f"schedules.{fn}", "peak_lr", k) for fn in ("constant", "warmup_cosine")
      for k in (*NUMBER, "negative")),
    *(Row(f"schedules.{fn}", "warmup_steps", k) for fn in ("warmup_constant", "warmup_linear")
      for k in (*INT, "negative-int")),
    *(Row("schedules.warmup_cosine", "total_steps", k) for k in (*INT, "zero", "negative-int")),
    *(Row("schedules.warmup_cosine", "num_cycles", k) for k in (*NUMBER, "negative")),
    *(Row("schedules.warmup_cosine_restarts", "num_cycles", k) for k in
      (*INT, "zero", "negative-int")),
    *(Row("schedules.warmup_polynomial", arg, k) for arg in ("lr_end", "power")
      for k in (*NUMBER, "negative")),
    *(Row("schedules.warmup_inverse_sqrt", "timescale", k) for k in (*INT, "zero",
                                                                     "negative-int")),
    *(Row("schedules.cosine_with_min_lr", "min_lr", k) for k in (*NUMBER, "negative")),
    *(Row("schedules.cosine_warmup_with_min_lr", arg, k)
      for arg in ("min_lr_rate", "warmup_lr_rate") for k in (*NUMBER, "negative")),
    *(Row("schedules.warmup_stable_decay", arg, k) for arg in ("num_decay_steps",
      "num_stable_steps") for k in (*INT, "negative-int")),
    *(Row("schedules.warmup_stable_decay", arg, "choice") for arg in ("warmup_type",
                                                                       "decay_type")),
    *(Row("schedules.warmup_stable_decay", "min_lr_ratio", k) for k in (*NUMBER, "negative",
                                                                        "above-one")),
    Row("schedules.from_name", "name", "choice"),
    Row("schedules.from_name", "name", "not-a-str"),
    *(Row("schedules.from_name", "warmup_steps", k) for k in ("not-a-number", "bool", "nan",
                                                              "inf", "negative")),
    *(Row("schedules.Plateau", arg, "choice") for arg in ("mode", "threshold_mode")),
    *(Row("schedules.Plateau", "factor", k) for k in (*NUMBER, "zero", "above-one")),
    *(Row("schedules.Plateau", arg, k) for arg in ("patience", "cooldown")
      for k in (*INT, "negative-int")),
    *(Row("schedules.Plateau", arg, k) for arg in ("threshold", "min_lr", "eps")
      for k in (*NUMBER, "negative")),
    *(Row("schedule(step)", "step", k) for k in (*INT, "negative-int")),
    *(Row("schedule_lr", "step", k) for k in (*INT, "negative-int")),
    Row("schedule_lr", "name", "choice"),
    # --- streams
    Row("data.stream", "data", "not-data"),
    *(Row("data.stream", "shuffle_buffer", k)
      for k in ("not-an-int-nor-none", "bool", "zero", "negative-int")),  # None: 1000
    Row("data.pack", "data", "not-data"),
    *(Row("data.pack", "block_size", k) for k in (*INT, "zero", "negative-int")),
    Row("data.pack", "mode", "choice"),
    Row("data.pack", "key", "not-a-str"),
    Row("data.mix", "sources", "not-data"),
    Row("data.mix", "sources", "empty"),
    *(Row("data.mix", "weights", k) for k in ("not-a-list", "empty", "bad-items")),
    # --- strategies
    Row("strategies.SingleDevice", "device", "choice"),
    Row("strategies.SingleDevice", "device", "not-a-path"),
    Row("strategies.SingleDevice", "precision", "choice"),
    Row("strategies.SingleDevice", "precision", "not-a-str"),
)
# fmt: on

# Known gaps, in modules being changed elsewhere now: (function, argument) -> (the kinds that
# get through, what the fix is). Each row stays in the table, marked xfail(strict=True): when the
# fix lands the row passes, and the strict mark fails until this entry goes.
_STATE = "isinstance(state, TrainState), else TypeError naming state"
_STRATEGY = "strategy is None or isinstance(strategy, ft.strategies.Strategy), else TypeError"
_BOOL = "isinstance({0}, bool), else TypeError naming {0} (it is used for its truthiness)"
_ROOT = (
    "isinstance(root, (str, os.PathLike)), else TypeError naming root (Path(root) raises "
    "'expected str, bytes or os.PathLike object' without the name)"
)
_EMA_NUMBER = (
    "ftrain/optim/_ema.py ema: _check({0!r}, {0}, <comparison>) compares first (None "
    "or a str raise a raw '<' TypeError; True passes as 1, inf passes); fix: "
    "_number({0!r}, {0}, <ok>, <want>) from ftrain/optim/_base.py as adamw does"
)
GAPS: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {}


def outcome(row: Row, value: Any) -> str | None:
    """None when `value` for `row.argument` is refused as it should be; what went wrong else."""
    call = CALLS[row.function]
    try:
        with within(20, f"{row.function}({row.argument}={value!r})"):
            out = call(**{row.argument: value})
            if isinstance(out, Iterator):
                list(itertools.islice(out, 1))
    except (TypeError, ValueError) as e:
        if re.search(rf"\b{re.escape(row.argument)}\b", str(e)):
            return None
        return f"{type(e).__name__} that does not name {row.argument!r}: {e}"
    except Hung as e:
        return f"hang: {e}"
    except Exception as e:  # a raw error, or another type
        return f"{type(e).__name__}, not TypeError/ValueError: {e}"
    finally:  # a bad `blocking` may have started a background save
        with contextlib.suppress(ft.CheckpointError):
            ft.wait_for_checkpoint()
    return "accepted (no error)"


def _param(row: Row) -> Any:
    kinds, fix = GAPS.get((row.function, row.argument), ((), ""))
    marks = [pytest.mark.xfail(strict=True, reason=fix)] if row.kind in kinds else []
    return pytest.param(row, id=f"{row.function}-{row.argument}-{row.kind}", marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in TABLE])
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_bad_argument_is_refused_naming_it(row, data):
    value = data.draw(KINDS[row.kind], label=row.argument)
    assume(not (value is None and row.argument in NONE_OK.get(row.function, ())))
    problem = outcome(row, value)
    assert problem is None, f"{row.function}({row.argument}={value!r}): {problem}"


def test_the_table_covers_every_function_and_kind():
    assert {r.function for r in TABLE} == set(CALLS)
    assert {r.kind for r in TABLE} == set(KINDS)
    assert len(set(TABLE)) == len(TABLE)
    rows = {(r.function, r.argument, r.kind) for r in TABLE}
    assert all((f, a, k) in rows for (f, a), (kinds, _) in GAPS.items() for k in kinds)
