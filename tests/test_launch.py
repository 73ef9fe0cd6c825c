"""The harness of the function-launching multi-process tests (tests/workers/launch.py): every
rank's failure reaches the test, a hang ends at the timeout, and the ranks run in a fresh
process each (forked from the fork server, not this one)."""

from __future__ import annotations

import time

import pytest

import launch


def test_a_raising_rank_fails_the_launch_with_its_error_and_output():
    with pytest.raises(AssertionError) as info:
        launch.run_ranks(launch.raises_on_rank_1, "boom-7", timeout=60)
    text = str(info.value)
    assert "ValueError: boom-7" in text  # the rank's traceback
    assert "rank 1 says boom-7" in text  # the end of what the ranks printed


def test_a_hanging_launch_is_killed_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="sleeps did not finish within 2 s"):
        launch.run_ranks(launch.sleeps, 600.0, timeout=2)
    assert time.monotonic() - start < 30


def test_exit_codes_and_the_ranks_environment_is_the_collection_time_one(tmp_path, monkeypatch):
    assert launch.exit_codes(launch.sleeps, 0.0) == [0, 0]
    codes = launch.exit_codes(launch.raises_on_rank_1, "x")
    assert codes[0] == 0 and codes[1] == 1
    monkeypatch.setenv("FTRAIN_TEST_LEAK", "1")  # a test's own setting: no later rank sees it
    launch.run_ranks(launch.writes_env, str(tmp_path), "FTRAIN_TEST_LEAK")
    assert [(tmp_path / f"env-{r}").read_text() for r in (0, 1)] == ["<unset>"] * 2
