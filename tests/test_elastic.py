"""torchrun launches (issue 14): a strategy joins the launcher's group by itself, two "nodes"
equal one process, and SIGKILLed ranks restart under `--max-restarts` and end bit-equal."""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ftrain as ft
from elastic_loop import build, plan, train
from ftrain.strategies._group import _attempt_store, collective_timeout
from helpers import opt_state_tensors, within
from launch import DDP_PRELOAD, start_python

SCRIPT = Path(__file__).parent / "workers" / "elastic_loop.py"
KILLS = 6  # random kill points in one job (test_checkpoint_crash kills one process more often)
TOTAL = 3 * KILLS + 2  # each attempt dies at most 3 steps after its start: all of them die early
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


pytestmark = pytest.mark.usefixtures("one_thread")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, **env: str) -> subprocess.Popen:
    """Start a torchrun agent in its own process group (so that a failure kills all of it)."""
    env = {**os.environ, "FTRAIN_COLLECTIVE_TIMEOUT": "20", "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Wait for every agent; on a timeout or failure kill every process group, then fail."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((out, err))
            assert p.returncode == 0, err[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return outs


def final(root: Path) -> ft.TrainState:
    path = ft.latest_checkpoint(root)
    assert path is not None and path.name == f"step-{TOTAL}"
    return ft.load_checkpoint(path, build())


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> ft.TrainState:
    """Two torchrun agents as two nodes (1 process each, c10d rendezvous on 127.0.0.1), sharing
    the checkpoint directory as a shared filesystem would; each rank builds `DDP()` itself.
    This 2-rank run without failures is the reference of the elastic and preemption tests."""
    root, port = tmp_path_factory.mktemp("two_nodes"), free_port()
    agents = [
        torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", "two-nodes", str(SCRIPT), str(root), str(TOTAL), "0",
                 TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # as docs/strategies.md advises
        for node in (0, 1)
    ]  # fmt: skip
    (out, _), _ = finish(agents, timeout=120)
    assert f"attempt 0: steps 0..{TOTAL}" in out
    return final(root)


def test_a_strategy_outside_a_launcher_says_how_to_launch(monkeypatch):
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    for cls in (ft.strategies.DDP, ft.strategies.FSDP):
        with pytest.raises(RuntimeError, match=r"unset: RANK.*torchrun --nproc_per_node N"):
            cls()
    assert not torch.distributed.is_initialized()


def test_the_collective_timeout_comes_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv("FTRAIN_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout() == timedelta(minutes=10)
    assert collective_timeout(timedelta(seconds=3)) == timedelta(seconds=3)
    monkeypatch.setenv("FTRAIN_COLLECTIVE_TIMEOUT", "7.5")
    assert collective_timeout() == timedelta(seconds=7.5)
    for bad in ("soon", "0", "-1", "nan"):
        monkeypatch.setenv("FTRAIN_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"FTRAIN_COLLECTIVE_TIMEOUT.*{bad!r}"):
            collective_timeout()
    with pytest.raises(ValueError, match="timeout must be a positive"):
        collective_timeout(timedelta(0))


def test_a_timeout_too_long_for_torch_is_a_clear_error(monkeypatch):
    """inf and 1e20 raised OverflowError from timedelta (issue 27); torch overflows long before."""
    for bad in ("inf", "1e20", "-inf", "31536001"):
        monkeypatch.setenv("FTRAIN_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(
            ValueError, match=rf"FTRAIN_COLLECTIVE_TIMEOUT.*\(0, 31536000\].*{bad!r}"
        ):
            collective_timeout()
    monkeypatch.setenv("FTRAIN_COLLECTIVE_TIMEOUT", "31536000")
    assert collective_timeout() == timedelta(days=365)
    with pytest.raises(ValueError, match=r"timeout must be a positive .* at most 365 days"):
        collective_timeout(timedelta.max)


def test_each_torchrun_attempt_gets_its_own_keys_in_the_agent_store(monkeypatch):
    server = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "GROUP_WORLD_SIZE": "1",
           "TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_MAX_RESTARTS": "5"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    store = _attempt_store(timedelta(seconds=5))
    assert store is not None
    store.set("rank_0", "addr")
    assert server.get("ftrain/attempt-3/rank_0") == b"addr"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a fresh store: nothing to do
    assert _attempt_store(timedelta(seconds=5)) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # nodes may count restarts differently
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        assert _attempt_store(timedelta(seconds=5)) is None


@pytest.mark.slow
def test_two_nodes_equal_one_process(two_nodes):
    one = train(build(), None, TOTAL)  # global batch 4 in one process
    assert (two_nodes.step, two_nodes.data.samples_seen) == (one.step, one.data.samples_seen)
    for n, p in one.params.items():
        torch.testing.assert_close(two_nodes.params[n], p, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
def test_sigkilled_ranks_restart_and_end_bit_equal_to_the_uninterrupted_run(two_nodes, tmp_path):
    """One torchrun job, KILLS + 1 tries: attempt r < KILLS SIGKILLs a random rank during the
    save of a step drawn from a generator seeded by r (TORCHELASTIC_RESTART_COUNT); torchrun
    restarts the job, which resumes from the newest committed checkpoint (a half-written one of
    the dead attempt is never loaded). Attempt KILLS finishes, bit-equal to the 2-rank run
    without kills. Before each attempt got its own key space in torchrun's store, a restarted
    attempt often failed with gloo's "connectFullMesh failed: Connection refused"."""
    port, kills = str(free_port()), str(KILLS)
    agent = torchrun("--nproc-per-node", "2", "--max-restarts", kills, "--master-port", port,
                     str(SCRIPT), str(tmp_path), str(TOTAL), kills)  # fmt: skip
    ((out, err),) = finish([agent], timeout=240)
    attempts = re.findall(r"attempt (\d+): steps (\d+)\.\.(\d+)", out)
    assert attempts == [(str(KILLS), attempts[0][1], str(TOTAL))], out
    failed = re.findall(r"failed \(exitcode: (-?\d+)\)", err)  # torchrun: one per failed attempt
    assert len(failed) == KILLS and "-9" in failed, err[-4000:]
    assert "connectFullMesh" not in err
    resumed = final(tmp_path)
    assert resumed.step == two_nodes.step == TOTAL
    for n, p in two_nodes.params.items():
        assert torch.equal(resumed.params[n], p), n
    reference = opt_state_tensors(two_nodes.opt_state)
    for n, t in opt_state_tensors(resumed.opt_state).items():
        assert torch.equal(t, reference[n]), n


@pytest.mark.slow
def test_sigterm_to_one_rank_makes_both_save_the_same_step_and_continue_bit_equal(
    two_nodes, tmp_path
):
    """4 preemptions in one 2-rank launch: each sends SIGTERM to one random rank at a random
    instant of a random step; both ranks learn it from the step's own all-reduce, save the same
    step, and leave the loop; the next segment resumes from there. The end is bit-equal to the
    run without preemptions."""
    port, segments = str(free_port()), 4
    agent = torchrun("--nproc-per-node", "2", "--master-port", port, str(SCRIPT), str(tmp_path),
                     str(TOTAL), "0", str(segments))  # fmt: skip
    ((out, _),) = finish([agent], timeout=180)
    found = re.findall(r"rank (\d) segment (\d+): steps (\d+)\.\.(\d+)", out)
    ends = {(int(s), int(a), int(b)) for _, s, a, b in found}
    assert len(found) == 2 * (segments + 1) and len(ends) == segments + 1, out  # ranks agree
    ends_sorted = sorted(ends)
    for (_, a, b), (_, next_start, _) in itertools.pairwise(ends_sorted):
        assert a < b < TOTAL and next_start == b  # preempted, saved, resumed from that step
    assert ends_sorted[-1][2] == TOTAL
    resumed = final(tmp_path)
    for n, p in two_nodes.params.items():
        assert torch.equal(resumed.params[n], p), n


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_when_a_rank_dies_or_freezes_the_other_exits_by_itself(tmp_path, how):
    """No launcher to clean up (two processes started as torchrun would, and nothing kills the
    survivor): a peer SIGKILLed inside a save ends the survivor's next collective at once (gloo
    sees the closed socket; on a loaded machine it may report a send time-out instead, at the
    30 s timeout at the latest); a frozen peer (SIGSTOP) ends it after FTRAIN_COLLECTIVE_TIMEOUT
    (3 s). Either way the survivor leaves its `with DDP()` block and the interpreter exits.
    Each runs `python elastic_loop.py` forked by `launch.start_python` from a process that
    imported what the script imports (no interpreter start-up), and exits as a fresh one does."""
    victim, _ = plan(0, 2, 0)
    port, procs, timeout = str(free_port()), [], "30" if how == "SIGKILL" else "3"
    try:
        for rank in (0, 1):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                   "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "FTRAIN_COLLECTIVE_TIMEOUT": timeout, "VICTIM_SIGNAL": how,
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
            procs.append(start_python(
                SCRIPT, str(tmp_path), str(TOTAL), "1", env=env, new_session=True,
                preload=DDP_PRELOAD,
            ))  # fmt: skip
        dead, survivor = procs[victim], procs[1 - victim]
        with within(60, "the victim's signal"):
            while dead.poll() is None and _state(dead.pid) != "T":
                time.sleep(0.02)
        gone = time.monotonic()
        out, _ = survivor.communicate(timeout=60)
        waited = time.monotonic() - gone
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # its process group
            p.communicate()
    assert survivor.returncode == 1, out[-3000:]
    # The survivor's collective raised (whatever gloo's wording: a closed socket, or a send
    # time-out on a loaded machine), and its error left the `with DDP()` block (exit code 1).
    assert re.search(r"rank \d: the step raised \w+Error", out), out[-3000:]
    if how == "SIGKILL":  # the socket closed: at once, at the latest at the 30 s timeout
        assert dead.returncode == -signal.SIGKILL, out[-3000:]
        assert waited < 50, (waited, out[-3000:])
    else:  # a frozen peer keeps its sockets open: the timeout ends the collective
        assert 3 < waited < 50, (waited, out[-3000:])


def _state(pid: int) -> str:
    """The process state letter from /proc (T: stopped; "" once reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # start_python's process: reaped by its parent, the zygote
        return ""
