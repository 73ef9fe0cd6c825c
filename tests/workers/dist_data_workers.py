"""The ranks of tests/test_dist_data_attacks.py: `make_batches` on two gloo ranks (CPU) when
the ranks were given other data or settings. Each check records the groups' row ids a rank
read, or the message ftrain raised."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

import ftrain as ft
from helpers import rank_env


def _rows(n: int) -> list[dict]:
    return [{"input_ids": [i + 1]} for i in range(n)]


def _read(strategy, data, **kw) -> dict:
    """The row ids of every micro-batch of every group, or ftrain's message."""
    try:
        groups = ft.make_batches(data, strategy=strategy, shuffle=False, **kw)
        return {"groups": [[b["input_ids"].flatten().tolist() for b in g] for g in groups]}
    except Exception as e:  # the test asserts on ftrain's own message
        return {"error": f"{type(e).__name__}: {e}"}


def _ddp_mesh() -> dict:
    """DDP(device_mesh=) of a (dp, tp) = (1, 2) mesh's "dp" dimension: one SGD step on the
    rows make_batches gives this rank; the weight after it, or ftrain's message."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    try:
        with ft.strategies.DDP(device_mesh=mesh["dp"]) as ddp:
            torch.manual_seed(0)
            state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), strategy=ddp)
            data = [(torch.tensor([float(i)]), torch.tensor([1.0])) for i in range(4)]
            mse = lambda m, b: (((m(b[0]) - b[1]) ** 2).sum(), b[1].numel())  # noqa: E731
            micro = next(ft.make_batches(data, state, batch_size=2, collate_fn=_stack))
            grads, stats = ft.accumulate_grads(state, micro, mse)
            state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
            out = {"weight": float(state.params["weight"].detach().item())}
            del state, grads, stats
            gc.collect()
            return out
    except Exception as e:  # the test asserts on ftrain's own message
        return {"error": f"{type(e).__name__}: {e}"}


def _evaluate(strategy) -> dict:
    """evaluate over 5 rows, 2 a rank: rank 1's share of the last global micro-batch is a
    stand-in (a copy of row 4, whose loss is 16), against one process over the 5 rows."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    data = [(torch.tensor([float(i)]), torch.tensor([float(i)])) for i in range(5)]
    mse = lambda m, b: (((m(b[0]) - b[1]) ** 2).sum(), b[1].numel())  # noqa: E731
    rows = lambda m, b: {"rows": (b[0].shape[0], 1), "big": ((b[1] > 3).sum(), b[0].shape[0])}  # noqa: E731
    got = {}
    for name, s in (("ddp", strategy), ("one", ft.strategies.SingleDevice("cpu"))):
        state = ft.TrainState.create(model, ft.optim.sgd(), strategy=s)
        batches = ft.make_batches(data, batch_size=2, shuffle=False, collate_fn=_stack, strategy=s)
        got[name] = ft.evaluate(state, batches, mse, metrics_fn=rows)
        del state
        gc.collect()
    return got


def _rows_of(shards: list) -> Iterator[dict]:
    for _ in shards:
        for i in range(4):
            yield {"input_ids": [i]}


def _generated(shards: list) -> Any:
    import datasets

    return datasets.IterableDataset.from_generator(_rows_of, gen_kwargs={"shards": shards})


def _stack(rows: list) -> tuple:
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def ranks(rank: int, world: int, port: int, out: str) -> None:
    """One rank of the 2-rank launch; each check in OUT.<rank>."""
    import torch.distributed as dist

    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    results: dict = {}
    with ft.strategies.DDP() as ddp:
        results["same"] = _read(ddp, _rows(10), batch_size=2, accum=2)
        # each rank given its own part of the data (split_dataset_by_node of a map-style set)
        results["rows"] = _read(ddp, _rows(10)[rank::2][: 5 - rank], batch_size=1, accum=1)
        results["accum"] = _read(ddp, _rows(8), batch_size=1, accum=1 + rank)
        results["batch_size"] = _read(ddp, _rows(8), batch_size=1 + rank)
        results["drop_last"] = _read(ddp, _rows(7), batch_size=2, drop_last=bool(rank))
        results["start"] = _read(ddp, _rows(8), batch_size=1, start=rank)
        split = torch.utils.data.Subset(_rows(8), range(rank, 8, 2))  # a per-rank split
        results["subset"] = _read(ddp, split, batch_size=1)
        results["content"] = _read(ddp, _rows(8) if rank else _rows(9)[1:], batch_size=1)
        # a stream on one rank, the same rows as a list on the other: one collective of one
        # size on both (the stream's check sent fewer values: a mismatched all-reduce)
        rows = _rows(8)
        data = ft.data.IterableRows(rows) if rank else rows
        results["stream"] = _read(ddp, data, batch_size=1)
        # a from_generator stream given each rank's own list of shards (of the same count)
        results["generator"] = _read(ddp, _generated([f"part-{rank}"]), batch_size=1)
        results["eval"] = _evaluate(ddp)
    results["ddp_mesh"] = _ddp_mesh()
    with ft.strategies.TP() as tp:  # dp=1: both processes are one data-parallel rank
        results["tp_same"] = _read(tp, _rows(6), batch_size=2)
        results["tp_rows"] = _read(tp, _rows(6 + rank), batch_size=2)
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def tp_2d(rank: int, world: int, port: int, out: str) -> None:
    """One of 4 processes: TP(dp=2), a (dp, tp) mesh of 2 x 2; its rows in OUT.<rank>."""
    import torch.distributed as dist

    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    with ft.strategies.TP(dp=2) as tp:
        got = _read(tp, _rows(10), batch_size=2, accum=2)
        got["dp_rank"] = tp.rank
    Path(f"{out}.{rank}").write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()
