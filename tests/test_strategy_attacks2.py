"""Strategies x parameters that only some ranks use in a step (a branch, an MoE expert): the
gradients must equal one process's on the same global batch, or the step must raise; and
`from_env(timeout=)` in a group initialised before, which must apply or raise.

Reproduced first (numbers in the docstrings). The 2-rank checks run in one launch of
tests/workers/strategy_attack2_workers.py (gloo on CPU, bounded by a timeout), whose results
the tests below read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's record of the 2-rank launch (bounded: never hangs)."""
    import strategy_attack2_workers as W
    from launch import run_ranks

    out = tmp_path_factory.mktemp("attacks2") / "results"
    run_ranks(W.ranks, str(out), timeout=120)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


def _exact(record: dict) -> None:
    assert "error" not in record and record["missing"] == [], record
    assert all(v <= 1e-6 for k, v in record.items() if k != "missing"), record


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_fsdp_with_experts_used_on_one_rank_equals_one_process(two_ranks, kind):
    """Rank 0's rows take expert a, rank 1's expert b (same shapes): FSDP2 reduce-scattered
    rank 0's gradient of a with rank 1's of b: each rank held a gradient of one expert only,
    and after one SGD step the parameters were up to 0.24 off one process's, without an error
    (where the shapes differ, the ranks died in gloo with SIGABRT)."""
    for got in two_ranks:
        _exact(got[kind])


@pytest.mark.slow
def test_ddp_with_a_parameter_unused_on_a_rank_raises_at_that_step(two_ranks):
    """Without find_unused_parameters DDP left the bucket unreduced: each rank applied its own
    gradient of its own expert (0.16 and 0.48 off one process), and torch raised only at the
    next forward, after the replicas had drifted apart (and a checkpoint taken in between
    saved rank 0's)."""
    for got in two_ranks:
        assert "pass find_unused_parameters=True" in got["ddp"].get("error", ""), got["ddp"]
        _exact(got["ddp_find"])


@pytest.mark.slow
def test_from_env_refuses_a_timeout_the_existing_group_does_not_have(two_ranks):
    """In a group initialised before (30 s), `from_env(timeout=3 s)` returned a DDP whose
    group kept 30 s: the timeout was dropped without a word."""
    for got in two_ranks:
        assert "timeout=datetime.timedelta(seconds=3) cannot apply" in got["timeout_other"].get(
            "error", ""
        ), got["timeout_other"]
        assert got["timeout_same"] == {"value": "DDP"}


@pytest.mark.slow
def test_fsdp_refuses_trainable_ignored_params(two_ranks):
    """`FSDP(ignored_params={p})` left p whole and unreduced: each rank applied its own
    gradient (2 ranks, a tiny Llama's lm_head: 0.022 on rank 0, 0.016 on rank 1 after one
    step, no error). A frozen one is FSDP's to leave alone."""
    for got in two_ranks:
        error = got["ignored"].get("error", "")
        assert "FSDP(ignored_params=...) holds trainable parameters ['b.weight']" in error, got
        assert got["ignored_frozen"] == {"value": ["a.bias", "a.weight", "b.bias"]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp", "hsdp", "tp_dp2"])
def test_every_strategy_starts_from_rank_0s_values(two_ranks, kind):
    """Each rank built its model from its own seed. DDP broadcasts rank 0's at wrap time, but
    `fully_shard` kept each rank's own slice: FSDP's Linear weight was rank 0's rows 0-2 over
    rank 1's rows 3-5, HSDP's replicas kept their own values for good (and the buffers too),
    as did TP(dp=2)'s data-parallel groups; no error."""
    for got in two_ranks:
        drift = got["from_rank0"][kind]
        assert drift and all(v == 0.0 for v in drift.values()), drift
