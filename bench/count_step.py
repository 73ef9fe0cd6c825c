"""Count what one step of a bench_loop.py loop executes: deterministic, whatever the load.

    python bench/count_step.py opcodes ftrain            # Python bytecodes a step, by function
    python bench/count_step.py opcodes raw
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/ft.out \\
        "$(python -c 'import sys; print(sys.executable)')" bench/count_step.py instructions ftrain

Step time on a shared 2-core machine moves by a few percent from run to run; these counts do
not (the instruction count varies by ~0.1% with string hashing). `opcodes` traces every bytecode
(`sys.settrace`, opcode events) over 20 steps of the mlp regime after 20 warm-up steps.
`instructions` runs 300 steps (`--steps`) with callgrind's instrumentation switched on around
them (`callgrind_control`), so valgrind's "Collected" line is the machine instructions of those
steps (divide by their number; the switch itself is ~0.5M). `--regime` picks bench_loop.py's
model (mlp by default). Neither says what the instructions cost: cache
misses are not counted, and the two loops' costs per instruction differ (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_loop


def _steps(loop: str, regime: str) -> tuple[Any, list[Any]]:
    torch.set_num_threads(1)
    model, data, _ = bench_loop.build(regime)
    step = bench_loop.make_loop(loop, copy.deepcopy(model), data, 10**6)
    for i, micro in enumerate(data[:20]):  # warm-up: first-step state, caches, lazy imports
        step(micro, i)
    return step, data


def opcodes(loop: str, regime: str, steps: int = 20, top: int = 25) -> None:
    step, data = _steps(loop, regime)
    counts: collections.Counter[str] = collections.Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            where = code.co_filename.split("site-packages/")[-1].split("/main/")[-1]
            counts[f"{where}:{code.co_name}"] += 1
        return tracer

    sys.settrace(tracer)
    for k in range(steps):
        step(data[k % len(data)], 20 + k)
    sys.settrace(None)
    print(f"{loop}: {sum(counts.values()) / steps:.0f} Python opcodes a step")
    for name, n in counts.most_common(top):
        print(f"{n / steps:8.1f}  {name}")


def instructions(loop: str, regime: str, steps: int = 300) -> None:
    step, data = _steps(loop, regime)

    def instrument(on: bool) -> None:
        arg = "--instr=on" if on else "--instr=off"
        cmd = ["callgrind_control", arg, str(os.getpid())]
        subprocess.run(cmd, check=True, capture_output=True)

    instrument(True)
    for k in range(steps):
        step(data[k % len(data)], 20 + k)
    instrument(False)
    print(f"{loop}: {steps} steps instrumented; divide valgrind's 'Collected' by {steps}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["opcodes", "instructions"])
    p.add_argument("loop", choices=["raw", "exact", "guarded", "ftrain"])
    p.add_argument("--regime", choices=bench_loop.REGIMES, default="mlp")
    p.add_argument(
        "--steps", type=int, help="steps counted (default: 20 traced, 300 under valgrind)"
    )
    p.add_argument("--top", type=int, default=25, help="functions listed (opcodes)")
    args = p.parse_args()
    if args.what == "opcodes":
        opcodes(args.loop, args.regime, args.steps or 20, args.top)
    else:
        instructions(args.loop, args.regime, *([args.steps] if args.steps else []))


if __name__ == "__main__":
    main()
