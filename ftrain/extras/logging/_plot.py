"""`python -m ftrain plot metrics.jsonl -o curves.png [--metrics NAME...]`: curves against step."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_metrics", "read_jsonl"]


RESTART = "ftrain_restart"  # JSONLSink's restart line: {"ftrain_restart": true, "step": s}

BadLine = Callable[[int, str], None]
"""Called with a skipped line's number (from 1) and why it was skipped."""

# An integer literal longer than this cannot be a float (the largest double has 309 digits);
# refusing it before int() also bounds the time a hostile line takes to parse.
_MAX_DIGITS = 308
_MAX_STEP = 2**63


def read_jsonl(
    path: str | os.PathLike[str], *, on_bad_line: BadLine | None = None
) -> list[dict[str, Any]]:
    """Records of a JSONL log, one per (step, kind: eval or not), sorted by step. Records of one
    step and kind are merged, the last written value of each field winning (resumed runs
    append): a train record and another record of the same step (`{"step": s, "test_loss":
    ...}`), or two eval records, both keep their fields. A restart line (`JSONLSink` writes
    one where a resumed run or a guard rollback goes on from step s) drops every record
    written before it at step s or later: steps made again, or undone.

    A line that is not a JSON object with an integer `step` in [0, 2**63) is skipped and
    reported to `on_bad_line(line_number, reason)`: a line cut short by a crash (also inside a
    UTF-8 character), nesting too deep to parse, an integer too large for a float (over 308
    digits). Blank lines are skipped silently. Time and memory stay linear in the file's size.

    Args:
        path: the log.
        on_bad_line: called for each skipped line (pandas' `on_bad_lines` as a callable);
            None skips them silently.
    """
    latest: dict[tuple[int, bool], dict[str, Any]] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            rec, why = _record(raw, first=number == 1)
            if rec is not None and rec.get(RESTART) is True and len(rec) == 2:
                latest = {k: v for k, v in latest.items() if k[0] < rec["step"]}
            elif rec is not None:
                key = (rec["step"], any(k.startswith("eval_") for k in rec))
                latest[key] = {**latest.get(key, {}), **rec}
            elif why and on_bad_line is not None:
                on_bad_line(number, why)
    return [latest[k] for k in sorted(latest)]


def _record(raw: bytes, *, first: bool) -> tuple[dict[str, Any] | None, str]:
    """(the record, "") for a good line, else (None, why); why is "" for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8 text (cut inside a character?)"
    text = text.removeprefix("\ufeff") if first else text
    if not text.strip():
        return None, ""
    try:
        rec = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        return None, "nested too deeply"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg})"
    except ValueError as e:  # _parse_int's, or int()'s own digit limit
        return None, str(e)
    step = rec.get("step") if isinstance(rec, dict) else None
    if type(step) is not int or not 0 <= step < _MAX_STEP:
        return None, "no integer 'step' in [0, 2**63)"
    return rec, ""


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits, too large for a float")
    return int(digits)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if _number(r.get(key))]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_metrics(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    metrics: Sequence[str] | None = None,
    mode: str = "min",
    on_bad_line: BadLine | None = None,
) -> Path:
    """Draw train/eval loss, learning rate and grad norm (or the named `metrics`) against step
    into a PNG, and mark the best step.

    Needs matplotlib (`pip install 'ftrain[plot]'`).

    Args:
        path: a JSONL log (`ft.logging`'s `metrics.jsonl`).
        out: the PNG to write.
        metrics: logged keys to plot, one panel each, e.g. `["eval_accuracy", "eval_loss"]`;
            the first is the one ranked for the best step (the metric you early-stop on). By
            default loss, learning rate and grad norm, with the best `eval_loss` marked.
        mode: "min" if a lower value of the ranked metric is better, "max" otherwise.
        on_bad_line: called with the number of each line skipped and why (see `read_jsonl`);
            the rest is plotted. `python -m ftrain plot` reports them on stderr.

    Returns:
        `out` as a Path.

    Raises:
        ValueError: if the file holds no record with a step, a named metric is never logged,
            or `mode` is neither "min" nor "max".
    """
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if metrics is not None and (isinstance(metrics, str) or not metrics):
        raise ValueError(f"metrics must be a non-empty list of logged keys, got {metrics!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("plotting needs matplotlib: pip install 'ftrain[plot]'") from e
    records = read_jsonl(path, on_bad_line=on_bad_line)
    if not records:
        raise ValueError(f"{path} holds no log record with a 'step'")
    panels = _panels(records, metrics, path)
    ranked = metrics[0] if metrics else "eval_loss"
    best = best_step(records, ranked, mode=mode)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), sharex=True)
    axes = list(axes) if len(panels) > 1 else [axes]
    for ax, (keys, ylabel) in zip(axes, panels, strict=True):
        for key, label in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if key.startswith("eval_") else None, label=label)
            if key == ranked and best is not None:
                ax.axvline(best[0], color="tab:red", linestyle="--", alpha=0.6)
                ax.plot([best[0]], [best[1]], "r*", markersize=12, label=f"best step {best[0]}")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _panels(
    records: list[dict[str, Any]], metrics: Sequence[str] | None, path: Any
) -> list[tuple[list[tuple[str, str]], str]]:
    if metrics is None:
        return [
            ([("loss", "train loss"), ("eval_loss", "eval loss")], "loss"),
            ([("learning_rate", "learning rate")], "lr"),
            ([("grad_norm", "grad norm (pre-clip)")], "norm"),
        ]
    missing = [m for m in metrics if not _series(records, m)[0]]
    if missing:
        logged = sorted({k for r in records for k, v in r.items() if _number(v)} - {"step"})
        raise ValueError(f"{path} never logs {missing} as a number; it logs {logged}")
    return [([(m, m)], m) for m in metrics]


def best_step(
    records: list[dict[str, Any]], key: str, *, mode: str = "min"
) -> tuple[int, float] | None:
    """(step, value) of the best finite `key` in `records` (ties: the earliest), or None."""
    pts = [(s, v) for s, v in zip(*_series(records, key), strict=True) if math.isfinite(v)]
    if not pts:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(pts, key=lambda sv: (sign * sv[1], sv[0]))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
