"""How much `import ftrain` costs on top of `import torch` (issue 19: within 0.3 s).

Each sample is a fresh interpreter that times `import torch`, then `import ftrain` (so the
difference is ftrain's own cost, torch already loaded). Interleaves the source trees given on
the command line (e.g. this branch and main), and reports medians.

    python bench/bench_import.py --runs 9 . /path/to/other/checkout
    python -X importtime -c "import torch, ftrain" 2>&1 | sort -t'|' -k2 -n | tail  # who costs
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

PROBE = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "import ftrain; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)"
)


def sample(src: str) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    torch_s, ftrain_s = map(float, out.stdout.split())
    return torch_s, ftrain_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("trees", nargs="+", help="source directories holding ftrain/")
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float]]] = {t: [] for t in args.trees}
    for _ in range(args.runs):
        for tree in args.trees:  # interleaved, so machine load hits every tree alike
            times[tree].append(sample(tree))
    for tree, rows in times.items():
        torch_s = statistics.median(r[0] for r in rows)
        ftrain_s = statistics.median(r[1] for r in rows)
        print(f"{tree}: import torch {torch_s:.2f} s, then import ftrain +{ftrain_s:.2f} s")


if __name__ == "__main__":
    main()
