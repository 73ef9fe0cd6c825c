"""Data-parallel throughput on CPU: the Tiny Shakespeare example in 1 process vs 2 processes
with DDP and with FSDP.

    python bench/bench_ddp.py [--iters 300] [--rounds 3]

All runs use the same global batch (12) and so the same training trajectory; the 1-process
run uses 2 torch threads, each of the 2 processes 1 (all use the machine's 2 cores). Rounds
rotate the order; reported: training seconds per 100 steps (median) and the speed ratio.
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


def run(kind: str, iters: int) -> tuple[float, float]:
    args = [str(EXAMPLE), "--max-iters", str(iters), "--eval-interval", str(10 * iters),
            "--eval-iters", "1", "--final-eval-iters", "20", "--log-interval", str(10 * iters),
            "--out", ""]  # fmt: skip
    if kind == "single":
        cmd, threads = [sys.executable, *args], "2"
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", *args, "--strategy", kind]  # fmt: skip
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
    kinds = ["single", "ddp", "fsdp"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    vals: dict[str, float] = {}
    for r in range(args.rounds):
        for kind in kinds[r % 3 :] + kinds[: r % 3]:
            t, vals[kind] = run(kind, args.iters)
            times[kind].append(t * 100 / args.iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.iters} steps, global batch 12, {args.rounds} rounds")
    print("| processes | s / 100 steps | speed vs 1 process | final val_loss |")
    print("|---|---|---|---|")
    print(f"| 1 (2 threads) | {med['single']:.2f} | 1.00 | {vals['single']:.4f} |")
    for kind in ("ddp", "fsdp"):
        print(f"| 2 {kind.upper()} (1 thread each) | {med[kind]:.2f} | "
              f"{med['single'] / med[kind]:.2f} | {vals[kind]:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
