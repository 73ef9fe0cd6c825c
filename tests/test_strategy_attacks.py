"""Combinations of strategies and `accumulate_grads` that used to give a silently wrong result.

Each was reproduced first (numbers in the test docstrings): a caller's 2-D mesh that inflated
FSDP's clipping norm, an override strategy or a hand-wrapped model whose reduction disagreed with
the item count, a weighted count below 1, a process outside the group training as rank -1, and
bad flags accepted in one process. The 2-rank checks run in one launch of
tests/workers/strategy_attack_workers.py from the suite's fork server (gloo on CPU, bounded by a
timeout), whose results the tests below read.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ftrain as ft

# --- one process --------------------------------------------------------------------------------


def test_a_weighted_count_below_one_divides_by_that_count():
    """Importance weights of 0.1 per row count 0.4 items per micro-batch, 0.8 in all: the
    gradient was divided by 1 (clamped) instead of 0.8, 0.8x the exact one, while the loss
    reported was divided by 0.8."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    state = ft.TrainState.create(model, ft.optim.sgd())

    def weighted(m, batch):
        return (0.1 * m(batch)).sum(), torch.tensor(0.4, dtype=torch.float64)

    grads, stats = ft.accumulate_grads(state, [x, x], weighted)
    model.zero_grad()
    exact = (0.1 * model(torch.cat([x, x]))).sum() / 0.8
    exact.backward()
    torch.testing.assert_close(grads["weight"], model.weight.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(stats.loss.double(), exact.detach(), rtol=1e-6, atol=0)
    # and the step is applied: 0.8 items truncated to an int64 0 made clip_and_step skip it
    assert float(stats.num_items) == pytest.approx(0.8)
    want = model.weight.detach() - 0.1 * model.weight.grad
    state, info = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert not bool(info.skipped)
    torch.testing.assert_close(state.params["weight"], want)


def test_an_override_strategy_laid_out_otherwise_is_refused():
    """`accumulate_grads(strategy=...)` with another layout than the strategy that set the
    model up: its counts and the model's reduction would disagree."""
    from helpers import FakeRank

    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    batch = [torch.ones(2, 2)]

    def loss(m, b):
        return m(b).sum(), b.shape[0]

    with pytest.raises(ValueError, match="differs from the strategy that set the model up"):
        ft.accumulate_grads(state, batch, loss, strategy=FakeRank(1, 2))
    # Another precision: an fp16 forward without the state's (absent) loss scale flushed small
    # gradients to zero.
    fp16 = ft.strategies.SingleDevice(state.strategy.device, precision="fp16")
    with pytest.raises(ValueError, match="differs from the strategy that set the model up"):
        ft.accumulate_grads(state, batch, loss, strategy=fp16)
    # The same layout is accepted (another instance of the same kind on the same device).
    ft.accumulate_grads(
        state, batch, loss, strategy=ft.strategies.SingleDevice(state.strategy.device)
    )


def test_from_env_in_one_process_refuses_what_torchrun_would_refuse(monkeypatch):
    """In one process these were accepted (and dropped), to fail only under torchrun: a bad
    timeout, `dp=True` / `replicate=1.0` (True is not 1), a string as a flag."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="timeout must be a positive"):
        ft.strategies.from_env(timeout=timedelta(seconds=-5))
    with pytest.raises(ValueError, match="timeout must be a positive"):
        ft.strategies.from_env(timeout=5)
    with pytest.raises(TypeError, match=r"cannot honour \['dp'\]"):
        ft.strategies.from_env("tp", dp=True)
    with pytest.raises(TypeError, match=r"cannot honour \['replicate'\]"):
        ft.strategies.from_env("fsdp", replicate=1.0)
    with pytest.raises(TypeError, match="sync_every_micro must be True or False"):
        ft.strategies.from_env("ddp", sync_every_micro="no")
    ok = ft.strategies.from_env("fsdp", replicate=1, sync_every_micro=True, timeout=timedelta(1))
    assert isinstance(ok, ft.strategies.SingleDevice)


@pytest.mark.parametrize("cls", [ft.strategies.DDP, ft.strategies.FSDP])
def test_a_string_flag_and_a_bool_replicate_are_refused_before_joining(cls, monkeypatch):
    """`sync_every_micro="no"` synced every micro-batch (a truthy string); `FSDP(replicate=True)`
    trained without HSDP (True == 1)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)  # joining would raise "launch with torchrun"
    with pytest.raises(TypeError, match="sync_every_micro must be True or False"):
        cls(sync_every_micro="no")
    if cls is ft.strategies.FSDP:
        with pytest.raises(TypeError, match="replicate must be an int"):
            cls(replicate=True)
    assert not torch.distributed.is_initialized()


# --- two ranks ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's record of the 2-rank launch (bounded: never hangs)."""
    import strategy_attack_workers as W
    from launch import run_ranks

    out = tmp_path_factory.mktemp("attacks") / "results"
    run_ranks(W.ranks, str(out), timeout=120)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_fsdp_with_the_callers_2d_mesh_clips_by_the_global_norm(two_ranks):
    """A (2, 1) mesh passed as `mesh=` is HSDP (replicated over dim 0): the norm summed the
    squares over every rank, counting each shard once per replica: 1.2427 where one process
    has 0.8787 (sqrt(2) times), so clipping scaled every update down."""
    for got in two_ranks:
        want = got["single_norm"]
        assert got["fsdp_mesh_2d"].get("value") == pytest.approx(want, rel=1e-5), got
        assert got["fsdp_mesh_1d"].get("value") == pytest.approx(want, rel=1e-5), got
        assert "mesh must be a 1-D (FSDP) or 2-D (HSDP" in got["fsdp_mesh_3d"].get("error", "")


@pytest.mark.slow
def test_a_single_device_override_of_a_ddp_state_is_refused(two_ranks):
    """DDP averages the gradients over ranks; SingleDevice then divided by this rank's count:
    gradient norms 1.7574 on rank 0 (2 of 8 rows) and 0.5858 on rank 1 where one process has
    0.8787, so the replicas drifted apart."""
    for got in two_ranks:
        assert "differs from the strategy that set the model up" in got["override"].get("error", "")


@pytest.mark.slow
def test_a_model_already_distributed_is_refused_by_single_device(two_ranks):
    """A model wrapped in DDP by hand (or sharded by fully_shard) under the default
    SingleDevice: each rank divided by its own item count (DDP: gradient norms 1.7574 and
    0.5858 on the two ranks, fully_shard: 1.4337 on both, where one process has 0.8787)."""
    for got in two_ranks:
        assert "wrapped in DistributedDataParallel" in got["hand_wrapped_ddp"].get("error", "")
        assert "parameters are distributed tensors" in got["hand_sharded"].get("error", "")
        # No strategy at all in a group of 2: every rank trained alone on every row.
        assert "got no strategy in a job of 2 processes" in got["default_in_group"]["error"]


@pytest.mark.slow
def test_a_process_outside_the_strategys_group_is_refused(two_ranks):
    """`DDP(process_group=g)` on a process outside `g` was rank -1 of -1, with a gradient
    factor of -1."""
    assert two_ranks[0]["non_member"] == {"value": "member"}
    assert "is not a member of the process_group" in two_ranks[1]["non_member"].get("error", "")


@pytest.mark.slow
def test_ddp_static_graph_with_skipped_syncs_names_the_fix(two_ranks):
    """torch's reducer failed an internal assert ("please report a bug to PyTorch")."""
    for got in two_ranks:
        message = got["static_graph"].get("error", "")
        assert "DDP(static_graph=True) cannot skip the gradient sync" in message


@pytest.mark.slow
def test_seeds_that_differ_between_ranks_are_refused(two_ranks):
    """`seed=base + rank`: make_batches shuffles by state.seed, so each rank drew its own
    permutation (overlapping rows, others never read), silently."""
    for got in two_ranks:
        assert "another seed on other processes of the job" in got["per_rank_seed"].get(
            "error", ""
        ), got
        assert got["same_seed"] == {"value": 7}, got


def test_to_device_keeps_a_namedtuple_batch_whole():
    """`type(batch)(generator)` filled a NamedTuple's first field only: a NamedTuple batch
    raised inside accumulate_grads, and a ZeroWeight stand-in came back holding a generator."""
    from typing import NamedTuple

    from ftrain.data import ZeroWeight

    class Pair(NamedTuple):
        x: torch.Tensor
        y: torch.Tensor

    strategy = ft.strategies.SingleDevice("cpu")
    pair = strategy.to_device(Pair(torch.ones(2, 8), torch.zeros(2, 4)))
    assert type(pair) is Pair and pair.y.shape == (2, 4)
    stand_in = strategy.to_device(ZeroWeight({"x": torch.ones(1)}))
    assert type(stand_in) is ZeroWeight and torch.equal(stand_in.batch["x"], torch.ones(1))
    model = torch.nn.Linear(8, 4)
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, stats = ft.accumulate_grads(
        state, [pair], lambda m, b: (((m(b.x) - b.y) ** 2).sum(), b.y.numel())
    )
    assert set(grads) == {"weight", "bias"} and int(stats.num_samples) == 2
