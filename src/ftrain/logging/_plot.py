"""`python -m ftrain plot metrics.jsonl -o curves.png`: loss, lr and grad norm against step."""

from __future__ import annotations

import json
import os
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
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_metrics(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Draw train/eval loss, learning rate and grad norm against step into a PNG.

    Needs matplotlib (`pip install 'ftrain[plot]'`).

    Raises:
        ValueError: if the file holds no record with a step.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("plotting needs matplotlib: pip install 'ftrain[plot]'") from e
    records = read_jsonl(path)
    if not records:
        raise ValueError(f"{path} holds no log record with a 'step'")
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    panels = [
        (axes[0], [("loss", "train loss"), ("eval_loss", "eval loss")], "loss"),
        (axes[1], [("learning_rate", "learning rate")], "lr"),
        (axes[2], [("grad_norm", "grad norm (pre-clip)")], "norm"),
    ]
    for ax, keys, ylabel in panels:
        for key, label in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if key.startswith("eval_") else None, label=label)
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
