import pytest
import torch

import ftrain as ft


@pytest.fixture
def state():
    return ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())


def _steps(state, pred, n=12, **kw):
    return [k for k in range(n + 1) if pred(state.replace(step=k), **kw)]


def test_integer_every(state):
    assert _steps(state, ft.should_log, every=4) == [4, 8, 12]
    assert _steps(state, ft.should_log, every=4, first=True) == [1, 4, 8, 12]
    assert _steps(state, ft.should_eval, every=5, total_steps=12) == [5, 10, 12]
    assert _steps(state, ft.should_save, every=5, total_steps=12) == [5, 10, 12]
    assert _steps(state, ft.should_log, every=5, total_steps=12) == [5, 10]


def test_fractional_every_rounds_up_like_hf(state):
    assert _steps(state, ft.should_log, every=0.25, total_steps=10, n=10) == [3, 6, 9]
    assert _steps(state, ft.should_eval, every=0.5, total_steps=11, n=11) == [6, 11]


@pytest.mark.parametrize(
    "kw,err",
    [
        ({"every": 0}, ValueError),
        ({"every": 1.5}, ValueError),
        ({"every": 0.1}, ValueError),
        ({"every": "10"}, TypeError),
    ],
)
def test_bad_every(state, kw, err):
    with pytest.raises(err):
        ft.should_log(state, **kw)


def test_should_stop_hf_counting_rule(state):
    stops = []
    for loss in [1.0, 0.9, 0.95, 0.93]:
        state = ft.track_best(state, {"eval_loss": loss})
        stops.append(ft.should_stop(state, patience=2))
    assert stops == [False, False, False, True]
    assert (state.early_stopping.best_metric, state.early_stopping.patience_counter) == (0.9, 2)


def test_track_best_threshold_and_max_mode(state):
    s = ft.track_best(state.replace(step=3), 0.5, mode="max")
    s = ft.track_best(s.replace(step=4), 0.51, mode="max", threshold=0.05)
    # better but not by more than the threshold: best moves, patience grows (HF)
    assert (
        s.early_stopping.best_metric,
        s.early_stopping.best_step,
        s.early_stopping.patience_counter,
    ) == (0.51, 4, 1)
    s = ft.track_best(s.replace(step=5), 0.7, mode="max", threshold=0.05)
    assert (
        s.early_stopping.best_metric,
        s.early_stopping.best_step,
        s.early_stopping.patience_counter,
    ) == (0.7, 5, 0)
    with pytest.raises(KeyError, match="eval_acc"):
        ft.track_best(s, {"eval_loss": 1.0}, metric="eval_acc")
    with pytest.raises(ValueError, match="patience"):
        ft.should_stop(s, patience=0)


@pytest.mark.parametrize("total", [0, -5, 2.5, True])
def test_bad_total_steps_raises_naming_it(state, total):
    # Issue 20 item 20: total_steps=0 divided by zero for a fractional every; negatives passed.
    for pred in (ft.should_log, ft.should_eval, ft.should_save):
        with pytest.raises(ValueError, match="total_steps"):
            pred(state.replace(step=5), every=0.1, total_steps=total)
        with pytest.raises(ValueError, match="total_steps"):
            pred(state.replace(step=5), every=10, total_steps=total)


@pytest.mark.parametrize("mode,later", [("min", [2.0, 1.5]), ("max", [0.5, 0.7])])
def test_track_best_never_keeps_nan_as_the_best(state, mode, later):
    # Issue 20 item 21: a first NaN evaluation stayed the best forever and stopped the run.
    s = ft.track_best(state.replace(step=1), float("nan"), mode=mode)
    assert s.early_stopping.best_metric is None and s.early_stopping.patience_counter == 1
    s = ft.track_best(s.replace(step=2), later[0], mode=mode)
    assert (
        s.early_stopping.best_metric,
        s.early_stopping.best_step,
        s.early_stopping.patience_counter,
    ) == (later[0], 2, 0)
    s = ft.track_best(s.replace(step=3), float("nan"), mode=mode)
    assert (
        s.early_stopping.best_metric,
        s.early_stopping.best_step,
        s.early_stopping.patience_counter,
    ) == (later[0], 2, 1)
    s = ft.track_best(s.replace(step=4), later[1], mode=mode)
    assert (
        s.early_stopping.best_metric,
        s.early_stopping.best_step,
        s.early_stopping.patience_counter,
    ) == (later[1], 4, 0)
    assert not ft.should_stop(s, patience=1)


class _ClfForSequenceClassification(torch.nn.Linear):  # an HF-style head, by name
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # called as model(x=...) by default_loss
        return super().forward(x)


def _focal(model, batch):
    logp = torch.log_softmax(model(batch["x"]), -1).gather(-1, batch["labels"][:, None])
    return -(((1 - logp.exp()) ** 2) * logp).sum(), torch.tensor(logp.numel())


def test_early_stopping_ranks_the_loss_the_record_names():
    # Issue 26: train on a focal loss; evaluate(state, val) alone would rank cross-entropy.
    # The record names its loss, so early stopping on the training loss is visible as such.
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    rows = [{"x": x[i], "labels": y[i]} for i in range(64)]
    state = ft.TrainState.create(_ClfForSequenceClassification(4, 3), ft.optim.sgd(), seed=0)
    records, stopped_at = [], None
    for _ in range(40):
        for micro in ft.make_batches(rows[:48], batch_size=16, seed=0, epoch=state.epoch):
            grads, stats = ft.accumulate_grads(state, micro, _focal)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=3.0)
        state = ft.next_epoch(state)
        val = ft.make_batches(rows[48:], batch_size=8, shuffle=False)
        records.append(ft.evaluate(state, val, _focal))
        state = ft.track_best(state, records[-1])
        if ft.should_stop(state, patience=2):
            stopped_at = len(records)
            break
    assert stopped_at is not None  # the large learning rate overshoots: no improvement twice
    assert {r["eval_loss_fn"] for r in records} == {f"{__name__}._focal"}
    assert state.early_stopping.best_metric == min(r["eval_loss"] for r in records)
    # Without loss_fn, evaluate reports the loss the state trained on (state.loss_fn) ...
    again = ft.evaluate(state, ft.make_batches(rows[48:], batch_size=8, shuffle=False))
    assert again["eval_loss_fn"] == f"{__name__}._focal"
    assert again["eval_loss"] == records[-1]["eval_loss"]
    # ... and an evaluation with another loss is refused when ranked by eval_loss.
    default = ft.evaluate(
        state, ft.make_batches(rows[48:], batch_size=8, shuffle=False), ft.losses.default_loss
    )
    assert default["eval_loss"] != pytest.approx(records[-1]["eval_loss"])
    with pytest.raises(ValueError, match="trains on"):
        ft.track_best(state, default)


def test_track_best_refuses_an_eval_loss_of_another_loss_than_the_best_s(tmp_path):
    """Resumed before its first step, a state built without `loss_fn=` evaluates with another
    loss than the one the best was ranked by (the loss function is not in the checkpoint): the
    two were compared, and the patience counted against a best of another loss, silently."""

    def mse(m, b):
        return ((m(b[0]) - b[1]) ** 2).sum(), b[1].numel()

    def l1(m, b):
        return (m(b[0]) - b[1]).abs().sum(), b[1].numel()

    torch.manual_seed(0)
    batches = [(torch.randn(4, 2), torch.randn(4, 1))]
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    state = ft.track_best(state, ft.evaluate(state, batches, loss_fn=mse))
    assert state.early_stopping.loss.endswith("mse")
    path = ft.save_checkpoint(state, tmp_path)
    resumed = ft.load_checkpoint(path, ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()))
    assert resumed.early_stopping.loss == state.early_stopping.loss  # kept in the checkpoint
    with pytest.raises(ValueError, match="the two do not compare"):
        ft.track_best(resumed, ft.evaluate(resumed, batches, loss_fn=l1))
    assert ft.track_best(resumed, ft.evaluate(resumed, batches, loss_fn=mse)).step == 0


@pytest.mark.parametrize(
    "metric", ["val/acc", "eval/accuracy", "val.f1", "valAcc", "test/bleu", "eval/rouge1"]
)
def test_a_score_named_with_slashes_dots_or_camel_case_needs_a_mode_too(state, tmp_path, metric):
    """Only "_" and "-" split a name into words: "val/acc" (Lightning's style, and a nested
    record's key), "val.f1", "valAcc" were one word each, ranked with the default "min": the
    worst score was kept as the best, and keep_best rotation deleted the best checkpoint."""
    with pytest.raises(ValueError, match=rf"track_best\(metric='{metric}'\) needs mode"):
        ft.track_best(state, {metric: 0.5}, metric=metric)
    with pytest.raises(ValueError, match=rf"save_checkpoint\(best_metric='{metric}'\) needs"):
        ft.save_checkpoint(state, tmp_path, metrics={metric: 0.5}, best_metric=metric)
    assert ft.track_best(state, {metric: 0.5}, metric=metric, mode="max").early_stopping.mode
    for name in ("val/loss", "eval/mae", "eval_rmse", "eval/perplexity"):  # still "min"
        assert ft.track_best(state, {name: 1.0}, metric=name).early_stopping.mode == "min"


@pytest.mark.parametrize(
    "metric",
    ["rewardLoss", "diceLoss", "eval/dice_loss_mean", "eval/iou_loss_avg", "eval/accum_steps",
     "eval/accelerator_time", "val_losses"],
)  # fmt: skip
def test_a_loss_named_with_camel_case_or_a_suffix_still_ranks_min(state, metric):
    """Splitting names at humps and dots asked for a mode on losses: "rewardLoss" ends with
    "Loss", not "loss"; "eval/dice_loss_mean" holds "loss" as a word; "accum"/"accel" began
    like "acc"uracy. A loss word ranks "min" as a name ending in "loss" does."""
    assert ft.track_best(state, {metric: 1.0}, metric=metric).early_stopping.mode == "min"
