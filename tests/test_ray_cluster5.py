"""ftrain.extras.ray against what clusters do (fifth round): runs that share a staging root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ftrain as ft
import launch
from cluster5_workers import ray_fallback_save

pytest.importorskip("ray.train")


def test_two_default_named_runs_in_one_second_stage_apart_where_ray_has_no_run_id(tmp_path):
    """Without Ray's run id, the staging folder was the run's name, and Ray's default name
    (`ray_train_run-<date>`) is to the second: a second run saving the same step replaced or
    refused the first's staged checkpoint while Ray still uploaded it."""
    root = tmp_path / "staging"
    for seed in (1, 2):  # two runs: two processes, one name
        launch.run_ranks(
            ray_fallback_save, str(root), seed, str(tmp_path / f"{seed}.json"), world=1
        )
    one, two = (json.loads((tmp_path / f"{s}.json.0").read_text()) for s in (1, 2))
    assert one["path"] != two["path"]
    for run in (one, two):
        state = ft.TrainState.create(torch.nn.Linear(3, 2), ft.optim.sgd())
        loaded = ft.load_checkpoint(run["path"], state)
        assert loaded.params["weight"].tolist() == run["weight"]  # each run's own weights
        assert loaded.step == 3


def test_the_ranks_of_one_run_stage_into_one_folder_where_ray_has_no_run_id(tmp_path):
    """The fallback folder names the group's rank 0 process: every rank stages there (a sharded
    checkpoint is one folder every rank writes into)."""
    launch.run_ranks(ray_fallback_save, str(tmp_path / "staging"), 0, str(tmp_path / "run"))
    paths = {json.loads((tmp_path / f"run.{r}").read_text())["path"] for r in (0, 1)}
    (path,) = paths
    assert ft.latest_checkpoint(Path(path).parent) == Path(path)


@pytest.fixture
def fake_worker(monkeypatch):
    """ray.train as a worker of Ray's local mode sees it (no cluster; no run id: one context
    object per fit, `new_fit` starts the next fit in this process): `report` records its
    calls, `get_checkpoint` returns what `restored` holds."""
    import ray.train

    from ftrain.process_state import STATE

    reports, restored = [], []
    monkeypatch.setattr(STATE, "ray_reported", None)  # this process reported nothing yet
    worker = {"get_world_rank": int, "get_experiment_name": staticmethod(lambda: "run")}
    fit = [type("C", (), worker)()]

    def new_fit():
        fit[0] = type("C", (), worker)()  # Ray's local mode: a context of its own
        restored.clear()

    monkeypatch.setattr(ray.train, "get_context", lambda: fit[0])
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kw: reports.append(metrics))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: restored[0] if restored else None)
    return reports, restored, new_fit


def _state(step):
    return ft.TrainState.create(torch.nn.Linear(3, 2), ft.optim.sgd()).replace(step=step)


def test_a_step_below_the_last_reported_one_is_refused_and_the_same_step_is_not_reported_again(
    tmp_path, fake_worker
):
    """A final save after the loop at the step the loop just saved: Ray registered two
    checkpoints `step-5` with one folder in its storage, and its retention (num_to_keep=1),
    deleting the older, deleted the run's only checkpoint; the restarted group found none.
    That save is now skipped with a warning (it raised, and Ray restarted the finished run
    until max_failures); an earlier step (a rollback's) is still refused."""
    from ftrain.extras import ray as ray_ft

    reports, _, _ = fake_worker
    first = ray_ft.save_and_report(_state(5), tmp_path, metrics={"loss": 1.0})
    with pytest.warns(UserWarning, match=r"Ray already holds step-5 .*not reported"):
        again = ray_ft.save_and_report(_state(5), tmp_path, metrics={"loss": 2.0})
    assert again == first  # the checkpoint Ray holds of that step
    with pytest.raises(ValueError, match=r"already reported step-5 to Ray.*report each step"):
        ray_ft.save_and_report(_state(4), tmp_path, metrics={"loss": 2.0})
    assert reports == [{"loss": 1.0, "step": 5}]  # Ray heard nothing more
    assert sorted(p.name for p in first.parent.parent.iterdir()) == ["report-5"]  # nor saved
    ray_ft.save_and_report(_state(6), tmp_path)
    assert reports[-1] == {"step": 6}


def test_a_group_restarted_after_its_last_save_finishes_instead_of_failing_again(
    tmp_path, fake_worker
):
    """A group restarted after its last report resumes at step total, its loop does nothing,
    and its final save reported `step-N` again into the folder Ray restored it from; refused,
    it raised, Ray restarted the group again and again, and the finished run ended FAILED.
    The save is skipped with a warning (on every rank: each restored the same checkpoint)."""
    import ray.train

    from ftrain.extras import ray as ray_ft

    reports, restored, _ = fake_worker
    restored.append(ray.train.Checkpoint("/storage/run/step-7"))
    for _ in range(2):  # a final save, and another one
        with pytest.warns(UserWarning, match=r"Ray already holds step-7"):
            path = ray_ft.save_and_report(_state(7), tmp_path, metrics={"loss": 1.0})
        assert path == Path("/storage/run/step-7")
    assert reports == [] and not list(tmp_path.iterdir())  # nothing saved
    with pytest.raises(ValueError, match=r"already reported step-7 to Ray"):
        ray_ft.save_and_report(_state(6), tmp_path)
    ray_ft.save_and_report(_state(8), tmp_path)
    assert reports == [{"step": 8}]


def test_ranks_that_disagree_on_skipping_a_reported_step_all_raise_in_the_same_reduction(
    tmp_path, fake_worker
):
    """The skip is decided in the save's reduction, which every rank enters: a rank that held
    the step while another did not would otherwise have left while the other waited in the
    save's collectives."""
    from ftrain.extras import ray as ray_ft

    class WithAnotherRank(ft.strategies.SingleDevice):
        def sum_over_processes(self, tensor):  # rank 1 holds no step: it would save
            if tensor.numel() != 5:  # not the save's reduction
                return tensor
            return tensor + torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])

    reports, _, _ = fake_worker
    ray_ft.save_and_report(_state(5), tmp_path)
    state = ft.TrainState.create(
        torch.nn.Linear(3, 2), ft.optim.sgd(), strategy=WithAnotherRank("cpu")
    ).replace(step=5)
    with pytest.raises(RuntimeError, match=r"1 of 2 ranks already reported"):
        ray_ft.save_and_report(state, tmp_path)
    assert reports == [{"step": 5}]


def test_a_new_fit_in_the_same_process_starts_its_steps_afresh(tmp_path, fake_worker):
    """Ray's local mode (num_workers=0) runs each fit in the driver process: after a fit that
    reported step 5, the next fit's step 2 was refused as a re-report of the first fit's
    steps unless the fit called `restore` (a fresh run need not). The record is the run's."""
    from ftrain.extras import ray as ray_ft

    reports, _, new_fit = fake_worker
    ray_ft.save_and_report(_state(5), tmp_path)
    for restore in (False, True):  # the next fit: a fresh run, or one that resumes (nothing)
        new_fit()
        state = ray_ft.restore(_state(0)) if restore else _state(0)
        ray_ft.save_and_report(state.replace(step=2), tmp_path / "next")
        with pytest.raises(ValueError, match=r"already reported step-2"):  # its own record
            ray_ft.save_and_report(state.replace(step=1), tmp_path / "next")
    assert reports == [{"step": 5}, {"step": 2}, {"step": 2}]


def test_two_fits_of_one_name_in_one_process_stage_apart(tmp_path, fake_worker):
    """Ray's local mode runs every fit in the driver process: two default-named fits started in
    one second (one name) staged into `<name>-<token of rank 0's process>`, one folder, and the
    second fit's step 4 replaced the staged checkpoint the first fit's result points to. Each
    run draws a token of its own at its first save and keeps it for the run."""
    from ftrain.extras import ray as ray_ft

    _, _, new_fit = fake_worker
    paths, weights = [], []
    for seed in (1, 2):
        new_fit()
        torch.manual_seed(seed)
        state = _state(4)
        paths.append(ray_ft.save_and_report(state, tmp_path))
        weights.append(state.params["weight"])
        later = ray_ft.save_and_report(state.replace(step=5), tmp_path)
        assert later.parent.parent == paths[-1].parent.parent  # one folder for the run
    assert paths[0] != paths[1]
    for path, weight in zip(paths, weights, strict=True):
        assert torch.equal(ft.load_checkpoint(path, _state(0)).params["weight"], weight)
