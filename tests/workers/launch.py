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
`python` process) stay subprocesses; tests of what a `python SCRIPT` process does at its end
(the interpreter's exit included) can fork it with `start_python` (test_strategies,
test_elastic), which skips only the interpreter's start-up.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
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
    "agree_workers",
    "dist_fail",
    "dist_workers",
    "ckpt_save_workers",
    "conformance_loop",
    "crash_loop",
    "cluster5_workers",
    "cursor_workers",
    "datafix_workers",
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


def exit_codes(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    timeout: float = 240,
    wait_for: Sequence[int] | None = None,
):
    """Run `fn` in `world` ranks until each exits by itself; their exit codes (a negative one
    is the signal that ended it). Bounded like `run_ranks`; what the ranks printed goes to the
    test's captured stdout. With `wait_for`, only those ranks must exit by themselves: the
    others are killed once they have (-9 unless they had exited too)."""
    since = _log_size()
    ctx = start_ranks(fn, *args, world=world)
    deadline = time.monotonic() + timeout
    awaited = [ctx.processes[r] for r in (range(world) if wait_for is None else wait_for)]
    try:
        while any(p.is_alive() for p in awaited):
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


# --- `python SCRIPT ARGS` without the start-up: for tests of what an interpreter does at exit ---

_ZYGOTE = r"""
import ctypes, importlib, json, os, select, signal, sys
list(map(importlib.import_module, sys.argv[1:]))  # what the script imports itself, once

def serve():
    # A request a line: {"token", "argv", "env", "cwd", "out", "session"} forks a child, or
    # {"kill": token}. Answers "pid TOKEN PID", then "exit TOKEN CODE" once the child is reaped.
    # EOF on stdin (pytest ended or was killed) ends the zygote, and so its children.
    buf, live = b"", {}  # pid: (token, own session)
    while True:
        ready = select.select([0], [], [], 0.02)[0]
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            token = live.pop(pid)[0]
            os.write(1, b"exit %d %d\n" % (token, os.waitstatus_to_exitcode(status)))
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if "kill" in req:
                for pid, (token, session) in list(live.items()):
                    if token == req["kill"]:
                        try:
                            (os.killpg if session else os.kill)(pid, signal.SIGKILL)
                        except ProcessLookupError:  # not yet in its own session
                            os.kill(pid, signal.SIGKILL)
                continue
            pid = os.fork()
            if pid == 0:
                return req
            live[pid] = (req["token"], req["session"])
            os.write(1, b"pid %d %d\n" % (req["token"], pid))

zygote = os.getpid()
req = serve()
if sys.platform == "linux":  # PR_SET_PDEATHSIG: never outlive the zygote (nor so pytest)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != zygote:
    os._exit(70)
if req["session"]:
    os.setsid()
for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                        (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    new = os.open(path, flags, 0o600)
    os.dup2(new, fd)
    os.close(new)
os.dup2(1, 2)
os.chdir(req["cwd"])
os.environ.clear()
os.environ.update(req["env"])
sys.argv = req["argv"]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` sets it
with open(sys.argv[0], "rb") as f:
    _code = compile(f.read(), sys.argv[0], "exec")
__file__, __cached__ = sys.argv[0], None
del ctypes, importlib, json, select, serve, zygote, req, fd, path, flags, new, f
del os, signal, sys
# The script runs in this module, __main__, as `python SCRIPT` runs it: what it leaves at its
# top level is torn down by the interpreter's exit, which follows.
exec(_code)
"""


class _Zygote:
    """The process that imported `preload` once and forks each `start_python` child."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ftrain-test-python-"))
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        self.log = self.dir / "zygote.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE, *preload], env=_ENV, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log,
            )  # fmt: skip
        self.alive = True  # until its output ends
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.changed = threading.Condition()
        self.tokens = iter(range(1 << 62))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, token, value = [*line.split(), b"", b"", b""][:3]
            with self.changed:
                if kind == b"pid":
                    self.pids[int(token)] = int(value)
                elif kind == b"exit":
                    self.codes[int(token)] = int(value)
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def fork(self, argv: list[str], env: dict[str, str], session: bool) -> Python:
        token = next(self.tokens)
        out = self.dir / f"python-{token}.out"
        self.send({"token": token, "argv": argv, "env": env, "cwd": os.getcwd(),
                   "out": str(out), "session": session})  # fmt: skip
        with self.changed:  # the first fork waits for the imports (one interpreter's start)
            if not self.changed.wait_for(lambda: token in self.pids or not self.alive, timeout=240):
                raise RuntimeError(f"the zygote forked nothing in 240 s:\n{self._log_tail()}")
        if token not in self.pids:
            raise RuntimeError(f"the zygote ended:\n{self._log_tail()}")
        return Python(self, token, self.pids[token], out)

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


_ZYGOTES: dict[tuple[str, ...], _Zygote] = {}
# `preload` for a script that builds a DDP model: DDP's constructor imports torch._dynamo (~840
# modules, 1.5-3 s on 2 cores), which a script that builds none would not import.
DDP_PRELOAD = ("torch", "ftrain", "torch._dynamo")


class Python:
    """A `python SCRIPT ARGS` process from `start_python`, read like a `subprocess.Popen` with
    stdout=PIPE, stderr=STDOUT, text=True: `pid`, `poll()`, `wait()`, `communicate()` (the
    output; TimeoutExpired past its timeout), `returncode` (negative: the signal), `kill()`."""

    def __init__(self, zygote: _Zygote, token: int, pid: int, out: Path) -> None:
        self._zygote, self._token, self.pid, self._out = zygote, token, pid, out
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.codes.get(self._token)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        zygote = self._zygote
        with zygote.changed:
            zygote.changed.wait_for(lambda: self.poll() is not None or not zygote.alive, timeout)
        if self.poll() is None and not zygote.alive:
            raise RuntimeError(f"the zygote of python {self.pid} ended:\n{zygote._log_tail()}")
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"python {self.pid}", timeout or 0.0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self._out.read_text(errors="replace"), None

    def kill(self) -> None:
        """SIGKILL it (its whole process group if it has its own session) unless it ended."""
        if self._zygote.alive:  # else it was SIGKILLed with the zygote (PR_SET_PDEATHSIG)
            self._zygote.send({"kill": self._token})


def start_python(
    script: str | Path,
    *args: str,
    env: dict[str, str],
    new_session: bool = False,
    preload: tuple[str, ...] = ("torch", "ftrain"),
) -> Python:
    """`python SCRIPT ARGS` with environment `env` (and its own session if `new_session`), for
    tests of what a process does at its end: the interpreter's own exit (exit handlers, joining
    threads, collecting the modules' objects, C-level exit handlers) runs as in a fresh
    `python` process; only the start-up is skipped. It is forked from a zygote (one per
    `preload`, started at its first use in a pytest session with the collection-time
    environment) that imported the modules in `preload`, which must be modules the script
    imports itself before it ends (then the child ends with the same modules as a fresh
    process); the child swaps in `env`, the current directory, sys.argv, sys.path[0] and its
    output file and runs the script in the `__main__` module. Variables that only interpreter
    or library start-up read (PYTHON*, OMP_NUM_THREADS before torch.set_num_threads) are the
    zygote's."""
    zygote = _ZYGOTES.get(preload)
    if zygote is None or not zygote.alive:
        zygote = _ZYGOTES[preload] = _Zygote(preload)
    return zygote.fork([str(script), *map(str, args)], dict(env), new_session)
