"""Exact resume when a step gets a plain list, tuple or slice of the micro-batches make_batches
yielded (`list(micro)`, `micro[:k]` then `micro[k:]`): the data position travels as with the
group itself. Before, `Stats.position` was None for anything but the group: `clip_and_step`
dropped the state's position, so a run resumed with another batch size repeated rows (4 of
24 after 2 steps of 4 rows resumed at 2), skipped them, or (a stream) could not resume at
all. Where the order cannot be right (micro-batches left out, reordered, a group cut short),
the step raises, naming what to pass instead; mixed with batches built by hand (or of groups
already freed) they have no position, as batches built by hand."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch

import ftrain as ft
from ftrain.data import step_data
from helpers import batch_ids as _ids
from helpers import id_loss as _loss
from helpers import id_rows
from helpers import linear_state as _state

N = 24
ROWS = id_rows(N)


def _train(state, data, batch_size, steps, split):
    """`steps` groups of 3 micro-batches, each stepped on as `split(group)` gives it."""
    seen = []
    for i, micro in enumerate(ft.make_batches(data, state, batch_size=batch_size, accum=3)):
        if i == steps:
            break
        for part in split(micro):
            seen += _ids(part)
            grads, stats = ft.accumulate_grads(state, part, _loss)
            state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    return state, seen


SPLITS = {
    "group": lambda m: [m],
    "list": lambda m: [list(m)],
    "tuple": lambda m: [tuple(m)],
    "comprehension": lambda m: [[b for b in m]],
    "slices": lambda m: [m[:1], m[1:]],
    "one by one": lambda m: [[b] for b in m],
    "a stand-in left out": lambda m: [[m[0], ft.data.ZeroWeight(m[1]), m[2]]],
}


@pytest.mark.parametrize("split", SPLITS)
def test_a_list_or_slice_of_a_group_resumes_map_data_exactly_with_another_batch_size(split):
    """1 step of 2 rows per micro-batch, 2 steps of 1 row stepped on as `split`, then 3 rows
    to the epoch's end (each run a new make_batches(data, state, ...)): the rows read are the
    epoch's order, each once (the last split leaves 2 rows out of the gradient, still read)."""
    state, first = _train(_state(), ROWS, 2, 1, SPLITS["group"])
    state, middle = _train(state, ROWS, 1, 2, SPLITS[split])
    state, last = _train(state, ROWS, 3, 99, SPLITS["group"])
    order = (ft.data.epoch_order(N, 0, 0) + 1).tolist()
    left_out = 2 if split == "a stand-in left out" else 0
    assert len(first + middle + last) == N - left_out
    if not left_out:
        assert first + middle + last == order
    assert json.loads(state.data.position)["kind"] == "map"


@pytest.mark.parametrize("split", ["list", "tuple", "slices", "one by one"])
def test_a_list_or_slice_of_a_group_resumes_a_stream_exactly(split):
    """A stream's position is the one after the last micro-batch passed (the group's after a
    list of it, the first micro-batch's after micro[:1]): the stream resumes there. Before, a
    list left none and the resume raised 'needs its position'."""
    data = ft.data.IterableRows(ROWS)
    _, straight = _train(_state(), data, 2, 99, SPLITS["group"])
    state, first = _train(_state(), data, 2, 1, SPLITS["group"])
    state, middle = _train(state, data, 2, 1, SPLITS[split])
    state, last = _train(state, data, 2, 99, SPLITS["group"])
    assert first + middle + last == straight
    assert sorted(straight) == list(range(1, N + 1))


def test_stats_position_of_a_list_and_of_slices():
    data = ft.data.IterableRows(ROWS)
    # (calls without a state: no cursor to stand at micro[1:])
    micro = next(ft.make_batches(data, batch_size=2, accum=3))
    grads_of = lambda m: ft.accumulate_grads(_state(), m, _loss)[1].position  # noqa: E731
    assert grads_of(list(micro)) == grads_of(tuple(micro)) == micro.position
    assert json.loads(grads_of(micro[:1]))["cursor"] == 1
    assert json.loads(grads_of(micro[1:2]))["src"] != json.loads(micro.position)["src"]
    map_micro = next(ft.make_batches(ROWS, batch_size=2, accum=3))
    assert grads_of(map_micro[1:]) == grads_of(list(map_micro)) == map_micro.position


@pytest.mark.parametrize(
    ("name", "split", "says"),
    [
        ("left out", lambda m: [[m[0], m[2]]], "micro-batches 3, 5 of the epoch"),
        ("reordered", lambda m: [list(m)[::-1]], "not consecutive in their order"),
        ("repeated", lambda m: [[*m, m[0]]], "micro-batches 3, 4, 5, 3"),
    ],
)
def test_micro_batches_whose_position_cannot_be_told_raise(name, split, says):
    """The cursor would count other micro-batches than the data went over (a resume would
    repeat or skip rows): accumulate_grads raises before any forward, naming what to pass."""
    state, _ = _train(_state(), ROWS, 2, 1, SPLITS["group"])
    with pytest.raises(ValueError, match="resume would repeat or skip rows") as e:
        _train(state, ROWS, 2, 1, split)
    assert says in str(e.value)
    assert "micro[i:j]" in str(e.value)


def test_a_step_gathered_from_several_groups_of_one_micro_batch_trains_on():
    """A token budget: accum=1 groups gathered until the step is full, only the last group
    still held (the loop variable). Refused as "of other origin" once; it trains, and the
    cursor counts every micro-batch."""
    state = _state()
    gathered = []
    for group in ft.make_batches(ROWS, state, batch_size=2, accum=1):
        gathered += list(group)
        if len(gathered) == 3:
            grads, stats = ft.accumulate_grads(state, gathered, _loss)
            state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
            gathered = []
        if state.step == 2:
            break
    assert (state.step, state.data.cursor) == (2, 6)


def test_a_list_of_a_group_repeating_one_batch_object_is_in_its_order():
    """Pre-batched data repeating one batch (overfitting one batch on purpose): list(micro) was
    refused as "micro-batches 0, 0, 0 ... not consecutive" (each found at its first place)."""
    batch = {"input_ids": torch.tensor([[1.0], [2.0]])}
    state = _state()
    micro = next(ft.make_batches([batch] * 8, state, batch_size=1, accum=3,
                                 collate_fn=lambda rows: rows[0]))  # fmt: skip
    grads, stats = ft.accumulate_grads(state, list(micro), _loss)
    assert stats.position == micro.position
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert state.data.cursor == 3


def test_a_group_cut_short_raises_at_the_next_step():
    """micro[:1] alone: the cursor says 1 micro-batch, the data went on past 3, so the next
    group is not where the state stands (a resume would read the 2 left out again)."""
    said = r"micro-batch 3 of epoch 0 .* at micro-batch 1 .* 1 to 2 were not stepped on"
    with pytest.raises(ValueError, match=said):
        _train(_state(), ROWS, 2, 2, lambda m: [m[:1]])


def test_a_group_passed_over_untrained_raises_naming_how_to_move_the_cursor():
    """accumulate_grads on a group without stepping, then the next group: the data went on,
    the cursor did not. Moving the cursor as the message says lets the loop go on exactly."""
    state = _state()
    it = ft.make_batches(ROWS, state, batch_size=2, accum=3)
    next(it)  # passed over
    micro = next(it)
    with pytest.raises(ValueError, match=r"micro-batch\(es\) 0 to 2 were not stepped on") as e:
        ft.accumulate_grads(state, micro, _loss)
    assert "state.replace(data=state.data.replace(cursor=3))" in str(e.value)
    state = state.replace(data=state.data.replace(cursor=3))
    grads, stats = ft.accumulate_grads(state, micro, _loss)
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert state.data.cursor == 6


def test_a_group_stepped_on_twice_with_its_stats_raises():
    """The cursor counted it twice (a resume would skip a group's rows)."""
    state = _state()
    micro = next(ft.make_batches(ROWS, state, batch_size=2, accum=3))
    for _ in range(2):
        grads, stats = ft.accumulate_grads(state, micro, _loss)  # the second time: refused
        state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
        if state.data.cursor == 3:
            with pytest.raises(ValueError, match="the cursor is past them"):
                ft.accumulate_grads(state, micro, _loss)
            break


def test_micro_batches_of_two_make_batches_calls_raise():
    state = _state()
    a = next(ft.make_batches(ROWS, state, batch_size=1, accum=2))
    b = next(ft.make_batches(ROWS, state, batch_size=1, accum=2))
    with pytest.raises(ValueError, match="of two make_batches calls"):
        ft.accumulate_grads(state, [a[0], b[1]], _loss)


def test_a_list_of_a_group_no_longer_alive_keeps_the_states_position():
    """A list made from a group that is gone (`list(next(it))`) cannot be traced: its Stats
    has no position. clip_and_step keeps the state's (it dropped it, and the resume at another
    batch size recounted the cursor from row 0: rows read twice)."""
    state, first = _train(_state(), ROWS, 2, 1, SPLITS["group"])
    it = ft.make_batches(ROWS, state, batch_size=2, accum=3)
    batches = list(next(it))  # the group itself is garbage at once
    grads, stats = ft.accumulate_grads(state, batches, _loss)
    assert stats.position is None
    kept = state.data.position
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert (state.data.cursor, state.data.position) == (6, kept)
    state, rest = _train(state, ROWS, 3, 99, SPLITS["group"])
    assert first + _ids(batches) + rest == (ft.data.epoch_order(N, 0, 0) + 1).tolist()


def test_a_make_batches_call_without_a_state_mixes_freely_and_has_no_position():
    """Evaluation and tests combine micro-batches of calls without a state (a stand-in of one
    group in another's step): no cursor counts them, so nothing is refused."""
    (a,) = ft.make_batches(ROWS[:2], batch_size=2, shuffle=False)
    (b,) = ft.make_batches(ROWS[2:4], batch_size=2, shuffle=False)
    assert step_data([*a, ft.data.ZeroWeight(b[0]), a[0]]).position is None
    assert step_data(list(a)).position == a.position


def test_a_copied_or_unpickled_group_is_one_built_by_hand_with_its_position():
    micro = next(ft.make_batches(ROWS, _state(), batch_size=2, accum=2))
    for other in (copy.copy(micro), pickle.loads(pickle.dumps(micro))):
        assert "_origin" not in other.__dict__
        assert step_data(other) == (micro.position, None, 0, False)
    assert step_data(micro).whole and step_data(list(micro)).whole
    assert not step_data(micro[:1]).whole


def test_a_step_without_stats_is_named_when_the_next_group_is_refused():
    """clip_and_step(state, grads) without stats= leaves the cursor where it was, so the next
    group is not where the state stands: the message named only a group cut short."""
    state = _state()
    with pytest.raises(ValueError, match=r"clip_and_step was given no stats=stats"):
        for micro in ft.make_batches(ROWS, state, batch_size=2, accum=3):
            grads, _ = ft.accumulate_grads(state, micro, _loss)
            state, _ = ft.clip_and_step(state, grads, lr=0.1)
