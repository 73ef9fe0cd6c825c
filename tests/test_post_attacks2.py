"""Preference log-probs as TRL users batch them (second attack session). Each test failed
before its fix; messages are ftrain's own."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ftrain as ft

P = ft.preference


def _gpt2() -> GPT2LMHeadModel:
    """Absolute position embeddings: a token's log-prob depends on the position it sits at."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, bos_token_id=1,
        eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).to(torch.float64)


def _left_padded(rows: list[dict[str, list[int]]], side: str) -> dict[str, torch.Tensor]:
    """One side of the pairs padded on the left (a tokenizer of padding_side="left"), labels
    copied from the ids past the prompt, pad id 1 (GPT-2's eos)."""
    width = max(len(r[f"{side}_input_ids"]) for r in rows)
    out: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "attention_mask": []}
    for r in rows:
        ids, labels = r[f"{side}_input_ids"], r[f"{side}_labels"]
        pad = width - len(ids)
        out["input_ids"].append([1] * pad + ids)
        out["labels"].append([-100] * pad + labels)
        out["attention_mask"].append([0] * pad + [1] * len(ids))
    return {f"{side}_{k}": torch.tensor(v) for k, v in out.items()}


def _alone(row: dict[str, list[int]], side: str) -> dict[str, torch.Tensor]:
    ids = torch.tensor([row[f"{side}_input_ids"]])
    return {"input_ids": ids, "labels": torch.tensor([row[f"{side}_labels"]]),
            "attention_mask": torch.ones_like(ids)}  # fmt: skip


ROWS = [
    {"chosen_input_ids": [5, 6, 7, 8, 9], "chosen_labels": [-100, -100, 7, 8, 9],
     "rejected_input_ids": [5, 6, 11], "rejected_labels": [-100, -100, 11]},
    {"chosen_input_ids": [9, 3], "chosen_labels": [-100, 3],
     "rejected_input_ids": [9, 4, 12, 13, 14, 15], "rejected_labels": [-100, 4, 12, 13, 14, 15]},
]  # fmt: skip


def test_left_padded_pairs_score_as_unpadded_ones_under_absolute_positions():
    """`sequence_logps` ran the model on a left-padded row as it came: without position ids
    the model numbered positions from the first column, so the row's tokens sat at positions
    shifted by its padding, and GPT-2 (absolute position embeddings) gave them other
    log-probs than the same row alone or padded on the right (-11.56 for -11.93): every DPO
    margin of a batch collated by a left-padding tokenizer depended on how much its rows were
    padded, silently. Now left-padded rows are moved to the left first (TRL's flush_left)."""
    model = _gpt2().eval()
    left = {**_left_padded(ROWS, "chosen"), **_left_padded(ROWS, "rejected")}
    right = P.pair_collate(pad_id=1)(ROWS)
    for side in ("chosen", "rejected"):
        part = {k.removeprefix(f"{side}_"): v for k, v in left.items() if k.startswith(side)}
        alone = [P.sequence_logps(model, _alone(r, side)) for r in ROWS]
        with torch.no_grad():
            torch.testing.assert_close(P.sequence_logps(model, part), torch.cat(alone))
    reference = _gpt2().requires_grad_(False)
    with torch.no_grad():
        reference.transformer.wte.weight.mul_(0.5)  # another model than the policy
    loss_fn = P.preference_loss(functools.partial(P.dpo_loss, beta=0.5), reference=reference)
    model.train()
    got, want = loss_fn(model, left), loss_fn(model, right)
    torch.testing.assert_close(got, want)


def test_a_reference_model_and_precomputed_references_together_are_refused():
    """`preference_loss(reference=ref)` on a batch that also holds `reference_chosen` and
    `reference_rejected` used the precomputed columns and never ran `ref`, without a word."""
    model = _gpt2().train()
    batch = P.pair_collate(pad_id=1)(ROWS)
    batch["reference_chosen"] = batch["reference_rejected"] = torch.zeros(2, dtype=torch.float64)
    dpo = functools.partial(P.dpo_loss, beta=0.5)
    P.preference_loss(dpo)(model, batch)  # the columns alone: fine
    both = P.preference_loss(dpo, reference=_gpt2().requires_grad_(False))
    with pytest.raises(ValueError, match="one of the two references would be ignored"):
        both(model, batch)
