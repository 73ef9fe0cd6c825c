"""The README loop of another git revision against this tree's, interleaved in one process.

    python bench/ab_revision.py fd2c751                 # mlp regime, 15 rounds
    python bench/ab_revision.py HEAD~3 --rounds 25 --regime embedding

A change to the step path moves the small step by 1-3%, and this VM's day moves every loop by
more than that from one run to the next (bench/RESULTS.md): two runs of `bench_loop.py`, one
per tree, cannot tell such a change from the load. Here both trees train in one interleaved
run (`bench_loop.time_regime`: the loops take turns in a rotating order), each loop twice,
against the plain raw loop. The other revision's `ftrain/` is taken with `git archive` into a
temporary folder and renamed `ftrain_rev` (its imports with it), so that both import side by
side; the loop body is this tree's `bench_loop.ftrain_loop`, run once with each package.
The revision must be a tree whose README loop this tree's `ftrain_loop` writes (the loop's
API unchanged).
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_loop

ROOT = Path(__file__).resolve().parent.parent
RENAMED = "ftrain_rev"


def extract(rev: str, into: Path) -> Path:
    """`rev`'s `ftrain/` package under `into`, renamed `ftrain_rev` with its imports."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "ftrain"],
        check=True,
        capture_output=True,
    ).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    package = into / RENAMED
    (into / "ftrain").rename(package)
    word = re.compile(r"\bftrain\b")
    for path in package.rglob("*.py"):
        path.write_text(word.sub(RENAMED, path.read_text(encoding="utf-8")), encoding="utf-8")
    return package


def loop_of(package: Any) -> Any:
    """`bench_loop.ftrain_loop` with `ft` bound to `package`."""
    fn = bench_loop.ftrain_loop
    scope = dict(fn.__globals__, ft=package)
    return types.FunctionType(fn.__code__, scope, f"{fn.__name__}_rev", fn.__defaults__)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("rev", help="the git revision to compare with this tree (a commit, a tag)")
    p.add_argument("--regime", choices=bench_loop.REGIMES, default="mlp")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, help="steps per round (default: the regime's)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        extract(args.rev, Path(tmp))
        sys.path.insert(0, tmp)
        package = importlib.import_module(RENAMED)
        if not package.TrainState.__module__.startswith(RENAMED):  # its imports renamed too
            raise RuntimeError(f"{RENAMED} runs this tree's code: {package.TrainState.__module__}")
        print(f"rev's package: {Path(package.__file__).parent}")
        rev_loop = loop_of(package)
        make = bench_loop.make_loop

        def make_loop(name: str, model: torch.nn.Module, data: list[Any], total: int) -> Any:
            return rev_loop(model, total) if name == "rev" else make(name, model, data, total)

        bench_loop.make_loop = make_loop
        loops = ["raw", "rev", "ftrain", "raw#2", "rev#2", "ftrain#2"]
        t = bench_loop.time_regime(args.regime, args.rounds, loops, args.steps)
    print(f"{args.regime}: rev = {args.rev}, ftrain = this tree; {args.rounds} rounds, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print("| loop | ms/step | time ratio | paired ratio |")
    print("|---|---|---|---|")
    for n in loops:
        print(f"| {n} | {t['ms'][n]:.3f} | {t['ratio'][n]:.3f} | **{t['paired'][n]:.3f}** |")


if __name__ == "__main__":
    main()
