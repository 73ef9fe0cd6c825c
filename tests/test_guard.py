"""The loss-spike guard on an injected spike: rollback, skip, log, and the same decisions after a
resume."""

import logging

import pytest
import torch

import ftrain as ft
from helpers import ragged_rows, tiny_llama

POISON = 60  # only the poisoned rows start with this token


def _rows(poisoned):
    rows = ragged_rows(40, seed=7)
    for i, r in enumerate(rows):
        first = POISON if i in poisoned else min(r["input_ids"][0], POISON - 1)
        r["input_ids"] = [first, *r["input_ids"][1:]]
    return rows


ROWS = _rows({12, 13})  # micro-batch 6 of epoch 0 at batch size 2


def _loss(scale):
    plain = ft.losses.causal_lm_loss()

    def loss_fn(model, batch):
        loss, n = plain(model, batch)
        hit = (batch["input_ids"][:, 0] == POISON).any()
        return torch.where(hit, loss * scale, loss), n

    return loss_fn


def _run(root, steps, *, scale=100.0, guard=None, stop_at=None, state=None, rows=ROWS,
         shuffle=False, trained=None):  # fmt: skip
    """The README loop with the guard; returns the state and the verdicts that rolled back.
    `trained` collects the first token of every row an update was taken on."""
    guard = guard or ft.guard.SpikeGuard(factor=3.0, warmup=3, beta=0.9)
    if state is None:
        state = ft.guard.GuardedState.create(tiny_llama(), ft.optim.adamw(), seed=0)
        if (ckpt := ft.latest_checkpoint(root)) is not None:
            state = ft.load_checkpoint(ckpt, state)
    rolled = []
    loss_fn = _loss(scale)
    while state.step < steps:
        for micro in ft.make_batches(rows, state, batch_size=2, shuffle=shuffle):
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, verdict = guard.observe(state, stats)
            if verdict.rollback:
                rolled.append((state.step, state.data.cursor, verdict.reason))
                del grads
                state = guard.rollback(state, root, skip=micro)
                break
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2, max_norm=1.0)
            if trained is not None:
                trained += [int(t) for b in micro for t in b["input_ids"][:, 0]]
            if ft.should_save(state, every=4):
                ft.save_checkpoint(state, root)
            if state.step in (stop_at, steps):
                return state, rolled
        else:
            state = ft.next_epoch(state)
    return state, rolled


def test_a_spike_rolls_back_skips_the_batch_logs_it_and_resumes_the_same(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ftrain.extras.guard"):
        whole, rolled = _run(tmp_path / "whole", 8)
    assert len(rolled) == 1
    step, cursor, reason = rolled[0]
    assert (step, cursor) == (6, 6) and "its average" in reason  # micro-batch 6
    # Back to the step-4 checkpoint, the data on from micro-batch 7: 4 more steps end at 11.
    assert (whole.rollbacks, whole.step, whole.data.cursor) == (1, 8, 11)
    (record,) = caplog.records
    assert "rollback 1 at step 6" in record.getMessage()
    assert "(step 4); skipping micro-batches [6, 7)" in record.getMessage()
    # A crash after the rollback, before the next save: the resume reloads step 4, meets the
    # spike again with the saved loss average, and rolls back the same way.
    _, rolled_first = _run(tmp_path / "crash", 8, stop_at=7)
    resumed, rolled_again = _run(tmp_path / "crash", 8)
    assert rolled_first == rolled_again == rolled
    for n, p in whole.params.items():
        assert torch.equal(resumed.params[n], p), n
    saved = (resumed.loss_avg, resumed.loss_var, resumed.loss_count)
    assert saved == (whole.loss_avg, whole.loss_var, whole.loss_count)


def test_a_run_of_nonfinite_losses_rolls_back(tmp_path):
    guard = ft.guard.SpikeGuard(max_nonfinite=2, warmup=3)
    rows = _rows({12, 13, 14, 15})  # micro-batches 6 and 7: two non-finite losses in a row
    state, rolled = _run(tmp_path, 8, scale=float("nan"), guard=guard, rows=rows)
    assert rolled == [(7, 7, "2 non-finite losses in a row")]
    assert (state.step, state.data.cursor, state.nonfinite_run) == (8, 12, 0)


def test_errors_and_the_no_checkpoint_case(tmp_path, caplog):
    plain = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    with pytest.raises(TypeError, match="GuardedState"):
        ft.guard.SpikeGuard().observe(plain, 1.0)
    bad_args = [(dict(factor=1.0), "factor"), (dict(beta=1.0), "beta"),
                (dict(warmup=0), "warmup"), (dict(max_nonfinite=0), "max_nonfinite"),
                (dict(max_rollbacks=0), "max_rollbacks"),
                (dict(max_rollbacks=True), "max_rollbacks")]  # fmt: skip
    for bad, match in bad_args:
        with pytest.raises(ValueError, match=match):
            ft.guard.SpikeGuard(**bad)
    state = ft.guard.GuardedState.create(tiny_llama(), ft.optim.sgd())
    state = state.replace(data=state.data.replace(cursor=5))
    with pytest.raises(ValueError, match="skip"):
        ft.guard.SpikeGuard().rollback(state, tmp_path, skip=0)
    with caplog.at_level(logging.WARNING, logger="ftrain.extras.guard"):
        state = ft.guard.SpikeGuard().rollback(state, tmp_path, skip=2)
    assert (state.data.cursor, state.step, state.rollbacks) == (7, 0, 1)
    assert "no checkpoint to load" in caplog.text


def _verdicts(guard, losses):
    state = ft.guard.GuardedState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    out = []
    for loss in losses:
        state, verdict = guard.observe(state, loss)
        out.append(verdict.rollback)
    return state, out


def test_negative_and_near_zero_losses_spike_only_when_they_rise_far():
    guard = ft.guard.SpikeGuard(factor=3.0, warmup=3, beta=0.9)
    # Before: with a negative average every loss after warm-up was "> 3 x the average", so
    # every step rolled back (issue 27, item 7).
    noisy = [-1.0, -1.1, -0.9, -1.0, -1.05, -0.95, -1.2, -0.8] * 5
    state, rolled = _verdicts(guard, noisy)
    assert not any(rolled)
    scale = max(abs(state.loss_avg), 3 * state.loss_var**0.5)  # the documented rule
    assert scale == abs(state.loss_avg)
    _, rolled = _verdicts(guard, [*noisy, state.loss_avg + 1.9 * scale])
    assert rolled[-1] is False
    _, rolled = _verdicts(guard, [*noisy, state.loss_avg + 2.1 * scale, -5.0])
    assert rolled[-2:] == [True, False]  # a rise spikes; a fall never does
    # Around zero the loss's own noise is the yardstick: 3 * (factor - 1) = 6 std.
    around_zero = [0.01, -0.01, 0.02, -0.02, 0.0, 0.015, -0.015] * 5
    state, rolled = _verdicts(guard, around_zero)
    assert not any(rolled)
    std = state.loss_var**0.5
    assert abs(state.loss_avg) < 3 * std
    _, rolled = _verdicts(guard, [*around_zero, state.loss_avg + 5.9 * std])
    assert rolled[-1] is False
    _, rolled = _verdicts(guard, [*around_zero, state.loss_avg + 6.1 * std])
    assert rolled[-1] is True


def test_positive_losses_keep_the_ratio_rule():
    guard = ft.guard.SpikeGuard(factor=3.0, warmup=3)
    steady = [2.0] * 10  # variance 0: the scale is the average
    assert _verdicts(guard, [*steady, 5.99])[1][-1] is False
    assert _verdicts(guard, [*steady, 6.01])[1][-1] is True
    # A falling loss with spikes: the decisions of the rule before, `loss > factor * avg`.
    guard = ft.guard.SpikeGuard(factor=3.0, warmup=3, beta=0.8)
    losses = [4.0, 3.5, 3.2, 3.0, 2.9, 2.8, 11.5, 2.7, 2.6, 9.7, 2.5, 2.45, 2.4, 8.5, 2.3]
    avg, count, before = None, 0, []
    for loss in losses:
        spike = avg is not None and count >= guard.warmup and loss > guard.factor * avg
        before.append(spike)
        if not spike:
            avg = loss if avg is None else guard.beta * avg + (1 - guard.beta) * loss
            count += 1
    assert _verdicts(guard, losses)[1] == before
    assert before.count(True) == 3


def test_a_loss_that_keeps_spiking_stops_after_max_rollbacks(tmp_path, caplog):
    # Every micro-batch from 6 on spikes: each rollback skips one and meets the next. Before,
    # nothing bounded the rollbacks.
    guard = ft.guard.SpikeGuard(factor=3.0, warmup=3, beta=0.9, max_rollbacks=3)
    rows = _rows(set(range(12, 40)))
    want = r"3 rollbacks done, max_rollbacks=3 reached at step 4 \(epoch 0, micro-batch 9\)"
    log_level = caplog.at_level(logging.WARNING, logger="ftrain.extras.guard")
    with log_level, pytest.raises(ft.guard.GuardError, match=want):
        _run(tmp_path, 20, guard=guard, rows=rows)
    assert [r.getMessage().split(" at step")[0] for r in caplog.records] == [
        f"loss guard: rollback {k}" for k in (1, 2, 3)
    ]
    # The default cap is finite too.
    assert ft.guard.SpikeGuard().max_rollbacks == 20


def _stream(rows, buffer=1000):
    return ft.data.stream(ft.data.IterableRows(rows), shuffle_buffer=buffer)


def test_the_guard_loop_on_a_stream_skips_the_spike_and_equals_a_run_without_those_rows(tmp_path):
    # Before: after the rollback, make_batches raised "state.data.position is the position for
    # {cursor: 4}, but the state is at {cursor: 7}" (issue 27, item 12).
    trained = []
    whole, rolled = _run(tmp_path / "whole", 8, rows=_stream(ROWS), trained=trained)
    assert [(step, cursor) for step, cursor, _ in rolled] == [(6, 6)]
    assert (whole.rollbacks, whole.step, whole.data.cursor) == (1, 8, 11)
    assert POISON not in trained
    # Back to the step-4 checkpoint (rows 0-7), the stream on from micro-batch 7 (row 14): the
    # same as a run that never had rows 8-13, and as the guard on the list of rows.
    without, _ = _run(tmp_path / "without", 8, rows=_stream(ROWS[:8] + ROWS[14:]))
    on_a_list, _ = _run(tmp_path / "list", 8)
    for n, p in whole.params.items():
        assert torch.equal(without.params[n], p), n
        assert torch.equal(on_a_list.params[n], p), n
    # A crash after the rollback, before the next save: the same decisions on resume.
    _, rolled_first = _run(tmp_path / "crash", 8, rows=_stream(ROWS), stop_at=7)
    resumed, rolled_again = _run(tmp_path / "crash", 8, rows=_stream(ROWS))
    assert rolled_first == rolled_again == rolled
    for n, p in whole.params.items():
        assert torch.equal(resumed.params[n], p), n


def test_the_guard_loop_on_a_shuffled_stream_never_trains_on_the_spike(tmp_path):
    trained = []
    state, rolled = _run(tmp_path, 10, rows=_stream(ROWS, buffer=8), shuffle=True,
                         trained=trained)  # fmt: skip
    assert [(step, cursor) for step, cursor, _ in rolled] == [(5, 5)]  # rows 12, 13 met at 5
    assert state.step == 10 and POISON not in trained
    assert len(trained) == 2 * (10 + 1)  # step 5 was taken twice: before and after the rollback


def test_an_int_skip_on_a_stream_is_refused_naming_the_fix(tmp_path):
    state = ft.guard.GuardedState.create(tiny_llama(), ft.optim.sgd())
    micro = next(iter(ft.make_batches(_stream(ROWS), state, batch_size=2, shuffle=False)))
    grads, stats = ft.accumulate_grads(state, micro)
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
    with pytest.raises(ValueError, match=r"skip=1 on a stream: .* Pass skip=micro"):
        ft.guard.SpikeGuard().rollback(state, tmp_path, skip=1)
    with pytest.raises(ValueError, match=r"skip must be the micro-batches observed"):
        ft.guard.SpikeGuard().rollback(state, tmp_path, skip=True)


def test_an_int_skip_works_on_map_style_data_that_carries_a_position():
    # Map-style groups carry a position too (the row reached); an int skip is refused only on
    # a stream, where only the group knows where the data stands after it.
    state = ft.guard.GuardedState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
    rows = [{"x": [float(i)]} for i in range(8)]
    micro = next(iter(ft.make_batches(rows, state, batch_size=2, accum=2)))
    assert micro.position is not None and '"kind":"map"' in micro.position
    moved = state.replace(data=state.data.replace(cursor=2, position=micro.position))
    guard = ft.guard.SpikeGuard(factor=3.0, warmup=1)
    assert guard.rollback(moved, "/nonexistent-root-for-this-test", skip=2).data.cursor == 4


def test_ddp_ranks_roll_back_to_the_same_checkpoint_after_a_background_save(tmp_path):
    """Under DDP rank 0 writes: the other ranks had no save in flight to wait for, listed the
    folder before rank 0's commit and loaded another checkpoint (or none): the load's
    agreement check failed, or the job hung until the collective timeout."""
    from guard_workers import rollback_after_a_background_save
    from launch import run_ranks

    out = tmp_path / "out"
    out.mkdir()
    run_ranks(rollback_after_a_background_save, str(tmp_path / "run"), str(out), timeout=90)
    assert [(out / f"rank{r}").read_text() for r in (0, 1)] == ["2", "2"]
