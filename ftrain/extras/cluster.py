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
# Launchers that set torch's variables themselves, by the variable that marks their processes:
# torchrun (and `accelerate launch`, built on it) sets TORCHELASTIC_RUN_ID; the raylet sets
# RAY_RAYLET_PID in every Ray worker, which on a Ray cluster started by `srun ... ray start`
# inherits the SLURM variables of the raylet's srun task, not of a task of its own.
_LAUNCHER_MARKERS = ("TORCHELASTIC_RUN_ID", "RAY_RAYLET_PID")
# Derived ports stay below 32768: Linux hands out 32768-60999 (ip_local_port_range) to outgoing
# connections, so a listening port there may already be taken on the head node.
PORT_BASE, PORT_SPAN = 20000, 12000

# A host list: names of printable ASCII, each a literal then [ranges] and literals, by commas.
_ITEM = r"[^\[\],]+(?:\[[^\[\]]*\][^\[\],]*)*"
_HOSTLIST = re.compile(rf"(?=[\x21-\x7e]+\Z){_ITEM}(?:,{_ITEM})*")
_TOKEN = re.compile(r"\[([^\[\]]*)\]|([^\[\],]+)")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # ASCII digits: str.isdigit takes "٣" and "²"
_Ranges = tuple[tuple[int, int, int], ...]  # (first, last, digits) of each range in brackets


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list as host names, in order (what `scontrol show hostnames`
    prints): `"gpu[01-03,07],login1"` -> gpu01, gpu02, gpu03, gpu07, login1.

    Raises:
        ValueError: for a malformed list (unbalanced brackets, a range that goes down, digits
            other than 0-9, whitespace or other characters that are not printable ASCII).

    Example:
        >>> expand_hostlist("node[08-10],big[1,3]")
        ['node08', 'node09', 'node10', 'big1', 'big3']
    """
    hosts: list[str] = []
    for parts in _parse_hostlist(hostlist):
        names = [""]
        for part in parts:
            names = [name + s for name in names for s in _strings(part)]
        hosts.extend(names)
    return hosts


def _first_host(hostlist: str) -> str:
    """The first host of `expand_hostlist(hostlist)`, without expanding the list.

    Raises:
        ValueError: as `expand_hostlist`.

    Example:
        >>> _first_host("node[08-999999999],big[1,3]")
        'node08'
    """
    parts = _parse_hostlist(hostlist)[0]
    return "".join(p if isinstance(p, str) else f"{p[0][0]:0{p[0][2]}d}" for p in parts)


def _parse_hostlist(hostlist: str) -> list[list[str | _Ranges]]:
    """Each host item as its parts: literal text, or the ranges of one pair of brackets."""
    if _HOSTLIST.fullmatch(hostlist) is None:
        raise ValueError(f"not a SLURM host list: {hostlist!r}")
    return [
        [_ranges(m[1], hostlist) if m[2] is None else m[2] for m in _TOKEN.finditer(item[0])]
        for item in re.finditer(_ITEM, hostlist)
    ]


def _ranges(text: str, whole: str) -> _Ranges:
    out = []
    for part in text.split(","):
        m = _RANGE.fullmatch(part)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ValueError(f"not a SLURM host list: {whole!r} (range {part!r})")
        out.append((int(m[1]), int(m[2] or m[1]), len(m[1])))
    return tuple(out)


def _strings(part: str | _Ranges) -> list[str]:
    if isinstance(part, str):
        return [part]
    return [f"{n:0{width}d}" for lo, hi, width in part for n in range(lo, hi + 1)]


def slurm_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torch.distributed's launcher variables for one `srun` task, from SLURM's.

    RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS, LOCAL_RANK = SLURM_LOCALID,
    MASTER_ADDR = the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), MASTER_PORT =
    20000 + a hash of (SLURM_JOB_ID, SLURM_RESTART_COUNT, SLURM_STEP_ID) modulo 12000 unless
    MASTER_PORT is set: every task of the step computes the same port, a requeued attempt gets
    another one than the attempt it replaces (whose sockets may linger), as does another step
    of the job running beside it, neighbouring job ids do not collide, and the port stays below
    Linux's ephemeral range (32768-60999). MASTER_ADDR, when set, is kept too.

    srun sets SLURM_STEP_NUM_TASKS for every task it starts; the batch script has SLURM_PROCID=0
    and the allocation's SLURM_NTASKS without it, and is no task of a step.

    Raises:
        ValueError: naming the SLURM variables that are missing or not numbers; in the batch
            script of an allocation of several tasks (start the script with srun); for a
            SLURM_PROCID outside the step's task count, a MASTER_PORT that is not a port, or
            task 0 running elsewhere than on the first host (`srun --distribution=arbitrary`:
            export MASTER_ADDR).

    Example:
        >>> env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1",
        ...        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}
        >>> slurm_env(env)["MASTER_ADDR"], slurm_env(env)["MASTER_PORT"]
        ('gpu07', '23321')
    """
    env = os.environ if environ is None else environ
    if "SLURM_STEP_NUM_TASKS" not in env:
        _refuse_batch_script(env)
    needed = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS")
    missing = [k for k in needed if not _is_count(env.get(k, ""))]
    nodes_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    missing += [] if env.get(nodes_var) or "MASTER_ADDR" in env else [nodes_var]
    counts = {k: env.get(k, "0") for k in ("SLURM_RESTART_COUNT", "SLURM_STEP_ID")}
    missing += [k for k, v in counts.items() if not _is_count(v)]
    if missing:
        raise ValueError(
            f"not an srun task: {', '.join(missing)} unset or not a number (srun sets them for "
            "each task it starts; run the script with srun, or with torchrun)"
        )
    rank, world = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
    if not int(rank) < int(world):
        raise ValueError(
            f"SLURM_PROCID={rank} is outside SLURM_STEP_NUM_TASKS={world}: not a task of this step"
        )
    if "MASTER_PORT" in env:
        _check_port(env["MASTER_PORT"])
    # Job, attempt and step hashed together: consecutive job ids (an array on one head node),
    # their requeued attempts and concurrent steps of one job do not land on one port.
    restart, step = (int(v) for v in counts.values())
    port = PORT_BASE + _mix(int(env["SLURM_JOB_ID"]), restart, step) % PORT_SPAN
    return {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "MASTER_ADDR": env.get("MASTER_ADDR") or _head(env, nodes_var),
        "MASTER_PORT": env.get("MASTER_PORT", str(port)),
    }


def _is_count(value: str) -> bool:
    return re.fullmatch(r"[0-9]+", value) is not None


def _head(env: Mapping[str, str], nodes_var: str) -> str:
    """The first host of the step's node list, which is task 0's host unless the tasks were
    placed otherwise (`srun -m arbitrary` with SLURM_HOSTFILE): task 0 checks."""
    head = _first_host(env[nodes_var])
    node = env.get("SLURMD_NODENAME")
    if env["SLURM_PROCID"] == "0" and node and node != head:
        raise ValueError(
            f"task 0 runs on SLURMD_NODENAME={node}, not on {head}, the first host of "
            f"{nodes_var}={env[nodes_var]}, which MASTER_ADDR would name (srun's --distribution "
            f"placed it, e.g. arbitrary with SLURM_HOSTFILE): export MASTER_ADDR={node} (task "
            "0's host) before srun"
        )
    return head


def _check_port(value: str) -> None:
    """Refuse a MASTER_PORT that is not an integer in 1..65535 (torch would fail later)."""
    if not (_is_count(value) and 1 <= int(value) <= 65535):
        raise ValueError(
            f"MASTER_PORT={value!r} is not a port: set it to an integer in 1..65535, or unset "
            "it (export_launcher_env then derives one from the job)"
        )


def _mix(job: int, attempt: int, step: int) -> int:
    """A fixed hash of (job, attempt, step): the same in every task of a step, another for the
    next attempt or another step."""
    x = job * 0x9E3779B97F4A7C15 + attempt * 0xBF58476D1CE4E5B9 + step * 0xD6E8FEB86659FD93
    x &= 2**64 - 1
    x ^= x >> 31
    return (x * 0x94D049BB133111EB & (2**64 - 1)) >> 29


def _refuse_batch_script(environ: Mapping[str, str]) -> None:
    """Refuse the batch script (or salloc shell) of an allocation of several tasks: no srun
    task (SLURM_STEP_NUM_TASKS unset), so a training started there is one process, not the
    SLURM_NTASKS ranks the allocation is for.

    Raises:
        ValueError: when SLURM_NTASKS > 1 (or is not a number) and SLURM_STEP_NUM_TASKS is unset.
    """
    ntasks = environ.get("SLURM_NTASKS", "1")
    if "SLURM_STEP_NUM_TASKS" in environ or (_is_count(ntasks) and int(ntasks) <= 1):
        return
    raise ValueError(
        "this is the batch script (or salloc shell) of a SLURM allocation of "
        f"SLURM_NTASKS={ntasks} tasks, not a task that srun started (SLURM_STEP_NUM_TASKS is "
        "unset): it would train as one process, or wait for the others until the timeout; "
        "start the script with srun (`srun python train.py`), or with torchrun, or set "
        "WORLD_SIZE=1 if one process is what you mean"
    )


def export_launcher_env(environ: MutableMapping[str, str] | None = None) -> str:
    """Set torch.distributed's launcher variables from the scheduler's, if no launcher did.

    Returns which described the group: "launcher" when a launcher set them (torchrun,
    `accelerate launch` and Ray Train by their markers TORCHELASTIC_RUN_ID and RAY_RAYLET_PID;
    a PyTorchJob pod, or anything else that set all of RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT; nothing changes), "slurm" for an srun task (`slurm_env`, written into
    `environ`), "none" otherwise (one process: `from_env` returns `SingleDevice`).

    Args:
        environ: the environment to read and change (default `os.environ`).

    Raises:
        ValueError: as `slurm_env` (the batch script of several tasks included, unless
            WORLD_SIZE is set); in an srun task, when RANK, WORLD_SIZE, MASTER_ADDR or
            MASTER_PORT are set (all four included, unless by a launcher's marker) and differ
            from what SLURM's say: exported in the batch script, RANK=$SLURM_PROCID is 0 in
            every task. A LOCAL_RANK set already is kept (e.g. 0 with `--gpus-per-task=1`).
    """
    env = os.environ if environ is None else environ
    if any(k in env for k in _LAUNCHER_MARKERS):  # a Ray worker without Ray Train: one process
        return "launcher" if "WORLD_SIZE" in env else "none"
    preset = all(k in env for k in _LAUNCHER)
    if "SLURM_STEP_NUM_TASKS" not in env:  # no srun task: the batch script, or no SLURM
        if "WORLD_SIZE" not in env:
            _refuse_batch_script(env)
        return "launcher" if preset else "none"
    if "SLURM_PROCID" not in env or "SLURM_JOB_ID" not in env:
        return "launcher" if preset else "none"
    derived = slurm_env(env)
    _refuse_clash(env, derived)
    if preset:
        return "launcher"
    env.update({k: v for k, v in derived.items() if not (k == "LOCAL_RANK" and k in env)})
    return "slurm"


def _refuse_clash(env: Mapping[str, str], derived: Mapping[str, str]) -> None:
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
            "variables say (exported in the batch script, they are the same in every task): "
            "unset them there and let export_launcher_env set them per task, or start the "
            "processes with torchrun"
        )
