"""The ranks of tests/test_dist_micro_counts.py, two gloo processes on CPU: steps whose
hand-built micro-batch lists hold another number of micro-batches on each process (FSDP, TP,
DDP with and without `sync_every_micro`), and `make_batches` called on one process alone. Each
check records ftrain's message or what the step gave, and how long it took."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ftrain as ft
from helpers import rank_env, tiny_llama

ROWS = [{"input_ids": [1 + i, 2, 3, 4, 5], "labels": [1 + i, 2, 3, 4, 5]} for i in range(8)]
KINDS = {
    "fsdp": ("fsdp", {}),
    "tp": ("tp", {}),
    "ddp": ("ddp", {}),
    "ddp-sync": ("ddp", {"sync_every_micro": True}),
}


def _batch(k: int) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1 + k, 2, 3, 4, 5]])
    return {"input_ids": ids, "labels": ids.clone()}


def _step(state: ft.TrainState, micro: Any) -> tuple[ft.TrainState, dict[str, Any]]:
    """One step on `micro`: the global grad norm, or ftrain's message (the state kept)."""
    start = time.monotonic()
    try:
        grads, stats = ft.accumulate_grads(state, micro)
    except ValueError as e:
        return state, {"error": str(e), "seconds": time.monotonic() - start}
    state, info = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    return state, {"norm": float(info.grad_norm), "seconds": time.monotonic() - start}


def _checks_made(state: ft.TrainState, micro: Any) -> int:
    """How many collectives over every process `accumulate_grads(state, micro)` ran beyond
    the step's own (its micro-batch count check: `sum_over_processes`)."""
    strategy, calls = state.strategy, []
    real = strategy.sum_over_processes

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(tensor)

    strategy.sum_over_processes = counting  # type: ignore[method-assign]
    try:
        ft.accumulate_grads(state, micro)
    finally:
        del strategy.sum_over_processes
    for p in state.params.values():
        p.grad = None
    return len(calls)


def _one_kind(rank: int, kind: str) -> dict[str, Any]:
    name, kwargs = KINDS[kind]
    strategy = ft.strategies.from_env(name, **kwargs)
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), seed=3, strategy=strategy)
    got: dict[str, Any] = {}
    # rank 0: 2 micro-batches, rank 1: 3 (hand-built lists)
    state, got["uneven"] = _step(state, [_batch(k) for k in range(2 + rank)])
    state, got["even"] = _step(state, [_batch(k) for k in range(2)])
    # (DDP's uneven step advanced the cursors by 2 and 3: make_batches would refuse them)
    state = state.replace(data=state.data.replace(cursor=0, position=None))
    micro = next(ft.make_batches(ROWS, state, batch_size=1, accum=2))
    got["checks"] = {
        "group": _checks_made(state, micro),
        "list": _checks_made(state, list(micro)),
        "slice": _checks_made(state, micro[:1]),
    }
    del micro
    strategy.close()
    del state
    return got


def uneven(rank: int, world: int, port: int, out: str) -> None:
    """Every kind in one process group; each rank writes `out.<rank>`."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = {kind: _one_kind(rank, kind) for kind in KINDS}
    # DDP's uneven step against one process over the same 5 micro-batches (2 + 3)
    one = ft.TrainState.create(
        tiny_llama(), ft.optim.sgd(), seed=3, strategy=ft.strategies.SingleDevice("cpu")
    )
    _, result["one"] = _step(one, [_batch(k) for k in (0, 1, 0, 1, 2)])
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def alone(rank: int, world: int, port: int, out: str, timeout_s: float) -> None:
    """Rank 0 calls make_batches and rank 1 never does (it waits past the group's timeout,
    then leaves). Rank 0 writes ftrain's message and how long it waited."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    if rank == 0:
        strategy = ft.strategies.DDP()
        start = time.monotonic()
        try:
            ft.make_batches(ROWS, batch_size=1, strategy=strategy)
            got = {"error": None}
        except Exception as e:  # the test asserts on the type and message
            got = {"type": type(e).__name__, "error": str(e)}
        got["seconds"] = time.monotonic() - start
        Path(f"{out}.{rank}").write_text(json.dumps(got))
    else:
        time.sleep(timeout_s + 4)
    # The group is broken (a peer timed out): leave without its teardown, which would wait.
    os._exit(0)
