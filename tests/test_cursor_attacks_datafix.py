"""The keyword loop (make_batches(data, epoch=state.epoch, start=state.data.cursor, ...), no
state) with an auxiliary make_batches(aux, batch_size=...) mixed into each step: the cursor
counted the auxiliary micro-batches too, and the next call started late (rows skipped). It
counts the training call's now, or refuses where it cannot tell which call that is."""

from __future__ import annotations

import pytest

import ftrain as ft
from helpers import batch_ids as _ids
from helpers import id_loss as _loss
from helpers import id_rows
from helpers import id_step as _step
from helpers import linear_state as _state

N = 24
ROWS = id_rows(N)
AUX = [{"input_ids": [100 + i]} for i in range(400)]
MIX = {
    "after": lambda g, extra: [*g, *extra],
    "before": lambda g, extra: [*extra, *g],
    "wrapped": lambda g, extra: ft.data.MicroBatches((*g, *extra), g.position),
}


def _keyword_loop(mix, aux_accum, stop_every=1, **aux_kw):
    """The keyword loop, stopped and called again after every `stop_every` steps (a resume)."""
    state, seen = _state(), []
    aux = iter(ft.make_batches(AUX, batch_size=2, accum=aux_accum, seed=1, **aux_kw))
    while state.data.cursor < N // 2:
        kw = {"seed": 0, "epoch": state.epoch, "start": state.data.cursor}
        for group in ft.make_batches(ROWS, batch_size=2, accum=3, **kw):
            seen += _ids(group)
            extra = next(aux)  # (held while the step runs: a group alive is traced to its call)
            state = _step(state, MIX[mix](group, extra))
            if state.step % stop_every == 0:
                break
    return state, seen


@pytest.mark.parametrize("mix", MIX)
@pytest.mark.parametrize("aux_accum", [1, 2, 3])
def test_the_keyword_loop_with_an_auxiliary_stream_resumes_without_skipping_rows(mix, aux_accum):
    """Stopped and called again after every step: with aux_accum=1 the cursor went 0 -> 4 ->
    8 -> 12, and rows 7-8 and 15-16 were never read (22 of 24)."""
    state, seen = _keyword_loop(mix, aux_accum)
    assert state.data.cursor == N // 2 and state.step == 4
    assert sorted(seen) == list(range(1, N + 1))


def test_an_auxiliary_call_given_start_too_is_told_apart_where_it_is_not_at_the_cursor():
    """The auxiliary call given start= of its own (its micro-batch 0 while the cursor is at 3):
    only the training call's stand at the cursor (as before: the auxiliary one lies before the
    cursor, so it counted as replay)."""
    state = _state()
    group = next(iter(ft.make_batches(ROWS, batch_size=2, accum=3, seed=0, start=0)))
    state = _step(state, group)
    del group
    group = next(iter(ft.make_batches(ROWS, batch_size=2, accum=3, seed=0, start=3)))
    extra = next(iter(ft.make_batches(AUX, batch_size=2, seed=1, start=0)))
    state = _step(state, [*group, *extra])
    assert state.data.cursor == 6


def test_two_calls_given_start_at_the_cursor_with_other_counts_raise_naming_the_fix():
    """Both given start=state.data.cursor, 3 and 1 micro-batches: which one's does the cursor
    count? Refused before any forward, naming the fix."""
    state = _state()
    group = next(iter(ft.make_batches(ROWS, batch_size=2, accum=3, seed=0, start=0)))
    extra = next(iter(ft.make_batches(AUX, batch_size=2, seed=1, start=0)))
    with pytest.raises(ValueError, match=r"would advance it by \[1, 3\]") as e:
        ft.accumulate_grads(state, [*group, *extra], _loss)
    assert "make_batches(data, state, ...)" in str(e.value)
    with pytest.raises(ValueError, match=r"would advance it by \[1, 3\]"):
        ft.func.private_grads(state, [*group, *extra], _loss, max_norm=1.0, noise_multiplier=0.0)


def test_two_calls_at_the_cursor_with_the_same_count_count_once():
    """The auxiliary call given start= too, with the training call's accum: either call's
    count is the step's (3), so nothing is refused."""
    state, seen = _keyword_loop("after", 3, start=0)
    assert state.data.cursor == N // 2
    assert sorted(seen) == list(range(1, N + 1))


def test_the_state_loop_with_an_auxiliary_stream_is_unchanged():
    state, seen = _state(), []
    aux = iter(ft.make_batches(AUX, batch_size=2, seed=1))
    for group in ft.make_batches(ROWS, state, batch_size=2, accum=3):
        seen += _ids(group)
        extra = next(aux)
        state = _step(state, [*extra, *group])
    assert state.data.cursor == N // 2
    assert sorted(seen) == list(range(1, N + 1))


def test_evaluate_over_two_calls_without_a_state_is_let_be():
    """The cursor rule is a training step's: evaluate mixes calls freely, as before."""
    state = _state()
    a = next(iter(ft.make_batches(ROWS, batch_size=2, accum=3, seed=0, start=0)))
    b = next(iter(ft.make_batches(AUX, batch_size=2, seed=1, start=0)))
    assert ft.evaluate(state, [[*a, *b]], _loss)["eval_items"] == 8


@pytest.mark.parametrize("aux_accum", [1, 3])
def test_the_keyword_loop_with_an_auxiliary_stream_and_a_replay_buffer_of_groups(aux_accum):
    """[*group, *aux_group, *buf[0]]: the buffer's micro-batches lie before the cursor
    (replay), the auxiliary call's count as built by hand; every step advances by 3."""
    state, seen, buf = _state(), [], []
    aux = iter(ft.make_batches(AUX, batch_size=2, accum=aux_accum, seed=1))
    while state.data.cursor < N // 2:
        kw = {"seed": 0, "epoch": state.epoch, "start": state.data.cursor}
        group = next(iter(ft.make_batches(ROWS, batch_size=2, accum=3, **kw)))
        seen += _ids(group)
        extra = next(aux)  # held, as in the loop: a group gone is one built by hand
        state = _step(state, [*group, *extra, *(buf[0] if buf else [])])
        assert state.data.cursor == 3 * state.step
        buf.append(group)
    assert sorted(seen) == list(range(1, N + 1))


def test_a_token_budget_step_of_the_keyword_loop_with_an_auxiliary_stream():
    """Three accum=1 groups gathered (only the last alive) and an auxiliary micro-batch: the
    freed ones fill the gap from the cursor, the auxiliary one does not count."""
    state, seen = _state(), []
    aux = iter(ft.make_batches(AUX, batch_size=2, seed=1))
    while state.data.cursor < N // 2:
        kw = {"seed": 0, "epoch": state.epoch, "start": state.data.cursor}
        gathered = []
        for group in ft.make_batches(ROWS, batch_size=2, accum=1, **kw):
            gathered += list(group)
            if len(gathered) == 3:
                break
        seen += _ids(gathered)
        extra = next(aux)
        state = _step(state, [*gathered, *extra])
        assert state.data.cursor == 3 * state.step
    assert sorted(seen) == list(range(1, N + 1))
