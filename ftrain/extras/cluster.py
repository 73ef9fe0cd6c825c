"""Schedulers that start the processes themselves: SLURM's `srun` (with `--requeue`).

torchrun, `accelerate launch`, Ray Train and Kubeflow's PyTorchJob set torch.distributed's
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the PyTorchJob operator sets them, and
PET_* for torchrun, in each pod), so `ft.strategies.from_env()` joins their group as it is.
`srun` starting one task per rank sets SLURM's variables instead; `export_launcher_env()`
translates them, before `from_env`:

    ft.extras.cluster.export_launcher_env()          # a no-op under torchrun / PyTorchJob
    with ft.strategies.from_env("ddp") as strategy:
        ...

A requeued job keeps its job id and counts SLURM_RESTART_COUNT up; it starts again in the same
run folder and resumes from `ft.latest_checkpoint`, which never returns a checkpoint the killed
attempt left half-written. See docs/strategies.md ("SLURM") for the `sbatch` recipe.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

__all__ = ["expand_hostlist", "export_launcher_env", "slurm_env"]

_LAUNCHER = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PORT_BASE, PORT_SPAN = 20000, 20000


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list as host names, in order (what `scontrol show hostnames`
    prints): `"gpu[01-03,07],login1"` -> gpu01, gpu02, gpu03, gpu07, login1.

    Raises:
        ValueError: for a malformed list (unbalanced brackets, a range that goes down).

    Example:
        >>> expand_hostlist("node[08-10],big[1,3]")
        ['node08', 'node09', 'node10', 'big1', 'big3']
    """
    if hostlist.count("[") != hostlist.count("]") or not hostlist.strip():
        raise ValueError(f"not a SLURM host list: {hostlist!r}")
    hosts: list[str] = []
    for item in _split_outside_brackets(hostlist):
        if not item or item.startswith("[") or "]" in item.split("[")[0]:
            raise ValueError(f"not a SLURM host list: {hostlist!r}")
        hosts.extend(_expand_one(item, hostlist))
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            raise ValueError(f"not a SLURM host list: {text!r}")
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def _expand_one(item: str, whole: str) -> list[str]:
    m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", item)
    if m is None:
        if "[" in item:  # "a[]"
            raise ValueError(f"not a SLURM host list: {whole!r}")
        return [item]
    prefix, ranges, rest = m.groups()
    out: list[str] = []
    for part in ranges.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"not a SLURM host list: {whole!r} (range {part!r})")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(f"{prefix}{n:0{width}d}{tail}" for tail in _expand_one(rest, whole))
    return out


def slurm_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torch.distributed's launcher variables for one `srun` task, from SLURM's.

    RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), LOCAL_RANK =
    SLURM_LOCALID, MASTER_ADDR = the first host of SLURM_STEP_NODELIST (else
    SLURM_JOB_NODELIST), MASTER_PORT = 20000 + a hash of (SLURM_JOB_ID, SLURM_RESTART_COUNT)
    modulo 20000 unless MASTER_PORT is set: every task computes the same port, a requeued
    attempt gets another one than the attempt it replaces (whose sockets may linger), and
    neighbouring job ids do not collide. MASTER_ADDR, when set, is kept too.

    Raises:
        ValueError: naming the SLURM variables that are missing or not numbers, or a
            SLURM_PROCID outside the step's task count.

    Example:
        >>> env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
        ...        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}
        >>> slurm_env(env)["MASTER_ADDR"], slurm_env(env)["MASTER_PORT"]
        ('gpu07', '35321')
    """
    env = os.environ if environ is None else environ
    needed = ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID"]
    missing = [k for k in needed if not env.get(k, "").isdigit()]
    world_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world = env.get(world_var, "")
    missing += [] if world.isdigit() else [world_var]
    nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST"))
    missing += [] if nodes or "MASTER_ADDR" in env else ["SLURM_JOB_NODELIST"]
    restart = env.get("SLURM_RESTART_COUNT", "0")
    missing += [] if restart.isdigit() else ["SLURM_RESTART_COUNT"]
    if missing:
        raise ValueError(
            f"not an srun task: {', '.join(missing)} unset or not a number (srun sets them for "
            "each task it starts; run the script with srun, or with torchrun)"
        )
    if not 0 <= int(env["SLURM_PROCID"]) < int(world):
        raise ValueError(
            f"SLURM_PROCID={env['SLURM_PROCID']} is outside {world_var}={world}: not a task of "
            "this step"
        )
    # Job and attempt hashed together: consecutive job ids (an array on one head node) and
    # their requeued attempts do not land on one port, as job + attempt did (1000+1 = 1001+0).
    port = PORT_BASE + _mix(int(env["SLURM_JOB_ID"]), int(restart)) % PORT_SPAN
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "MASTER_ADDR": env.get("MASTER_ADDR") or expand_hostlist(nodes or "")[0],
        "MASTER_PORT": env.get("MASTER_PORT") or str(port),
    }


def _mix(job: int, attempt: int) -> int:
    """A fixed hash of (job, attempt): the same in every task, another for the next attempt."""
    x = (job * 0x9E3779B97F4A7C15 + attempt * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 31
    return (x * 0x94D049BB133111EB & (2**64 - 1)) >> 29


def export_launcher_env(environ: MutableMapping[str, str] | None = None) -> str:
    """Set torch.distributed's launcher variables from the scheduler's, if no launcher did.

    Returns which described the group: "launcher" when RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT were set already (torchrun, `accelerate launch`, Ray Train, a PyTorchJob pod;
    nothing changes), "slurm" for an srun task (`slurm_env`, written into `environ`), "none"
    otherwise (one process: `from_env` returns `SingleDevice`).

    Args:
        environ: the environment to read and change (default `os.environ`).

    Raises:
        ValueError: as `slurm_env`; when some of the four are set already and differ from
            what SLURM's say (a RANK exported in the batch script would have made every task
            that rank). A LOCAL_RANK set already is kept (e.g. 0 with `--gpus-per-task=1`).
    """
    env = os.environ if environ is None else environ
    if all(k in env for k in _LAUNCHER):
        return "launcher"
    if "SLURM_PROCID" not in env or "SLURM_JOB_ID" not in env:
        return "none"
    derived = slurm_env(env)
    # LOCAL_RANK may differ: with --gpus-per-task=1 each task sees one GPU, and LOCAL_RANK=0
    # set in the batch script is how to say so.
    clash = [
        f"{k}={env[k]} (SLURM: {v})"
        for k, v in derived.items()
        if k in env and env[k] != v and k != "LOCAL_RANK"
    ]
    if clash:
        raise ValueError(
            f"{', '.join(clash)} already set, differing from what this srun task's SLURM "
            "variables say: unset them in the batch script (or set all four for a launcher "
            "of your own)"
        )
    env.update({k: v for k, v in derived.items() if not (k == "LOCAL_RANK" and k in env)})
    return "slurm"
