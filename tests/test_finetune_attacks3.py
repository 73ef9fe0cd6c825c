"""Silent failures of everyday fine-tuning, fourth pass: left truncation, (inputs, labels) batches,
LoRA's task type, and sampled generation; each pinned by what the user asked for."""

from __future__ import annotations

import warnings

import pytest
import torch

import ftrain as ft

TEXT = "the quick brown fox jumps over the lazy dog and then the cat sat on a mat "


@pytest.fixture(scope="module")
def tok():
    return ft.sft.train_tokenizer([TEXT[i:] + TEXT[:i] for i in range(0, 64, 4)], 300)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _encode(tok, row, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.sft.TruncationWarning)
        return ft.sft.SFTCollator(tok, **kwargs).encode(row)


@pytest.mark.parametrize("side", ["left", "right"])
def test_left_truncation_cuts_the_prompts_start_and_never_the_responses_start(tok, side):
    # truncation_side="left" cut the response at its start too: the labels began mid-answer
    # (" on a mat" trained to follow the prompt) while its first tokens were never trained.
    row = {"input": " the quick brown fox jumps", "output": " and then the cat sat on a mat"}
    p, a = _ids(tok, row["input"]), _ids(tok, row["output"])
    bos, eos = tok.bos_token_id, tok.eos_token_id
    tok.truncation_side = side
    try:
        got = _encode(tok, row, source_max_len=4, target_max_len=3)
        whole = _encode(tok, row, source_max_len=64, target_max_len=64)
    finally:
        tok.truncation_side = "right"
    prompt = p[-3:] if side == "left" else p[:3]
    assert got["input_ids"] == [bos, *prompt, *a[:3]]
    assert got["labels"] == [-100] * 4 + a[:3]  # the response's start, on either side
    assert whole["labels"] == [-100] * (len(p) + 1) + [*a, eos]  # nothing cut: as before


def test_left_truncation_warning_says_which_ends_were_cut(tok):
    tok.truncation_side = "left"
    try:
        collator = ft.sft.SFTCollator(tok, source_max_len=3, target_max_len=2)
        with pytest.warns(ft.sft.TruncationWarning) as record:
            collator([{"input": " the quick brown fox", "output": " the lazy dog sat"}])
    finally:
        tok.truncation_side = "right"
    message = str(record[0].message)
    assert "cut the starts of 1 of 1 prompts" in message
    assert "the ends of 1 of 1 responses" in message
    assert collator.truncated == ft.sft.TruncationCounts(rows=1, prompts=1, responses=1)


def _llama_state():
    from helpers import tiny_llama

    return ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=0)


def _split_rows(n=4):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30, (n, 6), generator=g)
    return ids, [({"input_ids": ids[i]}, {"labels": ids[i]}) for i in range(n)]


def _pair_loss(model, batch):
    # A loss_fn for (inputs, labels) batches; given the parts one at a time, it scores the
    # inputs dict as if it held labels too (its own "input_ids" read as labels).
    inputs, labels = batch if isinstance(batch, tuple) else (batch, {"labels": None})
    out = model(**inputs, labels=labels["labels"])
    return out.loss * 5, 5


@pytest.mark.parametrize("run", ["evaluate", "predict"])
def test_a_dataloaders_inputs_labels_batch_is_refused_not_read_as_two_batches(run):
    # A DataLoader over (inputs, labels) rows yields [inputs, labels] (default collate): read as
    # a group of two batches, each dict went to the loss_fn alone.
    state = _llama_state()
    _, rows = _split_rows()
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    go = {
        "evaluate": lambda b: ft.evaluate(state, b, loss_fn=_pair_loss),
        "predict": lambda b: list(ft.predict(state, b, lambda m, x: {"n": torch.ones(2)})),
    }[run]
    with pytest.raises(ValueError, match=r"a batch is a list of 2 dicts that share no key"):
        go(loader)
    with pytest.raises(ValueError, match=r"Merge them into one dict \(\{\*\*inputs, \*\*labels\}"):
        go(rows[0])  # one (inputs, labels) row passed as the batches: each dict a "batch"


def test_inputs_labels_batches_as_tuples_or_merged_dicts_evaluate_as_one_batch():
    # The two ways the error offers give the loss of the whole batch.
    state = _llama_state()
    ids, rows = _split_rows()

    def as_tuple(items):
        return tuple(torch.utils.data.default_collate(items))

    def merged(items):
        inputs, labels = torch.utils.data.default_collate(items)
        return {**inputs, **labels}

    tuples = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=as_tuple)
    dicts = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=merged)
    want = ft.evaluate(state, [{"input_ids": ids, "labels": ids}])["eval_loss"]
    assert ft.evaluate(state, dicts)["eval_loss"] == pytest.approx(want, rel=1e-5)
    got = ft.evaluate(state, tuples, loss_fn=_pair_loss)["eval_loss"]
    assert got == pytest.approx(want, rel=1e-5)
