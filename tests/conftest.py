import contextlib
import os
import signal

# pyarrow (under `datasets`, `mlflow`) bundles jemalloc, which starts a `jemalloc_bg_thd`
# thread with every signal blocked. A fault in that thread kills the whole pytest process
# without faulthandler's traceback (a blocked synchronous SIGSEGV is fatal at once): CI ended
# once mid-suite with exit 139 and no output, and jemalloc's background thread is a known
# source of such faults (apache/arrow#44342, jemalloc/jemalloc#2739). The suite runs without
# it; set before anything loads libarrow, inherited by every process a test launches.
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")

import pytest
import torch
import torch.distributed as dist

import ftrain as ft
from ftrain import process_state
from helpers import LAUNCHER_VARS, tiny_llama

# Signals whose handlers a test could leave installed (the preemption handler takes two).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def environ(monkeypatch):
    """os.environ without any launcher's or scheduler's variables (`LAUNCHER_VARS`); returns
    a setter."""
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)

    def set_env(env: dict[str, str]) -> None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)

    return set_env


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny models' steps took 50x longer with two on a busy
    2-core machine (measured in tests/test_preemption.py); launched workers use one too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _process_wide() -> dict:
    """What every test must leave as it found it (a test in a subprocess changes none)."""
    return {
        "ftrain.process_state": process_state.snapshot(),
        "torch.distributed process group": dist.is_available() and dist.is_initialized(),
        "torch.get_num_threads()": torch.get_num_threads(),
        **{f"{s.name} handler": signal.getsignal(s) for s in SIGNALS},
    }


def _restore(before: dict) -> None:
    """Put back what can be, so that one leaking test does not fail the tests after it."""
    now = process_state.snapshot()
    if now.save_in_flight is not None:
        with contextlib.suppress(ft.CheckpointError):  # a failed save: the test's to check
            ft.wait_for_checkpoint()
    if now.preemption is not None:
        now.preemption.close()
    if (
        dist.is_available()
        and dist.is_initialized()
        and not before["torch.distributed process group"]
    ):
        dist.destroy_process_group()
    torch.set_num_threads(before["torch.get_num_threads()"])
    for s in SIGNALS:
        handler = before[f"{s.name} handler"]
        if handler is not None:  # None: installed from C, which Python cannot put back
            signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _leaves_process_wide_state_as_it_found_it():
    """Fail a test that leaves process-wide state changed: ftrain's own (an unreported
    background save, an active preemption handler), a process group, torch's thread count,
    a signal handler. The next tests would otherwise run in a changed process."""
    before = _process_wide()
    yield
    after = _process_wide()
    changed = [f"{k}: {before[k]!r} -> {after[k]!r}" for k in before if after[k] != before[k]]
    if changed:
        _restore(before)
        pytest.fail("the test left process-wide state changed:\n  " + "\n  ".join(changed))
