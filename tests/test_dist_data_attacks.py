"""Distributed strategies x the data pipeline: data-parallel ranks never read the same rows,
never run different numbers of micro-batches without an error, and tensor-parallel ranks of
one group read the same rows.

The 2-rank checks run in one launch of tests/workers/dist_data_workers.py (gloo on CPU,
bounded by a timeout), whose records the tests below read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's record of the 2-rank launch (bounded: never hangs)."""
    import dist_data_workers as W
    from launch import run_ranks

    out = tmp_path_factory.mktemp("ddata") / "results"
    run_ranks(W.ranks, str(out), timeout=120)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


def test_ranks_given_the_same_data_read_disjoint_rows_in_equal_counts(two_ranks):
    a, b = (r["same"]["groups"] for r in two_ranks)
    assert [len(g) for g in a] == [len(g) for g in b]
    rows = [x for r in (a, b) for g in r for m in g for x in m]
    assert sorted(rows) == list(range(1, 11))


@pytest.mark.parametrize(
    "check, names",
    [
        ("rows", "rows"),
        ("accum", "accum"),
        ("batch_size", "batch_size"),
        ("drop_last", "drop_last"),
        ("start", "start"),
        ("content", "content"),
        ("subset", "subset"),
        ("stream", "data"),
        ("generator", "data"),
    ],
)
def test_ranks_given_other_data_or_settings_raise_naming_them(two_ranks, check, names):
    """Each rank was given its own part of the data (n = 5 and 4 rows), its own accum, batch
    size, drop_last, start, rows of other contents, or a torch Subset of its own rows (whose
    rows are not digested): make_batches yielded without a word,
    and the ranks read overlapping rows, or ran 5 and 4 micro-batches (DDP trains on: each
    rank's final backward meets the other's), e.g. rank 1 starting its next epoch while rank 0
    was still in this one."""
    for got in two_ranks:
        error = got[check].get("error", "")
        assert "on every rank" in error and names in error, got[check]


def test_evaluate_over_a_short_last_batch_counts_the_real_rows_only(two_ranks):
    """5 rows, 2 a rank: rank 1 evaluates a stand-in copy of row 4 (loss 16) that must count
    nothing (checked and right)."""
    for got in two_ranks:
        ddp, one = got["eval"]["ddp"], got["eval"]["one"]
        assert ddp["eval_loss"] == one["eval_loss"] == 6.0 and ddp["eval_items"] == 5
        # rows per real batch: [0, 1], [4] on rank 0, [2, 3] on rank 1 (the stand-in: none)
        assert ddp["eval_rows"] == one["eval_rows"] == 5 / 3
        assert ddp["eval_big"] == one["eval_big"] == 0.2


def test_ddp_over_a_device_mesh_of_other_ranks_than_its_data_split_is_refused(two_ranks):
    """DDP(device_mesh=mesh["dp"]) of a (dp, tp) = (1, 2) mesh: torch's DDP reduced over the
    mesh's group (one process each), while the strategy kept the default group's rank and
    world size, so make_batches gave the two processes of one tensor-parallel group other
    rows and each trained alone: after one step the replicas' weights were 0.5 and 0.9."""
    for got in two_ranks:
        assert "device_mesh" in got["ddp_mesh"].get("error", ""), got["ddp_mesh"]


def test_tensor_parallel_ranks_of_one_group_read_the_same_rows(two_ranks):
    a, b = (r["tp_same"]["groups"] for r in two_ranks)
    assert a == b and sorted(x for g in a for m in g for x in m) == list(range(1, 7))
    for got in two_ranks:
        error = got["tp_rows"].get("error", "")
        assert "on every rank" in error and "rows" in error, got["tp_rows"]


def test_a_2d_mesh_gives_one_tensor_parallel_group_the_same_rows_and_groups_their_own(tmp_path):
    """TP(dp=2) on 4 processes: processes 0, 1 are data-parallel rank 0, processes 2, 3 rank 1
    (checked and right)."""
    import dist_data_workers as W
    from launch import run_ranks

    run_ranks(W.tp_2d, str(tmp_path / "r"), world=4, timeout=120)
    got = [json.loads((tmp_path / f"r.{p}").read_text()) for p in range(4)]
    assert [g["dp_rank"] for g in got] == [0, 0, 1, 1]
    assert got[0]["groups"] == got[1]["groups"] and got[2]["groups"] == got[3]["groups"]
    rows = [x for g in (got[0], got[2]) for grp in g["groups"] for m in grp for x in m]
    assert sorted(rows) == list(range(1, 11))
