"""How much `import ftrain` costs on top of `import torch` (issue 25, item 6: at most +0.3 s).

Each round starts fresh interpreters for every tree given on the command line (a folder that
holds `ftrain/`, e.g. this checkout and another worktree), interleaved so that machine load
hits all alike:

- `import torch` alone, and `import ftrain` alone (which imports torch): the difference of
  their medians is what a user waits for beyond torch (on a loaded machine `import torch`
  itself varies by more than ftrain costs, so this difference is noisy);
- `import torch; import ftrain` in one process: ftrain's own increment, torch already loaded
  (the sharper number).

It also lists the heavy modules `import ftrain` loads beyond `import torch` (the extras, the HF
stack, torch.compile's, DCP's): there should be none; tests/test_layout.py checks the same.

    python bench/bench_import.py --rounds 9 .
    python bench/bench_import.py --rounds 9 . /path/to/other/checkout
    python -X importtime -c "import torch, ftrain" 2>&1 | sort -t'|' -k2 -n | tail  # who costs
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ALONE = "import time; t0 = time.perf_counter(); import {m}; print(time.perf_counter() - t0)"
AFTER_TORCH = (
    "import time; import torch; t0 = time.perf_counter(); import ftrain; "
    "print(time.perf_counter() - t0)"
)
NEW_MODULES = (
    "import sys, torch; before = set(sys.modules); import ftrain; "
    "print('\\n'.join(sorted(set(sys.modules) - before)))"
)
HEAVY = (
    "ftrain.extras",
    "transformers",
    "datasets",
    "peft",
    "accelerate",
    "safetensors",
    "numpy",
    "matplotlib",
    "tensorboard",
    "sympy",
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed",
    "torch.distributed.checkpoint",
)


def _run(tree: str, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    return out.stdout


def sample(tree: str) -> tuple[float, float, float]:
    """(import torch, import ftrain, ftrain after torch) in seconds, three fresh processes."""
    torch_s = float(_run(tree, ALONE.format(m="torch")))
    ftrain_s = float(_run(tree, ALONE.format(m="ftrain")))
    after_s = float(_run(tree, AFTER_TORCH))
    return torch_s, ftrain_s, after_s


def heavy_modules(tree: str) -> list[str]:
    """The modules of HEAVY (or under them) that `import ftrain` loads after `import torch`."""
    new = _run(tree, NEW_MODULES).split()
    return sorted({h for m in new for h in HEAVY if m == h or m.startswith(h + ".")})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("trees", nargs="*", default=["."], help="folders holding ftrain/")
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float, float]]] = {t: [] for t in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:  # interleaved, so machine load hits every tree alike
            times[tree].append(sample(tree))
    print(f"{args.rounds} rounds, medians, fresh interpreters ({sys.executable})")
    for tree, rows in times.items():
        torch_s, ftrain_s, after_s = (statistics.median(r[k] for r in rows) for k in range(3))
        print(
            f"{tree}: import torch {torch_s:.2f} s; import ftrain {ftrain_s:.2f} s "
            f"({ftrain_s - torch_s:+.2f} s); ftrain after torch +{after_s:.2f} s "
            f"(range {min(r[2] for r in rows):.2f}-{max(r[2] for r in rows):.2f})"
        )
        print(f"{tree}: heavy modules import ftrain adds: {heavy_modules(tree) or 'none'}")


if __name__ == "__main__":
    main()
