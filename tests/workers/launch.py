"""Ranks for the multi-process tests that run a function (not a script): torch.multiprocessing
processes forked from one fork server that imported torch, ftrain, transformers' Llama and the
worker modules once, instead of `spawn` importing them again in every rank (~5 s a launch on
2 cores, ~0.5 s from the server).

The server starts at the first launch of a pytest session, with the environment this module
saw when it was imported (collection time: no test's monkeypatch leaks into every later rank)
plus tests/ and tests/workers/ on PYTHONPATH (so that it can preload the worker modules), and
with its output (and so every rank's) appended to one log file: what the ranks of a launch
printed goes to the test's captured stdout (shown when the test fails), and a failed launch
quotes it. Each rank runs `fn` through `_rank`, which runs the interpreter's exit handlers
afterwards (a forked process leaves through `os._exit`, which skips them: ftrain's
wait for a background save among them) and ends the rank if the pytest process is gone (a
forked rank's parent is the server, not pytest, so torch's parent-death signal never comes).
Tests of one process killed and restarted use it too (`world=1`: test_checkpoint_crash,
test_rl, test_resume_conformance). Tests of a script and its launcher (torchrun, a bare
`python` process, what an interpreter does at exit) stay subprocesses.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from cluster_launch import free_port

PRELOAD = [
    "torch",
    "torch.distributed",
    "ftrain",
    "transformers.models.llama.modeling_llama",
    "launch",  # this module: each rank runs `_rank` from it (and it imports pytest)
    "helpers",
    "dist_workers",
    "ckpt_save_workers",
    "conformance_loop",
    "crash_loop",
    "generate_workers",
    "optim_workers",
    "rl_resume",
    "rl_workers",
    "tp_workers",
]
_HERE = Path(__file__).resolve().parent
_ENV = dict(os.environ)  # as at collection
_ENV["PYTHONPATH"] = os.pathsep.join(
    [str(_HERE), str(_HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
)
_LOG: list[Path] = []  # the server's output, once started


def _server_log() -> Path:
    """Start the fork server (once) with the collection-time environment, its output in a log."""
    if _LOG:
        return _LOG[0]
    fd, name = tempfile.mkstemp(prefix="ftrain-test-ranks-", suffix=".log")
    now = dict(os.environ)
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.environ.clear()
        os.environ.update(_ENV)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        multiprocessing.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)
        os.environ.clear()
        os.environ.update(now)
    _LOG.append(Path(name))
    atexit.register(_LOG[0].unlink, missing_ok=True)  # the failures quoted what they need
    return _LOG[0]


def log_tail(chars: int = 4000) -> str:
    """The end of what the ranks printed so far (all launches of this session)."""
    if not _LOG:
        return ""
    with open(_LOG[0], "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
        return f.read().decode(errors="replace")


def _rank(rank: int, pytest_pid: int, fn: Callable[..., Any], *args: Any) -> None:
    """One rank: `fn(rank, *args)`, then the exit handlers an interpreter would run."""

    def orphaned() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pytest_pid, 0)
            except ProcessLookupError:
                os._exit(70)  # pytest was killed: do not outlive it

    threading.Thread(target=orphaned, daemon=True).start()
    try:
        fn(rank, *args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()  # e.g. ftrain's: a failed last background save fails the rank


def start_ranks(fn: Callable[..., Any], *args: Any, world: int = 2) -> mp.ProcessContext:
    """Start `fn(rank, world, port, *args)` in `world` processes; returns torch's context."""
    _server_log()
    return mp.start_processes(
        _rank,
        args=(os.getpid(), fn, world, free_port(), *args),
        nprocs=world,
        start_method="forkserver",
        join=False,
    )


def _log_size() -> int:
    return _LOG[0].stat().st_size if _LOG else 0


def _echo(since: int, chars: int = 20000) -> None:
    """Print what the ranks wrote to the log since offset `since` (into the test's capture)."""
    if not _LOG:
        return
    with open(_LOG[0], "rb") as f:
        f.seek(max(since, f.seek(0, os.SEEK_END) - chars))
        text = f.read().decode(errors="replace")
    if text:
        print(f"--- the ranks' output ---\n{text}", end="" if text.endswith("\n") else "\n")


def kill(ctx: mp.ProcessContext) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(timeout=10)


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 240) -> None:
    """Run `fn(rank, world, port, *args)` in `world` ranks to the end. A rank's error fails the
    test with its traceback and the end of the ranks' output; past `timeout` seconds every rank
    is killed and the test fails (a hang never stalls the suite)."""
    since = _log_size()
    ctx = start_ranks(fn, *args, world=world)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"{fn.__name__} did not finish within {timeout:.0f} s\n"
                    f"--- the ranks' output (end) ---\n{log_tail()}"
                )
    except ProcessException as e:
        raise AssertionError(f"{e}\n--- the ranks' output (end) ---\n{log_tail()}") from e
    finally:
        kill(ctx)
        _echo(since)


def exit_codes(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 240):
    """Run `fn` in `world` ranks until each exits by itself; their exit codes (a negative one
    is the signal that ended it). Bounded like `run_ranks`; what the ranks printed goes to the
    test's captured stdout."""
    since = _log_size()
    ctx = start_ranks(fn, *args, world=world)
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{fn.__name__} did not finish within {timeout:.0f} s\n"
                    f"--- the ranks' output (end) ---\n{log_tail()}"
                )
            time.sleep(0.1)
    finally:
        kill(ctx)
        _echo(since)
    return [p.exitcode for p in ctx.processes]


# --- for tests/test_launch.py: the harness reports a failing or hanging rank ------------------


def raises_on_rank_1(rank: int, world: int, port: int, message: str) -> None:
    if rank == 1:
        print(f"rank 1 says {message}", flush=True)
        raise ValueError(message)


def sleeps(rank: int, world: int, port: int, seconds: float) -> None:
    time.sleep(seconds)


def writes_env(rank: int, world: int, port: int, out: str, name: str) -> None:
    Path(out, f"env-{rank}").write_text(os.environ.get(name, "<unset>"))


def registers_exit_handler(rank: int, world: int, port: int, out: str) -> None:
    atexit.register(lambda: Path(out, f"exited-{rank}").write_text("ran"))


def imported_modules(rank: int, world: int, port: int, out: str) -> None:
    Path(out, f"modules-{rank}").write_text("\n".join(sorted(sys.modules)))
