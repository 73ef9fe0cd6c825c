"""Ray Train (issue 28): the README loop in TorchTrainer, checkpoints reported to Ray and
restored from it, a SIGKILLed worker and a SIGTERMed one, a restart with fewer workers.

Every Ray case runs in one `ray.init` session (tests/workers/ray_driver.py, in a subprocess
bounded in time, so that Ray's signal handlers never reach this process); the tests below read
what it left. No Ray process may outlive it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import ftrain as ft
from cluster_launch import base_env, data_position, env_ranks, load_example
from ftrain.extras import ray as ray_ft
from helpers import opt_state_tensors

train = load_example("train")
build, loop = train.build, train.loop

DRIVER = Path(__file__).parent / "workers" / "ray_driver.py"
TOTAL, PREEMPT, KILL, HALF = 10, 2, 5, 7  # as in the driver

pytestmark = pytest.mark.usefixtures("one_thread")


def processes_under(marker: str) -> list[int]:
    """Pids whose command line names `marker` (Ray's temp dir is in every Ray process's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ray")
    temp_dir = tempfile.mkdtemp(prefix="ftr", dir="/tmp")  # short: Ray's Unix socket paths
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), str(out), temp_dir], env=base_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        time.sleep(0.5)  # ray.shutdown() returned; let the last children be reaped
        stray = processes_under(temp_dir)
        for pid in stray:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)  # Ray's session: logs, sockets
    assert proc.returncode == 0, log[-6000:]
    assert stray == [], f"Ray processes outlived ray.shutdown(): {stray}"
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> ft.TrainState:
    """The same run on 2 ranks without Ray and without faults, to step HALF."""
    root = tmp_path_factory.mktemp("reference")
    env_ranks(root, "--strategy", "fsdp", "--steps", str(HALF), "--save-every", str(HALF))
    return ft.load_checkpoint(ft.latest_checkpoint(root), build())


def events(ray_run: Path, fit: str) -> list[str]:
    lines = (ray_run / "events.log").read_text().splitlines()
    return [line.split(" ", 1)[1] for line in lines if line.startswith(fit + " ")]


def assert_bit_equal(a: ft.TrainState, b: ft.TrainState) -> None:
    assert data_position(a) == data_position(b)  # the data order continues alike
    for n, p in b.params.items():
        assert torch.equal(a.params[n], p), n
    theirs = opt_state_tensors(b.opt_state)
    for n, t in opt_state_tensors(a.opt_state).items():
        assert torch.equal(t, theirs[n]), n


@pytest.mark.slow
def test_a_sigkilled_worker_restarts_and_the_run_ends_bit_equal(ray_run, reference):
    """Rank 0 SIGKILLs itself during the save of step KILL; Ray restarts the group from the
    newest checkpoint it registered (a half-written or half-uploaded one never is), and the
    sharded (FSDP) run ends bit-equal to the same 2 ranks without Ray or faults."""
    results = json.loads((ray_run / "results.json").read_text())
    assert Path(results["fit1"]["checkpoint"]).name == f"step-{HALF}"
    lines = events(ray_run, "fit1")
    assert f"rank 0: SIGKILL in the save of step {KILL}" in lines
    starts = [int(m) for line in lines for m in re.findall(r"rank 0/2: start at step (\d+)", line)]
    assert len(starts) == 3 and starts[2] <= KILL, lines  # three attempts; the last resumed
    ended = ft.load_checkpoint(results["fit1"]["checkpoint"], build())
    assert_bit_equal(ended, reference)


@pytest.mark.slow
def test_sigterm_to_one_worker_makes_every_rank_save_the_same_step_and_ray_resumes_there(
    ray_run,
):
    lines = events(ray_run, "fit1")
    assert f"rank 1: SIGTERM after step {PREEMPT}" in lines
    ends = sorted(line for line in lines if re.fullmatch(r"rank \d/2: steps 0\.\.\d+", line))
    saved = PREEMPT + 1  # the flag is voted in the next step's all-reduce
    assert ends == [f"rank 0/2: steps 0..{saved}", f"rank 1/2: steps 0..{saved}"], lines
    second = lines.index(ends[0]) + 1  # the restarted group starts at the preemption's step
    assert f"rank 0/2: start at step {saved}" in lines[second : second + 4], lines


@pytest.mark.slow
def test_a_new_fit_with_one_worker_continues_the_two_workers_sharded_checkpoint(ray_run):
    """fit 2 has 1 DDP worker where fit 1 had 2 FSDP ones: it restores Ray's sharded step-HALF
    and continues exactly as one process continues from that checkpoint."""
    results = json.loads((ray_run / "results.json").read_text())
    assert events(ray_run, "fit2") == [f"rank 0/1: start at step {HALF}",
                                       f"rank 0/1: steps {HALF}..{TOTAL}"]  # fmt: skip
    storage = ray_run / "storage" / "run"
    one = ft.load_checkpoint(storage / f"step-{HALF}", build())
    one = loop(one, TOTAL, save=lambda s: None, save_every=TOTAL)
    assert_bit_equal(ft.load_checkpoint(results["fit2"]["checkpoint"], build()), one)


@pytest.mark.slow
def test_ray_keeps_what_checkpoint_config_says_and_its_storage_is_a_run_folder(ray_run):
    """fit 1 kept the 2 newest (keep_last=2, Ray rotating); fit 2 kept all. ftrain rotated
    nothing, and Ray's storage folder is an ftrain run folder."""
    storage = ray_run / "storage" / "run"
    steps = sorted(int(p.name[5:]) for p in storage.glob("step-*"))
    assert steps == list(range(HALF - 1, TOTAL + 1)), steps
    assert ft.latest_checkpoint(storage) == storage / f"step-{TOTAL}"
    # A worker finds its run's CheckpointConfig (no public Ray API says it), where
    # save_and_report reads the metric that checkpoints must hold.
    assert "rank 0: the run keeps 2" in events(ray_run, "fit1")
    staged = [p for p in (ray_run / "staging").rglob("step-*") if p.is_dir()]
    assert all(int(p.name[5:]) <= KILL for p in staged), staged  # the uploads removed theirs
    # each fit staged into a folder of its own, named by Ray's run id
    runs = [p.name for p in (ray_run / "staging").iterdir()]
    assert len(runs) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", r) for r in runs), runs


# --- without a Ray cluster ---------------------------------------------------------------------


def test_checkpoint_config_says_ftrain_retention_in_ray_terms():
    c = ray_ft.checkpoint_config(keep_last=3)
    assert (c.num_to_keep, c.checkpoint_score_attribute) == (3, None)
    assert ray_ft.checkpoint_config(keep_last=0).num_to_keep == 1  # the newest stays, as in ftrain
    assert ray_ft.checkpoint_config().num_to_keep is None
    c = ray_ft.checkpoint_config(keep_last=1, keep_best=2, best_metric="acc", mode="max")
    assert (c.num_to_keep, c.checkpoint_score_attribute, c.checkpoint_score_order) == (
        2,
        "acc",
        "max",
    )
    c = ray_ft.checkpoint_config(best_metric="loss")  # keep_last=None keeps everything
    assert (c.num_to_keep, c.checkpoint_score_attribute) == (None, "loss")


def test_checkpoint_config_refuses_what_ray_cannot_keep_and_bad_values():
    with pytest.raises(ValueError, match=r"keep_last=3 with best_metric='loss'.*cannot keep both"):
        ray_ft.checkpoint_config(keep_last=3, best_metric="loss")
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        ray_ft.checkpoint_config(keep_best=2)
    with pytest.raises(ValueError, match="keep_last must be an int >= 0"):
        ray_ft.checkpoint_config(keep_last=-1)
    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        ray_ft.checkpoint_config(best_metric="loss", mode="best")  # type: ignore[arg-type]
    # A score ranked by the default "min": Ray kept the worst accuracy as the best.
    with pytest.raises(ValueError, match=r"checkpoint_config\(best_metric='eval_accuracy'\) needs"):
        ray_ft.checkpoint_config(best_metric="eval_accuracy")


def test_a_ray_without_train_v2_is_a_clear_error(monkeypatch):
    import ray.train

    monkeypatch.delattr(ray.train, "CheckpointUploadMode")
    with pytest.raises(
        ImportError, match=r"needs Ray Train V2 .*ray \d+\.\d+.*CheckpointUploadMode"
    ):
        ray_ft.require_ray()
    with pytest.raises(ImportError, match="needs Ray Train V2"):
        ray_ft.checkpoint_config(keep_last=1)


def test_the_ray_helpers_outside_a_ray_worker_say_where_they_run():
    state = build()
    with pytest.raises(ValueError, match="upload must be 'async' or 'sync'"):
        ray_ft.save_and_report(state, "unused", upload="later")  # type: ignore[arg-type]
    for call in (lambda: ray_ft.save_and_report(state, "unused"), lambda: ray_ft.restore(state),
                 ray_ft.wait_for_reports):  # fmt: skip
        with pytest.raises(RuntimeError, match="runs inside TorchTrainer's train_loop_per_worker"):
            call()


def _in_a_thread(fn):
    """Run `fn` in a thread while this (main) thread runs Python code, as a Ray worker's does."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)  # bytecode: the pending call runs here
    thread.join(timeout=1)
    assert not thread.is_alive()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_on_preemption_from_a_training_thread_installs_the_handler_in_the_main_thread():
    """Ray Train runs train_loop_per_worker in a thread; signal handlers live in the main one."""
    before = signal.getsignal(signal.SIGUSR1)
    preempt = _in_a_thread(lambda: ray_ft.on_preemption(signals=(signal.SIGUSR1,)))
    try:
        assert signal.getsignal(signal.SIGUSR1) is not before
        assert ft.strategies.active_preemption() is preempt.inner and not preempt.received
        os.kill(os.getpid(), signal.SIGUSR1)
        state = build()
        batch = [{"x": torch.ones(2, 8), "y": torch.tensor([0, 1])}]
        grads, stats = ft.accumulate_grads(state, batch, train.loss_fn)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
        assert preempt.received and preempt.requested and ft.should_save(state, every=100)
    finally:
        _in_a_thread(lambda: preempt.close())
    assert signal.getsignal(signal.SIGUSR1) is before
    assert ft.strategies.active_preemption() is None


def test_run_in_main_thread_returns_the_result_and_raises_the_error():
    assert _in_a_thread(lambda: ray_ft.run_in_main_thread(threading.current_thread)) is (
        threading.main_thread()
    )

    def boom():
        raise KeyError("in the main thread")

    with pytest.raises(KeyError, match="in the main thread"):
        _in_a_thread(lambda: ray_ft.run_in_main_thread(boom))
    ran = []
    with pytest.raises(TimeoutError, match=r"ran no Python code for 0\.2 s"):
        thread_error = {}

        def waits():
            time.sleep(0.3)  # the main thread is in its sleep by now
            try:
                ray_ft.run_in_main_thread(lambda: ran.append(1), timeout_s=0.2)
            except TimeoutError as e:
                thread_error["e"] = e

        t = threading.Thread(target=waits)
        t.start()
        time.sleep(1.5)  # in C: the main thread runs no Python code meanwhile
        t.join()
        raise thread_error["e"]
    for _ in range(100_000):  # Python code in the main thread: the queued call comes due
        pass
    assert ran == []  # the caller was told it failed: the late call did nothing


@pytest.fixture
def fake_worker(monkeypatch):
    """ray.train as a worker sees it, with `report` recording its calls (no cluster)."""
    import ray.train

    from ftrain.process_state import STATE

    reports = []
    monkeypatch.setattr(STATE, "ray_reported", None)  # this process reported nothing yet
    worker = {"get_world_rank": int, "get_experiment_name": staticmethod(lambda: "run")}
    monkeypatch.setattr(ray.train, "get_context", lambda: type("C", (), worker))
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kw: reports.append((metrics, kw)))
    return reports


def test_save_and_report_reports_a_committed_checkpoint_for_async_upload(tmp_path, fake_worker):
    import ray.train

    state = build()
    path = ray_ft.save_and_report(state, tmp_path, metrics={"loss": torch.tensor(1.5)})
    # The run's own folder (the run's name and its rank 0 process where Ray's run id is not
    # found, as here)
    run = path.parent.parent
    assert run.parent == tmp_path and run.name.startswith("run-")
    assert path == run / "report-0" / "step-0"
    assert ft.latest_checkpoint(path.parent) == path
    ((metrics, kw),) = fake_worker
    assert metrics == {"loss": 1.5, "step": 0}  # numbers: Ray refuses tensors
    assert kw["checkpoint"].path == str(path) and kw["checkpoint_dir_name"] == "step-0"
    assert kw["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.ASYNC
    assert kw["delete_local_checkpoint_after_upload"] is True  # Ray owns what it uploaded
    assert ft.checkpoint.read_meta(path)["metrics"] == {"loss": 1.5}
    shutil.rmtree(path)  # what Ray does once the upload is done
    ray_ft.save_and_report(state.replace(step=1), tmp_path, upload="sync")
    assert fake_worker[1][1]["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.SYNC
    assert sorted(p.name for p in run.iterdir()) == ["report-1"]  # emptied: gone


def test_a_sharded_checkpoint_some_rank_cannot_see_is_refused_before_ray_hears_of_it(
    tmp_path, fake_worker, monkeypatch
):
    class Sharded(ft.strategies.SingleDevice):
        checkpoint_sharded = True  # every rank writes shards into one folder

    state = build(Sharded("cpu"))
    monkeypatch.setattr(ft, "latest_checkpoint", lambda root: None)  # a node-local root
    with pytest.raises(RuntimeError, match=r"root=.* must be shared by every worker"):
        ray_ft.save_and_report(state, tmp_path)
    assert fake_worker == []


def test_wait_for_reports_raises_when_ray_times_out_before_registering(tmp_path, fake_worker):
    """Ray's wait returns the checkpoints registered so far when its timeout passes; a
    preempted worker leaving then would restart from an older checkpoint, so this raises."""
    import ray.train

    def registered(*names):
        def get_all(consistency_mode, timeout_s):
            assert consistency_mode == ray.train.CheckpointConsistencyMode.COMMITTED
            made = [ray.train.Checkpoint(f"/storage/run/{n}") for n in names]
            return [type("Reported", (), {"checkpoint": c}) for c in made]

        return get_all

    state = build()
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(ray.train, "get_all_reported_checkpoints", registered())
        ray_ft.wait_for_reports(timeout_s=5)  # nothing reported from here: nothing to wait for
        ray_ft.save_and_report(state.replace(step=3), tmp_path)
        with pytest.raises(TimeoutError, match=r"not registered checkpoint 'step-3'.*timeout_s=5"):
            ray_ft.wait_for_reports(timeout_s=5)
        mp.setattr(ray.train, "get_all_reported_checkpoints", registered("step-1"))
        with pytest.raises(TimeoutError, match="'step-3'"):
            ray_ft.wait_for_reports(timeout_s=5)
        mp.setattr(ray.train, "get_all_reported_checkpoints", registered("step-1", "step-3"))
        ray_ft.wait_for_reports(timeout_s=5)
        for bad in (0, -1.0, float("nan"), True, "5"):
            with pytest.raises(ValueError, match="timeout_s must be a number > 0 or None"):
                ray_ft.wait_for_reports(timeout_s=bad)
    finally:
        mp.undo()


def test_restore_passes_allow_other_base_to_the_load(tmp_path, fake_worker, monkeypatch):
    """`restore(..., allow_other_base=True)` reaches `load_checkpoint` (a run moved onto
    another base model on purpose); without it the base check refuses, naming the way out."""
    import contextlib

    import ray.train

    def frozen_first(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
        m[0].requires_grad_(False)
        return ft.TrainState.create(m, ft.optim.sgd())

    path = ft.save_checkpoint(frozen_first(0), tmp_path)
    checkpoint = type("Checkpoint", (), {"as_directory": lambda self: contextlib.nullcontext(path)})
    monkeypatch.setattr(ray.train, "get_checkpoint", checkpoint)
    with pytest.raises(ft.checkpoint.CheckpointMismatchError, match="allow_other_base=True"):
        ray_ft.restore(frozen_first(1))
    assert ray_ft.restore(frozen_first(1), allow_other_base=True).step == 0
