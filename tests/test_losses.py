"""The default loss decides by the model (issue 26): causal LMs shift, encoder-decoder and
token-classification models do not, anything else is told to pass loss_fn=."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from helpers import (
    digit_tokenizer,
    ragged_rows,
    reverse_rows,
    tiny_bert_tagger,
    tiny_llama,
    tiny_t5,
)

L = ft.losses


def _tag_rows(n, seed=0):
    """Token-classification rows: random ids, a tag per token, the first token's tag -100."""
    rows = ragged_rows(n, seed=seed, mask_prompt=False)
    return [
        {"input_ids": r["input_ids"], "labels": [-100] + [t % 5 for t in r["input_ids"][1:]]}
        for r in rows
    ]


def _seq2seq_batch(model, rows):
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(digit_tokenizer(), model=model)(rows)


def test_loss_for_decides_by_the_model_not_the_labels():
    from transformers import BartConfig, BartForConditionalGeneration, BertForSequenceClassification

    bart = BartForConditionalGeneration(
        BartConfig(vocab_size=16, d_model=16, encoder_layers=1, decoder_layers=1,
                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                   decoder_ffn_dim=32, max_position_embeddings=32)
    )  # fmt: skip
    seq_cls = BertForSequenceClassification(tiny_bert_tagger().config)
    assert L.loss_for(tiny_llama()) is L._CAUSAL
    assert L.loss_for(tiny_t5()) is L._SEQ2SEQ
    assert L.loss_for(bart) is L._SEQ2SEQ
    assert L.loss_for(tiny_bert_tagger()) is L._TOKENS
    assert L.loss_for(seq_cls) is L._CLASSIFY


def test_loss_for_looks_through_wrappers():
    from peft import LoraConfig, get_peft_model

    t5 = tiny_t5()
    assert L.loss_for(torch.compile(t5)) is L._SEQ2SEQ  # compiles nothing until called
    assert L.loss_for(torch.nn.DataParallel(tiny_bert_tagger())) is L._TOKENS  # DDP's .module
    lora = get_peft_model(tiny_t5(), LoraConfig(r=2, target_modules=["q", "v"]))
    assert L.loss_for(lora) is L._SEQ2SEQ


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


def test_a_plain_module_is_told_to_pass_loss_fn():
    state = ft.TrainState.create(_Plain(), ft.optim.sgd())
    batch = {"x": torch.randn(4, 3), "labels": torch.tensor([0, 1, 0, 1])}
    # Before: torch's "forward() got an unexpected keyword argument 'input_ids'"-style errors.
    with pytest.raises(TypeError, match=r"does not know _Plain.*loss_fn="):
        ft.accumulate_grads(state, [batch])
    _, stats = ft.accumulate_grads(state, [batch], ft.losses.classification_loss())
    assert int(stats.num_items) == 4


def test_token_classification_does_not_shift():
    model = tiny_bert_tagger().double()
    batch = ft.pad_collate()(_tag_rows(6))
    loss, n = L.default_loss(model, batch)
    labels = batch["labels"]
    assert int(n) == int((labels != -100).sum())  # every tag counts, none lost to a shift
    hf = model(**batch).loss  # HF's own mean over the same tokens
    torch.testing.assert_close(loss / n, hf, rtol=1e-12, atol=0)
    torch.testing.assert_close(L.token_classification_loss()(model, batch)[0], loss)


@pytest.mark.parametrize("with_decoder_inputs", [True, False])
def test_seq2seq_does_not_shift_and_builds_decoder_inputs(with_decoder_inputs):
    model = tiny_t5().double()
    batch = _seq2seq_batch(model, reverse_rows(5))
    if not with_decoder_inputs:
        del batch["decoder_input_ids"]  # built from the labels, as the model would
    loss, n = L.default_loss(model, batch)
    assert int(n) == int((batch["labels"] != -100).sum())
    hf = model(**batch).loss  # T5 computes the mean over labels != -100 itself
    torch.testing.assert_close(loss / n, hf, rtol=1e-12, atol=0)


def test_seq2seq_without_prepare_method_shifts_behind_the_start_token():
    model = tiny_t5().double()
    batch = _seq2seq_batch(model, reverse_rows(4, seed=3))
    want = batch.pop("decoder_input_ids")

    class NoPrepare(type(model)):
        prepare_decoder_input_ids_from_labels = None

    model.__class__ = NoPrepare
    assert torch.equal(L._decoder_inputs(model, batch["labels"]), want)
    model.config.decoder_start_token_id = None
    with pytest.raises(ValueError, match="decoder_input_ids"):
        L.default_loss(model, batch)


@pytest.mark.parametrize("make", [tiny_t5, tiny_bert_tagger, tiny_llama])
def test_counting_first_counts_as_the_loss_does(monkeypatch, make):
    """The count-first path (large models) counts unshifted labels for T5 and taggers, shifted
    ones for causal LMs; gradients equal the divide-after path's."""
    import ftrain.grads as grads_module

    model = make().double()
    if make is tiny_t5:
        rows = reverse_rows(8, seed=2)
        micro = [_seq2seq_batch(model, rows[i : i + 4]) for i in (0, 4)]
    else:
        rows = _tag_rows(8, seed=2) if make is tiny_bert_tagger else ragged_rows(8, seed=2)
        (micro,) = list(ft.make_batches(rows, batch_size=4, accum=2, shuffle=False))
    state = ft.TrainState.create(model, ft.optim.sgd())
    ref, ref_stats = ft.accumulate_grads(state, micro)
    ref = {k: g.clone() for k, g in ref.items()}
    shift = 1 if make is tiny_llama else 0
    want = sum(int((b["labels"][:, shift:] != -100).sum()) for b in micro)
    assert int(ref_stats.num_items) == want
    monkeypatch.setattr(grads_module, "COUNT_FIRST_NUMEL", 1)
    n = L._items_before_forward(ft.losses.default_loss, micro[0], model)
    assert int(n) == int((micro[0]["labels"][:, shift:] != -100).sum())
    grads, stats = ft.accumulate_grads(state, micro)
    assert int(stats.num_items) == want
    for k, g in grads.items():
        torch.testing.assert_close(g, ref[k], rtol=1e-6, atol=5e-8, msg=k)  # as test_grads
