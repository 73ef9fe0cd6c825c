"""The main job against nanoGPT: examples/shakespeare_char.py, then nanoGPT's own CPU run.

    python bench/bench_shakespeare.py --nanogpt /tmp/nanogpt [--rounds 2] [-- extra example args]

`--nanogpt` is a nanoGPT checkout (not part of this repo) whose shakespeare_char data was
prepared from this repo's text, without a download:

    cp examples/data/tinyshakespeare.txt /tmp/nanogpt/data/shakespeare_char/input.txt
    cd /tmp/nanogpt && python data/shakespeare_char/prepare.py

Each round runs both whole processes, one right after the other (the order flips every round),
and records wall time and final validation loss. nanoGPT runs the command its README gives for
CPU (4 layers, 4 heads, 128-dim, block 64, batch 12, 2000 iterations, dropout 0, no compile);
the example runs with its defaults and a fresh checkpoint folder.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
    "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
    "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0",
]  # fmt: skip


def run_nanogpt(checkout: Path, out: Path) -> tuple[float, float]:
    """(seconds, final val loss) of nanoGPT's CPU shakespeare_char run."""
    t0 = time.perf_counter()
    log = subprocess.run(
        [sys.executable, "train.py", *NANOGPT_ARGS, f"--out_dir={out}"],
        cwd=checkout, check=True, capture_output=True, text=True, timeout=1800,
    ).stdout  # fmt: skip
    seconds = time.perf_counter() - t0
    return seconds, float(re.findall(r"val loss ([0-9.]+)", log)[-1])


def run_ftrain(out: Path, extra: list[str]) -> tuple[float, float]:
    """(seconds, final val_loss) of `python examples/shakespeare_char.py`."""
    t0 = time.perf_counter()
    log = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "shakespeare_char.py"), "--out", str(out), *extra],
        check=True, capture_output=True, text=True, timeout=1800,
    ).stdout  # fmt: skip
    seconds = time.perf_counter() - t0
    return seconds, float(re.findall(r"val_loss=([0-9.]+)", log)[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout, data prepared")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("extra", nargs="*", help="extra arguments for the example (after --)")
    args = p.parse_args()
    times: dict[str, list[float]] = {"ftrain": [], "nanogpt": []}
    for r in range(args.rounds):
        order = ["ftrain", "nanogpt"] if r % 2 == 0 else ["nanogpt", "ftrain"]
        for name in order:
            with tempfile.TemporaryDirectory() as tmp:
                if name == "ftrain":
                    sec, loss = run_ftrain(Path(tmp), args.extra)
                else:
                    sec, loss = run_nanogpt(args.nanogpt, Path(tmp))
            times[name].append(sec)
            print(f"round {r} {name:8s} {sec:7.1f} s  val_loss {loss:.4f}", flush=True)
    ft_s, ng_s = statistics.median(times["ftrain"]), statistics.median(times["nanogpt"])
    print(f"median: ftrain {ft_s:.1f} s, nanoGPT {ng_s:.1f} s, ratio {ft_s / ng_s:.3f}")


if __name__ == "__main__":
    main()
