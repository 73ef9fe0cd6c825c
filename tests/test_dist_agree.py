"""Ranks that disagree: evaluate, predict and generate over iterators of other lengths, no
batches on one rank, a batch or prompt one rank refuses (ft.generate, ft.rl.sample, the
advantages). Each left the other ranks waiting in a collective until the backend's timeout;
each now raises on every rank, at once, with ftrain's message (the rank whose input was
refused its own error, the others one that says so). And the cost: the agreements run only
where a collective would pair up unlike, never for make_batches' groups nor under one process.

Two gloo processes on CPU run every case in one process group (tests/workers/agree_workers.py),
with a collective timeout a hang would have to wait out. The training loop's own iterator
given to evaluate at the epoch's start is a one-process matter, at the end."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import pytest
import torch

import ftrain as ft

GROUP_TIMEOUT_S = 60  # what a hang would wait for; every case must end long before it
FAST_S = GROUP_TIMEOUT_S / 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's record of every case: {case: {"got" | "error" + "type", "seconds"}}."""
    import agree_workers as W
    from launch import run_ranks

    out = tmp_path_factory.mktemp("agree") / "results"
    run_ranks(W.everything, str(out), GROUP_TIMEOUT_S, timeout=600)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


def _errors(ranks: list[dict], case: str) -> list[str]:
    """Every rank's message for `case`, each a ValueError raised fast."""
    got = [r[case] for r in ranks]
    for rank, record in enumerate(got):
        assert record.get("type") == "ValueError", (rank, record)
        assert record["seconds"] < FAST_S, (rank, record)
    return [record["error"] for record in got]


CALLS = ["evaluate", "predict", "generate"]


@pytest.mark.parametrize("form", ["iter", "list"])
@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@pytest.mark.parametrize("call", CALLS)
def test_uneven_batches_under_collective_forwards_fail_fast_on_every_rank(ranks, call, kind, form):
    """Rank 0 got 2 batches, rank 1 got 3: an iterator's length is not known before it runs
    (lists were counted up front, except generate's), so FSDP's and TP's forwards of the third
    batch waited on rank 1 for a rank 0 that had left: hung until the backend's timeout. The
    processes now agree before each batch that every one has one."""
    case = f"uneven-{call}-{kind}-{form}"
    if form == "list" and call != "generate":
        for rank, error in enumerate(_errors(ranks, case)):  # the count check, as before
            assert f"got {2 + rank} micro-batch(es) on this process" in error
        return
    mine, theirs = _errors(ranks, case)
    assert mine.startswith(f"{call}: this process (rank 0) ran out of batches after 2, while 1 ")
    assert theirs.startswith(f"{call}: 1 of the 2 processes ran out of batches after 2, while ")
    assert "this process (rank 1) had more" in theirs
    assert "strategy=state.strategy" in mine


@pytest.mark.parametrize("call", ["predict", "generate"])
def test_uneven_iterators_where_ddp_gathers_or_generates_in_lockstep_fail_fast(ranks, call):
    """Under DDP, predict gathers each batch's outputs (a collective per batch) and generate
    runs a synced generation (a collective per new token): rank 1's third batch hung there."""
    mine, theirs = _errors(ranks, f"uneven-{call}-ddp-iter")
    assert "ran out of batches after 2" in mine
    assert "ran out of batches after 2" in theirs
    assert "had more" in theirs


def test_uneven_iterators_where_nothing_pairs_them_are_let_be(ranks):
    """DDP's evaluate sums every rank's batches whatever their numbers (its forwards run no
    collective after the first), and predict(gather=False) yields each rank's own rows."""
    for rank, got in enumerate(r["uneven-evaluate-ddp-iter"] for r in ranks):
        assert got.get("got") == 20.0, (rank, got)  # (2 + 3) batches of 4 scored tokens
    for rank, got in enumerate(r["uneven-predict-ddp-iter-local"] for r in ranks):
        assert got.get("got") == 2 + rank, (rank, got)


@pytest.mark.parametrize("form", ["iter", "list"])
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("call", CALLS)
def test_no_batches_on_one_rank_fails_fast_on_every_rank(ranks, call, kind, form):
    """`evaluate(state, [])` on rank 0 alone: it raised "evaluate got no batches" there and
    left rank 1 in the sums' all-reduce (or DDP's first forward, which broadcasts the module's
    buffers from rank 0). Every rank raises now, with ftrain's message."""
    errors = _errors(ranks, f"empty-{call}-{kind}-{form}")
    if form == "list" and (kind == "fsdp" or call == "predict") and call != "generate":
        for rank, error in enumerate(errors):  # counted up front, as before
            assert f"got {rank} micro-batch(es) on this process" in error
        return
    mine, theirs = errors
    assert mine.startswith(f"{call} got no batches on this process (rank 0), while 1 of the 2")
    assert theirs.startswith(f"{call} got no batches on 1 of the 2 ")
    assert "while this process (rank 1) had some" in theirs


def test_no_batches_on_one_rank_of_an_ungathered_predict_is_that_ranks_alone(ranks):
    """predict(gather=False) under DDP: each rank predicts its own rows through the module
    inside DDP's wrapper, so no collective pairs the ranks (DDP's first forward broadcast
    buffers: rank 1 waited there for rank 0). Rank 0, without batches, says so; rank 1 has its
    row."""
    got = [r["empty-predict-ddp-iter-local"] for r in ranks]
    assert got[0].get("type") == "ValueError", got
    assert got[0]["error"].startswith("predict got no batches (an eval set"), got
    assert got[1].get("got") == 1, got
    assert all(g["seconds"] < FAST_S for g in got), got


def test_a_rank_predicting_alone_without_a_collective_forward_waits_for_no_one(ranks):
    """Rank 0 predicts alone (gather=False) under DDP after a training step: the agreement
    before the first batch (for DDP's buffer broadcast), and DDP's broadcast itself for a model
    with buffers (every HF model: Llama's rotary ones), left it waiting for rank 1 until the
    backend's timeout. Each rank predicts through the module inside DDP's wrapper."""
    for case in ("alone-predict-ddp", "alone-predict-ddp-llama"):
        got = [r[case] for r in ranks]
        assert [g.get("got") for g in got] == [2, 0], got
        assert got[0]["seconds"] < FAST_S, got


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_an_iterator_that_fails_on_one_rank_under_fsdp_fails_every_rank(ranks, call):
    """Rank 1's iterator raised while reading its second batch: rank 1 raised at once and
    rank 0 waited in the agreement before that batch until the backend's timeout (a process
    that stays up: a notebook, a retrying job). Rank 1 joins the agreement with its error."""
    got = [r[f"reading-fails-{call}-fsdp"] for r in ranks]
    assert got[1]["type"] == "OSError" and "rank 1's data went away" in got[1]["error"], got
    assert got[0]["type"] == "ValueError", got[0]
    assert got[0]["error"].startswith(f"{call}: 1 of the 2 processes failed on their batch")
    assert all(g["seconds"] < FAST_S for g in got), got


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_a_first_batch_that_fails_on_one_ddp_rank_fails_every_rank(ranks, call):
    """Under DDP with no collective in the first forward (a model without buffers, or any
    model after an earlier forward without gradients) no agreement runs before the first
    batch: rank 1's iterator raised on its first read and rank 1 raised alone (it had run no
    batch), leaving rank 0 in the final all-reduce until the backend's timeout."""
    got = [r[f"first-read-fails-{call}-ddp"] for r in ranks]
    assert got[1]["type"] == "OSError" and "rank 1's data went away" in got[1]["error"], got
    assert got[0]["type"] == "ValueError", got[0]
    assert got[0]["error"].startswith(f"{call}: 1 of the 2 ranks failed on their batch")
    assert all(g["seconds"] < FAST_S for g in got), got


@pytest.mark.parametrize("case", ["none-evaluate-ddp", "none-predict-ddp", "none-generate-ddp",
                                  "none-evaluate-fsdp"])  # fmt: skip
def test_no_batches_on_any_rank_keeps_the_one_process_message(ranks, case):
    call = case.split("-")[1]
    for error in _errors(ranks, case):
        assert error.startswith(f"{call} got no batches")
        assert "on this process" not in error


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("call", CALLS)
def test_as_many_batches_everywhere_give_the_results(ranks, call, kind):
    want = {"evaluate": 24.0, "predict": 6, "generate": 6}[call]  # 3 batches a rank
    for rank, got in enumerate(r[f"even-{call}-{kind}-iter"] for r in ranks):
        assert got.get("got") == want, (rank, got)


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_a_batch_that_fails_on_one_ddp_rank_fails_every_rank(ranks, call):
    """Rank 1's metrics_fn (output_fn) raised on its second batch: rank 0 went on to the
    sums' all-reduce (the gather's names check) and waited there. Rank 1 joins it with its
    error: it raises that error, rank 0 one that names it."""
    got = [r[f"fails-{call}-ddp"] for r in ranks]
    assert got[1]["type"] == "RuntimeError", got[1]
    assert f"rank 1's {'metrics' if call == 'evaluate' else 'output'}_fn failed" in got[1]["error"]
    assert got[0]["type"] == "ValueError", got[0]
    assert got[0]["error"].startswith(f"{call}: 1 of the 2 ranks failed on their batch")
    assert all(g["seconds"] < FAST_S for g in got), got


@pytest.mark.parametrize("case", ["refused-generate-ddp-iter", "refused-generate-fsdp-list"])
def test_a_prompt_batch_one_rank_refuses_is_refused_on_every_rank(ranks, case):
    """Rank 1's second batch holds its labels (a training batch): generate refused it there,
    before the generation, and left rank 0 in the synced generation's collectives."""
    theirs, mine = _errors(ranks, case)
    assert "the batch's labels mark tokens of its input_ids" in mine
    assert theirs.startswith("generate: 1 of the 2 processes failed on their batch")


SAMPLE_ERRORS = {
    "padding": "prompt rows [1] are all padding",
    "index": "index must hold distinct numbers",
    "shape": "prompts['input_ids'] must be a 2-D tensor",
    "token": "hold ids that are not token ids of the model's 61",
    "stop": "stop_token_ids [1000] are not token ids of the model's 61",
}


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("what", list(SAMPLE_ERRORS))
def test_sample_inputs_one_rank_refuses_are_refused_on_every_rank(ranks, what, kind):
    """ft.rl.sample: an input error of one rank (an all-padding prompt, a repeated index, a
    1-D input_ids, a token outside the vocabulary, stop ids outside it) raised there alone,
    and the other rank waited in the first gather (or the decode's all-reduce) until the
    timeout. The checks' outcome now travels in the first gather (the stop ids, known from the
    prefill's logits, in the first token's all-reduce): every rank raises."""
    theirs, mine = _errors(ranks, f"sample-{what}-{kind}")
    assert SAMPLE_ERRORS[what] in mine
    assert theirs.startswith("sample: ")
    assert "rank" in theirs and "raised there" in theirs


def test_sample_with_good_inputs_on_every_rank_samples(ranks):
    assert [r["sample-none-ddp"].get("got") for r in ranks] == [2, 2]


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_rewards_one_rank_refuses_are_refused_on_every_rank(ranks, what):
    """group_advantages / rloo_advantages checked this rank's rewards before the gather: a
    2-D or integer tensor on rank 1 raised there and left rank 0 in the gather."""
    theirs, mine = _errors(ranks, f"advantages-{what}-ddp")
    assert "rewards must be" in mine
    assert theirs.startswith("data-parallel rank(s) [1] refused their rewards")


@pytest.mark.parametrize("call", CALLS)
def test_the_agreements_cost_nothing_for_make_batches_groups(ranks, call):
    """make_batches(..., strategy=...) agreed on the data and settings over the processes:
    every process has as many of its groups, and no agreement runs (the calls' own
    collectives aside: generate's agreement runs for every batch, next to a generation that
    runs one per new token)."""
    for kind in ("ddp", "fsdp"):
        for got in (r[f"agreements-{call}-{kind}-made"] for r in ranks):
            assert "got" in got, got
            if call == "generate":  # 3 batches, and the end
                assert got["got"]["sum_over_processes"] == 4, (kind, got)
            else:
                assert got["got"]["sum_over_processes"] == 0, (kind, got)


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_the_agreements_of_plain_iterators_and_lists(ranks, call):
    """FSDP: one all-reduce per batch of a plain iterator and one at the end (lists: the one
    count check, as before). DDP: one before the first batch (its first forward is a
    collective); lists of a gathering predict are counted up front instead."""
    for r in ranks:
        assert r[f"agreements-{call}-fsdp-iter"]["got"]["sum_over_processes"] == 4
        assert r[f"agreements-{call}-fsdp-list"]["got"]["sum_over_processes"] == 1
        assert r[f"agreements-{call}-ddp-iter"]["got"]["sum_over_processes"] == 1
        ddp_list = r[f"agreements-{call}-ddp-list"]["got"]["sum_over_processes"]
        assert ddp_list == 1, r[f"agreements-{call}-ddp-list"]


# --- the training loop's own iterator, at the epoch's start (one process) --------------------

ROWS = [{"input_ids": [1 + i, 2, 3], "labels": [1 + i, 2, 3]} for i in range(8)]


def _state():
    from helpers import tiny_llama

    return ft.TrainState.create(tiny_llama(), ft.optim.sgd(), seed=0)


def _outputs(model, batch):
    return {"n": batch["input_ids"][:, 0]}


@pytest.mark.parametrize("wrap", ["itself", "islice", "generator"])
@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_the_loops_iterator_at_the_epochs_start_is_refused(call, wrap):
    """`batches = make_batches(train, state, ...)` given to evaluate before the loop ran it
    (cursor 0): evaluate read the epoch, and `for micro in batches` then trained on nothing,
    without a word. It is refused, as it is mid-epoch (where it starts at the cursor)."""
    state = _state()
    batches = ft.make_batches(ROWS, state, batch_size=2, accum=1)
    given = {
        "itself": batches,
        "islice": itertools.islice(batches, 1000),
        "generator": (g for g in batches),
    }[wrap]
    run = {
        "evaluate": lambda: ft.evaluate(state, given),
        "predict": lambda: list(ft.predict(state, given, _outputs)),
    }[call]
    with pytest.raises(ValueError, match=r"at the start of an epoch \(state.data.cursor 0\)"):
        run()


def test_after_next_epoch_the_loops_iterator_is_refused_too():
    state = ft.next_epoch(_state())
    assert (state.epoch, state.data.cursor) == (1, 0)
    with pytest.raises(ValueError, match="would then train on nothing"):
        ft.evaluate(state, ft.make_batches(ROWS, state, batch_size=2))


def test_evaluation_data_read_without_the_state_is_let_be_at_the_epochs_start():
    """The documented idiom (README, docs): make_batches(val, batch_size=..., shuffle=False),
    and groups collected as such (a list of the loop's groups, the step's own group)."""
    state = _state()
    assert ft.evaluate(state, ft.make_batches(ROWS, batch_size=2, shuffle=False))["eval_items"]
    groups = list(itertools.islice(ft.make_batches(ROWS, state, batch_size=2, accum=2), 2))
    assert ft.evaluate(state, groups)["eval_items"] == 16.0
    assert ft.evaluate(state, groups[0])["eval_items"] == 8.0
    for micro in ft.make_batches(ROWS, state, batch_size=2, accum=2):  # the loop trains on all
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.0)
    assert state.data.cursor == 4


def test_a_deque_of_recent_groups_is_evaluated_at_the_epochs_start():
    """A deque of the loop's recent groups, the newest the step's own, evaluated before the
    step trains on it: at step 0 (cursor 0) the refusal of the loop's iterator took the deque
    for it. Only an iterator can be the loop's."""
    state = _state()
    recent: collections.deque = collections.deque(maxlen=2)
    for micro in ft.make_batches(ROWS, state, batch_size=2, accum=2):
        recent.append(micro)
        assert ft.evaluate(state, recent)["eval_items"] == 8.0 * len(recent)
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.0)
    assert state.data.cursor == 4


def test_an_iterable_that_returns_the_loops_iterator_is_refused_mid_epoch():
    """An object whose __iter__ returns make_batches(data, state) (not an iterator itself, nor
    a container) was let through when only iterators were checked: evaluated from the cursor
    on, without the rows before it."""
    state = _state()
    for micro in ft.make_batches(ROWS, state, batch_size=2, accum=1):
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.0)
        break

    class Wrapper:
        def __iter__(self):
            return iter(ft.make_batches(ROWS, state, batch_size=2, accum=1))

    with pytest.raises(ValueError, match="starting at micro-batch 1"):
        ft.evaluate(state, Wrapper())


def test_a_prompt_token_outside_the_vocabulary_is_refused_before_the_forward():
    """ft.rl.sample with a prompt id past the embedding table: the lookup failed in the
    forward (on CUDA a device-side assert that ends the process); refused with the positions."""
    state = _state()
    state.model.generation_config.pad_token_id = 0
    ids = torch.tensor([[5, 9, 14], [7, 61, 22]])
    with pytest.raises(ValueError, match=r"not token ids of the model's 61 .* \[\(1, 1\)\]"):
        ft.rl.sample(state, {"input_ids": ids}, index=[0, 1], max_new_tokens=2)
