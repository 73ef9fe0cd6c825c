"""Per-step overhead of accumulate_grads and clip_and_step against an older checkout's.

An all-overhead step (a 16-32-4 MLP, accumulation 2, one thread), interleaved in one process:
this tree's functions, the same functions loaded from another checkout's `ftrain/`, and a
bare forward+backward. Prints median microseconds.

    python bench/bench_step_overhead.py --old /path/to/other/checkout/ftrain [--steps 3000]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

import ftrain as ft


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ftrain._old_{name}", path / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _state() -> ft.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return ft.TrainState.create(model, ft.optim.adamw())


def _loss(m: torch.nn.Module, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return m(b).pow(2).sum(), torch.tensor(b.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--old", type=Path, required=True, help="another checkout's ftrain/ folder")
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    old_grads, old_step = _load(args.old, "grads"), _load(args.old, "step")
    micro = [torch.randn(8, 16) for _ in range(2)]
    new, old = _state(), _state()
    times: dict[str, list[float]] = {k: [] for k in ("acc", "step", "old_acc", "old_step", "fb")}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        grads, stats = ft.accumulate_grads(new, micro, _loss)
        t1 = time.perf_counter()
        new, _ = ft.clip_and_step(new, grads, lr=1e-3, max_norm=1.0, stats=stats)
        t2 = time.perf_counter()
        grads_o, stats_o = old_grads.accumulate_grads(old, micro, _loss)
        t3 = time.perf_counter()
        old, _ = old_step.clip_and_step(old, grads_o, lr=1e-3, max_norm=1.0, stats=stats_o)
        t4 = time.perf_counter()
        for p in new.params.values():  # a bare forward+backward over the same micro-batches
            p.grad = None
        for b in micro:
            (_loss(new.model, b)[0] / 16).backward()
        t5 = time.perf_counter()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[k].append(dt)
    print({k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()})


if __name__ == "__main__":
    main()
