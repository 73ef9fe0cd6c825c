"""The ranks of tests/test_strategy_attacks.py's 2-rank checks: each builds what a user could
and records what ftrain returned or the message it raised, for the tests to assert on."""

from __future__ import annotations

import gc
import json
from datetime import timedelta
from pathlib import Path

import torch

import ftrain as ft
from helpers import rank_env


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum(), y.numel()


def _half(rank: int, world: int, rows: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the global batch: 2 rows on rank 0, the other 6 on rank 1 (ragged
    item counts, so that a per-rank mean differs from the global one)."""
    x, y = _data()
    part = slice(0, rows) if rank == 0 else slice(rows, None)
    return [(x[part], y[part])]


def _global_norm() -> float:
    state = ft.TrainState.create(_mlp(), ft.optim.sgd(), strategy=ft.strategies.SingleDevice("cpu"))
    grads, _ = ft.accumulate_grads(state, [_data()], _mse)
    return float(state.strategy.grad_norm(list(grads.values())))


def _attempt(results: dict, name: str, fn) -> None:
    """Record what `fn` returned, or the message of what it raised."""
    try:
        results[name] = {"value": fn()}
    except Exception as e:  # the test asserts on ftrain's own message
        results[name] = {"error": f"{type(e).__name__}: {e}"}


def _fsdp_norm(mesh_shape: tuple[int, ...]) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard", "x")[-len(mesh_shape) :]  # fully_shard wants 2-D ones named
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with ft.strategies.FSDP(mesh=mesh) as strategy:
        state = ft.TrainState.create(_mlp(), ft.optim.sgd(), strategy=strategy)
        grads, _ = ft.accumulate_grads(state, _half(strategy.rank, strategy.world_size), _mse)
        return float(strategy.grad_norm(list(grads.values())))


def _override(rank: int) -> float:
    with ft.strategies.DDP() as strategy:
        state = ft.TrainState.create(_mlp(), ft.optim.sgd(), strategy=strategy)
        single = ft.strategies.SingleDevice("cpu")
        grads, _ = ft.accumulate_grads(state, _half(rank, 2), _mse, strategy=single)
        return float(local_norm(grads))


def _hand_wrapped_ddp(rank: int) -> float:
    from torch.nn.parallel import DistributedDataParallel

    single = ft.strategies.SingleDevice()  # said so: the default in a group raises first
    state = ft.TrainState.create(DistributedDataParallel(_mlp()), ft.optim.sgd(), strategy=single)
    grads, _ = ft.accumulate_grads(state, _half(rank, 2), _mse)
    return float(local_norm(grads))


def _hand_sharded() -> str:
    from torch.distributed.fsdp import fully_shard

    single = ft.strategies.SingleDevice()
    state = ft.TrainState.create(fully_shard(_mlp()), ft.optim.sgd(), strategy=single)
    return type(state.strategy).__name__


def _non_member(group) -> list:
    strategy = ft.strategies.DDP(process_group=group)
    strategy.closed = True  # nothing set up; close() would wait at a barrier of `group`
    return [strategy.rank, strategy.world_size, strategy.grad_reduce_factor]


def _seeds(rank: int) -> int:
    """seed=base + rank (per-rank augmentation habit): each rank would shuffle its own way."""
    with ft.strategies.DDP() as strategy:
        return ft.TrainState.create(_mlp(), ft.optim.sgd(), seed=7 + rank, strategy=strategy).seed


def _same_seeds(rank: int) -> int:
    with ft.strategies.DDP() as strategy:
        return ft.TrainState.create(_mlp(), ft.optim.sgd(), seed=7, strategy=strategy).seed


def _static_graph(rank: int) -> str:
    with ft.strategies.DDP(static_graph=True) as strategy:
        state = ft.TrainState.create(_mlp(), ft.optim.sgd(), strategy=strategy)
        ft.accumulate_grads(state, _half(rank, 2) * 2, _mse)
        return "trained"


def local_norm(grads) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))


def ranks(rank: int, world: int, port: int, out: str) -> None:
    """One rank of tests/test_strategy_attacks.py's 2-rank launch (`launch.run_ranks`): every
    check in turn, each recorded in OUT.<rank>."""
    import torch.distributed as dist

    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # the caller's own group
    results: dict = {"single_norm": _global_norm()}
    _attempt(results, "fsdp_mesh_2d", lambda: _fsdp_norm((2, 1)))
    _attempt(results, "fsdp_mesh_1d", lambda: _fsdp_norm((2,)))
    _attempt(results, "fsdp_mesh_3d", lambda: _fsdp_norm((1, 1, 2)))
    _attempt(results, "override", lambda: _override(rank))
    _attempt(results, "hand_wrapped_ddp", lambda: _hand_wrapped_ddp(rank))
    _attempt(results, "hand_sharded", _hand_sharded)
    _attempt(results, "default_in_group", lambda: ft.TrainState.create(_mlp(), ft.optim.sgd()))
    group = dist.new_group([0])  # every rank takes part in making it; rank 1 is not a member
    _attempt(results, "non_member", lambda: _non_member(group) if rank == 1 else "member")
    dist.barrier()
    _attempt(results, "per_rank_seed", lambda: _seeds(rank))
    _attempt(results, "same_seed", lambda: _same_seeds(rank))
    _attempt(results, "static_graph", lambda: _static_graph(rank))  # last: a failed backward
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    gc.collect()  # a DDP wrapper freed after the group is destroyed deadlocks at exit
    dist.barrier()
    dist.destroy_process_group()
