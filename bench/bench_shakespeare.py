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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
    "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
    "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0",
]  # fmt: skip


def nanogpt_cmd(checkout: Path, out: Path) -> tuple[list[str], Path, str]:
    """nanoGPT's CPU shakespeare_char command, its folder, and how its final val loss prints."""
    return [sys.executable, "train.py", *NANOGPT_ARGS, f"--out_dir={out}"], checkout, "val loss "


def ftrain_cmd(out: Path, extra: list[str]) -> tuple[list[str], Path, str]:
    """`python examples/shakespeare_char.py` with a fresh checkpoint folder."""
    script = str(ROOT / "examples" / "shakespeare_char.py")
    return [sys.executable, script, "--out", str(out), *extra], ROOT, "val_loss="


def run(cmds: list[tuple[list[str], Path, str]]) -> list[tuple[float, float]]:
    """Start `cmds` together; (seconds, final validation loss) of each, when all are done."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) for c, d, _ in cmds]  # fmt: skip
    logs: list[str] = [""] * len(procs)
    ends: list[float] = [0.0] * len(procs)

    def wait(i: int) -> None:  # each process's own end time, whichever finishes first
        logs[i] = procs[i].communicate(timeout=7200)[0]
        ends[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = []
    for p, log, end, (_, _, tag) in zip(procs, logs, ends, cmds, strict=True):
        if p.returncode:
            raise RuntimeError(f"{p.args} failed with status {p.returncode}")
        out.append((end, float(re.findall(re.escape(tag) + r"([0-9.]+)", log)[-1])))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout, data prepared")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--together", action="store_true",
        help="start both at once (a busy machine: both then see the same load) instead of "
        "one right after the other",
    )  # fmt: skip
    p.add_argument("extra", nargs="*", help="extra arguments for the example (after --)")
    args = p.parse_args()
    times: dict[str, list[float]] = {"ftrain": [], "nanogpt": []}
    for r in range(args.rounds):
        order = ["ftrain", "nanogpt"] if r % 2 == 0 else ["nanogpt", "ftrain"]
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            cmds = {"ftrain": ftrain_cmd(Path(a), args.extra),
                    "nanogpt": nanogpt_cmd(args.nanogpt, Path(b))}  # fmt: skip
            if args.together:
                results = dict(zip(order, run([cmds[n] for n in order]), strict=True))
            else:
                results = {n: run([cmds[n]])[0] for n in order}
        for name in order:
            sec, loss = results[name]
            times[name].append(sec)
            print(f"round {r} {name:8s} {sec:7.1f} s  val_loss {loss:.4f}", flush=True)
    ft_s, ng_s = statistics.median(times["ftrain"]), statistics.median(times["nanogpt"])
    print(f"median: ftrain {ft_s:.1f} s, nanoGPT {ng_s:.1f} s, ratio {ft_s / ng_s:.3f}")


if __name__ == "__main__":
    main()
