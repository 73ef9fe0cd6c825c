"""Regenerate docs/img/curves.png: the logging loop of docs/logging.md on the digits MLP of
examples/search.py (300 steps), then `python -m ftrain plot` of its metrics.jsonl.

    python docs/img/make_curves.py
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import ftrain as ft

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("search", ROOT / "examples" / "search.py")
search = importlib.util.module_from_spec(spec)
spec.loader.exec_module(search)

total, train, val = 300, *search.digits(0)
torch.manual_seed(0)
state = ft.TrainState.create(search.MLP(), ft.optim.adamw(weight_decay=0.01), seed=0)
lr = ft.schedules.warmup_cosine(peak_lr=0.02, warmup_steps=30, total_steps=total)
loss_fn = ft.losses.classification_loss()
out = Path(tempfile.mkdtemp()) / "metrics.jsonl"
sink = ft.logging.JSONLSink(out)
window = ft.logging.window(state)
while state.step < total:
    for micro in ft.make_batches(train, state, batch_size=32):
        grads, stats = ft.accumulate_grads(state, micro, loss_fn)
        state, info = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step), max_norm=1.0)
        window = ft.logging.update(window, stats, info)
        if ft.should_log(state, every=10):
            record, window = ft.logging.emit(window, state)
            sink.log(record)
        if ft.should_eval(state, every=50, total_steps=total):
            batches = ft.make_batches(val, batch_size=250, shuffle=False)
            sink.log({"step": state.step, **ft.evaluate(state, batches, loss_fn)})
        if state.step >= total:
            break
    else:
        state = ft.next_epoch(state)
sink.close()
png = ROOT / "docs" / "img" / "curves.png"
subprocess.run([sys.executable, "-m", "ftrain", "plot", str(out), "-o", str(png)], check=True)
print(png)
