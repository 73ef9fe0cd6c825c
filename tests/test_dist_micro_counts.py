"""Two processes (gloo, CPU) that do not run as many micro-batches a step, and make_batches on
one process alone: each fails fast with ftrain's message on every process (it hung until the
backend's timeout under FSDP, gloo aborted under TP), at no cost for make_batches' groups.

The ranks run in tests/workers/micro_count_workers.py, bounded by a timeout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GROUP_TIMEOUT_S = 60  # the uneven launch's collective timeout: a hang would last this long


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> list[dict]:
    """Each rank's record of the launch: rank 0 passes 2 hand-built micro-batches, rank 1 3."""
    import micro_count_workers as W
    from launch import run_ranks

    out = tmp_path_factory.mktemp("micro") / "results"
    run_ranks(W.uneven, str(out), timeout=240)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("kind", ["fsdp", "tp", "ddp-sync"])
def test_uneven_micro_counts_fail_fast_on_every_process(uneven, kind):
    """FSDP gathers parameters in every forward and reduces in the final backward only, TP's
    processes reduce inside every forward, DDP with sync_every_micro in every backward: with 2
    micro-batches on one process and 3 on the other their collectives paired unlike (FSDP
    hung until the timeout, gloo aborted TP's processes). Now both raise before any forward,
    naming the counts, and the group stays usable: the next, even step trains."""
    for rank, got in enumerate(uneven):
        step = got[kind]["uneven"]
        assert "error" in step, (rank, step)
        assert f"got {2 + rank} micro-batch(es) on this process" in step["error"]
        assert "2.5 on average over the 2 processes" in step["error"]
        assert step["seconds"] < GROUP_TIMEOUT_S / 4, step
        assert "norm" in got[kind]["even"], (rank, got[kind]["even"])
    assert uneven[0][kind]["even"]["norm"] == uneven[1][kind]["even"]["norm"]


def test_ddp_trains_uneven_micro_counts_as_one_process_over_all_of_them(uneven):
    """DDP (no sync_every_micro) reduces once, in each process's final backward: 2 and 3
    micro-batches give the gradient of all 5, as one process over them, so it is let be."""
    for got in uneven:
        assert "error" not in got["ddp"]["uneven"], got["ddp"]["uneven"]
        assert got["ddp"]["uneven"]["norm"] == pytest.approx(got["one"]["norm"], rel=1e-5)


@pytest.mark.parametrize("kind", ["fsdp", "tp", "ddp-sync"])
def test_make_batches_groups_cost_no_count_check(uneven, kind):
    """A whole group of make_batches(data, state, ...) (or a list of it) has a count every
    process agreed on when make_batches checked its settings: no collective is added. A slice
    may differ by process: it is checked (one small all-reduce and a host sync)."""
    for got in uneven:
        assert got[kind]["checks"] == {"group": 0, "list": 0, "slice": 1}


def test_make_batches_on_one_process_alone_fails_with_ftrains_message(tmp_path):
    """Rank 0 calls make_batches, rank 1 never does: make_batches' one collective (the check
    that every process was given the same data and settings) timed out with gloo's message
    alone ("Timed out waiting 5000ms for recv operation"). It now names the cause, at the
    group's collective timeout (a shorter wait would fail processes that are only late)."""
    import micro_count_workers as W
    from launch import run_ranks

    timeout_s = 5
    out = tmp_path / "alone"
    run_ranks(W.alone, str(out), timeout_s, timeout=120)
    got = json.loads(Path(f"{out}.0").read_text())
    assert got.get("type") == "RuntimeError", got
    assert "every process must call make_batches together" in got["error"]
    assert "not under `if rank == 0:`" in got["error"]
    assert timeout_s * 0.8 < got["seconds"] < timeout_s + 10, got


def test_a_cuda_collective_no_peer_joins_ends_before_the_watchdog_would():
    """On CUDA the check is enqueued on NCCL and read by polling its event: with no peer it
    raises after 90% of the collective timeout, before torch's watchdog aborts the process
    with NCCL's message alone. (The event's query is stood in for: no GPU here.)"""
    import time

    import torch

    from ftrain.strategies import await_collective as _await_peers

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"waited 0\.18 s"):
        _await_peers(torch.device("cuda"), 0.2, done=lambda: False)
    assert 0.18 <= time.monotonic() - start < 2
    polls = iter([False, False, True])
    _await_peers(torch.device("cuda"), 60, done=lambda: next(polls))  # joined: returns
    _await_peers(torch.device("cpu"), 0.0)  # gloo waits in the call itself
