"""Preemption against what clusters do (fifth round): a handler on some ranks only."""

from __future__ import annotations

import json

import launch
from cluster5_workers import preempt_on_rank_0_only


def test_a_handler_on_some_ranks_only_is_named_at_the_first_vote_instead_of_a_hang(tmp_path):
    """The vote is a collective that only ranks with a handler join: with it on rank 0 alone,
    rank 0's vote met rank 1's all-reduce of the step's counts and both waited out the process
    group's timeout (30 min with gloo). Now rank 0 says so at its first vote, and rank 1, left
    alone in its collective, fails as rank 0 leaves."""
    codes = launch.exit_codes(preempt_on_rank_0_only, str(tmp_path / "err"), timeout=60)
    assert codes[0] != 0 and codes[1] != 0
    kind, message, took = json.loads((tmp_path / "err.0").read_text())
    assert kind == "RuntimeError"
    assert "on_preemption() is installed on this process (rank 0) but rank(s) [1]" in message
    assert "install it on every rank" in message
    assert took < 30
