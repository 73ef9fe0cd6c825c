"""The ranks of tests/test_data_stream_datafix.py, two gloo processes on CPU: a stream state
given another stream of the same shape. Each rank records ftrain's message."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import ftrain as ft
from helpers import id_rows, id_step, rank_env

TRAIN = id_rows(24)
VAL = [{"input_ids": [100 + i]} for i in range(24)]


def other_stream(rank: int, world: int, port: int, out: str) -> None:
    """One step on the training stream, then make_batches(val_stream, state): every rank must
    refuse; the training stream itself resumes."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    strategy = ft.strategies.from_env("ddp")
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), strategy=strategy)
    train = ft.data.IterableRows(TRAIN)
    group = next(iter(ft.make_batches(train, state, batch_size=2, accum=2)))
    state = id_step(state, group)
    del group
    got: dict[str, str] = {}
    try:
        next(iter(ft.make_batches(ft.data.IterableRows(VAL), state, batch_size=2, accum=2)))
        got["val"] = "no error"
    except ValueError as e:
        got["val"] = str(e)
    rest = list(ft.make_batches(train, state, batch_size=2, accum=2))
    got["train"] = f"{sum(len(g) for g in rest)} micro-batches"
    Path(f"{out}.{rank}").write_text(json.dumps(got))
    strategy.close()  # (a DDP model's reducer still held the group: the exit hung once)
    dist.destroy_process_group()


class _RankRows(torch.utils.data.IterableDataset):
    """A torch stream that picks its own rank's rows (`dist.get_rank()`): a per-rank split."""

    def __iter__(self):
        return iter(TRAIN[dist.get_rank() :: dist.get_world_size()])


def _twice(source):
    """One source object mixed with itself."""
    return ft.data.mix([source, source], weights=[1, 1])


def _collate(rows):
    return {"input_ids": torch.tensor([r["input_ids"] for r in rows])}


class _Once(torch.utils.data.IterableDataset):
    """A stream that can be read once: __iter__ returns the one generator it keeps."""

    def __init__(self, rows):
        self.rows = iter(list(rows))

    def __iter__(self):
        return self.rows


class _Counted(ft.data.IterableRows):
    """IterableRows that counts how often it is read from its start."""

    opened = 0

    def __iter__(self):
        _Counted.opened += 1
        return super().__iter__()


def split_stream(rank: int, world: int, port: int, out: str) -> None:
    """Each rank given its own part of a stream (IterableRows(rows[rank::2]), or a dataset
    that splits itself by rank): which rows each rank trained on, or ftrain's message."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    strategy = ft.strategies.from_env("ddp")
    got: dict[str, object] = {}
    cases = {
        "list": lambda: ft.data.IterableRows(TRAIN[rank::world]),
        "self-split": _RankRows,
        "same": lambda: _Counted(TRAIN),
        "read once": lambda: _Once(TRAIN),
        "read once, mixed": lambda: ft.data.mix(
            [
                ft.data.pack(ft.data.IterableRows(TRAIN), block_size=1),
                ft.data.pack(_Once(TRAIN), block_size=1),
            ],
            weights=[1, 1],
        ),
        "same, mixed twice": lambda: _twice(ft.data.stream(ft.data.IterableRows(TRAIN))),
        "same, workers": lambda: ft.data.mix(
            [ft.data.IterableRows(TRAIN[:12]), ft.data.IterableRows(TRAIN[12:])], weights=[1, 1]
        ),
    }
    for name, data in cases.items():
        state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), strategy=strategy)
        # (a collate the ranks' workers can unpickle: these ranks are forked from a server)
        kw = {"num_workers": 2, "collate_fn": _collate} if "workers" in name else {}
        try:
            ids = [
                x
                for g in ft.make_batches(data(), state, batch_size=2, accum=2, **kw)
                for b in g
                if not isinstance(b, ft.data.ZeroWeight)
                for x in b["input_ids"].flatten().tolist()
            ]
            got[name] = {"rows": ids, "opened": _Counted.opened}
        except ValueError as e:
            got[name] = {"error": str(e)}
    Path(f"{out}.{rank}").write_text(json.dumps(got))
    strategy.close()  # (a DDP model's reducer still held the group: the exit hung once)
    dist.destroy_process_group()
