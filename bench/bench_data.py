"""Background loading: ftrain with workers vs a raw DataLoader loop vs ftrain synchronous.

    python bench/bench_data.py                # 5 interleaved rounds, prints a table
    python bench/bench_data.py --rounds 3 --steps 20 --read-ms 4

The dataset is IO-bound: each row takes `--read-ms` to read (a sleep, like a disk or network
read that leaves the CPU free). The step is compute-bound: a small MLP language model. Three
loops train their own copy of the same model for `--steps` optimizer steps on the same rows:

- raw:      `DataLoader(ds, batch_size, shuffle=True, num_workers=2)` + a plain PyTorch step
            (fused AdamW, clip, zero_grad(set_to_none=True));
- ftrain-2: the README loop with `make_batches(..., num_workers=2)`;
- ftrain-0: the README loop with `make_batches(...)` (loading in the loop's process).

Each round runs the three in turn (order rotated per round), each from a fresh iterator, so
worker start-up is counted for both worker loops; the table reports medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import ftrain as ft

VOCAB, SEQ, BATCH = 256, 64, 8


class SlowRows(torch.utils.data.Dataset[dict[str, list[int]]]):
    """Rows of token ids that take `read_s` seconds each to read."""

    def __init__(self, n: int, read_s: float) -> None:
        self.n, self.read_s = n, read_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        time.sleep(self.read_s)
        ids = [(i * 7 + t * 3) % VOCAB for t in range(SEQ)]
        return {"input_ids": ids}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 128),
        torch.nn.Linear(128, 512),
        torch.nn.GELU(),
        torch.nn.Linear(512, VOCAB),
    )


def loss_fn(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    ids = batch["input_ids"]
    logits = m(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum"
    )
    return loss, ids[:, 1:].numel()


def run_raw(ds: SlowRows, steps: int) -> float:
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, shuffle=True, num_workers=2, collate_fn=ft.pad_collate()
    )
    t0 = time.perf_counter()
    for i, batch in enumerate(loader):
        loss, n = loss_fn(m, batch)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i + 1 == steps:
            break
    return time.perf_counter() - t0


def run_ftrain(ds: SlowRows, steps: int, workers: int) -> float:
    state = ft.TrainState.create(model(), ft.optim.adamw(weight_decay=0.1), seed=0)
    t0 = time.perf_counter()
    while state.step < steps:  # the README loop (grads lives across iterations)
        for micro in ft.make_batches(ds, state, batch_size=BATCH, num_workers=workers):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3, max_norm=1.0)
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--read-ms", type=float, default=8.0)
    args = p.parse_args(argv)
    # One compute thread in every loop: on a small shared machine, intra-op threads would
    # fight the loader processes and the noise would swamp the comparison.
    torch.set_num_threads(1)
    ds = SlowRows(BATCH * (args.steps + 5), args.read_ms / 1000)
    loops: dict[str, Callable[[], float]] = {
        "raw DataLoader(num_workers=2)": lambda: run_raw(ds, args.steps),
        "ftrain num_workers=2": lambda: run_ftrain(ds, args.steps, 2),
        "ftrain num_workers=0": lambda: run_ftrain(ds, args.steps, 0),
    }
    names = list(loops)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % 3 :] + names[: r % 3]:  # rotate the order: noise hits all
            times[name].append(loops[name]())
    med = {n: statistics.median(t) for n, t in times.items()}
    raw, w2, w0 = (med[n] for n in names)
    print(f"{args.rounds} rounds x {args.steps} steps, batch {BATCH}, {args.read_ms} ms per row")
    for n in names:
        ms = 1000 * med[n] / args.steps
        print(f"{n:32s} {ms:7.1f} ms/step  (rounds: {', '.join(f'{t:.2f}' for t in times[n])})")
    print(f"ftrain-2 / raw      = {w2 / raw:.3f}   (goal <= 1.05)")
    print(f"ftrain-0 / ftrain-2 = {w0 / w2:.3f}   (goal >= 1.5)")
    return {"ratio_raw": w2 / raw, "speedup": w0 / w2, "medians": med}


if __name__ == "__main__":
    main()
