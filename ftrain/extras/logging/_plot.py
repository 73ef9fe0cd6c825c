"""`python -m ftrain plot metrics.jsonl -o curves.png [--metrics NAME...]`: curves against step."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_metrics", "read_jsonl"]


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a JSONL log, one per (step, kind), the last written winning (resumed runs
    append), sorted by step. Lines that are not JSON objects with a `step` are skipped."""
    latest: dict[tuple[int, bool], dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # e.g. a line cut short by a crash
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                is_eval = any(k.startswith("eval_") for k in rec)
                latest[(rec["step"], is_eval)] = rec
    return [latest[k] for k in sorted(latest)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if _number(r.get(key))]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_metrics(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    metrics: Sequence[str] | None = None,
    mode: str = "min",
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
    records = read_jsonl(path)
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
