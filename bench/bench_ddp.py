"""Data-parallel throughput on CPU: the Tiny Shakespeare example in 1 process vs 2 DDP processes.

    python bench/bench_ddp.py [--iters 300] [--rounds 3]

Both runs use the same global batch (12) and so the same training trajectory; the 1-process
run uses 2 torch threads, each DDP process 1 (both use the machine's 2 cores). Rounds alternate
the order; reported: training seconds per 100 steps (median) and the speed ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "shakespeare_char.py"


def run(procs: int, iters: int) -> tuple[float, float]:
    args = [str(EXAMPLE), "--max-iters", str(iters), "--eval-interval", str(10 * iters),
            "--eval-iters", "1", "--final-eval-iters", "20", "--log-interval", str(10 * iters),
            "--out", ""]  # fmt: skip
    if procs == 1:
        cmd, threads = [sys.executable, *args], "2"
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(procs), *args, "--strategy", "ddp"]  # fmt: skip
        threads = "1"
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    seconds = float(re.search(r"train_time=([\d.]+)s", out).group(1))
    val = float(re.search(r"val_loss=([\d.]+)", out).group(1))
    return seconds, val


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    times: dict[int, list[float]] = {1: [], 2: []}
    vals: dict[int, float] = {}
    for r in range(args.rounds):
        for procs in (1, 2) if r % 2 == 0 else (2, 1):
            t, vals[procs] = run(procs, args.iters)
            times[procs].append(t * 100 / args.iters)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"{args.iters} steps, global batch 12, {args.rounds} rounds")
    print("| processes | s / 100 steps | speed vs 1 process | final val_loss |")
    print("|---|---|---|---|")
    print(f"| 1 (2 threads) | {one:.2f} | 1.00 | {vals[1]:.4f} |")
    print(f"| 2 DDP (1 thread each) | {two:.2f} | {one / two:.2f} | {vals[2]:.4f} |")


if __name__ == "__main__":
    main()
