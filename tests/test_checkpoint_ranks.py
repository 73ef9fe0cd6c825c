"""Issue 20.15: data-parallel ranks agree on the checkpoint they load (2 gloo processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_that_see_different_checkpoints_all_refuse_to_resume(tmp_path):
    """Node-local run folders: each rank would resume from its own copy (another step, other
    parameters) and train on silently. The ranks compare the step and the checkpoint's digest
    in one all-reduce at load, and every rank raises CheckpointError when they differ; ranks
    that read equal copies resume. `latest_checkpoint(root, strategy=...)` refuses on every
    rank when one found no checkpoint (it would skip the load and start afresh) or the steps
    differ."""
    script = Path(__file__).parent / "workers" / "ckpt_ranks_child.py"
    port, procs = _free_port(), []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(sys.path))  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(rank)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))  # fmt: skip
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank}:\n{out}"
        lines = dict(ln.split(": ", 1) for ln in out.splitlines() if ": " in ln)
        assert lines["same checkpoint"] == "loaded step 5", out
        for case in ("step differs", "parameters differ"):
            assert lines[case].startswith("refused: the 2 ranks opened different checkpoints"), out
        assert f"step {5 + rank}" in lines["step differs"], out
        # latest_checkpoint(strategy=...): the ranks agree on what they found, or all refuse.
        assert lines["latest agrees"] == "found step-5", out
        assert lines["latest on no rank"] == "found None", out
        assert lines["latest on one rank"].startswith("refused: 1 of 2 ranks found a checkpoint")
        this = "step-5" if rank == 0 else "none"
        assert f"(this rank: {this})" in lines["latest on one rank"], out
        assert lines["latest step differs"].startswith(
            "refused: the 2 ranks found checkpoints of different steps"
        ), out
        # Rank 0's background save (DDP: it alone writes), loaded at once by every rank.
        assert lines["background save"] == "new weights", out
        assert lines["latest with a background save"] == "found step-9", out
