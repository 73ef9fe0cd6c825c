"""torch.compile and bf16 autocast: ftrain vs a raw PyTorch loop, interleaved in one run.

    python bench/bench_compile.py [--regime llama] [--rounds 4]

Six loops train their own copy of the same model on the same data (bench_loop.py's regimes:
AdamW, accumulation 2, clip 1.0): raw and ftrain, each eager, `torch.compile(model)`, and bf16
autocast. Blocks rotate every round; reported: median ms/step, ftrain/raw in each mode, and the
speed-up of each mode over eager. Compilation happens in an untimed warm-up block (its time is
reported separately).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import bench_loop
import torch
from bench_loop import ACCUM, CLIP, WD, _block, _to_device, build

import ftrain as ft

MODES = ("eager", "compile", "bf16")


def raw_loop(model: torch.nn.Module, total: int, mode: str) -> Callable[[list[Any], int], None]:
    if mode == "compile":
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=WD, fused=True)
    lr = ft.schedules.warmup_cosine(1e-3, 10, total)

    def cast() -> contextlib.AbstractContextManager[Any]:
        if mode == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(micro: list[Any], k: int) -> None:
        opt.zero_grad(set_to_none=True)
        for batch in micro:
            with cast():
                loss = model(**batch).loss / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for group in opt.param_groups:
            group["lr"] = lr(k)
        opt.step()

    return step


def ftrain_loop(model: torch.nn.Module, total: int, mode: str) -> Callable[[list[Any], int], None]:
    if mode == "compile":
        model = torch.compile(model)
    strategy = ft.strategies.SingleDevice(precision="bf16" if mode == "bf16" else None)
    return bench_loop.ftrain_loop(model, total, strategy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regime", default="llama", choices=["tiny", "embedding", "llama"])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    model, data, steps = build(args.regime)
    model, data = _to_device(model, data)
    total = steps * (args.rounds + 1)
    loops = {
        (kind, mode): make(copy.deepcopy(model), total, mode)
        for mode in MODES
        for kind, make in (("raw", raw_loop), ("ftrain", ftrain_loop))
    }
    warmup = {}
    for key, step in loops.items():  # compiles here, untimed in the table
        t0 = time.perf_counter()
        _block(step, data, 0)
        warmup[key] = time.perf_counter() - t0
    per_step: dict[tuple[str, str], list[float]] = {k: [] for k in loops}
    keys = list(loops)
    for r in range(args.rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            per_step[key] += _block(loops[key], data, steps * (r + 1))
    med = {k: statistics.median(v) * 1e3 for k, v in per_step.items()}
    n = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"regime {args.regime} ({n:.2f}M params), {steps} steps x {args.rounds} rounds, "
          f"accum {ACCUM}, {torch.get_num_threads()} threads")  # fmt: skip
    print("| mode | raw ms/step | ftrain ms/step | ftrain / raw | speed-up vs eager (ftrain) "
          "| first block incl. compile, s (raw / ftrain) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        raw, fts = med[("raw", mode)], med[("ftrain", mode)]
        print(f"| {mode} | {raw:.1f} | {fts:.1f} | **{fts / raw:.3f}** | "
              f"{med[('ftrain', 'eager')] / fts:.2f} | "
              f"{warmup[('raw', mode)]:.1f} / {warmup[('ftrain', mode)]:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
