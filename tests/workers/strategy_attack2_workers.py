"""The ranks of tests/test_strategy_attacks2.py: parameters that only some ranks use in the
forward (a branch, an MoE expert), under DDP and FSDP, against one process on the same global
batch. Each check records what ftrain returned or the message it raised."""

from __future__ import annotations

import gc
import json
from datetime import timedelta
from pathlib import Path

import torch

import ftrain as ft
from helpers import rank_env, tiny_llama


class Experts(torch.nn.Module):
    """Two experts of one shape; a batch's flag picks one (as a router sends a rank's rows)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.b(x) if expert else self.a(x)


def _mse(model, batch):
    x, y, expert = batch
    return ((model(x, expert) - y) ** 2).sum(), y.numel()


def _micro(rank: int | None) -> list:
    """Three micro-batches a rank (FSDP gathers in every forward: the counts must agree).
    Rank 0's rows take expert a, rank 1's expert b. None: the global batch."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    mine = {
        0: [(x[:1], y[:1], 0), (x[1:2], y[1:2], 0), (x[2:3], y[2:3], 0)],
        1: [(x[3:5], y[3:5], 1), (x[5:6], y[5:6], 1), (x[6:], y[6:], 1)],
    }
    return mine[0] + mine[1] if rank is None else mine[rank]


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach()


def _step(strategy, micro) -> dict:
    """One SGD step: the gradients, and the parameters after it (whole tensors)."""
    state = ft.TrainState.create(Experts(), ft.optim.sgd(), strategy=strategy)
    grads, stats = ft.accumulate_grads(state, micro, _mse)
    out = {f"grad.{n}": _whole(g) for n, g in grads.items()}
    state, _ = ft.clip_and_step(state, grads, lr=0.5, stats=stats)
    return out | {n: _whole(p) for n, p in state.params.items()}


def _error(results: dict, rank: int, name: str, make) -> None:
    """How far each tensor is from one process's, or the message of what ftrain raised."""
    try:
        with make() as strategy:
            got = _step(strategy, _micro(rank))
        want = _step(ft.strategies.SingleDevice("cpu"), _micro(None))
        missing = sorted(set(want) ^ set(got))
        results[name] = {"missing": missing} | {
            k: float((got[k] - want[k]).abs().max()) for k in want if k in got
        }
    except Exception as e:  # the test asserts on ftrain's own message
        results[name] = {"error": f"{type(e).__name__}: {e}"}


def _ignored(frozen: bool) -> dict:
    """FSDP(ignored_params=...) over expert b: FSDP neither shards nor reduces it."""
    model = Experts()
    model.b.weight.requires_grad_(not frozen)
    try:
        with ft.strategies.FSDP(ignored_params={model.b.weight}) as strategy:
            state = ft.TrainState.create(model, ft.optim.sgd(), strategy=strategy)
            return {"value": sorted(state.params)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _seeded(seed: int) -> torch.nn.Module:
    """A model initialised from `seed`, with a buffer that says it too."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6))
    model[1].running_mean.fill_(float(seed))
    return model


def _from_rank0(rank: int, make, build) -> dict:
    """How far each whole parameter and buffer of a model initialised by rank (seed = rank)
    is, once set up, from rank 0's (seed 0)."""
    with make() as strategy:
        state = ft.TrainState.create(build(rank), ft.optim.sgd(), strategy=strategy)
        model = strategy.unwrap(state.model)
        got = {n: _whole(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    ref = build(0)
    want = dict([*ref.named_parameters(), *ref.named_buffers()])
    return {n: float((t.float() - want[n].detach().float()).abs().max()) for n, t in got.items()}


def _from_env(seconds: float) -> dict:
    """`from_env(timeout=...)` in a group initialised before with a timeout of 30 s."""
    try:
        with ft.strategies.from_env("ddp", timeout=timedelta(seconds=seconds)) as strategy:
            return {"value": type(strategy).__name__}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def ranks(rank: int, world: int, port: int, out: str) -> None:
    """One rank of tests/test_strategy_attacks2.py's 2-rank launch, each check in OUT.<rank>."""
    import torch.distributed as dist

    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    results: dict = {"timeout_other": _from_env(3), "timeout_same": _from_env(30)}
    _error(results, rank, "fsdp", ft.strategies.FSDP)
    _error(results, rank, "hsdp", lambda: ft.strategies.FSDP(replicate=2))
    _error(results, rank, "ddp_find", lambda: ft.strategies.DDP(find_unused_parameters=True))
    results["ignored"], results["ignored_frozen"] = _ignored(False), _ignored(True)
    results["from_rank0"] = {
        "ddp": _from_rank0(rank, ft.strategies.DDP, _seeded),
        "fsdp": _from_rank0(rank, ft.strategies.FSDP, _seeded),
        "hsdp": _from_rank0(rank, lambda: ft.strategies.FSDP(replicate=2), _seeded),
        "tp_dp2": _from_rank0(rank, lambda: ft.strategies.TP(dp=2), lambda s: tiny_llama(seed=s)),
    }
    _error(results, rank, "ddp", ft.strategies.DDP)  # last: both ranks raise before reducing
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    gc.collect()  # a DDP wrapper freed after the group is destroyed deadlocks at exit
    dist.barrier()
    dist.destroy_process_group()
