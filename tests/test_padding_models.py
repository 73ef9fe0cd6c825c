"""Left padding with the model types whose outputs change with it: encoders' sequence
classifiers (first-token pooling), positions that ignore the mask, and the decoders that take
no position_ids (BART's family as causal LMs, RWKV)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import ftrain as ft

TINY = dict(
    num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
    vocab_size=64, max_position_embeddings=64, embedding_size=32, dim=32, hidden_dim=64,
    n_heads=4, n_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, classifier_dropout=0.0,
)  # fmt: skip
ROWS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def tiny(model_type: str, auto, *, pad: int = 0, **extra):
    cfg = AutoConfig.for_model(model_type)
    for key, value in {**TINY, **extra}.items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    cfg.pad_token_id, cfg.num_labels = pad, 3
    torch.manual_seed(0)
    return auto.from_config(cfg).eval()


def padded(rows, *, side: str, pad: int = 0, labels=None) -> dict:
    n = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        fill = [pad] * (n - len(row))
        ids.append(fill + row if side == "left" else row + fill)
        ones, zeros = [1] * len(row), [0] * (n - len(row))
        mask.append(zeros + ones if side == "left" else ones + zeros)
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    if labels is not None:
        batch["labels"] = torch.tensor(labels)
    return batch


@pytest.mark.parametrize("model_type", ["bert", "distilbert", "roberta", "albert", "electra"])
def test_a_left_padded_encoder_classifier_reads_its_rows_as_right_padded(model_type):
    """An encoder's sequence classifier pools [CLS], its first token: in a left-padded row
    that was a pad, so the loss, the metrics and predict's logits were the pad's (HF's own loss
    too). They are now those of the right-padded batch."""
    pad = 1 if model_type == "roberta" else 0
    model = tiny(model_type, AutoModelForSequenceClassification, pad=pad)
    right = padded(ROWS, side="right", pad=pad, labels=[0, 2])
    left = padded(ROWS, side="left", pad=pad, labels=[0, 2])
    loss_fn = ft.losses.classification_loss()
    with torch.no_grad():
        want, n = loss_fn(model, right)
        got, m = loss_fn(model, left)
        assert int(n) == int(m) == 2
        torch.testing.assert_close(got, want)
        metrics = ft.classification_metrics(model, left)
        torch.testing.assert_close(metrics["loss"][0], want)
        alone = [model(input_ids=torch.tensor([r])).logits[0] for r in ROWS]
        logits = ft.losses.model_logits(model, ft.losses.padded_as_model(model, left))
    torch.testing.assert_close(logits, torch.stack(alone), atol=1e-5, rtol=1e-4)


def test_right_aligning_keeps_a_right_padded_batch_and_moves_every_input_of_the_mask_shape():
    model = tiny("bert", AutoModelForSequenceClassification)
    right = {**padded(ROWS, side="right", labels=[0, 2]), "token_type_ids": torch.zeros(2, 5)}
    out = ft.losses.padded_as_model(model, right)
    for key in right:
        assert torch.equal(out[key], right[key]), key
    left = padded(ROWS, side="left", labels=[[1, 0, 1, 0, 0], [0, 1, 1, 1, 1]])
    left["token_type_ids"] = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]])
    left["inputs_embeds"] = torch.arange(10.0).reshape(2, 5, 1).expand(2, 5, 3)
    out = ft.losses.padded_as_model(model, left)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]]
    assert out["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert out["token_type_ids"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert out["inputs_embeds"][1, :, 0].tolist() == [7.0, 8.0, 9.0, 5.0, 6.0]
    assert torch.equal(out["labels"], left["labels"])  # per row: never moved


def test_a_token_classifier_is_not_right_aligned():
    """Its logits line up with its labels, position by position: not moved."""
    model = tiny("bert", AutoModelForTokenClassification)
    left = padded(ROWS, side="left")
    assert torch.equal(ft.losses.padded_as_model(model, left)["input_ids"], left["input_ids"])


ENCODERS = [
    "albert", "deberta", "deberta-v2", "distilbert", "flaubert", "layoutlm", "mobilebert",
    "squeezebert",
]  # fmt: skip


@pytest.mark.parametrize("model_type", ENCODERS)
def test_a_left_padded_encoder_tagger_reads_its_tokens_from_position_0(model_type):
    """These encoders count positions 0, 1, ... from the row's first slot, padding or not: a
    left-padded row's tokens were read at shifted positions, so token_classification_loss
    changed with the rows padded beside it. Positions now come from the mask."""
    model = tiny(model_type, AutoModelForTokenClassification)
    labels = [[0, 1, 2, 1, 0], [2, 1, 0, -100, -100]]
    right = padded(ROWS, side="right", labels=labels)
    left = padded(ROWS, side="left", labels=[labels[0], [-100, -100, 2, 1, 0]])
    loss_fn = ft.losses.token_classification_loss()
    with torch.no_grad():
        want, n = loss_fn(model, right)
        got, m = loss_fn(model, left)
        plain = model(**{k: v for k, v in right.items() if k != "labels"}).logits
        logits = ft.losses.model_logits(model, right)
    assert int(n) == int(m) == 8
    torch.testing.assert_close(got, want)
    assert torch.equal(logits[0], plain[0]) and torch.equal(logits[1, :3], plain[1, :3])


def _bart_decoder():
    from transformers import BartConfig, BartForCausalLM

    torch.manual_seed(0)
    return BartForCausalLM(BartConfig(**BART)).eval()


def _rwkv():
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    return RwkvForCausalLM(
        RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                   intermediate_size=64, context_length=64)
    ).eval()  # fmt: skip


BART = dict(
    vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    max_position_embeddings=64, pad_token_id=0, dropout=0.0,
)  # fmt: skip


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (_bart_decoder, "counts positions from the row's first slot and takes no position_ids"),
        (_rwkv, "its recurrence ignores the attention mask"),
    ],
)
def test_a_left_padded_batch_to_a_decoder_that_cannot_take_positions_is_refused(build, why):
    """BART's family's decoders as causal LMs and RWKV read a left-padded row differently from
    the row alone (no position_ids to give them): the loss changed with the padding, silently.
    A left-padded batch now raises, naming the model and the fix; right padding trains."""
    model = build()
    name = type(model).__name__
    labels = [[5, 6, 7, 8, 9], [10, 11, 12, -100, -100]]
    right = padded(ROWS, side="right", labels=labels)
    left = padded(ROWS, side="left", labels=[labels[0], [-100, -100, 10, 11, 12]])
    for loss_fn in (ft.losses.causal_lm_loss(), ft.losses.token_classification_loss()):
        with pytest.raises(ValueError, match=f"left-padded batch .*{name}.*{why}.*padding_side"):
            loss_fn(model, left)
    with pytest.raises(ValueError, match="left-padded"):
        ft.losses.model_logits(model, left)
    loss, n = ft.losses.causal_lm_loss()(model, right)
    assert int(n) == 6 and torch.isfinite(loss)


def test_a_left_padded_batch_after_unpadded_ones_is_refused_too():
    """The check ran only until the batch's keys had a call plan: after a first batch without
    padding (rows of one length, data grouped by length), left-padded batches went through
    and their loss changed with the padding. It runs until a batch with padding has passed."""
    model = _bart_decoder()
    loss_fn = ft.losses.causal_lm_loss()
    even = padded([[5, 6, 7], [8, 9, 10]], side="right", labels=[[5, 6, 7], [8, 9, 10]])
    for _ in range(3):
        loss_fn(model, even)
    left = padded(ROWS, side="left", labels=[[5, 6, 7, 8, 9], [-100, -100, 10, 11, 12]])
    with pytest.raises(ValueError, match="left-padded batch"):
        loss_fn(model, left)
    right = padded(ROWS, side="right", labels=[[5, 6, 7, 8, 9], [10, 11, 12, -100, -100]])
    loss_fn(model, right)  # padding seen, on the right: checked (no host read from here on)
    assert not ft.losses._left_padding_pending(model)


@pytest.mark.parametrize("model_type", ["bart", "pegasus", "t5"])
def test_a_left_padded_encoder_input_gives_the_seq2seq_loss_of_right_padding(model_type):
    """BART's family (and LED, Pegasus-X, BERT2BERT) count the encoder's positions from its
    first slot: a left-padded input was read from its padding on, so seq2seq_loss changed with
    the rows padded beside it. The encoder's rows are now right-aligned first (T5's relative
    positions needed nothing: its loss stays the same)."""
    from transformers import AutoModelForSeq2SeqLM

    extra = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, d_kv=8,
                 d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0)  # fmt: skip
    if model_type == "t5":
        from helpers import tiny_t5

        model = tiny_t5().eval()
    else:
        model = tiny(model_type, AutoModelForSeq2SeqLM, **extra)
    labels = [[7, 8, 2], [9, 2, -100]]
    right = padded(ROWS, side="right", labels=labels)
    left = padded(ROWS, side="left", labels=labels)
    with torch.no_grad():
        want, n = ft.losses.seq2seq_loss()(model, right)
        got, m = ft.losses.seq2seq_loss()(model, left)
    assert int(n) == int(m) == 5
    torch.testing.assert_close(got, want)
    # predict reads the encoder's input as the loss does (it disagreed with it for BART)
    state = ft.TrainState.create(model, ft.optim.sgd())
    (by_left,), (by_right,) = (list(ft.predict(state, [b])) for b in (left, right))
    np.testing.assert_allclose(by_left["logits"], by_right["logits"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta", "camembert", "esm", "mobilebert"])
def test_a_left_padded_roberta_tagger_padded_in_another_id_reads_its_own_positions(model_type):
    """RoBERTa's family counts positions from the tokens that are not its pad id (1), and
    MobileBERT's trigram embeddings read the token before a row's first: padding in
    make_batches' default id 0 before a row changed its tokens' outputs, so the token loss and
    predict's logits changed with the rows padded beside it. The mask's padding is now the
    model's pad id."""
    model = tiny(model_type, AutoModelForTokenClassification, pad=1)
    labels = [[0, 1, 2, 1, 0], [2, 1, 0, -100, -100]]
    right = padded(ROWS, side="right", pad=0, labels=labels)
    left = padded(ROWS, side="left", pad=0, labels=[labels[0], [-100, -100, 2, 1, 0]])
    loss_fn = ft.losses.token_classification_loss()
    with torch.no_grad():
        want, _ = loss_fn(model, right)
        got, _ = loss_fn(model, left)
        unchanged = ft.losses.token_classification_loss()(model, right)[0]
    torch.testing.assert_close(got, want)
    assert torch.equal(unchanged, want)
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([ROWS[1]])).logits[0]
        logits = ft.losses.model_logits(model, left)  # predict's
    torch.testing.assert_close(logits[1, 2:], alone, atol=1e-5, rtol=1e-4)


def test_a_left_padded_roberta_decoder_padded_in_another_id_gives_the_right_padded_loss():
    """RoBERTa's decoder as a causal LM (RobertaForCausalLM) reads positions the same way."""
    from transformers import AutoModelForCausalLM

    model = tiny("roberta", AutoModelForCausalLM, pad=1, is_decoder=True)
    labels = [[5, 6, 7, 8, 9], [10, 11, 12, -100, -100]]
    right = padded(ROWS, side="right", labels=labels)
    left = padded(ROWS, side="left", labels=[labels[0], [-100, -100, 10, 11, 12]])
    with torch.no_grad():
        want, n = ft.losses.causal_lm_loss()(model, right)
        got, m = ft.losses.causal_lm_loss()(model, left)
    assert int(n) == int(m) == 6
    torch.testing.assert_close(got, want)


def test_a_left_padded_bert_classifier_trains_and_evaluates_as_right_padded():
    """Through the loop's calls (default loss): accumulate_grads' gradients and evaluate's
    loss of a left-padded batch are those of the right-padded one."""
    model = tiny("bert", AutoModelForSequenceClassification).double()
    state = ft.TrainState.create(model, ft.optim.sgd())
    right = padded(ROWS, side="right", labels=[0, 2])
    left = padded(ROWS, side="left", labels=[0, 2])
    want, _ = ft.accumulate_grads(state, [right])
    want = {k: g.clone() for k, g in want.items()}
    got, _ = ft.accumulate_grads(state, [left])
    for k, g in got.items():
        torch.testing.assert_close(g, want[k], msg=k)
    assert ft.evaluate(state, [left])["eval_loss"] == pytest.approx(
        ft.evaluate(state, [right])["eval_loss"], rel=1e-9
    )


def test_classifiers_that_read_the_last_position_keep_their_left_padded_rows():
    """Right-aligning every sequence classifier moved a pad into the last slot of XLNet's (it
    pools the last position; its tokenizer pads on the left for that) and of a decoder's
    without a pad id (HF reads position -1, a batch of one): both read a pad where HF and the
    row alone read its last token. Only the types measured to read the first slot move."""
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        XLNetConfig,
        XLNetForSequenceClassification,
    )

    torch.manual_seed(0)
    xlnet_cfg = XLNetConfig(vocab_size=40, d_model=16, n_layer=1, n_head=2, d_inner=16)
    xlnet_cfg.num_labels, xlnet_cfg.pad_token_id = 3, 5
    llama_cfg = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_labels=3,
    )  # fmt: skip
    xlnet = XLNetForSequenceClassification(xlnet_cfg).eval()
    llama = LlamaForSequenceClassification(llama_cfg).eval()
    assert llama.config.pad_token_id is None
    for model, pad, row in ((xlnet, 5, [9, 10, 3]), (llama, 0, [7, 8, 9])):
        ids = torch.tensor([[pad, pad, pad, *row]])
        mask = (ids != pad).long()
        batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([2])}
        alone = {"input_ids": torch.tensor([row]), "labels": torch.tensor([2])}
        with torch.no_grad():
            got = ft.losses.model_logits(model, ft.losses.padded_as_model(model, batch))
            want = model(input_ids=alone["input_ids"]).logits
            loss, _ = ft.losses.default_loss(model, batch)
            alone_loss, _ = ft.losses.default_loss(model, alone)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(loss, alone_loss, atol=1e-5, rtol=1e-4)


def test_right_aligning_moves_only_the_models_inputs():
    """`padded_as_model` rolled every tensor of the mask's shape: a column of the user's own
    loss (per-token targets under another key) was moved away from the rows it belongs to."""
    model = tiny("bert", AutoModelForSequenceClassification)
    left = padded(ROWS, side="left", labels=[0, 2])
    left["my_targets"] = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]])
    out = ft.losses.padded_as_model(model, left)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]]
    assert torch.equal(out["my_targets"], left["my_targets"])
