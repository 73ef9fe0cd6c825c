"""Start N ranks of a script as a scheduler would, each in its own session; bounded in time."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "cluster" / "train.py"


def load_example(name: str):
    """examples/cluster/<name>.py as a module named cluster_<name> (no sys.path change)."""
    spec = importlib.util.spec_from_file_location(f"cluster_{name}", TRAIN.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any launcher's variables, plus `extra`."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    path = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "FTRAIN_COLLECTIVE_TIMEOUT": "30",
            **extra}  # fmt: skip


def run_all(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    timeout: float,
    *,
    evict: tuple[Path, int] | None = None,
) -> list[tuple[int, str, str]]:
    """Run every command (its env beside it) at once; wait for all, killing every one's session
    on a timeout. Returns (returncode, stdout, stderr) per command. `evict=(path, i)`: once
    `path` exists, SIGTERM command i's whole session, as Kubernetes evicts a pod."""
    procs = [
        subprocess.Popen(
            list(c),
            env=dict(e),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=ROOT,
        )
        for c, e in zip(commands, envs, strict=True)
    ]
    outs = []
    if evict is not None:
        threading.Thread(
            target=_evict, args=(procs[evict[1]], evict[0], timeout), daemon=True
        ).start()
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return outs


def _evict(proc: subprocess.Popen[str], path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)


def env_ranks(run_dir: Path, *args: str, world: int = 2, timeout: float = 90) -> list[str]:
    """examples/cluster/train.py on `world` ranks described by MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE, RANK (what a PyTorchJob sets in each pod); returns each rank's stdout."""
    port = str(free_port())
    envs = [base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world),
                     RANK=str(r), LOCAL_RANK="0") for r in range(world)]  # fmt: skip
    cmd = [sys.executable, str(TRAIN), str(run_dir), *args]
    outs = run_all([cmd] * world, envs, timeout)
    for code, _, err in outs:
        assert code == 0, err[-3000:]
    return [out for _, out, _ in outs]


def data_position(state) -> tuple:
    """Where a state is in its data: step, epoch, cursor, the JSON position, the counters."""
    d = state.data
    return (state.step, state.epoch, d.cursor, d.position, int(d.tokens_seen), int(d.samples_seen))
