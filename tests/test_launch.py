"""The harness of the function-launching multi-process tests (tests/workers/launch.py): every
rank's failure reaches the test, a hang ends at the timeout, and the ranks run in a fresh
process each (forked from the fork server, not this one)."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_exit_codes_and_what_the_ranks_printed_reaches_the_test(capsys):
    assert launch.exit_codes(launch.sleeps, 0.0) == [0, 0]
    codes = launch.exit_codes(launch.raises_on_rank_1, "x-3")
    assert codes[0] == 0 and codes[1] == 1
    assert "rank 1 says x-3" in capsys.readouterr().out  # shown when a test fails


def test_a_rank_runs_the_exit_handlers_and_had_the_worker_modules_preloaded(tmp_path):
    launch.run_ranks(launch.registers_exit_handler, str(tmp_path))
    assert [(tmp_path / f"exited-{r}").read_text() for r in (0, 1)] == ["ran", "ran"]
    launch.run_ranks(launch.imported_modules, str(tmp_path))
    modules = set((tmp_path / "modules-0").read_text().split())
    assert {"ftrain", "transformers.models.llama.modeling_llama", "dist_workers"} <= modules


def test_the_server_starts_with_the_collection_time_environment(monkeypatch):
    """A variable set by a test (after collection) does not reach the server, and so no rank;
    the test's own environment and output are back afterwards. (Checked on the start-up
    itself, without starting a second server.)"""
    seen = {}
    monkeypatch.setattr(launch, "_LOG", [])
    monkeypatch.setattr(launch.forkserver, "ensure_running", lambda: seen.update(os.environ))
    monkeypatch.setenv("FTRAIN_TEST_LEAK", "1")
    log = launch._server_log()
    try:
        assert "FTRAIN_TEST_LEAK" not in seen and seen["PYTHONPATH"] == launch._ENV["PYTHONPATH"]
        assert os.environ["FTRAIN_TEST_LEAK"] == "1"
        print("after")  # fd 1 is the test's again
    finally:
        log.unlink()


def test_start_python_ends_as_a_fresh_interpreter_does(tmp_path):
    """A script forked by `start_python` exits as `python SCRIPT` does: exit handlers, a
    non-daemon thread joined, objects collected at teardown, the exit code of sys.exit or of
    an exception, its argv, environment and working directory."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import atexit, os, sys, threading, time\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "class Noisy:\n"
        "    def __del__(self):\n"
        "        print('collected', flush=True)\n"
        "kept = Noisy()\n"
        "t = threading.Thread(target=lambda: (time.sleep(0.2), print('thread ended')))\n"
        "t.start()\n"
        "print('argv', sys.argv[1:], os.environ['PROBE'], os.getcwd() == os.environ['WHERE'])\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise RuntimeError('on purpose')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    env = dict(os.environ, PROBE="seen", WHERE=os.getcwd())
    fresh = subprocess.run(
        [sys.executable, str(script), "3"], env=env, capture_output=True, text=True, timeout=60
    )
    forked = launch.start_python(script, "3", env=env, preload=("os",))
    out, _ = forked.communicate(timeout=60)
    assert forked.returncode == fresh.returncode == 3
    assert out.splitlines() == fresh.stdout.splitlines() == [
        "argv ['3'] seen True", "thread ended", "atexit ran", "collected"
    ]  # fmt: skip
    raised = launch.start_python(script, "raise", env=env, preload=("os",))
    out, _ = raised.communicate(timeout=60)
    assert raised.returncode == 1 and "RuntimeError: on purpose" in out
