"""The cluster environment read wrong (a review of ftrain.extras.cluster and from_env): the
batch script taken for task 0, concurrent steps and ephemeral ports, launchers' variables
exported in the batch shell, task 0 away from the first host, MASTER_PORT values that are not
ports, host lists with whitespace or other digits, pods that torchrun should have started."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

import ftrain as ft
from cluster_launch import ROOT
from ftrain.extras import cluster
from ftrain.extras.cluster import expand_hostlist, export_launcher_env, slurm_env

# What srun sets in task 1 of a 2-task step, and what sbatch sets in the batch script of a
# 4-task allocation (an env dump: SLURM_PROCID=0, the allocation's SLURM_NTASKS, no step).
TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[01-02]",
        "SLURM_JOB_NODELIST": "node[01-02]"}  # fmt: skip
BATCH = {"SLURM_JOB_ID": "200505", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4",
         "SLURM_JOB_NODELIST": "gnode[10,20,25,37]", "SLURMD_NODENAME": "gnode10"}  # fmt: skip
# Everything from_env or export_launcher_env reads to tell who started the process.
READ = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "RAY_RAYLET_PID", "PET_NNODES", "PET_MASTER_ADDR", "JOB_COMPLETION_INDEX", *TASK,
        *BATCH, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")  # fmt: skip


# --- 1. the batch script is no srun task ---------------------------------------------------------


def test_the_batch_script_of_several_tasks_is_refused_not_taken_for_task_0(environ):
    """It has SLURM_PROCID=0 and SLURM_NTASKS=4: WORLD_SIZE=4 waited out the store timeout
    (export_launcher_env), and from_env trained one process silently."""
    message = r"batch script \(or salloc shell\) of a SLURM allocation of SLURM_NTASKS=4 tasks"
    for call in (export_launcher_env, slurm_env):
        env = dict(BATCH)
        with pytest.raises(ValueError, match=message) as err:
            call(env)
        assert "srun" in str(err.value) and env == BATCH  # nothing written
    environ(BATCH)
    with pytest.raises(ValueError, match=message + r".*start the script with srun"):
        ft.strategies.from_env("ddp")


def test_a_one_task_batch_script_stays_one_process(environ):
    one = {**BATCH, "SLURM_NTASKS": "1"}
    env = dict(one)
    assert export_launcher_env(env) == "none" and env == one
    with pytest.raises(ValueError, match="not an srun task: SLURM_STEP_NUM_TASKS unset"):
        slurm_env(one)  # slurm_env describes srun tasks only
    environ(one)
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)


def test_world_size_1_says_one_process_is_meant_in_a_batch_script(environ):
    env = {**BATCH, "WORLD_SIZE": "1"}
    assert export_launcher_env(env) == "none"
    environ(env)
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)


# --- 2, 7. ports ---------------------------------------------------------------------------------


def test_concurrent_steps_of_one_job_get_different_ports():
    """`srun -n2 --exclusive ... &` twice in one job: both steps' task 0 on node01."""
    for job in ("4242", "1", "99999"):
        ports = {
            slurm_env({**TASK, "SLURM_JOB_ID": job, "SLURM_STEP_ID": step})["MASTER_PORT"]
            for step in ("0", "1", "2")
        }
        assert len(ports) == 3, (job, ports)
    same = [slurm_env({**TASK, "SLURM_PROCID": r})["MASTER_PORT"] for r in "01"]
    assert same[0] == same[1]  # every task of one step agrees


def test_derived_ports_stay_below_the_ephemeral_range():
    """Linux hands 32768-60999 to outgoing connections: a port there may be taken already."""
    ports = [
        int(slurm_env({**TASK, "SLURM_JOB_ID": str(j), "SLURM_RESTART_COUNT": a})["MASTER_PORT"])
        for j in range(1, 3001)
        for a in "01"
    ]
    assert min(ports) >= 20000 and max(ports) < 32768
    assert len(set(ports)) > 4000  # still spread out


# --- 5, 12. launchers' variables -----------------------------------------------------------------

EXPORTED = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


def test_all_four_exported_in_the_batch_shell_are_checked_against_the_srun_task():
    """RANK=$SLURM_PROCID exported in the batch script is 0 in every task: task 1 would have
    joined as a second rank 0."""
    with pytest.raises(ValueError, match=r"RANK=0 \(SLURM: 1\) already set, differing"):
        export_launcher_env({**TASK, **EXPORTED})
    with pytest.raises(ValueError, match=r"WORLD_SIZE=8 \(SLURM: 2\) already set, differing"):
        export_launcher_env({**TASK, **EXPORTED, "RANK": "1", "WORLD_SIZE": "8"})
    agreeing = {**TASK, **EXPORTED, "RANK": "1"}
    env = dict(agreeing)
    assert export_launcher_env(env) == "launcher" and env == agreeing


@pytest.mark.parametrize("marker", ["TORCHELASTIC_RUN_ID", "RAY_RAYLET_PID"])
def test_a_launchers_own_variables_are_taken_inside_an_srun_task(marker):
    """`srun torchrun ...` (SLURM_PROCID is the node's) and a Ray Train worker on a Ray cluster
    started by `srun ray start` (SLURM_* inherited from the raylet; Ray Train sets RANK,
    WORLD_SIZE, LOCAL_RANK, and with init_method="tcp" no MASTER_*)."""
    torchrun = {**TASK, **EXPORTED, "RANK": "5", "WORLD_SIZE": "8", marker: "1"}
    ray = {k: v for k, v in torchrun.items() if not k.startswith("MASTER_")}
    for launched in (torchrun, ray):
        env = dict(launched)
        assert export_launcher_env(env) == "launcher" and env == launched
    worker = {**TASK, marker: "1"}  # a Ray task, no Ray Train: one process, SLURM's not its own
    assert export_launcher_env(dict(worker)) == "none"


def test_a_ray_worker_under_srun_is_one_process_for_from_env(environ):
    environ({**TASK, "RAY_RAYLET_PID": "4711"})
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)


# --- 6. srun -m arbitrary ------------------------------------------------------------------------


def test_task_0_away_from_the_first_host_is_refused_on_task_0():
    """SLURM_HOSTFILE listing node02 first: task 0 runs there, MASTER_ADDR said node01."""
    task0 = {**TASK, "SLURM_PROCID": "0", "SLURMD_NODENAME": "node02"}
    with pytest.raises(ValueError, match="SLURMD_NODENAME=node02, not on node01") as err:
        export_launcher_env(dict(task0))
    assert "--distribution" in str(err.value) and "export MASTER_ADDR=node02" in str(err.value)
    assert slurm_env({**task0, "MASTER_ADDR": "node02"})["MASTER_ADDR"] == "node02"
    assert slurm_env({**task0, "SLURMD_NODENAME": "node01"})["MASTER_ADDR"] == "node01"
    assert slurm_env({**TASK, "SLURMD_NODENAME": "node01"})["MASTER_ADDR"] == "node01"


# --- 8. MASTER_PORT ------------------------------------------------------------------------------

NOT_PORTS = ["70000", "0", "-1", "http", "29500.0", "", " 29500", "\u0663"]


@pytest.mark.parametrize("port", NOT_PORTS)
def test_a_master_port_that_is_not_a_port_is_refused_by_name(port):
    message = re.escape(f"MASTER_PORT={port!r} is not a port")
    with pytest.raises(ValueError, match=message):
        export_launcher_env({**TASK, "MASTER_PORT": port})
    assert export_launcher_env({**TASK, "MASTER_PORT": "65535"}) == "slurm"


@pytest.mark.parametrize("port", NOT_PORTS)
def test_from_env_refuses_a_master_port_that_is_not_a_port(environ, port):
    environ({**EXPORTED, "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    message = re.escape(f"MASTER_PORT={port!r} in the environment is not a port")
    with pytest.raises(ValueError, match=message):
        ft.strategies.from_env("ddp", timeout=timedelta(seconds=3))  # before any rendezvous


# --- 9. LOCAL_RANK -------------------------------------------------------------------------------


def test_the_docs_say_what_export_launcher_env_does_with_a_local_rank():
    """Kept, deliberately (--gpus-per-task=1 sees one GPU: LOCAL_RANK=0); the docs said refused."""
    env = {**TASK, "LOCAL_RANK": "0", "SLURM_LOCALID": "1"}
    assert export_launcher_env(env) == "slurm" and env["LOCAL_RANK"] == "0"
    docs = (ROOT / "docs" / "strategies.md").read_text()
    section = docs[docs.index("### SLURM") : docs.index("### Kubernetes")]
    assert "LOCAL_RANK already set is kept" in " ".join(section.split())
    assert not re.search(r"RANK/WORLD_SIZE/LOCAL_RANK already set", section)


# --- 10. host lists ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [" n1", "n1 ,n2", "n1\t", "n[1-2]\n", "n[\u0663]", "n[\u00b2]", "n[1-\u0663]", "nö1"]
)
def test_host_lists_with_whitespace_or_other_digits_are_refused(bad):
    with pytest.raises(ValueError, match="not a SLURM host list"):
        expand_hostlist(bad)
    with pytest.raises(ValueError, match="not a SLURM host list"):
        slurm_env({**TASK, "SLURM_STEP_NODELIST": bad})


def test_master_addr_takes_the_first_host_without_expanding_the_list(monkeypatch):
    def expand(hostlist: str) -> list[str]:
        raise AssertionError(f"expanded {hostlist!r} for its first host")

    monkeypatch.setattr(cluster, "expand_hostlist", expand)
    for nodes, head in (("n[0-999999999999]", "n0"), ("gpu[007-9],x", "gpu007"),
                        ("a[2-3]-ib[05,7]", "a2-ib05"), ("login1,n[1-2]", "login1")):  # fmt: skip
        assert slurm_env({**TASK, "SLURM_STEP_NODELIST": nodes})["MASTER_ADDR"] == head


def test_the_first_host_is_the_first_of_the_expanded_list():
    for nodes in ("gpu[007-9],x", "a[2-3]-ib[05,7]", "login1,n[1-2]", "n[10,2-3]", "a[1][2]"):
        env = slurm_env({**TASK, "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": nodes})
        assert env["MASTER_ADDR"] == expand_hostlist(nodes)[0]


# --- 4. pods that torchrun should have started ---------------------------------------------------


@pytest.mark.parametrize(
    "pod, named",
    [
        ({"PET_NNODES": "4", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-0"}, "PET_NNODES=4"),
        ({"PET_NNODES": "2:4"}, "PET_NNODES=2:4"),
        ({"JOB_COMPLETION_INDEX": "3", "MASTER_ADDR": "job-0.svc"}, "JOB_COMPLETION_INDEX=3"),
        ({"JOB_COMPLETION_INDEX": "3", "PET_MASTER_ADDR": "job-0.svc"}, "JOB_COMPLETION_INDEX=3"),
        ({"JOB_COMPLETION_INDEX": "3", "PET_NNODES": "4"}, "PET_NNODES=4, JOB_COMPLETION_INDEX=3"),
    ],
)
def test_from_env_refuses_a_pod_that_torchrun_should_have_started(environ, pod, named):
    environ(pod)
    assert export_launcher_env() == "none"  # no SLURM: from_env is where it is refused
    with pytest.raises(ValueError, match=re.escape(named) + ".*but WORLD_SIZE is unset") as err:
        ft.strategies.from_env("ddp")
    assert "torchrun --nproc-per-node" in str(err.value)


def test_a_one_node_pod_or_world_size_1_is_one_process(environ):
    environ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1"})
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)
    environ({"JOB_COMPLETION_INDEX": "3", "WORLD_SIZE": "1"})  # independent pods, said so
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)


def test_an_indexed_jobs_pod_without_a_rendezvous_address_is_a_sweeps_one_process(environ):
    """An Indexed Job is a sweep of independent runs as often as one training: its index
    alone, with no MASTER_ADDR / PET_MASTER_ADDR / PET_NNODES, is one process."""
    environ({"JOB_COMPLETION_INDEX": "3"})
    assert export_launcher_env() == "none"
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)


# --- 5. processes an MPI launcher started ------------------------------------------------------


@pytest.mark.parametrize("size", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"])
def test_from_env_refuses_a_process_of_several_that_mpirun_started(environ, size):
    """`mpirun -np 2 python train.py` sets MPI's variables only: from_env returned SingleDevice
    in each process, and both trained alone on every row into one run folder."""
    environ({size: "2"})
    with pytest.raises(ValueError, match=f"one of {size}=2 processes an MPI launcher"):
        ft.strategies.from_env("ddp")
    environ({size: "1"})  # one MPI process is one process
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)
    environ({size: "2", "WORLD_SIZE": "1"})  # independent runs, said so
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)
