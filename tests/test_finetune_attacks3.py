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
