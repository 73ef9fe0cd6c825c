"""How long a sharded (FSDP) save holds the training loop up: blocking vs background.

    python bench/bench_async_save.py [--rounds 5] [--every 3]

Two processes on CPU (gloo) train one ~30M-parameter GPT-2 (the model of bench_checkpoint.py)
with FSDP, the README step (`accumulate_grads`, `clip_and_step`). Every `--every` steps each
round saves once in each of three ways, in an order that alternates between rounds:
`ft.save_checkpoint(blocking=True)`, `ft.save_checkpoint(blocking=False)`, and the raw
reference, `torch.distributed.checkpoint.async_save` of the same tensors over a gloo group of
its own (what a hand-written FSDP loop would call; no commit protocol). Reported on rank 0,
medians over rounds: the time the call held the loop (its stall), the time until the save was
on disk, and a training step's time.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from bench_checkpoint import build_model  # the same ~30M-parameter GPT-2

import ftrain as ft


def worker(rank: int, world: int, port: int, root: str, rounds: int, every: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp

    with ft.strategies.from_env("fsdp") as strategy:
        state = ft.TrainState.create(build_model(), ft.optim.adamw(), strategy=strategy)
        ids = torch.randint(0, 50_000, (2, 16), generator=torch.Generator().manual_seed(rank))
        micro = [{"input_ids": ids, "labels": ids}]
        steps: list[float] = []
        times: dict[str, list[tuple[float, float]]] = {"blocking": [], "background": [], "raw": []}

        def train(n: int) -> None:
            nonlocal state
            for _ in range(n):
                t = time.perf_counter()
                grads, stats = ft.accumulate_grads(state, micro)
                state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-4, max_norm=1.0)
                float(stats.loss)  # the loop's host sync, as a logging step has it
                steps.append(time.perf_counter() - t)

        def save(mode: str) -> None:
            t = time.perf_counter()
            if mode == "raw":
                opt = {
                    k: v
                    for k, v in ft.checkpoint.flatten_tree(state.opt_state).items()
                    if torch.is_tensor(v)
                }
                tensors = {**state.params, **opt}
                future = dcp.async_save(
                    tensors, checkpoint_id=f"{root}/raw-{state.step}", process_group=raw_group
                )
            else:
                ft.save_checkpoint(state, root, keep_last=1, blocking=mode == "blocking")
            stall = time.perf_counter() - t
            train(every)  # the loop goes on while a background save writes
            if mode == "raw":
                future.result()
            else:
                ft.wait_for_checkpoint()
            times[mode].append((stall, time.perf_counter() - t))

        # The raw loop, too, needs a group of its own: DCP writes in a thread, and collectives
        # of that thread and the training's must not share a group.
        raw_group = torch.distributed.new_group(backend="gloo")
        train(2)  # warm-up
        for r in range(rounds):
            modes = ["blocking", "background", "raw"]
            for mode in modes if r % 2 == 0 else modes[::-1]:
                save(mode)
        if rank == 0:
            step = statistics.median(steps)
            print(f"FSDP x{world} CPU, GPT-2 ~30M params, {rounds} rounds, median step {step:.3f}s")
            for mode, rows in times.items():
                stall = statistics.median(s for s, _ in rows)
                done = statistics.median(d for _, d in rows)
                print(
                    f"{mode:>10}: call held the loop {stall:.3f}s ({stall / step:.1f} steps); "
                    f"on disk after {done:.3f}s (incl. {every} steps)"
                )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--every", type=int, default=3)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(
            worker, args=(2, port, str(Path(root)), args.rounds, args.every), nprocs=2,
            start_method="spawn",
        )  # fmt: skip


if __name__ == "__main__":
    main()
