"""SLURM and Kubernetes by their environment (issue 28): srun's variables become torch's, a
requeued job resumes in the same run folder, the recipes in examples/cluster/ run as written."""

from __future__ import annotations

import os
import re
import shlex
import socket
import stat
import sys
from pathlib import Path

import pytest
import torch
import yaml

import cluster_victim
import ftrain as ft
import launch
from cluster_launch import ROOT, base_env, data_position, free_port, load_example, run_all
from ftrain.extras.cluster import expand_hostlist, export_launcher_env, slurm_env
from helpers import opt_state_tensors

build = load_example("train").build

STEPS = 40
WORKERS = Path(__file__).parent / "workers"
SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_LOCALID": "1", "SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_RESTART_COUNT": "2"}  # fmt: skip


def test_host_lists_expand_as_scontrol_show_hostnames():
    assert expand_hostlist("gpu[07-08,11],login1") == ["gpu07", "gpu08", "gpu11", "login1"]
    assert expand_hostlist("a[1-2]-ib[5,7]") == ["a1-ib5", "a1-ib7", "a2-ib5", "a2-ib7"]
    assert expand_hostlist("node[098-101]") == ["node098", "node099", "node100", "node101"]
    for bad in ("", "a[1-", "a[3-1]", "a]", "a,,b", "a[x]", "a[3-]", "a[]", "[1-2]"):
        with pytest.raises(ValueError, match="not a SLURM host list"):
            expand_hostlist(bad)


def test_srun_variables_become_torchs_with_a_port_per_attempt():
    env = slurm_env(SRUN)
    port = env.pop("MASTER_PORT")
    assert env == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07"}
    assert 20000 <= int(port) < 32768  # below Linux's ephemeral ports
    assert slurm_env({**SRUN, "SLURM_PROCID": "3", "SLURM_LOCALID": "3"})["MASTER_PORT"] == port
    requeued = slurm_env({**SRUN, "SLURM_RESTART_COUNT": "3"})
    assert requeued["MASTER_PORT"] != port  # never the killed attempt's sockets
    # job 778's second attempt is not job 777's third (job + attempt gave both 20779)
    neighbour = slurm_env({**SRUN, "SLURM_JOB_ID": "778", "SLURM_RESTART_COUNT": "1"})
    assert neighbour["MASTER_PORT"] != port
    step = slurm_env({**SRUN, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "cpu[3-4]"})
    assert (step["WORLD_SIZE"], step["MASTER_ADDR"]) == ("2", "cpu3")  # the step's, not the job's
    own = slurm_env({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (own["MASTER_ADDR"], own["MASTER_PORT"]) == ("10.0.0.1", "1234")


def test_missing_srun_variables_are_named():
    broken = {k: v for k, v in SRUN.items() if k not in ("SLURM_PROCID", "SLURM_JOB_NODELIST")}
    match = r"SLURM_PROCID, SLURM_JOB_NODELIST, SLURM_RESTART_COUNT unset or not a number"
    with pytest.raises(ValueError, match=match):
        slurm_env({**broken, "SLURM_RESTART_COUNT": "x", "SLURM_PROCID": ""})


def test_srun_variables_that_cannot_describe_this_task_are_named():
    with pytest.raises(ValueError, match="SLURM_PROCID=4 is outside SLURM_STEP_NUM_TASKS=4"):
        slurm_env({**SRUN, "SLURM_PROCID": "4"})
    with pytest.raises(ValueError, match="SLURM_PROCID=1 is outside SLURM_STEP_NUM_TASKS=1"):
        slurm_env({**SRUN, "SLURM_STEP_NUM_TASKS": "1"})
    with pytest.raises(ValueError, match="SLURM_STEP_NUM_TASKS unset or not a number"):
        slurm_env({**SRUN, "SLURM_STEP_NUM_TASKS": "2(x2)"})  # the variable read is named


def test_export_launcher_env_refuses_variables_that_contradict_slurms():
    for preset in ({"RANK": "0", "WORLD_SIZE": "8"}, {"WORLD_SIZE": "2"}):
        with pytest.raises(ValueError, match="differing from what this srun task's SLURM"):
            export_launcher_env({**SRUN, **preset})
    env = {**SRUN, "MASTER_ADDR": "10.0.0.1", "RANK": "1"}  # agreeing ones are kept
    assert export_launcher_env(env) == "slurm" and env["MASTER_ADDR"] == "10.0.0.1"
    env = {**SRUN, "LOCAL_RANK": "0"}  # --gpus-per-task=1: one GPU visible, kept
    assert export_launcher_env(env) == "slurm" and env["LOCAL_RANK"] == "0"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4"}, "call ftrain.extras.cluster.export"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 in the environment: a world has at least 1"),
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not an integer"),
        ({"WORLD_SIZE": "1", "RANK": "3"}, "RANK=3 in the environment is outside WORLD_SIZE=1"),
    ],
)
def test_from_env_refuses_an_environment_that_would_train_each_process_alone(
    monkeypatch, env, message
):
    """Under `srun -n4 python train.py` without export_launcher_env, every task was a
    SingleDevice run of its own, all writing one run folder."""
    for k in ("WORLD_SIZE", "RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=re.escape(message)):
        ft.strategies.from_env("ddp")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # a one-task step is one process
    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    assert isinstance(ft.strategies.from_env("ddp"), ft.strategies.SingleDevice)


def test_from_env_takes_a_group_made_by_hand_in_a_srun_step(monkeypatch):
    """dist.init_process_group(rank=SLURM_PROCID, world_size=...) by hand, no WORLD_SIZE in
    the environment: the group is what counts, not the refusal for lone tasks."""
    import torch.distributed as dist

    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        with ft.strategies.from_env("ddp") as strategy:
            assert isinstance(strategy, ft.strategies.DDP) and strategy.world_size == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_export_launcher_env_leaves_a_launchers_variables_alone():
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", **SRUN,
                "TORCHELASTIC_RUN_ID": "777"}  # fmt: skip
    env = dict(torchrun)
    assert export_launcher_env(env) == "launcher" and env == torchrun  # srun ... torchrun
    env = dict(SRUN)
    assert export_launcher_env(env) == "slurm" and env["RANK"] == "1"
    env = {"PATH": "/bin"}
    assert export_launcher_env(env) == "none" and env == {"PATH": "/bin"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> ft.TrainState:
    """examples/cluster/train.py's main on 2 ranks without faults. The ranks fork from the
    suite's fork server (~1 s instead of ~5 s for two fresh interpreters): this is the run to
    compare with, not a launch under test (the tests below start the recipes as written)."""
    root = tmp_path_factory.mktemp("reference")
    args = ("--steps", str(STEPS), "--save-every", str(STEPS))
    launch.run_ranks(cluster_victim.without_faults, str(root), *args, timeout=90)
    return ft.load_checkpoint(ft.latest_checkpoint(root), build())


def assert_bit_equal(root: Path, reference: ft.TrainState) -> None:
    path = ft.latest_checkpoint(root)
    assert path is not None and path.name == f"step-{STEPS}"
    ended = ft.load_checkpoint(path, build())
    assert data_position(ended) == data_position(reference)  # the data order continues alike
    for n, p in reference.params.items():
        assert torch.equal(ended.params[n], p), n
    theirs = opt_state_tensors(reference.opt_state)
    for n, t in opt_state_tensors(ended.opt_state).items():
        assert torch.equal(t, theirs[n]), n


def fake_slurm(tmp: Path) -> Path:
    """A bin folder with `srun` (tests/workers/cluster_srun.py) and `scontrol` (logs its args)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": f'exec {shlex.quote(sys.executable)} {WORKERS / "cluster_srun.py"} "$@"\n',
        "scontrol": f'echo "$@" >> {tmp / "scontrol.log"}\n',
        "python": f'exec {shlex.quote(sys.executable)} "$@"\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


def slurm_job(tmp: Path, attempt: int, job_id: int, **extra: str) -> dict[str, str]:
    """What sbatch sets for the batch script of one attempt of a 2-task job on this machine."""
    path = f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}"
    return base_env(SLURM_JOB_ID=str(job_id), SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost",
                    SLURM_RESTART_COUNT=str(attempt), PATH=path, **extra)  # fmt: skip


def _ends(out: str, start: int | str) -> int:
    """How many ranks report training from `start` to STEPS (the srun stand-in shares one pipe
    between its tasks, so two ranks' lines may interleave: count the phrase, not lines)."""
    return len(re.findall(rf"\(slurm\): steps {start}\.\.{STEPS}(?!\d)", out))


def a_job_id() -> int:
    """A job id whose attempts 0 and 1 derive ports (slurm_env, step 0) free on 127.0.0.1."""
    for job in range(os.getpid(), os.getpid() + 1000):
        attempts = [{**SRUN, "SLURM_JOB_ID": str(job), "SLURM_RESTART_COUNT": a} for a in "01"]
        if all(_bindable(int(slurm_env(env)["MASTER_PORT"])) for env in attempts):
            return job
    raise RuntimeError("no job id with two free derived ports in 1000 tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_the_sbatch_recipe_saves_on_sigusr1_requeues_and_resumes_bit_equal(tmp_path, reference):
    """examples/cluster/slurm.sbatch as written, with srun and scontrol stand-ins: SIGUSR1 (the
    time limit's warning) reaches both tasks, they save the same step and exit 75, the script
    requeues the job; the requeued attempt (same job id and run folder) ends bit-equal."""
    sbatch = ROOT / "examples" / "cluster" / "slurm.sbatch"
    header = re.findall(r"^#SBATCH (\S+)", sbatch.read_text(), re.M)
    assert "--requeue" in header and any(re.fullmatch(r"--signal=USR1@\d+", h) for h in header)
    fake_slurm(tmp_path)
    run, job = tmp_path / "run", a_job_id()
    first = slurm_job(
        tmp_path, 0, job, RUN_DIR=str(run), FAKE_SLURM_SIGNAL_WHEN=str(run / "step-4")
    )
    cmd = ["bash", str(sbatch), "--steps", str(STEPS), "--save-every", "4"]
    ((code, out, err),) = run_all([cmd], [first], timeout=90)
    assert code == 0, err[-3000:]
    ends = set(re.findall(r"rank [01]/2 \(slurm\): steps 0\.\.(\d+) preempted", out))
    assert len(ends) == 1, out + err[-2000:]  # both ranks, one step
    (saved,) = ends
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", str(job)]
    assert ft.latest_checkpoint(run) == run / f"step-{saved}"
    ((code, out, err),) = run_all([cmd], [slurm_job(tmp_path, 1, job, RUN_DIR=str(run))], 90)
    assert code == 0, err[-3000:]
    assert _ends(out, saved) == 2, out
    assert_bit_equal(run, reference)


@pytest.mark.slow
def test_a_requeued_srun_job_resumes_the_newest_committed_checkpoint_after_a_sigkill(
    tmp_path, reference
):
    """Rank 1 is SIGKILLed during the save of step 9 (a node lost mid-write); srun kills the
    other task; the requeued attempt resumes from the newest *committed* checkpoint (never the
    half-written one), finishes, and ends bit-equal to the run without faults."""
    fake_slurm(tmp_path)
    run, job = tmp_path / "run", a_job_id()
    cmd = ["srun", "--kill-on-bad-exit=1", sys.executable, str(WORKERS / "cluster_victim.py"),
           str(run), "--steps", str(STEPS), "--save-every", "1", "--keep-last", "3"]  # fmt: skip
    env = slurm_job(tmp_path, 0, job, VICTIM_STEP="9", VICTIM_RANK="1")
    ((code, _, err),) = run_all([cmd], [env], timeout=90)
    assert code in (128 + 9, 137), err[-3000:]  # the victim's SIGKILL
    newest = ft.latest_checkpoint(run)
    assert newest is not None and int(newest.name[5:]) in (8, 9)
    committed_before = sorted(p.name for p in run.glob("step-*"))
    ((code, out, err),) = run_all([cmd], [slurm_job(tmp_path, 1, job)], timeout=90)
    assert code == 0, err[-3000:]
    assert _ends(out, newest.name[5:]) == 2, out
    assert committed_before and not list(run.glob(".tmp-*"))  # the dead save's leftovers went
    assert_bit_equal(run, reference)


@pytest.mark.slow
def test_the_pytorchjob_manifest_runs_as_its_pods_would(tmp_path, reference):
    """examples/cluster/pytorchjob.yaml: each replica's command with the variables the training
    operator sets in its pod (MASTER_*, WORLD_SIZE, RANK, and PET_* for torchrun), the run
    folder mounted at /mnt/run. The Worker pod is evicted (SIGTERM to its whole pod) after the
    first checkpoint: both ranks save the same step and fail, restartPolicy OnFailure starts both
    pods again on the same volume, and the run ends bit-equal to the same 2 ranks by hand."""
    job = yaml.safe_load((ROOT / "examples" / "cluster" / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Master", "Worker"]
    run, port, commands, envs = tmp_path / "run", str(free_port()), [], []
    for rank, spec in enumerate(replicas.values()):
        pod = spec["template"]["spec"]
        assert spec["restartPolicy"] == "OnFailure" and pod["terminationGracePeriodSeconds"] > 0
        (container,) = pod["containers"]
        assert {"name": "run", "mountPath": "/mnt/run"} in container["volumeMounts"]
        (volume,) = pod["volumes"]
        assert "persistentVolumeClaim" in volume  # the run folder outlives the pods
        command = [c.replace("/mnt/run", str(run)) for c in container["command"]]
        assert command[0] == "torchrun"
        commands.append([sys.executable, "-m", "torch.distributed.run", *command[1:],
                         "--steps", str(STEPS), "--save-every", "8"])  # fmt: skip
        operator = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
                    "RANK": str(rank), "PET_NNODES": "2", "PET_NODE_RANK": str(rank),
                    "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port}  # fmt: skip
        envs.append(base_env(**{e["name"]: e["value"] for e in container["env"]}, **operator))
    outs = run_all(commands, envs, timeout=120, evict=(run / "step-8", 1))
    assert all(code != 0 for code, _, _ in outs), outs  # OnFailure restarts both pods
    ends = set(re.findall(r"rank [01]/2 \(launcher\): steps 0\.\.(\d+) preempted", outs[0][1]
                          + outs[1][1]))  # fmt: skip
    assert len(ends) == 1, [err[-2000:] for _, _, err in outs]  # both ranks, one step
    (saved,) = ends
    assert ft.latest_checkpoint(run) == run / f"step-{saved}"
    outs = run_all(commands, envs, timeout=120)
    for code, _, err in outs:
        assert code == 0, err[-3000:]
    assert "".join(out for _, out, _ in outs).count(f"(launcher): steps {saved}..{STEPS}\n") == 2
    assert_bit_equal(run, reference)
