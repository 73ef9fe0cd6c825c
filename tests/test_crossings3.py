"""Third review of where the second wave's features cross (EMA, the guard, the compiled step,
logging, ft.func, schedules), each killed midway, resumed or fed forged input: every case once
gave a silent wrong result; now it is right or it raises."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import ftrain as ft

X = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
Y = torch.randn(64, 1, generator=torch.Generator().manual_seed(1))
ROWS = [(X[i], Y[i]) for i in range(64)]


def _collate(rows):
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum(), torch.tensor(x.shape[0])


def _linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 1)


def _train(state, steps, *, root=None, save_every=None, lr=0.01):
    """`steps` more updates over ROWS (4 rows a micro-batch), saving at multiples of
    `save_every`."""
    end = state.step + steps
    while state.step < end:
        for micro in ft.make_batches(ROWS, state, batch_size=4, accum=1, collate_fn=_collate):
            grads, stats = ft.accumulate_grads(state, micro, _mse)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=lr)
            if save_every and state.step % save_every == 0:
                ft.save_checkpoint(state, root)
            if state.step >= end:
                break
        else:
            state = ft.next_epoch(state)
    return state


# --- guard x resume ------------------------------------------------------------------------------


def test_a_guard_rollback_never_moves_forward_to_a_checkpoint_of_another_branch(tmp_path):
    # Run A saved steps 2 and 4; run B resumed from step 2 (to branch off) and met a spike at
    # step 2 before its first save. The newest checkpoint is A's step 4: the rollback loaded
    # it, jumping forward two steps into weights B never trained.
    state = _train(ft.guard.GuardedState.create(_linear(), ft.optim.sgd()), 4,
                   root=tmp_path, save_every=2)  # fmt: skip
    branch = ft.guard.GuardedState.create(_linear(), ft.optim.sgd())
    branch = ft.load_checkpoint(tmp_path / "step-2", branch)
    micro = next(iter(ft.make_batches(ROWS, branch, batch_size=4, collate_fn=_collate)))
    guard = ft.guard.SpikeGuard()
    with pytest.raises(ft.guard.GuardError, match=r"step-4 \(step 4\) is past this state's step 2"):
        guard.rollback(branch, tmp_path, skip=micro)
    assert branch.step == 2 and branch.rollbacks == 0  # not consumed: still usable
    del state


# --- EMA x the step ------------------------------------------------------------------------------


def test_gradients_taken_inside_swap_ema_are_not_applied_after_it():
    # Inside the block the model holds the average: accumulate_grads took its gradient there,
    # and clip_and_step after the block applied it to the live weights, without a word.
    state = ft.TrainState.create(_linear(), ft.optim.ema(ft.optim.sgd(), decay=0.5))
    state = _train(state, 2)
    micro = [_collate(ROWS[:4])]
    live = {n: p.detach().clone() for n, p in state.params.items()}
    with ft.optim.swap_ema(state):
        grads, stats = ft.accumulate_grads(state, micro, _mse)
    with pytest.raises(ValueError, match=r"accumulate_grads took inside ft.optim.swap_ema"):
        ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    assert all(torch.equal(p, live[n]) for n, p in state.params.items())  # nothing applied
    grads, stats = ft.accumulate_grads(state, micro, _mse)  # after the block: the live weights
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    assert state.step == 3


# --- ft.func ensembles x clipping ----------------------------------------------------------------


def test_clip_and_step_max_norm_on_an_ensemble_is_refused_and_clip_members_is_the_way():
    # max_norm clipped all members by the norm of their gradients together: a member with small
    # gradients was shrunk by another's large ones, unlike K separate runs (docs/research.md
    # said so, but the call was taken).
    members = [_linear(0), _linear(1)]
    state = ft.TrainState.create(ft.func.Ensemble(members), ft.optim.sgd())
    micro = [_collate(ROWS[:4])]
    grads, stats = ft.accumulate_grads(state, micro, ft.func.ensemble_loss(_mse))
    for compile in (False, True):  # refused before anything is compiled or changed
        with pytest.raises(ValueError, match=r"max_norm.*Ensemble.*clip_members"):
            ft.clip_and_step(state, grads, stats=stats, lr=0.1, max_norm=1.0, compile=compile)
    norms = ft.func.clip_members(grads, 1.0)
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    assert norms.shape == (2,) and state.step == 1


# --- trackers x ranks ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mlflow", "wandb"])
def test_a_tracker_built_without_rank_on_a_launched_rank_1_stays_quiet(tmp_path, monkeypatch, kind):
    # "Both do nothing on ranks other than 0, so every rank can build them", but `rank`
    # defaulted to 0: under torchrun every rank that built one without rank= logged every
    # record into the run (twice per step with 2 ranks), or opened a run of its own.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("RANK", "1")  # what torchrun sets (no process group here)
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = tmp_path / "run"
    if kind == "mlflow":
        sink = ft.logging.MLflowSink(run, tracking_uri=(tmp_path / "mlruns").as_uri())
    else:
        sink = ft.logging.WandbSink(run)  # (returns before W&B is set up)
    sink.log({"step": 1, "loss": 1.0})
    sink.close()
    assert sink.run_id is None and not run.exists()


def test_one_ema_optimizer_reused_for_a_float64_model_weighs_its_average_in_float64():
    # The skip-aware weight's dtype was cached by parameter names only: after a float32 model,
    # a float64 one with the same names got a float32 weight (1 - 0.9999 rounded: 2.6e-12
    # off after one step), unlike a fresh optimizer.
    def one_step(opt, dtype):
        model = _linear().to(dtype)
        state = ft.TrainState.create(model, opt)
        x = X[:4].to(dtype)
        grads, stats = ft.accumulate_grads(state, [x], lambda m, b: (m(b).sum(), 4))
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1.0)
        return state.opt_state.ema

    reused = ft.optim.ema(ft.optim.sgd(), decay=0.9999, warmup=False)
    one_step(reused, torch.float32)
    got = one_step(reused, torch.float64)
    want = one_step(ft.optim.ema(ft.optim.sgd(), decay=0.9999, warmup=False), torch.float64)
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_a_sweep_checkpoint_refuses_a_resume_with_other_member_settings(tmp_path):
    # A plain adamw(weight_decay=0.1) checkpoint refuses adamw(weight_decay=0.5) by name; a
    # sweep records no settings, so other lr_factors or member weight decays loaded silently.
    def state(wd, factor):
        opt = ft.func.sweep([ft.optim.adamw(), ft.optim.adamw(weight_decay=wd)],
                            lr_factors=[1.0, factor])  # fmt: skip
        return ft.TrainState.create(ft.func.Ensemble([_linear(0), _linear(1)]), opt)

    path = ft.save_checkpoint(state(0.1, 2.0), tmp_path)
    for wd, factor in ((0.1, 3.0), (0.5, 2.0)):
        with pytest.raises(ft.checkpoint.CheckpointMismatchError):
            ft.load_checkpoint(path, state(wd, factor))
    assert ft.load_checkpoint(path, state(0.1, 2.0)).step == 0  # the same settings resume


def test_private_gradients_are_not_taken_inside_swap_ema():
    # private_grads returns a plain dict: taken inside the block (the average's gradients),
    # clip_and_step after it applied them to the live weights, as with accumulate_grads.
    state = ft.TrainState.create(_linear(), ft.optim.ema(ft.optim.sgd(), decay=0.5))
    micro = [_collate(ROWS[:4])]
    kw = {"max_norm": 1.0, "noise_multiplier": 0.0}
    with ft.optim.swap_ema(state), pytest.raises(ValueError, match=r"private_grads.*swap_ema"):
        ft.func.private_grads(state, micro, _mse, **kw)
    grads, stats = ft.func.private_grads(state, micro, _mse, **kw)
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    assert state.step == 1


def test_a_resumed_wandb_run_refuses_changed_params_as_mlflow_does(tmp_path, monkeypatch):
    # MLflowSink raised for params that differ from the resumed run's; WandbSink passed no
    # config on resume, so a restart with lr=0.2 kept the run's lr=0.1 without a word.
    monkeypatch.setenv("WANDB_MODE", "offline")  # as tests/test_trackers.py (W&B's settings
    monkeypatch.setenv("WANDB_SILENT", "true")  # are process-wide once set up)
    run = tmp_path / "run"
    ft.logging.WandbSink(run, params={"lr": 0.1, "wd": 0.0}).close()
    with pytest.raises(ValueError, match=r"params differ.*'lr': \('0.1', '0.2'\)"):
        ft.logging.WandbSink(run, params={"lr": 0.2})
    again = ft.logging.WandbSink(run, params={"lr": 0.1, "seed": 3}, rank=0)
    assert again.resumed and again._run.config["seed"] == 3  # a new key is added
    again.close()


def test_a_profiler_built_without_rank_names_its_trace_by_the_launched_rank(tmp_path, monkeypatch):
    # "build one per rank to profile each", but rank defaulted to 0: every rank wrote a
    # `rank0.*` trace into the folder, and each rank's traces() listed the others' too.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    prof = ft.logging.Profiler(tmp_path / "prof", steps=(3, 3), warmup=1)
    state = ft.TrainState.create(_linear(), ft.optim.sgd(), strategy=ft.strategies.SingleDevice())
    for _ in range(3):
        state = _train(state, 1)
        prof.step(state)
    (trace,) = prof.traces()
    assert trace.name.startswith("rank1.")


def test_a_run_that_raises_inside_the_logger_is_not_marked_finished(tmp_path, monkeypatch):
    # Logger.__exit__ on an error closes the sinks, and MLflowSink.close() marked the crashed
    # run FINISHED (MLflow's own `with start_run()` marks it FAILED, W&B's `with init()` exits 1).
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    state = ft.TrainState.create(_linear(), ft.optim.sgd())
    statuses = []
    for fail in (True, False):
        sink = ft.logging.MLflowSink(tmp_path / f"run{fail}", tracking_uri=uri)
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():  # noqa: SIM117
            with ft.logging.Logger(state, every=1, sinks=[sink], progress=False):
                if fail:
                    raise RuntimeError("diverged")
        statuses.append(MlflowClient(uri).get_run(sink.run_id).info.status)
    assert statuses == ["FAILED", "FINISHED"]


def test_swap_ema_of_a_sweep_of_ema_optimizers_does_not_advise_what_sweep_refuses():
    # docs/research.md suggests sweep([ema(adamw()), ...]); swap_ema then said "wrap the
    # optimizer: ft.optim.ema(...)", which ema refuses for a sweep.
    ens = ft.func.Ensemble([_linear(0), _linear(1)])
    state = ft.TrainState.create(ens, ft.func.sweep([ft.optim.ema(ft.optim.adamw())] * 2))
    with (
        pytest.raises(TypeError, match=r"one per member \(ft.func.sweep of ema"),
        ft.optim.swap_ema(state),
    ):
        pass
