"""The compiled step: `clip_and_step(..., compile=True)` vs eager vs raw PyTorch, interleaved.

    python bench/bench_compiled_step.py                      # tiny and embedding regimes
    python bench/bench_compiled_step.py --regime tiny --rounds 7

Four loops train their own copy of bench_loop.py's model on the same data (AdamW wd 0.1,
accumulation 2, clip 1.0, warmup-cosine lr, logging every 10 steps): the README loop eager and
with `compile=True`, the raw loop with fused AdamW (bench_loop.py's), and the raw loop with
the optimizer step compiled as PyTorch's tutorial does it (`torch.compile(opt.step)` over a
foreach AdamW with a tensor lr). The loops take turns step by step (order rotating); medians
of per-step times. The first block of each loop (where compilation happens) is untimed in the
medians and reported.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from bench_loop import _block, _to_device, build, ftrain_loop, raw_loop

LOOPS = ("raw fused", "raw compiled opt.step", "ftrain eager", "ftrain compile=True")


def time_regime(regime: str, rounds: int) -> None:
    model, data, steps = build(regime)
    model, data = _to_device(model, data)
    total = steps * (rounds + 1)
    makers = {
        "raw fused": raw_loop,
        "raw compiled opt.step": lambda m, t: raw_loop(m, t, compiled_step=True),
        "ftrain eager": ftrain_loop,
        "ftrain compile=True": lambda m, t: ftrain_loop(m, t, compile=True),
    }
    loops = {name: make(copy.deepcopy(model), total) for name, make in makers.items()}
    first = {}
    for name, step in loops.items():  # compiles here
        t0 = time.perf_counter()
        _block(step, data, 0)
        first[name] = time.perf_counter() - t0
    # Interleaved step by step (order rotating): on a shared machine the load changes faster
    # than a block of steps lasts, which made block-interleaved medians of the tiny regime
    # differ by 1.8x between two loops doing the same work.
    per_step: dict[str, list[float]] = {name: [] for name in loops}
    turn = 0
    for r in range(rounds):
        for i, micro in enumerate(data):
            order = LOOPS[turn % 4 :] + LOOPS[: turn % 4]
            turn += 1
            for name in order:
                per_step[name] += _block(loops[name], [micro], steps * (r + 1) + i)
    med = {name: statistics.median(ts) * 1e3 for name, ts in per_step.items()}
    n = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"\nregime {regime} ({n:.2f}M params), {steps} steps x {rounds} rounds")
    print("| loop | ms/step | vs raw fused | vs ftrain eager | first block incl. compile (s) |")
    print("|---|---|---|---|---|")
    for name in LOOPS:
        print(
            f"| {name} | {med[name]:.2f} | {med[name] / med['raw fused']:.3f} | "
            f"{med[name] / med['ftrain eager']:.3f} | {first[name]:.1f} |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regime", choices=["tiny", "embedding", "all"], default="all")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for regime in ["tiny", "embedding"] if args.regime == "all" else [args.regime]:
        time_regime(regime, args.rounds)


if __name__ == "__main__":
    main()
