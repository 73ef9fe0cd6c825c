"""The save side: the strategy seam, rotation after a rollback, concurrent writers, lost saves."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import ftrain as ft
from ftrain import process_state
from ftrain.checkpoint import _save
from helpers import hold_background_writes
from launch import exit_codes, run_ranks

SEAM = (
    "to_host",
    "save_shards",
    "save_shards_async",
    "load_shards",
    "full_state_dict",
    "copy_whole",
)
SRC = Path(ft.__file__).parent


def _state(step=0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    return ft.TrainState.create(model, ft.optim.adamw()).replace(step=step)


def _run(script: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )


# --- the strategy seam ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls", [ft.strategies.SingleDevice, ft.strategies.DDP, ft.strategies.FSDP, ft.strategies.TP]
)
def test_every_strategy_implements_the_checkpoint_seam(cls):
    for name in SEAM:
        assert callable(getattr(cls, name)), (cls, name)
        assert name in ft.strategies.Strategy.__dict__  # part of the documented protocol
    assert cls.checkpoint_sharded is (cls in (ft.strategies.FSDP, ft.strategies.TP))
    assert isinstance(ft.strategies.SingleDevice("cpu"), ft.strategies.Strategy)


def test_single_device_seam_round_trips_shard_files(tmp_path):
    s = ft.strategies.SingleDevice("cpu")
    model = torch.nn.Linear(3, 2)
    tensors = {n: t.detach() for n, t in s.full_state_dict(model).items()}
    s.save_shards(tensors, tmp_path / "model")
    assert [f.suffix for f in (tmp_path / "model").iterdir()] == [".safetensors"]  # no pickle
    back = {n: torch.zeros_like(t) for n, t in tensors.items()}
    s.load_shards(tmp_path / "model", back)
    for n, t in tensors.items():
        assert torch.equal(back[n], t)
    dst = torch.zeros(2, 3)
    s.copy_whole(dst, tensors["weight"])
    assert torch.equal(dst, tensors["weight"])


def test_a_background_shard_write_stages_copies_first_then_writes_then_commits(tmp_path):
    s = ft.strategies.SingleDevice("cpu")
    weight, seen = torch.arange(6.0).reshape(2, 3), []
    parts = {tmp_path / "model": {"weight": weight}, tmp_path / "optimizer": {}}
    write = s.save_shards_async(parts, commit=lambda: seen.append(sorted(os.listdir(tmp_path))))
    weight.add_(100)  # the next step, in place: the staged copy keeps what was saved
    assert seen == []  # nothing is written before the write runs
    write()
    assert seen == [["model", "optimizer"]]  # committed once the shards are on disk
    back = {"weight": torch.zeros(2, 3)}
    s.load_shards(tmp_path / "model", back)
    assert torch.equal(back["weight"], torch.arange(6.0).reshape(2, 3))

    def disk_full():
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):  # the commit's error reaches the writer
        s.save_shards_async({tmp_path / "m2": {"weight": weight}}, commit=disk_full)()


def test_single_device_to_host_stages_copies_the_next_step_cannot_change():
    s = ft.strategies.SingleDevice("cpu")
    weight, strided = torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(3, 2).t()
    (kept, view), wait = s.to_host([weight, strided], copy=False)
    assert kept is weight and view.is_contiguous() and torch.equal(view, strided)
    (copied, _), wait = s.to_host([weight, strided], copy=True)
    weight.add_(100)  # the next step, in place
    wait()  # nothing in flight on a CPU: returns at once
    assert torch.equal(copied, torch.arange(6.0).reshape(2, 3))


def test_checkpoint_code_never_asks_what_kind_of_tensor_it_holds():
    """Placement questions go through the strategy (issue 11): no DTensor or device test in
    checkpoint/ (pinned staging of CUDA tensors is `Strategy.to_host`'s)."""
    pattern = re.compile(
        r"device_mesh|full_tensor|DTensor|is_sharded|placements|to_local|is_cuda|torch\.cuda"
    )
    for f in sorted((SRC / "checkpoint").glob("*.py")):
        hits = [line for line in f.read_text().splitlines() if pattern.search(line)]
        assert not hits, (f.name, hits)


def test_import_does_not_load_distributed_checkpoint():
    run = _run(
        "import sys, ftrain\n"
        "heavy = [m for m in sys.modules if m.startswith('torch.distributed.checkpoint')]\n"
        "print(heavy)\n"
        "raise SystemExit(1 if heavy else 0)\n"
    )
    assert run.returncode == 0, run.stdout + run.stderr


# --- retention after a rollback --------------------------------------------------------------


def test_rotation_after_a_rollback_keeps_the_checkpoint_just_written(tmp_path):
    for step in (10, 20, 30):
        ft.save_checkpoint(_state(step), tmp_path, keep_last=2)
    path = ft.save_checkpoint(_state(15), tmp_path, keep_last=2)  # resumed from step 10
    assert path.name == "step-15" and ft.load_checkpoint(path, _state()).step == 15
    # Newest by commit order: 30 (the abandoned branch) and 15; resume goes on from 15.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-15", "step-30"]
    assert ft.latest_checkpoint(tmp_path) == path
    ft.save_checkpoint(_state(16), tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-16"]


def test_rotation_keeps_the_best_even_on_an_abandoned_branch(tmp_path):
    losses = {10: 0.5, 20: 0.1, 30: 0.9, 15: 0.7}
    for step, loss in losses.items():
        ft.save_checkpoint(
            _state(step), tmp_path, metrics={"loss": loss}, keep_last=0, best_metric="loss"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-15", "step-20"]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_without_best_metric_keeps_the_best_that_earlier_saves_ranked(tmp_path, blocking):
    """A preemption save or an ad-hoc one between evaluations (no best_metric) deleted the best
    (issue 27): rotation ranks by what the newest ranked save recorded in its state.json."""

    def save(step, **kw):
        ft.save_checkpoint(_state(step), tmp_path, keep_last=1, blocking=blocking, **kw)
        ft.wait_for_checkpoint()
        return sorted(int(p.name[5:]) for p in tmp_path.iterdir())

    assert save(100, metrics={"loss": 0.2}, best_metric="loss") == [100]
    assert save(200, metrics={"loss": 0.5}, best_metric="loss") == [100, 200]
    assert save(250) == [100, 250]  # preempted: no metrics at all
    meta = json.loads((tmp_path / "step-100" / "state.json").read_text())
    assert meta["ranking"] == {"best_metric": "loss", "keep_best": 1, "mode": "min"}
    assert save(300, metrics={"train_loss": 3.0}) == [100, 300]
    assert "ranking" not in json.loads((tmp_path / "step-300" / "state.json").read_text())
    assert save(350, metrics={"loss": 0.1}) == [350]  # recorded, so ranked: the new best
    assert save(400, metrics={"loss": 0.3}, best_metric="loss") == [350, 400]
    assert ft.load_checkpoint(tmp_path / "step-350", _state()).step == 350


def test_best_metric_missing_from_metrics_raises_naming_it(tmp_path):
    with pytest.raises(ValueError, match="best_metric='eval_accuracy' is not in metrics"):
        ft.save_checkpoint(
            _state(1), tmp_path, metrics={"eval_loss": 1.0}, best_metric="eval_accuracy"
        )
    with pytest.raises(ValueError, match="eval_accuracy"):
        ft.save_checkpoint(_state(1), tmp_path, best_metric="eval_accuracy", keep_last=1)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


# --- concurrent writers -----------------------------------------------------------------------


def _owned(what: str, pid: int, host: str | None = None) -> str:
    """A temporary directory's name as docs/checkpoints.md documents it."""
    host = host or re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64]
    return f".tmp-{what}.{pid}@{host}.0123abcd"


def _foreign_tmp(root: Path, pid: int) -> Path:
    tmp = root / _owned("step-99", pid)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"being written")
    return tmp


def test_a_save_never_removes_another_live_writers_temporary_directory(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _foreign_tmp(tmp_path, other.pid)  # a requeued job's predecessor, still saving
        remote = tmp_path / _owned("step-98", 1, host="another-node")
        remote.mkdir()
        ft.save_checkpoint(_state(1), tmp_path)
        ft.save_checkpoint(_state(2), tmp_path, keep_last=1)
        assert live.is_dir() and (live / "model.safetensors").read_bytes() == b"being written"
        assert remote.is_dir()  # another machine's: removed only once a day old
    finally:
        other.kill()
        other.wait(10)
    ft.save_checkpoint(_state(3), tmp_path, keep_last=1)  # its owner is gone: a crash's leftover
    assert sorted(p.name for p in tmp_path.iterdir() if p != remote) == ["step-3"]
    os.utime(remote, (0, 0))
    ft.save_checkpoint(_state(4), tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


@pytest.mark.slow
def test_two_processes_saving_into_one_folder_both_succeed(tmp_path):
    script = (  # both start saving together, once both have imported
        "import sys, time, pathlib, torch, ftrain as ft\n"
        "first, root = int(sys.argv[1]), pathlib.Path(sys.argv[2])\n"
        "state = ft.TrainState.create(torch.nn.Linear(128, 128), ft.optim.adamw())\n"
        "(root.parent / f'ready-{first}').touch()\n"
        "while len(list(root.parent.glob('ready-*'))) < 2:\n"
        "    time.sleep(0.01)\n"
        "for i in range(15):\n"
        "    ft.save_checkpoint(state.replace(step=first + i), root)\n"
    )
    root = tmp_path / "run"
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(first), root], stderr=subprocess.PIPE)
        for first in (0, 1000)
    ]
    errors = [p.communicate(timeout=240)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    steps = sorted(int(p.name[5:]) for p in root.iterdir())
    assert steps == [*range(15), *range(1000, 1015)]


# --- errors: one type, never lost ------------------------------------------------------------


def test_blocking_and_background_saves_raise_the_same_error(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(ft.CheckpointError) as blocking:
        ft.save_checkpoint(_state(1), afile)
    ft.save_checkpoint(_state(1), afile, blocking=False)
    with pytest.raises(ft.CheckpointError) as background:
        ft.wait_for_checkpoint()
    for info in (blocking, background):
        assert isinstance(info.value, OSError) and str(afile) in str(info.value)

    def disk_full(tensors, path):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(_save, "write_safetensors", disk_full)
    with pytest.raises(ft.CheckpointError, match="No space left") as blocking:
        ft.save_checkpoint(_state(2), tmp_path / "run")
    ft.save_checkpoint(_state(2), tmp_path / "run", blocking=False)
    with pytest.raises(ft.CheckpointError, match="No space left") as background:
        ft.wait_for_checkpoint()
    assert type(blocking.value.__cause__) is type(background.value.__cause__) is SafetensorError
    assert ft.latest_checkpoint(tmp_path / "run") is None


def test_an_interrupted_wait_does_not_forget_the_save_in_flight(tmp_path, monkeypatch):
    release = hold_background_writes(monkeypatch)
    ft.save_checkpoint(_state(1), tmp_path, blocking=False)
    bg = process_state.STATE.save_in_flight

    def ctrl_c(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(bg, "join", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        ft.wait_for_checkpoint()
    monkeypatch.delattr(bg, "join")
    timer = threading.Timer(0.5, release.set)
    timer.start()
    ft.save_checkpoint(_state(2), tmp_path)  # waits for step 1 instead of deleting its files
    timer.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
    ft.load_checkpoint(tmp_path / "step-1", _state())


def _read_step(path, ready, out):
    ready.wait(20)  # the parent's save committed
    out.put(ft.checkpoint.read_meta(path)["fields"]["step"])


def test_a_process_forked_during_a_background_save_reads_its_checkpoint(tmp_path, monkeypatch):
    """A ProcessPoolExecutor worker forked while a save was in flight inherited the save but
    not its writer thread: reading the checkpoint waited forever for it."""
    import multiprocessing

    release = hold_background_writes(monkeypatch)
    path = ft.save_checkpoint(_state(3), tmp_path, blocking=False)
    fork = multiprocessing.get_context("fork")
    ready, out = fork.Event(), fork.Queue()
    child = fork.Process(target=_read_step, args=(path, ready, out))
    child.start()
    release.set()
    ft.wait_for_checkpoint()
    ready.set()
    child.join(timeout=30)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung and child.exitcode == 0
    assert out.get(timeout=5) == 3


def test_reading_an_older_checkpoint_while_a_save_fails_leaves_the_failure_to_report(
    tmp_path, monkeypatch
):
    """read_meta of an intact older checkpoint raised the in-flight save's failure and took
    it: the next save said nothing of the lost checkpoint. It waits, reads, and leaves the
    failure to the next checkpoint call; reading the checkpoint the failed save was writing
    raises it."""
    release = threading.Event()
    older = ft.save_checkpoint(_state(1), tmp_path)

    def disk_full(tensors, path):
        release.wait(20)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_save, "write_safetensors", disk_full)
    failed = ft.save_checkpoint(_state(2), tmp_path, blocking=False)
    threading.Timer(0.3, release.set).start()
    assert ft.checkpoint.read_meta(older)["fields"]["step"] == 1  # waited for the save
    with pytest.raises(ft.CheckpointError, match=r"background save of step 2 failed: .*space"):
        ft.checkpoint.read_meta(failed)
    monkeypatch.undo()
    with pytest.raises(ft.CheckpointError, match=r"background save of step 2 failed: .*space"):
        ft.save_checkpoint(_state(3), tmp_path)
    assert ft.save_checkpoint(_state(3), tmp_path).name == "step-3"


class _Interrupt(Exception):
    """What a signal handler raises in the test below (Ctrl-C raises KeyboardInterrupt)."""


def _raise_interrupt(signum, frame):
    raise _Interrupt


@pytest.mark.parametrize("outcome", ["commits", "fails"])
def test_a_wait_interrupted_by_a_signal_handler_never_loses_the_save_in_flight(
    tmp_path, monkeypatch, outcome
):
    """A real signal, not a patched join: on Python 3.11 a `Thread.join` interrupted by an
    exception from a signal handler marks the running thread stopped, and the next save then
    removed the running save's temporary folder (issue 27). The first save commits, or its
    error is raised by the next save; it never vanishes."""
    # the background save stays mid-write until released
    release = hold_background_writes(monkeypatch, then_fail=outcome == "fails")
    previous = signal.signal(signal.SIGALRM, _raise_interrupt)
    try:
        ft.save_checkpoint(_state(1), tmp_path, blocking=False)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_Interrupt):
            ft.wait_for_checkpoint()  # blocks until the alarm's handler raises
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert process_state.STATE.save_in_flight is not None  # still tracked
    timer = threading.Timer(0.5, release.set)
    timer.start()
    try:
        if outcome == "fails":
            with pytest.raises(ft.CheckpointError, match="background save of step 1 failed"):
                ft.save_checkpoint(_state(2), tmp_path)
            assert not any(p.name == "step-1" for p in tmp_path.iterdir())
            return
        ft.save_checkpoint(_state(2), tmp_path)  # waits for step 1 instead of deleting its files
    finally:
        timer.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
    assert ft.load_checkpoint(tmp_path / "step-1", _state()).step == 1


def test_a_failed_final_background_save_fails_the_process(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    script = (
        "import torch, ftrain as ft\n"
        "state = ft.TrainState.create(torch.nn.Linear(4, 4), ft.optim.adamw())\n"
        f"ft.save_checkpoint(state.replace(step=7), {str(afile / 'run')!r}, blocking=False)\n"
        "print('script done', flush=True)\n"
    )
    run = _run(script)
    assert "script done" in run.stdout
    assert run.returncode == 1, run.stderr
    assert "background save of step 7 failed" in run.stderr


# --- DDP: a failed commit raises on every rank ------------------------------------------------


def test_ddp_rank_0_failing_a_blocking_save_raises_on_every_rank(tmp_path):
    import ckpt_save_workers as W

    run_ranks(W.ddp_save_failure, str(tmp_path), timeout=180)  # collectives time out at 60 s
    outcomes = [json.loads((tmp_path / f"outcome-{r}.json").read_text()) for r in (0, 1)]
    assert outcomes == [["CheckpointError", True, "step-1"]] * 2


def test_a_failed_background_save_of_one_rank_raises_at_load_on_every_rank(tmp_path):
    """Rank 0's background save failed: load_checkpoint raised it on rank 0 before the ranks'
    barrier, and rank 1 waited there until the process group timed out."""
    import ckpt_save_workers as W

    run_ranks(W.failed_background_save_then_load, str(tmp_path), timeout=180)
    outcomes = [json.loads((tmp_path / f"outcome-{r}.json").read_text()) for r in (0, 1)]
    assert outcomes[0].startswith("background save of step 2 failed: "), outcomes
    assert "No space left on device" in outcomes[0]
    assert outcomes[1].startswith("1 of 2 ranks could not read "), outcomes
    assert outcomes[1].endswith("or raised a failed background save; see their errors")
    steps = [json.loads((tmp_path / f"step-{r}.json").read_text()) for r in (0, 1)]
    assert steps == [1, 1]  # reported once: the next load goes on


# --- background saves of sharded (FSDP) states -------------------------------------------------


def _launch_two(worker, out: Path, seconds: float = 240) -> list[int | None]:
    """Run `worker` on 2 spawned ranks until both exit by themselves; their exit codes."""
    return exit_codes(worker, str(out), timeout=seconds)  # collectives time out at 60 s


@pytest.mark.slow
def test_fsdp_background_saves_are_blocking_ones_committed_on_every_rank_or_none(tmp_path):
    import ckpt_save_workers as W
    from dist_workers import train
    from helpers import tiny_llama

    assert _launch_two(W.fsdp_async_saves, tmp_path) == [-9, -9]  # SIGKILL mid-save, last
    assert (tmp_path / "killed-0").exists() and (tmp_path / "killed-1").exists()
    outcomes = [json.loads((tmp_path / f"outcome-{r}.json").read_text()) for r in (0, 1)]
    # Rank 1's shard write fails, then rank 0's commit: training goes on, and both ranks raise
    # at the next save.
    failed = ["trained", "CheckpointError: True", True]
    assert outcomes == [["step-3", *failed, *failed]] * 2
    assert list((tmp_path / "failed").iterdir()) == []  # nothing committed, nothing left over

    def fresh():
        return ft.TrainState.create(tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3)

    background, blocking = _same_checkpoints(tmp_path, 3, fresh)
    # The save of step 9 cut short by the crash is not a checkpoint; a new save cleans up.
    assert ft.latest_checkpoint(tmp_path / "async") == tmp_path / "async" / "step-3"
    ft.save_checkpoint(blocking, tmp_path / "async")
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == ["step-3"]
    resumed, _ = train(background, steps=6, batch_size=4)
    reference, _ = train(fresh(), steps=6, batch_size=4)
    for n, p in reference.params.items():
        torch.testing.assert_close(resumed.params[n], p, rtol=1e-5, atol=1e-6, msg=n)


def _same_checkpoints(root: Path, step: int, fresh):
    """The background and the blocking save of one state, loaded into one process: equal."""
    from helpers import opt_state_tensors

    background = ft.load_checkpoint(root / "async" / f"step-{step}", fresh())
    blocking = ft.load_checkpoint(root / "blocking" / f"step-{step}", fresh())
    for n, p in blocking.params.items():  # written while training went on: still that step's
        assert torch.equal(background.params[n], p), n
    for p, t in opt_state_tensors(blocking.opt_state).items():
        assert torch.equal(opt_state_tensors(background.opt_state)[p], t), p
    assert (background.step, background.data.cursor) == (step, blocking.data.cursor)
    return background, blocking


@pytest.mark.slow
def test_tp_background_saves_are_blocking_ones(tmp_path):
    import ckpt_save_workers as W
    from helpers import tiny_llama

    assert _launch_two(W.tp_async_save, tmp_path) == [0, 0]
    assert [(tmp_path / f"done-{r}").read_text() for r in (0, 1)] == ["step-2"] * 2
    _same_checkpoints(
        tmp_path, 2, lambda: ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3)
    )


def test_saving_a_consumed_state_raises_consumed_state_error_itself(tmp_path):
    """The README promises ConsumedStateError; a blocking save wrapped it in a CheckpointError."""
    state = _state()
    batch = {"x": torch.ones(2, 3)}
    grads, stats = ft.accumulate_grads(state, [batch], lambda m, b: (m(b["x"]).sum(), 2))
    ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    for blocking in (True, False):
        with pytest.raises(ft.ConsumedStateError, match="consumed by clip_and_step") as e:
            ft.save_checkpoint(state, tmp_path, blocking=blocking)
        assert not isinstance(e.value, ft.CheckpointError)
    with pytest.raises(ft.ConsumedStateError, match="consumed by clip_and_step"):
        ft.export_pretrained(state, tmp_path / "export")
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_commit_survives_another_writer_rotating_the_newest_checkpoint_away(
    tmp_path, monkeypatch
):
    """The newest committed checkpoint may vanish between listing and reading its marker (another
    writer's rotation in a shared root): the save still commits, ordered after the rest."""
    import shutil

    from ftrain.checkpoint import _save

    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    ft.save_checkpoint(state.replace(step=1), tmp_path)
    ft.save_checkpoint(state.replace(step=2), tmp_path)
    listed = _save.committed(tmp_path)
    shutil.rmtree(tmp_path / "step-2")
    monkeypatch.setattr(_save, "committed", lambda root: listed)  # listed before the delete
    ft.save_checkpoint(state.replace(step=3), tmp_path)
    monkeypatch.undo()
    assert ft.latest_checkpoint(tmp_path) == tmp_path / "step-3"


def test_a_score_ranked_without_a_mode_is_refused(tmp_path):
    """`best_metric="eval_accuracy"` with the default mode="min" kept the checkpoint of the
    worst accuracy as the best, without a word (track_best refuses the same)."""
    with pytest.raises(ValueError, match=r"save_checkpoint\(best_metric='eval_accuracy'\) needs"):
        ft.save_checkpoint(
            _state(1), tmp_path, metrics={"eval_accuracy": 0.5}, best_metric="eval_accuracy"
        )
    for acc in (0.5, 0.9, 0.4):
        ft.save_checkpoint(
            _state(1), tmp_path / "max", metrics={"eval_accuracy": acc},
            best_metric="eval_accuracy", mode="max", keep_last=0,
        )  # fmt: skip
    ft.save_checkpoint(
        _state(1), tmp_path / "loss", metrics={"eval_loss": 1.0}, best_metric="eval_loss"
    )


def test_loading_the_path_a_background_save_is_writing_waits_for_it(tmp_path, monkeypatch):
    """A run that went back saves a step again: its path still holds the older checkpoint of
    that step until the background save commits. Loading (or opening) the path that
    save_checkpoint returned read the old weights without a word."""
    old = _state(3)
    ft.save_checkpoint(old, tmp_path)
    new = _state(3)
    with torch.no_grad():
        for p in new.params.values():
            p.add_(1.0)
    release = hold_background_writes(monkeypatch)
    for read in ("load", "open"):
        path = ft.save_checkpoint(new, tmp_path, blocking=False)
        timer = threading.Timer(0.5, release.set)
        timer.start()
        if read == "load":
            got = ft.load_checkpoint(path, _state()).params
        else:
            got = ft.checkpoint.read_model_tensors(ft.checkpoint.open_checkpoint(path))
        timer.join()
        release.clear()
        assert process_state.STATE.save_in_flight is None  # waited for, and reported
        for name, p in new.params.items():
            assert torch.equal(got[name], p), name
