"""What `make_batches` costs the loop's process to collate, in-process (no workers).

    python bench/bench_collate.py                       # this tree
    PYTHONPATH=/tmp/old python bench/bench_collate.py   # another tree's ftrain/ (git archive)

Two readers, one thread: the main example's windows (`CharWindows` over 2M random tokens) at
GPT-2-124M's batch (groups of 4 micro-batches of 12 x 1024), and a torch `IterableDataset` stream
of short rows (32 rows a micro-batch, shuffled through its buffer, `pad_collate`). Reported: the
best of `--repeats` means of ms per group (map) and per micro-batch (stream). The loop waits
this long each step unless workers load ahead: on a GPU, time the device idles after a host
sync (issue 30).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from shakespeare_char import CharWindows

import ftrain as ft


class Rows(torch.utils.data.IterableDataset):
    """A stream of short token rows."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"input_ids": [1, 2, 3, i % 50 + 1]}


def per_item(it, n: int) -> float:
    """Mean ms of `next(it)` over n calls (after 3 untimed). The mean, not a median: a shuffled
    stream reads a whole shuffle buffer of rows in the call that first needs one."""
    for _ in range(3):
        next(it)
    t = time.perf_counter()
    for _ in range(n):
        next(it)
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--stream-batch", type=int, default=32)
    p.add_argument("--items", type=int, default=100, help="groups (micro-batches) timed a run")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    tokens = np.random.default_rng(0).integers(0, 50304, size=2_000_000, dtype=np.int64)
    windows = CharWindows(tokens, a.block)
    need = (a.items + 3) * a.stream_batch
    best_map = min(
        per_item(iter(ft.make_batches(windows, batch_size=a.batch, accum=a.accum)), a.items)
        for _ in range(a.repeats)
    )
    best_stream = min(
        per_item(iter(ft.make_batches(Rows(need), batch_size=a.stream_batch)), a.items)
        for _ in range(a.repeats)
    )
    print(f"ftrain {ft.__file__}")
    print(f"map: a group of {a.accum} x {a.batch} x {a.block} windows {best_map:.3f} ms")
    print(f"stream: a micro-batch of {a.stream_batch} rows {best_stream:.3f} ms")


if __name__ == "__main__":
    main()
