"""The data cursor at the crossings of make_batches' groups with batches of other origin: a
replay buffer mixed into a step, a step gathered from several groups, micro-counts that differ
by process where the step is not a whole group (evaluate). A resumed epoch must cover every row
exactly once, or the step must refuse, naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

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


def _rest_of_epoch(state, data, batch_size=2):
    """The rows a resumed make_batches(data, state, ...) reads to the epoch's end."""
    seen = []
    for micro in ft.make_batches(data, state, batch_size=batch_size, accum=3):
        seen += _ids(micro)
        state = _step(state, micro)
    return state, seen


MIXES = {
    "replay after": lambda g: [*g, REPLAY],
    "replay before": lambda g: [REPLAY, *g],
    "replay between": lambda g: [g[0], REPLAY, *g[1:]],
    "wrapped": lambda g: ft.data.MicroBatches((*g, REPLAY), g.position),
    "wrapped, no position": lambda g: ft.data.MicroBatches((REPLAY, *g)),
}


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
def test_a_replay_batch_mixed_into_a_step_does_not_move_the_cursor(mix, stream):
    """accumulate_grads(state, [*group, replay]) advanced state.data.cursor by 4 for a group of
    3: the resumed epoch (a new make_batches(data, state, ...), with another batch size too)
    skipped a micro-batch's 2 rows (22 of 24 read). The cursor counts the group's only."""
    data = ft.data.IterableRows(ROWS) if stream else ROWS
    state, seen = _state(), []
    group = next(iter(ft.make_batches(data, state, batch_size=2, accum=3)))
    seen += _ids(group)
    state = _step(state, MIXES[mix](group))
    assert state.data.cursor == 3
    assert state.data.position == group.position
    del group
    state, rest = _rest_of_epoch(state, data, batch_size=2 if stream else 3)
    assert sorted(seen + rest) == list(range(1, N + 1))


@pytest.mark.parametrize("mix", ["replay after", "replay before", "wrapped"])
def test_a_replay_batch_in_a_loop_of_make_batches_keywords_does_not_move_the_cursor(mix):
    """The loop of DESIGN.md, make_batches(data, epoch=state.epoch, start=state.data.cursor,
    ...) without the state: the replay batch moved the cursor too, and the next call started a
    micro-batch late (22 of 24 rows read)."""
    state, seen = _state(), []
    for _ in range(2):
        kw = {"seed": 0, "epoch": state.epoch, "start": state.data.cursor}
        for group in ft.make_batches(ROWS, batch_size=2, accum=3, **kw):
            seen += _ids(group)
            state = _step(state, MIXES[mix](group) if state.step == 0 else group)
            if state.step == 1:
                break
    assert state.data.cursor == 12
    assert sorted(seen) == list(range(1, N + 1))


def test_a_step_gathered_from_several_groups_and_a_replay_batch_counts_the_groups():
    """Earlier accum=1 groups already gone (a token budget) fill the gap from the cursor to the
    live group's micro-batch; the replay batch does not count."""
    state, seen, gathered = _state(), [], []
    for group in ft.make_batches(ROWS, state, batch_size=2, accum=1):
        gathered += list(group)
        if len(gathered) == 3:
            seen += _ids(gathered)
            state = _step(state, [*gathered, REPLAY])
            gathered = []
        if state.step == 2:
            break
    assert state.data.cursor == 6
    state, rest = _rest_of_epoch(state, ROWS)
    assert sorted(seen + rest) == list(range(1, N + 1))


def test_a_token_budget_step_over_a_stream_resumes():
    """A step gathered from accum=1 groups of a stream, only the last group alive: its position
    was None and the resume raised 'needs its position'. It is the last group's now."""
    data = ft.data.IterableRows(ROWS)
    state, seen, gathered = _state(), [], []
    for group in ft.make_batches(data, state, batch_size=2, accum=1):
        gathered += list(group)
        if len(gathered) == 3:
            seen += _ids(gathered)
            state = _step(state, gathered)
            gathered = []
        if state.step == 2:
            break
    state, rest = _rest_of_epoch(state, data)
    assert sorted(seen + rest) == list(range(1, N + 1))


def test_a_group_left_out_before_a_replay_mix_raises_naming_the_cursor():
    """The group after one passed over untrained, mixed with a replay batch: refused as the
    group alone is (the replay batch is not the missing micro-batches)."""
    state = _state()
    it = ft.make_batches(ROWS, state, batch_size=2, accum=3)
    next(it)
    group = next(it)
    with pytest.raises(ValueError, match=r"micro-batch\(es\) 0 to 2 were not stepped on"):
        ft.accumulate_grads(state, [REPLAY, *group], _loss)


def test_a_replay_mix_of_a_group_left_out_in_part_raises():
    state = _state()
    group = next(iter(ft.make_batches(ROWS, state, batch_size=2, accum=3)))
    with pytest.raises(ValueError, match="not consecutive in their order"):
        ft.accumulate_grads(state, [group[0], group[2], REPLAY], _loss)


GROUP_TIMEOUT_S = 60  # the launch's collective timeout: a hang would last this long


@pytest.fixture(scope="module")
def uneven_eval(tmp_path_factory) -> dict[int, dict]:
    """Each rank's record: evaluate over hand-built lists of 2 + rank batches (FSDP, TP)."""
    import cursor_workers as W
    from launch import run_ranks

    out = tmp_path_factory.mktemp("eval") / "results"
    run_ranks(W.uneven_eval, str(out), ["fsdp", "tp", "ddp", "ddp+sync"], timeout=240)
    return {rank: json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)}


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@pytest.mark.parametrize("case", ["uneven", "uneven groups"])
def test_evaluate_over_uneven_hand_built_lists_fails_fast_on_every_process(uneven_eval, kind, case):
    """FSDP gathers parameters in every forward, TP's processes reduce inside it: 2 batches on
    one process and 3 on the other hung until the collective timeout (or gloo aborted). Now
    both raise before any forward, naming the counts, and the next, even evaluation runs."""
    for rank, got in uneven_eval.items():
        step = got[kind][case]
        assert "error" in step, (rank, step)
        assert "evaluate got" in step["error"], step
        assert "on average over the 2 processes" in step["error"], step
        assert step["seconds"] < GROUP_TIMEOUT_S / 4, step
        assert "value" in got[kind]["even"], (rank, got[kind]["even"])
    assert uneven_eval[0][kind]["even"]["value"] == uneven_eval[1][kind]["even"]["value"]


@pytest.mark.parametrize("kind", ["fsdp", "tp", "ddp"])
def test_predict_over_uneven_hand_built_lists_fails_fast_on_every_process(uneven_eval, kind):
    """predict gathers each batch's outputs over the processes (and FSDP's and TP's forwards
    run collectives): 2 batches on one process and 3 on the other paired one call's batches
    with the next call's gathers, then hung. Now both raise before any forward."""
    for rank, got in uneven_eval.items():
        step = got[kind]["predict uneven"]
        assert "error" in step, (rank, step)
        assert f"predict got {2 + rank} micro-batch(es) on this process" in step["error"]
        assert step["seconds"] < GROUP_TIMEOUT_S / 4, step
        assert got[kind]["predict even"]["value"][1][0][0] == 2, got[kind]["predict even"]


@pytest.mark.parametrize("kind", ["ddp", "ddp+sync"])
def test_evaluate_under_ddp_over_uneven_lists_is_let_be(uneven_eval, kind):
    """DDP's forwards run no collective: 2 and 3 batches give the loss over all 5, with
    sync_every_micro too (its collectives are in the backward; it was refused, the review's)."""
    for got in uneven_eval.values():
        assert "value" in got[kind]["uneven"], got[kind]["uneven"]
    assert uneven_eval[0][kind]["uneven"]["value"] == uneven_eval[1][kind]["uneven"]["value"]


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_evaluate_over_make_batches_costs_no_count_check(uneven_eval, kind):
    """make_batches(..., strategy=) agreed on its groups over the processes: no collective is
    added for its iterator nor for one of its groups; a hand-built list pays one."""
    for got in uneven_eval.values():
        assert got[kind]["checks"] == {"make_batches": 0, "group": 0, "list": 1}


VAL = [{"input_ids": [i + 1]} for i in range(8)]


def _mid_epoch():
    """A state 3 micro-batches into its epoch, with no data position (trained on batches built
    by hand, or loaded from a checkpoint of an ftrain that kept none)."""
    state = _state()
    group = [{"input_ids": torch.tensor([[float(i)]])} for i in range(3)]
    state = _step(state, group)
    assert (state.data.cursor, state.data.position) == (3, None)
    return state


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_evaluating_over_make_batches_given_the_training_state_mid_epoch_raises(call):
    """evaluate(state, make_batches(val, state, ...)): the call starts at the training
    cursor, so evaluate read 2 of the 8 rows and reported their loss as the eval loss."""
    state = _mid_epoch()
    batches = ft.make_batches(VAL, state, batch_size=2, shuffle=False)
    run = {
        "evaluate": lambda: ft.evaluate(state, batches, _loss),
        "predict": lambda: list(ft.predict(state, batches, lambda m, b: {"x": b["input_ids"]})),
    }[call]
    with pytest.raises(ValueError, match=r"starting at micro-batch 3: .* without the state"):
        run()
    whole = ft.evaluate(state, ft.make_batches(VAL, batch_size=2, shuffle=False), _loss)
    assert whole["eval_items"] == 8


def test_evaluate_over_a_deque_of_recent_training_groups_is_let_be():
    """A smoothed training loss: evaluate(state, recent), `recent` a deque of the last groups
    the loop trained on. Refused (the review's) once its oldest group was past micro-batch 0:
    any iterable whose first group was not an epoch's first was taken for make_batches'
    iterator started mid-epoch; only that iterator is."""
    import collections

    state, recent = _state(), collections.deque(maxlen=2)
    for micro in ft.make_batches(ROWS, state, batch_size=2, accum=2):
        state = _step(state, micro)
        recent.append(micro)
        if state.data.cursor >= 6:
            break
    assert [ft.data.step_data(g).first for g in recent] == [2, 4]
    assert ft.evaluate(state, recent, _loss)["eval_items"] == 8
    assert ft.evaluate(state, iter(list(recent)), _loss)["eval_items"] == 8
    assert ft.data.resumed_at(recent) is None
    resumed = ft.make_batches(ROWS, state, batch_size=2, accum=2)
    assert ft.data.resumed_at(resumed) == 6
    state = _step(state, next(resumed))  # training from it is what it is for
    assert state.data.cursor == 8


@pytest.mark.parametrize("wrap", ["islice", "generator"])
def test_evaluating_over_a_wrapped_make_batches_given_the_training_state_raises(wrap):
    """`islice(make_batches(val, state, ...), n)` or a generator over it mid-epoch: only the
    iterator itself was recognised (the second review's), so evaluate read from the training
    cursor on and scored 12 of 24 rows. Its first group is the call's first, at the cursor the
    state stands at: refused. After a resume, a deque whose oldest group is the resumed call's
    first is let be (trained on: the cursor moved past it)."""
    import collections
    import itertools

    state = _mid_epoch()
    wrapped = {
        "islice": lambda it: itertools.islice(it, 1000),
        "generator": lambda it: (g for g in it),
    }[wrap]
    val = lambda: wrapped(ft.make_batches(VAL * 3, state, batch_size=2, shuffle=False))  # noqa: E731
    with pytest.raises(ValueError, match=r"starting at micro-batch 3: .* without the state"):
        ft.evaluate(state, val(), _loss)
    with pytest.raises(ValueError, match=r"starting at micro-batch 3"):
        list(ft.predict(state, val(), lambda m, b: {}))
    recent = collections.deque(maxlen=2)
    for micro in ft.make_batches(VAL * 3, state, batch_size=2, accum=1, shuffle=False):
        recent.append(micro)
        state = _step(state, micro)
        if len(recent) == 2:
            break
    assert ft.data.step_data(recent[0]).first == 3  # the resumed call's first, trained on
    assert ft.evaluate(state, wrapped(iter(recent)), _loss)["eval_items"] == 4


def test_evaluate_on_the_steps_own_group_mid_epoch_is_let_be():
    """A group given as such (the step's own, after it) is what the caller means to evaluate."""
    state = _mid_epoch()
    state = state.replace(data=state.data.replace(cursor=0))
    it = ft.make_batches(ROWS, state, batch_size=2, accum=3)
    state = _step(state, next(it))
    micro = next(it)
    assert ft.evaluate(state, micro, _loss)["eval_items"] == 6
    assert ft.evaluate(state, [micro], _loss)["eval_items"] == 6


AUX = [{"input_ids": [100 + i]} for i in range(40)]


@pytest.mark.parametrize("where", ["after", "before"])
def test_an_auxiliary_stream_of_make_batches_without_a_state_mixes_into_the_step(where):
    """[*group, *aux_group], aux of make_batches(aux, batch_size=...) without a state: refused
    as "of two make_batches calls" (a false refusal: no cursor counts the auxiliary data). It
    trains, and the cursor counts the state's call's micro-batches only."""
    state, seen = _state(), []
    aux = ft.make_batches(AUX, batch_size=2, seed=1)
    for group in ft.make_batches(ROWS, state, batch_size=2, accum=3):
        seen += _ids(group)
        extra = next(aux)  # (held: a group alive is traced to its call)
        state = _step(state, [*group, *extra] if where == "after" else [*extra, *group])
    assert state.data.cursor == 12
    assert sorted(seen) == list(range(1, N + 1))


def test_one_micro_batch_of_a_group_mixed_with_a_replay_batch_is_named_as_one():
    """The refusal named the micro-batch count of the whole step: 'micro-batches 5 to 5'."""
    state = _state()
    it = ft.make_batches(ROWS, state, batch_size=2, accum=3)
    next(it)
    group = next(it)
    with pytest.raises(ValueError, match=r"micro holds micro-batch 5 of epoch 0"):
        ft.accumulate_grads(state, [group[2], REPLAY], _loss)
