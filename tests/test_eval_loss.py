"""Evaluation reports the loss the state trains on (issue 26, item 5): after training with a
focal loss, `evaluate`, `track_best` and checkpoint retention rank by the focal loss, never
silently by the default cross-entropy."""

from __future__ import annotations

import json

import pytest
import torch

import ftrain as ft
from helpers import tiny_bert_tagger


def focal(model, batch):
    """Token-level focal loss (gamma 2): a sum over labelled tokens and their count."""
    logits = ft.losses.upcast(ft.losses.model_logits(model, batch))
    labels = batch["labels"]
    keep = labels != -100
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (-((1 - logp.exp()) ** 2) * logp * keep).sum(), keep.sum()


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 61, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        rows.append({"input_ids": ids.tolist(), "labels": (ids % 5).tolist()})
    return rows


TRAIN, VAL = _rows(32, 0), _rows(12, 1)


def _val():
    return ft.make_batches(VAL, batch_size=4, shuffle=False)


def _train(state, steps, loss_fn=None):
    while state.step < steps:
        for group in ft.make_batches(TRAIN, state, batch_size=4, accum=2):
            grads, stats = ft.accumulate_grads(state, group, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=5e-3, max_norm=1.0)
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return state


def _manual(state, loss_fn):
    """The global (sum / count) of `loss_fn` over the validation rows, computed by hand."""
    total = count = 0.0
    with torch.no_grad():
        state.model.eval()
        for group in _val():
            for batch in group:
                s, n = loss_fn(state.model, batch)
                total, count = total + float(s), count + float(n)
    return total / count


def test_evaluate_reports_the_loss_the_state_trained_on():
    state = _train(ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw()), 2, focal)
    assert state.loss_fn is focal  # recorded by clip_and_step from the step's stats
    record = ft.evaluate(state, _val())
    assert record["eval_loss_fn"].endswith(".focal")
    assert record["eval_loss"] == pytest.approx(_manual(state, focal), rel=1e-9)
    ce = ft.losses.token_classification_loss()
    assert abs(record["eval_loss"] - _manual(state, ce)) > 1e-3  # it is not cross-entropy


def test_with_classification_metrics_the_metrics_loss_keeps_its_own_name():
    state = _train(ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw()), 2, focal)
    record = ft.evaluate(state, _val(), metrics_fn=ft.classification_metrics)
    assert record["eval_loss"] == pytest.approx(_manual(state, focal), rel=1e-9)
    ce = ft.losses.token_classification_loss()
    assert record["eval_metrics_loss"] == pytest.approx(_manual(state, ce), rel=1e-9)
    assert 0.0 <= record["eval_accuracy"] <= 1.0
    # A state on the default loss keeps the single-pass form: the metrics' loss is eval_loss.
    plain = _train(ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw()), 1)
    record = ft.evaluate(plain, _val(), metrics_fn=ft.classification_metrics)
    assert "eval_metrics_loss" not in record
    assert record["eval_loss_fn"] == "ftrain.eval.classification_metrics"


def test_a_loss_declared_at_create_is_used_by_accumulate_grads_and_evaluate():
    declared = ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw(), loss_fn=focal)
    explicit = ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw())
    group = next(iter(ft.make_batches(TRAIN, declared, batch_size=4, accum=2)))
    g1, s1 = ft.accumulate_grads(declared, group)
    g2, s2 = ft.accumulate_grads(explicit, group, focal)
    assert s1.loss_fn is focal and float(s1.loss) == float(s2.loss)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=0, atol=0)
    assert ft.evaluate(declared, _val())["eval_loss_fn"].endswith(".focal")


def test_create_refuses_a_loss_that_is_not_callable():
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw(), loss_fn="focal")


def test_track_best_refuses_an_eval_loss_of_another_loss():
    state = _train(ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw()), 1, focal)
    other = ft.evaluate(state, _val(), loss_fn=ft.losses.token_classification_loss())
    with pytest.raises(ValueError, match=r"track_best: metrics' eval_loss is .* trains on .*focal"):
        ft.track_best(state, other)
    ft.track_best(state, other, metric="eval_items")  # another key is the user's explicit call
    ft.track_best(state, ft.evaluate(state, _val()))


def test_early_stopping_and_retention_rank_by_the_training_loss(tmp_path):
    """A focal-loss run evaluated every step: the checkpoint kept as best and the early-stopping
    best are those of the lowest focal loss, computed by hand, not of the cross-entropy."""
    state = ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw(), seed=3)
    focal_by_step, ce_by_step = {}, {}
    ce = ft.losses.token_classification_loss()
    for _ in range(6):
        state = _train(state, state.step + 1, focal)
        record = ft.evaluate(state, _val())
        focal_by_step[state.step] = _manual(state, focal)
        ce_by_step[state.step] = _manual(state, ce)
        assert record["eval_loss"] == pytest.approx(focal_by_step[state.step], rel=1e-9)
        state = ft.track_best(state, record)
        ft.save_checkpoint(
            state, tmp_path, metrics=record, keep_last=1, keep_best=1, best_metric="eval_loss"
        )
    best = min(focal_by_step, key=focal_by_step.__getitem__)
    assert state.early_stopping.best_step == best
    kept = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("step-*"))
    assert best in kept and 6 in kept and len(kept) <= 2
    meta = json.loads((tmp_path / f"step-{best}" / "state.json").read_text())
    assert "focal" in json.dumps(meta)


def test_per_sample_grads_use_the_declared_loss_too():
    declared = ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw(), loss_fn=focal)
    batch = ft.data.pad_collate()(TRAIN[:3])
    got = ft.func.per_sample_grads(declared, batch, chunk_size=1)  # HF masks: no vmap
    want = ft.func.per_sample_grads(declared, batch, loss_fn=focal, chunk_size=1)
    other = ft.func.per_sample_grads(declared, batch, loss_fn=ft.losses.default_loss, chunk_size=1)
    assert any(not torch.equal(got[n], other[n]) for n in got)  # focal, not cross-entropy
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_private_grads_record_the_loss_and_the_data_position_as_accumulate_grads():
    """DP-SGD steps keep the state's data position (so a resume continues exactly) and its
    training loss (so evaluate reports it)."""
    rows = [{"x": [float(i), 1.0], "labels": [float(i % 2)]} for i in range(16)]

    def mse(model, batch):
        return ((model(batch["x"]) - batch["labels"]) ** 2).sum(), batch["x"].shape[0]

    def run(grads_fn):
        state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(), seed=0)
        group = next(iter(ft.make_batches(rows, state, batch_size=4, accum=2)))
        grads, stats = grads_fn(state, group)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
        return state

    dp = run(lambda s, g: ft.func.private_grads(s, g, mse, max_norm=1.0, noise_multiplier=0.0))
    plain = run(lambda s, g: ft.accumulate_grads(s, g, mse))
    assert dp.loss_fn is mse and dp.data.position == plain.data.position is not None


def test_a_default_loss_run_ranks_classification_metrics_eval_loss():
    """The everyday case stays open: trained on the default loss, evaluated with
    classification_metrics (its cross-entropy is the default loss), ranked by eval_loss."""
    state = _train(ft.TrainState.create(tiny_bert_tagger(), ft.optim.adamw()), 1)
    assert state.loss_fn is ft.losses.default_loss
    record = ft.evaluate(state, _val(), metrics_fn=ft.classification_metrics)
    state = ft.track_best(state, record)
    assert state.early_stopping.best_metric == record["eval_loss"]
