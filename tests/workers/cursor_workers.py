"""The ranks of tests/test_cursor_attacks.py, two gloo processes on CPU: evaluate and
predict given hand-built lists that hold another number of batches on
each process. Each check records ftrain's message or what the call gave, and how long it took."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ftrain as ft
from helpers import rank_env, tiny_llama

ROWS = [{"input_ids": [1 + i, 2, 3, 4, 5], "labels": [1 + i, 2, 3, 4, 5]} for i in range(8)]


def _batch(k: int) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1 + k, 2, 3, 4, 5]])
    return {"input_ids": ids, "labels": ids.clone()}


def _timed(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        got = {"value": fn()}
    except ValueError as e:
        got = {"error": str(e)}
    return {**got, "seconds": time.monotonic() - start}


def _checks_made(strategy: Any, fn: Any) -> int:
    """How many `sum_over_processes` collectives `fn()` ran (the micro-batch count check)."""
    calls = []
    real = strategy.sum_over_processes

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(tensor)

    strategy.sum_over_processes = counting
    try:
        fn()
    finally:
        del strategy.sum_over_processes
    return len(calls)


def _eval_kind(rank: int, kind: str) -> dict[str, Any]:
    name, _, sync = kind.partition("+")  # "ddp+sync": DDP(sync_every_micro=True)
    strategy = ft.strategies.from_env(name, **({"sync_every_micro": True} if sync else {}))
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), seed=3, strategy=strategy)
    got: dict[str, Any] = {}
    ev = lambda b: ft.evaluate(state, b)["eval_loss"]  # noqa: E731
    got["uneven"] = _timed(lambda: ev([_batch(k) for k in range(2 + rank)]))
    got["uneven groups"] = _timed(lambda: ev([[_batch(0)], [_batch(k) for k in range(1 + rank)]]))
    got["even"] = _timed(lambda: ev([_batch(k) for k in range(2)]))
    pr = lambda b: [o["labels"].tolist() for o in ft.predict(state, b)]  # noqa: E731
    got["predict uneven"] = _timed(lambda: pr([_batch(k) for k in range(2 + rank)]))
    got["predict even"] = _timed(lambda: pr([_batch(k) for k in range(2)]))
    made = lambda: ft.make_batches(ROWS, batch_size=1, shuffle=False, strategy=strategy)  # noqa: E731
    batches, group = made(), next(iter(made()))  # (make_batches' own check: before counting)
    got["checks"] = {
        "make_batches": _checks_made(strategy, lambda: ev(batches)),
        "group": _checks_made(strategy, lambda: ev(group)),
        "list": _checks_made(strategy, lambda: ev([_batch(0), _batch(1)])),
    }
    strategy.close()
    return got


def uneven_eval(rank: int, world: int, port: int, out: str, kinds: list[str]) -> None:
    """Each rank writes `out.<rank>`: per kind, evaluate over 2 + rank hand-built batches."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = {kind: _eval_kind(rank, kind) for kind in kinds}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()
