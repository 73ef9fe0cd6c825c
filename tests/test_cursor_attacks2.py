"""The data cursor where steps are not accumulate_grads' own (ft.func.private_grads), where
make_batches is given the training state by mistake, and where a replay buffer holds groups."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from helpers import batch_ids as _ids
from helpers import id_loss as _loss
from helpers import id_rows
from helpers import id_step as _step
from helpers import linear_state as _state

N = 24
ROWS = id_rows(N)
REPLAY = {"input_ids": torch.tensor([[100.0]])}


def _private_step(state, micro):
    grads, stats = ft.func.private_grads(state, micro, _loss, max_norm=1.0, noise_multiplier=0.0)
    return ft.clip_and_step(state, grads, lr=0.1, stats=stats)[0]


@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
def test_private_grads_with_a_replay_batch_counts_the_groups_micro_batches_only(stream):
    """private_grads(state, [*group, replay]) set num_micro=4 for a group of 3: clip_and_step
    moved the cursor to 4 and the resumed epoch skipped a micro-batch (22 of 24 rows read). It
    counts as accumulate_grads does now."""
    data = ft.data.IterableRows(ROWS) if stream else ROWS
    state, seen = _state(), []
    group = next(iter(ft.make_batches(data, state, batch_size=2, accum=3)))
    seen += _ids(group)
    state = _private_step(state, [*group, REPLAY])
    assert state.data.cursor == 3
    assert state.data.position == group.position
    del group
    for micro in ft.make_batches(data, state, batch_size=2, accum=3):
        seen += _ids(micro)
        state = _private_step(state, micro)
    assert sorted(seen) == list(range(1, N + 1))


def test_private_grads_refuses_a_group_after_one_left_out_as_accumulate_grads_does():
    """A group stepped on after one passed over: private_grads trained on it and the cursor
    said 3 where the data stood at 6. It refuses, naming the micro-batches not stepped on."""
    state = _state()
    it = ft.make_batches(ROWS, state, batch_size=2, accum=3)
    next(it)
    group = next(it)
    with pytest.raises(ValueError, match=r"micro-batch\(es\) 0 to 2 were not stepped on"):
        ft.func.private_grads(state, group, _loss, max_norm=1.0, noise_multiplier=0.0)


def _trained_one_step(data):
    state = _state()
    return _step(state, next(iter(ft.make_batches(data, state, batch_size=2, accum=3))))


EVAL_DATA = {
    "fewer rows": ([{"input_ids": [100 + i]} for i in range(8)], {"shuffle": False}, "rows 24"),
    "not shuffled": ([{"input_ids": [100 + i]} for i in range(N)], {"shuffle": False}, "shuffle"),
    "other rows": ([{"input_ids": [100 + i]} for i in range(N)], {}, "data holds other rows"),
    "a stream": (ft.data.IterableRows(ROWS[:8]), {"shuffle": False}, "is a position in map"),
}


@pytest.mark.parametrize("case", EVAL_DATA)
def test_evaluation_data_given_the_training_state_names_the_call_without_the_state(case):
    """make_batches(val, state, ...) mid-epoch: the refusal's only advice was to restart the
    epoch, state.replace(data=state.data.replace(cursor=0, position=None)), which moves the
    training cursor back (training then reads the epoch's first rows again). It names the likely
    cause and the call without the state too, keeping what differs."""
    state = _trained_one_step(ROWS)
    val, kw, fact = EVAL_DATA[case]
    with pytest.raises(ValueError) as e:
        list(ft.make_batches(val, state, batch_size=2, **kw))
    text = str(e.value)
    assert fact in text
    assert "evaluation data given the training state" in text
    assert "make_batches(val, batch_size=..., shuffle=False, strategy=state.strategy)" in text
    assert "without the state" in text


REPLAY_MIXES = {
    "group after": lambda micro, old: [*micro, *old],
    "group before": lambda micro, old: [*old, *micro],
    "part of a group between": lambda micro, old: [micro[0], old[1], *micro[1:]],
}


@pytest.mark.parametrize("mix", REPLAY_MIXES)
@pytest.mark.parametrize("loop", ["state", "keywords"])
@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
def test_a_replay_buffer_of_groups_mixes_into_later_steps(mix, loop, stream):
    """buf.append(micro), then accumulate_grads(state, [*micro, *buf[0]]): with the state's
    make_batches refused as 'not consecutive' (list(micro) was let be); with the keyword loop
    (start=state.data.cursor) the cursor counted the buffer's 3 micro-batches too (9 after 2
    steps), so a resume skipped rows. The earlier groups' batches are replay now."""
    data = ft.data.IterableRows(ROWS) if stream else ROWS
    state, seen, buf = _state(), [], []
    kw = {"epoch": state.epoch, "start": state.data.cursor}
    batches = (
        ft.make_batches(data, state, batch_size=2, accum=3)
        if loop == "state"
        else ft.make_batches(data, batch_size=2, accum=3, **kw)
    )
    for micro in batches:
        seen += _ids(micro)
        state = _step(state, REPLAY_MIXES[mix](micro, buf[0]) if buf else micro)
        assert state.data.cursor == 3 * state.step
        assert state.data.position == micro.position
        buf.append(micro)
    assert sorted(seen) == list(range(1, N + 1))


def test_a_group_trained_on_again_alone_is_still_refused():
    """Only the replay buffer's batches mixed with the micro-batches at the cursor are replay:
    a group stepped on again with its stats alone still raises, as before."""
    state = _state()
    group = next(iter(ft.make_batches(ROWS, state, batch_size=2, accum=3)))
    state = _step(state, group)
    with pytest.raises(ValueError, match="the cursor is past them"):
        ft.accumulate_grads(state, [*group, REPLAY], _loss)


def test_a_group_the_state_stands_inside_is_no_replay():
    """The state's cursor inside a group (changed after make_batches was called): its earlier
    micro-batches are not taken for replay; refused as before."""
    state = _state()
    group = next(iter(ft.make_batches(ROWS, state, batch_size=2, accum=3)))
    state = state.replace(data=state.data.replace(cursor=1))
    with pytest.raises(ValueError, match="the cursor is past them"):
        ft.accumulate_grads(state, group, _loss)
    with pytest.raises(ValueError, match="not consecutive in their order"):
        ft.accumulate_grads(state, [group[1], group[2], group[0]], _loss)


STREAM_EVAL_DATA = {
    "not shuffled": (lambda: ft.data.IterableRows(ROWS[:8]), {"shuffle": False}, "keep it when"),
    "other sources": (
        lambda: ft.data.pack(ft.data.IterableRows(ROWS[:8]), block_size=2, mode="concat"),
        {},
        "saved for other data",
    ),
    "another batch size": (lambda: ft.data.IterableRows(ROWS[:8]), {"batch_size": 4}, "keep the"),
}


@pytest.mark.parametrize("case", STREAM_EVAL_DATA)
def test_evaluation_streams_given_a_stream_states_training_state_name_the_call(case):
    """The stream refusals of make_batches(val, state, ...) advised only keeping the setting or
    restarting the epoch (the training cursor); they name the call without the state too."""
    state = _trained_one_step(ft.data.IterableRows(ROWS))
    make, kw, fact = STREAM_EVAL_DATA[case]
    with pytest.raises(ValueError) as e:
        list(ft.make_batches(make(), state, **{"batch_size": 2, **kw}))
    assert fact in str(e.value) and "without the state" in str(e.value)
