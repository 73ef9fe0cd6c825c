"""Checkpoint benchmarks: the cost of saving while training, and O(1) resume of the data order.

    python bench/bench_checkpoint.py save      # step time with saves: none / sync / async / raw
    python bench/bench_checkpoint.py resume    # time to the first batch vs resume position

`save`: four copies of one ~30M-parameter GPT-2 (mostly embedding, so the checkpoint is big
relative to a step) train on the same data; every `--every` steps one saves nothing, one calls
`ft.save_checkpoint` (blocking; again without checksums), one `ft.save_checkpoint(blocking=False)`,
and the raw PyTorch
loop calls `torch.save` on its model and optimizer state dicts, the usual hand-written loop.
Rounds alternate the order. Reported: mean wall time per step including saves, its ratio to the
no-save loop, and how long each save call blocked the loop.

`resume`: `make_batches(..., start=s)` over a 10,000,000-row map-style dataset with batch_size 8,
timed from the call to the first batch, cold (the epoch order is recomputed, as in a new
process), for s up to 1,000,000 micro-batches. For contrast, skipping by iterating (what a
dataloader without random access does) is timed at small s and grows linearly.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ftrain as ft
from ftrain.data import epoch_order

# --- saving while training ------------------------------------------------------------------


def build_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=50_000, n_positions=32, n_embd=576, n_layer=1, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def batches(n: int) -> list[list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 50_000, (2, 16), generator=g)
        out.append([{"input_ids": ids, "labels": ids}])
    return out


def ftrain_runner(
    mode: str, root: Path, checksum: bool = True
) -> Callable[[list[Any], bool], float]:
    box = [ft.TrainState.create(build_model(), ft.optim.adamw(weight_decay=0.1))]

    def step(micro: list[Any], save: bool) -> float:
        grads, stats = ft.accumulate_grads(box[0], micro)
        box[0], _ = ft.clip_and_step(box[0], grads, stats=stats, lr=1e-4, max_norm=1.0)
        if not (save and mode != "none"):
            return 0.0
        t0 = time.perf_counter()
        ft.save_checkpoint(box[0], root, keep_last=1, blocking=mode == "sync", checksum=checksum)
        return time.perf_counter() - t0

    return step


def raw_runner(root: Path) -> Callable[[list[Any], bool], float]:
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    count = [0]

    def step(micro: list[Any], save: bool) -> float:
        opt.zero_grad(set_to_none=True)
        for b in micro:
            model(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        count[0] += 1
        if not save:
            return 0.0
        t0 = time.perf_counter()
        # What a hand-written loop does (pickle-based, not atomic, no rotation).
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, root / "raw.pt")
        return time.perf_counter() - t0

    return step


def bench_save(rounds: int, steps: int, every: int) -> None:
    data = batches(steps)
    with tempfile.TemporaryDirectory() as tmp:
        runners = {
            "no save": ftrain_runner("none", Path(tmp) / "none"),
            "ftrain sync": ftrain_runner("sync", Path(tmp) / "sync"),
            "ftrain sync, checksum=False": ftrain_runner("sync", Path(tmp) / "nosum", False),
            "ftrain async": ftrain_runner("async", Path(tmp) / "async"),
            "raw torch.save": raw_runner(Path(tmp)),
        }
        for run in runners.values():  # warm-up: allocator, optimizer state, one save each
            for i, micro in enumerate(data[:2]):
                run(micro, i == 1)
        ft.wait_for_checkpoint()
        wall: dict[str, list[float]] = {k: [] for k in runners}
        blocked: dict[str, list[float]] = {k: [] for k in runners}
        for r in range(rounds):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name in order:
                t0 = time.perf_counter()
                for i, micro in enumerate(data):
                    b = runners[name](micro, (i + 1) % every == 0)
                    if b:
                        blocked[name].append(b)
                ft.wait_for_checkpoint()  # the block ends when its last save is on disk
                wall[name].append((time.perf_counter() - t0) / len(data))
    base = statistics.median(wall["no save"])
    size = sum(p.numel() for p in build_model().parameters()) * 4 * 3 / 2**20
    print(
        f"model+AdamW state ~{size:.0f} MiB; save every {every} steps; {rounds} rounds; "
        f"{torch.get_num_threads()} training thread(s)"
    )
    print("| loop | ms/step (incl. saves) | ratio to no save | blocked per save (ms) |")
    print("|---|---|---|---|")
    for name in runners:
        ms = statistics.median(wall[name]) * 1e3
        stall = f"{statistics.median(blocked[name]) * 1e3:.0f}" if blocked[name] else "-"
        print(f"| {name} | {ms:.1f} | {ms / 1e3 / base:.2f} | {stall} |")


# --- O(1) resume ------------------------------------------------------------------------------


class Rows:
    """A 10M-row map-style dataset that builds rows on demand (no 10M-row array in memory)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": [i % 97 + 1] * 8, "labels": [i % 97 + 1] * 8}


def first_batch(data: Rows, start: int) -> float:
    epoch_order.cache_clear()  # cold, as in a freshly started process
    t0 = time.perf_counter()
    next(iter(ft.make_batches(data, batch_size=8, seed=0, start=start)))
    return time.perf_counter() - t0


def skip_by_iterating(data: Rows, start: int) -> float:
    epoch_order.cache_clear()
    t0 = time.perf_counter()
    it = iter(ft.make_batches(data, batch_size=8, seed=0))
    for _ in range(start + 1):
        next(it)
    return time.perf_counter() - t0


def bench_resume(repeats: int) -> None:
    data = Rows(10_000_000)
    positions = [0, 1_000, 10_000, 100_000, 1_000_000]
    times: dict[int, list[float]] = {p: [] for p in positions}
    naive: dict[int, list[float]] = {p: [] for p in (0, 1_000, 10_000)}
    for r in range(repeats):
        for p in positions if r % 2 == 0 else reversed(positions):
            times[p].append(first_batch(data, p))
        for p in naive:
            naive[p].append(skip_by_iterating(data, p))
    print(f"10,000,000 rows, batch_size 8, median of {repeats} cold runs")
    print("| start (micro-batches) | time to first batch (ms) | skipping by iterating (ms) |")
    print("|---|---|---|")
    for p in positions:
        skip = f"{statistics.median(naive[p]) * 1e3:.0f}" if p in naive else "-"
        print(f"| {p:,} | {statistics.median(times[p]) * 1e3:.0f} | {skip} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("save")
    s.add_argument("--rounds", type=int, default=4)
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--every", type=int, default=5)
    s.add_argument("--threads", type=int, default=0, help="torch threads for training (0: default)")
    r = sub.add_parser("resume")
    r.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.what == "save" and args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "save":
        bench_save(args.rounds, args.steps, args.every)
    else:
        bench_resume(args.repeats)


if __name__ == "__main__":
    main()
