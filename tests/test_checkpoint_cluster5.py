"""Checkpoints against what clusters do (fifth round): elastic restarts with other world sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_workers as W
import ftrain as ft
import launch
from cluster5_workers import fsdp_node_local_save, fsdp_reshard
from helpers import opt_state_tensors, tiny_llama


def _single(root):
    state = ft.TrainState.create(tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3)
    return ft.load_checkpoint(ft.latest_checkpoint(root), state)


def test_a_two_rank_fsdp_checkpoint_reshards_onto_three_ranks_exactly(tmp_path):
    """A pod restarted with another world size: 2 ranks' shards loaded by 3 (uneven shards:
    16 rows as 6, 6, 4) and saved again hold the very same tensors (4 ranks: the same, checked
    by hand; 1 rank: tests/test_distributed.py)."""
    world = 3
    src, dst = tmp_path / "two", tmp_path / f"to-{world}"
    launch.run_ranks(W.resume, [str(src)], 2, 2, "fsdp")
    launch.run_ranks(fsdp_reshard, str(src), str(dst), world=world)
    a, b = _single(src), _single(dst)
    assert ft.checkpoint.read_meta(ft.latest_checkpoint(dst))["world_size"] == world
    for n, p in a.params.items():
        assert torch.equal(b.params[n], p), n
    theirs = opt_state_tensors(b.opt_state)
    for n, t in opt_state_tensors(a.opt_state).items():
        assert torch.equal(theirs[n], t), n


def test_a_save_whose_rotation_meets_another_writers_rotation_commits_without_error(
    tmp_path, monkeypatch
):
    """Two jobs in one run folder (a requeued job whose predecessor still runs), both with
    keep_last: both list the folder and rotate the same old checkpoint; the second rename
    found it gone, and the save, committed already, raised CheckpointError on every rank
    (the run died of a checkpoint that was written)."""
    import shutil

    from ftrain.checkpoint import _save

    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    for step in (1, 2):
        ft.save_checkpoint(state.replace(step=step), tmp_path)
    listed = _save.committed(tmp_path)
    shutil.rmtree(tmp_path / "step-1")  # the other writer's rotation, after this one listed
    monkeypatch.setattr(_save, "committed", lambda root: listed)
    ft.save_checkpoint(state.replace(step=3), tmp_path, keep_last=1)
    monkeypatch.undo()
    assert [p.name for _, p in _save.committed(tmp_path)] == ["step-3"]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_sharded_save_into_a_node_local_root_raises_on_every_rank_and_commits_nothing(
    tmp_path, blocking
):
    """Multi-node FSDP with the run folder on each node's own disk (the same path on every
    node): rank 1's shards went into its node's folder, rank 0 committed its own shards only,
    and the save returned on every rank; no checkpoint of the run loaded ("the shards ... do
    not cover it once" at the resume). Now rank 0's commit checks the shards' cover first."""
    launch.run_ranks(fsdp_node_local_save, str(tmp_path), str(tmp_path / "out"), blocking)
    rank0, rank1 = ((tmp_path / f"out.{r}").read_text() for r in (0, 1))
    assert rank0.startswith("CheckpointError") and "do not cover it once" in rank0
    assert "must be one folder that every rank sees" in rank0
    assert rank1.startswith("CheckpointError") and "on another rank" in rank1
    assert ft.latest_checkpoint(tmp_path / "node0" / "run") is None  # nothing committed


def test_a_save_meeting_another_writers_save_of_the_same_step_commits_without_error(
    tmp_path, monkeypatch
):
    """A requeued job beside its predecessor (both resumed from one checkpoint) saves the same
    steps: the other writer published `step-N` between this save's look and its rename, the
    rename met a folder in place, and the save, whole, raised CheckpointError. Now it moves the
    other copy aside as a re-save does (the last writer's copy stays)."""
    import os

    from ftrain.checkpoint import _io

    mine = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).replace(step=4)
    other = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).replace(step=4)
    theirs = ft.save_checkpoint(other, tmp_path / "other")
    rename, raced = os.rename, []

    def other_writer_first(src, dst):
        if Path(dst).name == "step-4" and not raced:  # their publish, just before ours
            raced.append(1)
            rename(theirs, dst)
        return rename(src, dst)

    monkeypatch.setattr(_io.os, "rename", other_writer_first)
    path = ft.save_checkpoint(mine, tmp_path / "run")
    monkeypatch.undo()
    assert raced and ft.latest_checkpoint(tmp_path / "run") == path
    loaded = ft.load_checkpoint(path, ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()))
    assert torch.equal(loaded.params["weight"], mine.params["weight"])
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-4"]  # no leftovers


def _resave_killed(root: str, killed_at: str, swap: bool = True) -> None:
    """A process re-saving step 5 of `root`, killed (os._exit) at `killed_at`; without `swap`,
    on a file system that cannot swap two folders in one step (NFS, Lustre)."""
    import os

    from ftrain.checkpoint import _io

    if not swap:
        _io._exchange = lambda a, b: False

    rename = os.rename
    torch.manual_seed(1)
    new = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).replace(step=5)

    def rename_then_die(src, dst):
        rename(src, dst)
        if Path(src).name == "step-5":  # the committed copy moved aside
            os._exit(9)

    def die(path, *args, **kwargs):
        os._exit(9)

    if killed_at == "moving the old copy aside":
        _io.os.rename = rename_then_die
    else:
        _io.shutil.rmtree = die
    ft.save_checkpoint(new, root, keep_last=1)  # (where folders are swapped, no rename kills)
    os._exit(0)


@pytest.mark.parametrize("killed_at", ["moving the old copy aside", "removing the old copy"])
def test_a_resave_killed_midway_leaves_a_loadable_checkpoint_of_the_step(tmp_path, killed_at):
    """Re-saving a step (a requeued job's predecessor saving the steps its successor saved, a
    final save at a saved step) moved the committed `step-N` aside, then renamed the new copy
    in: a process killed between the two left only temporaries, which the next save's sweep
    removed, and with keep_last=1 no checkpoint at all. Where the system swaps two folders in
    one step (Linux), the old and new copies are swapped: `step-N` exists at every instant."""
    import multiprocessing

    from ftrain.checkpoint import _io

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    if not _io._exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no atomic directory swap on this system")
    root = tmp_path / "run"
    torch.manual_seed(0)
    old = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).replace(step=5)
    ft.save_checkpoint(old, root, keep_last=1)
    child = multiprocessing.get_context("fork").Process(
        target=_resave_killed, args=(str(root), killed_at)
    )
    child.start()
    child.join(60)
    if child.is_alive():  # (never left behind: the assertion below then fails)
        child.kill()
    assert child.exitcode in (0, 9)  # killed, or saved without the rename that kills
    path = ft.latest_checkpoint(root)
    assert path is not None and Path(path).name == "step-5"
    fresh = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    loaded = ft.load_checkpoint(path, fresh)  # a whole copy, the old or the new one
    torch.manual_seed(1)
    new = torch.nn.Linear(2, 1).weight
    assert torch.equal(loaded.params["weight"], old.params["weight"]) or torch.equal(
        loaded.params["weight"], new
    )


def test_a_resave_killed_midway_without_a_folder_swap_is_put_back_by_the_next_save(tmp_path):
    """Where two folders cannot be swapped in one step (NFS rejects renameat2's flags), a
    re-save killed between its two renames leaves the committed step-N under the temporary
    name it was moved aside to; the next save's sweep of stale temporaries deleted it, the
    only copy of that step. It is put back when no step-N took its place."""
    import multiprocessing

    root = tmp_path / "run"
    torch.manual_seed(0)
    old = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()).replace(step=5)
    ft.save_checkpoint(old, root, keep_last=2)
    child = multiprocessing.get_context("fork").Process(
        target=_resave_killed, args=(str(root), "moving the old copy aside", False)
    )
    child.start()
    child.join(60)
    if child.is_alive():  # (never left behind: the assertion below then fails)
        child.kill()
    assert child.exitcode == 9
    assert ft.latest_checkpoint(root) is None  # the window: step-5 moved aside, nothing else
    ft.save_checkpoint(old.replace(step=6), root, keep_last=2)  # its sweep
    assert sorted(p.name for p in root.iterdir()) == ["step-5", "step-6"]
    fresh = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    loaded = ft.load_checkpoint(root / "step-5", fresh)
    assert loaded.step == 5 and torch.equal(loaded.params["weight"], old.params["weight"])
