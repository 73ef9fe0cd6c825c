"""Where evaluation, cadence, logging and the preference losses cross other features: each test
is a silent wrong result (or an argument accepted and ignored) that the tree gave before."""

from __future__ import annotations

import copy
import functools
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import ftrain as ft
from ftrain import preference as P
from helpers import tiny_gpt2, tiny_llama

# --- evaluate --------------------------------------------------------------------------------


def _square(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum(), torch.tensor(float(len(x)))


def _linear_state(**kw):
    torch.manual_seed(0)
    return ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(), **kw)


BATCH = (torch.ones(4, 2), torch.zeros(4, 1))


@pytest.mark.parametrize("name", ["items", "ppl", "loss_fn"])
def test_evaluate_refuses_a_metric_named_like_a_key_it_reports_itself(name):
    """A metric "items" came back as eval_items = the loss's count, "ppl" as exp(eval_loss),
    "loss_fn" as the loss's name: the user's value was overwritten without a word."""

    def metrics_fn(model, batch):
        n = torch.tensor(4.0)
        return {name: (7 * n, n)}

    with pytest.raises(ValueError, match=rf"metrics_fn returned \['{name}'\].*eval_{name}"):
        ft.evaluate(_linear_state(), [BATCH], _square, metrics_fn=metrics_fn, perplexity=True)


def test_evaluate_refuses_a_metrics_loss_where_the_metrics_loss_goes():
    """With a training loss of its own, the metrics' "loss" is reported as eval_metrics_loss;
    a metric of that name was replaced by it (9.0 came back as 1.0)."""

    def focal(model, batch):
        return 2 * _square(model, batch)[0], torch.tensor(4.0)

    def metrics_fn(model, batch):
        n = torch.tensor(4.0)
        return {"loss": (n, n), "metrics_loss": (9 * n, n)}

    with pytest.raises(ValueError, match=r"metrics_fn returned \['metrics_loss'\]"):
        ft.evaluate(_linear_state(loss_fn=focal), [BATCH], metrics_fn=metrics_fn)


def test_the_perplexity_of_a_nan_loss_is_nan_not_infinite():
    def nan_loss(model, batch):
        return torch.tensor(math.nan), torch.tensor(4.0)

    out = ft.evaluate(_linear_state(), [BATCH], nan_loss, perplexity=True)
    assert math.isnan(out["eval_loss"]) and math.isnan(out["eval_ppl"])  # was inf
    big = ft.evaluate(
        _linear_state(), [BATCH], lambda m, b: (torch.tensor(4e3), 4), perplexity=True
    )
    assert big["eval_ppl"] == math.inf


def test_evaluate_and_predict_on_two_ranks_refuse_names_that_differ_between_ranks(tmp_path):
    """Rank 0 returned acc_cat (1/1), rank 1 acc_dog (2/1): the rows were summed position by
    position, and rank 0 reported eval_acc_cat = 1.5, rank 1 eval_acc_dog = 1.5. predict
    gathers output by output: names that differ paired rows of two outputs."""
    import json

    import dist_workers
    from launch import run_ranks

    run_ranks(dist_workers.names_differ, str(tmp_path), timeout=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        same = result["same"]
        assert same["eval_acc_cat"] == pytest.approx(1 / 3) and same["eval_acc_dog"] == 0.5
        assert same["eval_items"] == 5.0
        mine = ("acc_cat", "acc_dog")[rank]
        assert f"metrics_fn returned other names on this rank (['{mine}'])" in result["per_rank"]
        assert f"output_fn returned other names on this rank (['{mine}'])" in result["predict"]


# --- preference losses -----------------------------------------------------------------------


def _pairs(n=4):
    g = torch.Generator().manual_seed(0)
    ids_c = torch.randint(1, 50, (n, 9), generator=g)
    ids_r = torch.randint(1, 50, (n, 9), generator=g)
    lab_c, lab_r = ids_c.clone(), ids_r.clone()
    lab_c[:, :3] = -100
    lab_r[:, :3] = -100
    return {"chosen_input_ids": ids_c, "chosen_labels": lab_c,
            "chosen_attention_mask": torch.ones_like(ids_c),
            "rejected_input_ids": ids_r, "rejected_labels": lab_r,
            "rejected_attention_mask": torch.ones_like(ids_r)}  # fmt: skip


def _logps(model, batch, side):
    return P.sequence_logps(
        model, {"input_ids": batch[f"{side}_input_ids"], "labels": batch[f"{side}_labels"]}
    )


def test_reference_log_probs_of_shape_batch_by_one_are_refused_not_broadcast():
    """A dataset column stored as [logp] per row collates to (batch, 1): the margin broadcast to
    (batch, batch), and the loss per pair came back 4x too large (2.737 instead of 0.684)."""
    model, ref = tiny_llama(), tiny_llama(seed=1)
    batch = {k: v[:, :7] for k, v in _pairs().items()}
    with torch.no_grad():
        rc, rr = (_logps(ref, batch, side) for side in ("chosen", "rejected"))
    loss_fn = P.preference_loss(functools.partial(P.dpo_loss, beta=0.1))
    total, n = loss_fn(model, {**batch, "reference_chosen": rc, "reference_rejected": rr})
    with torch.no_grad():
        pc, pr = (_logps(model, batch, side) for side in ("chosen", "rejected"))
    want = -torch.nn.functional.logsigmoid(0.1 * ((pc - rc) - (pr - rr))).sum()  # TRL's sigmoid
    assert int(n) == 4 and total.item() == pytest.approx(want.item(), rel=1e-5)
    column = {**batch, "reference_chosen": rc[:, None], "reference_rejected": rr[:, None]}
    with pytest.raises(ValueError, match=r"reference_chosen must be a tensor of shape \(4,\)"):
        loss_fn(model, column)
    z = torch.zeros(3)
    with pytest.raises(ValueError, match=r"reference_chosen.*\(3, 1\)"):
        P.dpo_loss(z, z, z[:, None], z[:, None])
    with pytest.raises(ValueError, match=r"shape \(batch,\)"):
        P.kto_loss(z[:, None], z[:, None], torch.tensor([True, False, True]), kl=0.0)
    with pytest.raises(ValueError, match=r"shape \(batch,\)"):
        P.simpo_loss(z, z[:2])


def test_a_reference_model_in_train_mode_runs_without_dropout():
    """A deep copy of a training model is in train mode: the reference log-probs had dropout
    noise, so the same policy and batch gave a different loss each call (2.7760, 2.7723, ...
    instead of 4 log 2 = 2.7726 with policy == reference)."""
    model = tiny_gpt2(dropout=0.1)
    reference = copy.deepcopy(model).requires_grad_(False)  # train mode, as deepcopy leaves it
    loss_fn = P.preference_loss(functools.partial(P.dpo_loss, beta=0.1), reference=reference)
    model.eval()
    values = [loss_fn(model, _pairs())[0].item() for _ in range(3)]
    assert values == [pytest.approx(4 * math.log(2), abs=1e-6)] * 3
    assert reference.training  # its mode is given back


def test_preference_loss_refuses_what_it_would_ignore_or_misread():
    model, ref = tiny_llama(), tiny_llama(seed=1)
    batch = {k: v[:, :7] for k, v in _pairs().items()}
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="reference= for simpo_loss"):
        P.preference_loss(P.simpo_loss, reference=ref, average=True)
    with pytest.raises(ValueError, match="dpo_loss needs reference log-probs"):
        P.preference_loss(P.dpo_loss)(model, batch)
    pre = {**batch, "reference_chosen": z, "reference_rejected": z}
    with pytest.raises(ValueError, match="reference-free and would ignore them"):
        P.preference_loss(P.orpo_loss, average=True)(model, pre)
    with pytest.raises(KeyError, match="reference_chosen but not its pair"):
        P.preference_loss(P.dpo_loss)(model, {**batch, "reference_chosen": z})

    def mean_dpo(pc, pr, rc, rr):  # a batch mean, not one loss per pair
        return P.dpo_loss(pc, pr, rc, rr).mean()

    with pytest.raises(ValueError, match=r"one value per pair.*mean_dpo returned shape \(\)"):
        P.preference_loss(mean_dpo, reference=ref)(model, batch)
    with pytest.raises(TypeError, match="average must be True or False"):
        P.preference_loss(P.simpo_loss, average="yes")


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda z: P.dpo_loss(z, z, z, z, beta=True), "beta must be a finite number > 0"),
        (lambda z: P.dpo_loss(z, z, z, z, beta=math.inf), "beta must be a finite number > 0"),
        (lambda z: P.simpo_loss(z, z, gamma=math.nan), "gamma must be a finite number"),
        (
            lambda z: P.kto_loss(z, z, z > 0, kl=0.0, desirable_weight=-1.0),
            "desirable_weight must be a finite number >= 0",
        ),
    ],
)
def test_preference_hyperparameters_that_are_no_numbers_raise(bad, match):
    """beta=True was taken as 1, beta=inf and gamma=NaN gave NaN losses, a negative KTO weight
    rewarded the examples it weighs."""
    with pytest.raises(ValueError, match=match):
        bad(torch.zeros(3))


# --- sinks and trackers ----------------------------------------------------------------------


def test_tensorboard_keeps_every_record_of_a_killed_run(tmp_path):
    """The writer wrote its queue every 2 minutes: a run killed after 10 records left none on
    disk, and a resume replays only the steps after its checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    child = textwrap.dedent(
        f"""
        import os, ftrain as ft
        sink = ft.logging.TensorBoardSink({str(tmp_path)!r})
        for s in range(1, 11):
            sink.log({{"step": s, "loss": 1.0 / s}})
        os._exit(9)  # killed: no close
        """
    )
    subprocess.run([sys.executable, "-c", child], timeout=120, check=False)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 11))


def test_sinks_log_tensor_and_numpy_values_instead_of_dropping_them(tmp_path, monkeypatch):
    """`logger.log({"step": s, "eval_reward": rewards.mean()})`: TensorBoard and MLflow skipped
    a 0-dim tensor, a numpy int64 and a numpy float32 without a word; JSONL raised a raw
    'not JSON serializable'."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    record = {"step": 3, "eval_reward": torch.tensor(0.25), "eval_correct": np.int64(7),
              "eval_acc": np.float32(0.5), "eval_loss": 1.5, "eval_loss_fn": "m.f"}  # fmt: skip
    want = {"eval_reward": 0.25, "eval_correct": 7.0, "eval_acc": 0.5, "eval_loss": 1.5}
    tb = ft.logging.TensorBoardSink(tmp_path / "tb")
    tb.log(record)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {t: acc.Scalars(t)[0].value for t in acc.Tags()["scalars"]} == {
        k.replace("eval_", "eval/"): v for k, v in want.items()
    }
    ml = ft.logging.MLflowSink(tmp_path / "run", tracking_uri=uri)
    ml.log(record)
    ml.close()
    assert MlflowClient(uri).get_run(ml.run_id).data.metrics == want
    jsonl = ft.logging.JSONLSink(tmp_path / "m.jsonl")
    jsonl.log(record)
    jsonl.close()
    (line,) = ft.logging.read_jsonl(tmp_path / "m.jsonl")
    assert line == {"step": 3, **want, "eval_correct": 7, "eval_loss_fn": "m.f"}
    shaped = r"record\['eval_x'\] is a tensor of shape \(2,\)"
    with (
        ft.logging.Sinks(ft.logging.JSONLSink(tmp_path / "n.jsonl")) as sink,
        pytest.raises(TypeError, match=shaped),
    ):
        sink.log({"step": 1, "eval_x": torch.ones(2)})


def test_read_jsonl_keeps_every_field_of_records_sharing_a_step(tmp_path):
    """A record of another name at a log step (`test_loss`) replaced the train record of that
    step, and a second eval record the first: loss and eval_loss vanished from the plot."""
    sink = ft.logging.JSONLSink(tmp_path / "m.jsonl")
    sink.log({"step": 10, "loss": 2.0, "learning_rate": 0.1})
    sink.log({"step": 10, "test_loss": 2.5})
    sink.log({"step": 10, "eval_loss": 2.2})
    sink.log({"step": 10, "eval_accuracy_top5": 0.9})
    sink.log({"step": 10, "eval_loss": 2.1})  # a resumed run: the last value wins
    sink.close()
    assert ft.logging.read_jsonl(tmp_path / "m.jsonl") == [
        {"step": 10, "loss": 2.0, "learning_rate": 0.1, "test_loss": 2.5},
        {"step": 10, "eval_loss": 2.1, "eval_accuracy_top5": 0.9},
    ]


def test_a_resumed_mlflow_sink_refuses_another_experiment_or_run_name(tmp_path, monkeypatch):
    """The stored run id won silently: asked for experiment 'ablation', the run went on logging
    into 'baseline' (which was never created)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri, root = (tmp_path / "mlruns").as_uri(), tmp_path / "run"
    ft.logging.MLflowSink(root, tracking_uri=uri, experiment="baseline", run_name="a").close()
    with pytest.raises(ValueError, match="whose experiment is 'baseline', but experiment="):
        ft.logging.MLflowSink(root, tracking_uri=uri, experiment="ablation")
    with pytest.raises(ValueError, match="whose run_name is 'a', but run_name='b'"):
        ft.logging.MLflowSink(root, tracking_uri=uri, experiment="baseline", run_name="b")
    again = ft.logging.MLflowSink(root, tracking_uri=uri, experiment="baseline")
    assert again.resumed
    again.close()


@pytest.mark.parametrize("steps,warmup", [((3.5, 5), 1), ((3, 5.5), 1), ((True, 5), 0)])
def test_profiler_refuses_steps_that_are_no_ints(tmp_path, steps, warmup):
    """steps=(3.5, 5) was accepted, and since no state.step equals 2.5 the profiler never
    started: no trace, no error."""
    with pytest.raises(TypeError, match=r"steps must be \(first, last\), two ints"):
        ft.logging.Profiler(tmp_path, steps=steps, warmup=warmup)
    with pytest.raises(ValueError, match="warmup must be an int >= 0"):
        ft.logging.Profiler(tmp_path, steps=(4, 5), warmup=1.5)


# --- Logger ----------------------------------------------------------------------------------


class _Keep:
    def __init__(self):
        self.records = []

    def step(self, state):
        pass

    def log(self, record):
        self.records.append(dict(record))

    def close(self):
        pass


ROWS = [{"x": torch.randn(2, generator=torch.Generator().manual_seed(i)),
         "y": torch.randn(1, generator=torch.Generator().manual_seed(1000 + i))}
        for i in range(200)]  # fmt: skip


def _mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(), batch["y"].numel()


def _steps(state, logger, until, losses, *, hook=None):
    while state.step < until:
        for micro in ft.make_batches(ROWS, state, batch_size=2):
            grads, stats = ft.accumulate_grads(state, micro, _mse)
            state, info = ft.clip_and_step(state, grads, stats=stats, lr=0.01)
            losses[state.step] = float(stats.loss)
            logger.step(state, stats, info)
            if hook is not None and (restored := hook(state)) is not None:
                state = restored
                break
            if state.step >= until:
                break
        else:
            state = ft.next_epoch(state)
    return state


def test_the_last_steps_of_a_run_are_logged_at_total_steps_and_on_close():
    """total_steps=25, every=10: records at 1, 10, 20 only; steps 21-25 were in no record (the
    last one said samples_seen 40 of 50), and close() dropped them too."""
    keep, losses = _Keep(), {}
    state = _linear_state()
    with ft.logging.Logger(state, every=10, total_steps=25, sinks=[keep], progress=False) as log:
        state = _steps(state, log, 25, losses)
    assert [r["step"] for r in keep.records] == [1, 10, 20, 25]
    assert keep.records[-1]["samples_seen"] == 50
    assert keep.records[-1]["loss"] == pytest.approx(sum(losses[k] for k in range(21, 26)) / 5)
    early, losses = _Keep(), {}  # early stopping: the loop ends before a log step
    state = _linear_state()
    logger = ft.logging.Logger(state, every=10, total_steps=100, sinks=[early], progress=False)
    state = _steps(state, logger, 13, losses)
    logger.close()
    assert [r["step"] for r in early.records] == [1, 10, 13]
    assert early.records[-1]["loss"] == pytest.approx(sum(losses[k] for k in (11, 12, 13)) / 3)
    logger.close()  # a second close emits nothing
    assert len(early.records) == 3


def test_a_rollback_starts_a_new_log_window_at_the_restored_state(tmp_path):
    """Save at 15, roll back at 18 (a loss spike): the step-20 record averaged the undone steps
    16-18 with their replays, 13 losses over steps 11-20 (1.409 for a run whose steps since the
    restore averaged 1.163)."""
    keep, losses, rolled = _Keep(), {}, []

    def spike(state):
        if state.step == 15:
            ft.save_checkpoint(state, tmp_path)
        if state.step == 18 and not rolled:
            rolled.append(True)
            return ft.load_checkpoint(ft.latest_checkpoint(tmp_path), state)
        return None

    state = _linear_state(seed=0)
    logger = ft.logging.Logger(state, every=10, sinks=[keep], progress=False, first=False)
    _steps(state, logger, 20, losses, hook=spike)
    assert rolled and [r["step"] for r in keep.records] == [10, 20]
    assert keep.records[-1]["loss"] == pytest.approx(sum(losses[k] for k in range(16, 21)) / 5)
    assert keep.records[-1]["samples_per_second"] > 0


def test_logger_refuses_a_double_step_a_float_step_and_flags_that_are_no_bools():
    state = _linear_state()
    with pytest.raises(TypeError, match="progress must be True or False"):
        ft.logging.Logger(state, every=1, total_steps=3, progress="no")  # showed a bar
    with pytest.raises(TypeError, match="first must be True or False"):
        ft.logging.Logger(state, every=1, progress=False, first="no")
    logger = ft.logging.Logger(state, every=2, progress=False)
    grads, stats = ft.accumulate_grads(state, [BATCH], _square)
    state, info = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    logger.step(state, stats, info)
    with pytest.raises(ValueError, match="got step 1 twice"):
        logger.step(state, stats, info)  # would have counted step 1 twice in the mean
    with pytest.raises(TypeError, match="'step' must be an int"):
        logger.log({"step": 10.5, "eval_loss": 1.0})  # the sinks would log it at step 10


@pytest.mark.parametrize(
    "kw",
    [
        {"flops_per_token": -6.0},
        {"flops_per_token": math.nan},
        {"flops_per_token": True, "peak_flops": True},
        {"flops_per_token": 6.0, "peak_flops": math.inf},
    ],
)
def test_throughput_figures_that_are_no_positive_numbers_raise(kw):
    """A negative or NaN flops_per_token gave negative or NaN flops_per_second; True was 1;
    peak_flops=inf gave an mfu of 0."""
    with pytest.raises(ValueError, match=r"^(flops_per_token|peak_flops)"):
        ft.logging.Logger(_linear_state(), every=1, progress=False, **kw)


def test_mfu_divides_by_every_device_of_a_distributed_run(monkeypatch):
    """tokens_seen counts every rank's tokens: with peak_flops one device's peak, MFU on W
    ranks came out W times too high. SingleDevice in a process group (independent runs) keeps
    its own count."""
    import types

    import torch.distributed as dist

    from ftrain.extras.logging._window import _devices

    single = ft.strategies.SingleDevice("cpu")
    distributed = types.SimpleNamespace(world_size=2)  # stands for DDP/FSDP/TP
    assert _devices(single) == 1 and _devices(distributed) == 1  # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    assert _devices(distributed) == 4
    assert _devices(single) == 1


def test_track_best_refuses_another_metric_or_mode_than_the_state_ranks(tmp_path):
    """Ranking eval_loss (best 0.3) then metric='eval_accuracy', mode='max' made 0.55 the best
    accuracy (the previous one was 0.6) with the patience reset: two rankings mixed."""
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
    state = ft.track_best(state, {"eval_loss": 0.3})
    assert (state.early_stopping.metric, state.early_stopping.mode) == ("eval_loss", "min")
    for metric, mode in (("eval_accuracy", "max"), ("eval_loss", "max"), ("eval_f1", "min")):
        with pytest.raises(ValueError, match=rf"track_best\(metric='{metric}', mode='{mode}'\)"):
            ft.track_best(state, {metric: 0.55}, metric=metric, mode=mode)
    # kept through a checkpoint, so a resumed run is held to it too
    loaded = ft.load_checkpoint(
        ft.save_checkpoint(state, tmp_path),
        ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd()),
    )
    assert loaded.early_stopping == state.early_stopping
    with pytest.raises(ValueError, match="on a state that ranks metric='eval_loss'"):
        ft.track_best(loaded, {"eval_accuracy": 0.9}, metric="eval_accuracy", mode="max")
    # a fresh EarlyStoppingState starts a new ranking
    fresh = loaded.replace(early_stopping=ft.state.EarlyStoppingState())
    fresh = ft.track_best(fresh, {"eval_accuracy": 0.9}, metric="eval_accuracy", mode="max")
    assert fresh.early_stopping.best_metric == 0.9


def test_preference_losses_take_equal_shapes_of_any_rank():
    """The (B, 1) refusal must not refuse a single pair (0-dim) or (prompts, samples) log-probs
    of one shape: those are element-wise pairs, as before."""
    for shape in ((), (4, 2)):
        a, b, c, d = (torch.randn(shape) for _ in range(4))
        loss = P.dpo_loss(a, b, c, d, beta=0.1)
        want = -torch.nn.functional.logsigmoid(0.1 * ((a - c) - (b - d)))
        torch.testing.assert_close(loss, want)
