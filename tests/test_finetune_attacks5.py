"""Silent failures of everyday fine-tuning, sixth pass: the problem type an exported
classifier's config records, label padding in pad_collate (pad_to_multiple_of beside
multi-hot labels, unsigned label dtypes), and left padding of models with learned positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForTokenClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
)
from transformers import BertForSequenceClassification as Bert

import ftrain as ft


def _bert_classifier(num_labels: int) -> Bert:
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_labels=num_labels,
    )  # fmt: skip
    return Bert(cfg)


@pytest.mark.parametrize(
    ("num_labels", "label", "kind"),
    [
        (1, lambda i: float(i % 3), "regression"),
        (1, lambda i: i % 3, "regression"),  # integer scores (STS-B-like): still regression
        (3, lambda i: [float(i % 2), 1.0, 0.0], "multi_label_classification"),
        (3, lambda i: i % 3, "single_label_classification"),
    ],
)
def test_a_classifiers_inferred_problem_type_is_recorded_in_its_exported_config(
    num_labels, label, kind, tmp_path
):
    # HF's loss records the problem type it infers in config.problem_type; the built-in loss
    # left it None, so an exported regression model ran through HF's text-classification
    # pipeline with a sigmoid on its score (num_labels == 1) and a multi-label one with a
    # softmax over its labels, silently: the Trainer's export says which it was.
    rows = [{"input_ids": [2, 3 + i % 4, 5], "labels": label(i)} for i in range(8)]
    state = ft.TrainState.create(_bert_classifier(num_labels), ft.optim.adamw(), seed=0)
    for micro in ft.make_batches(rows, state, batch_size=4):
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
    reference = _bert_classifier(num_labels)  # HF's own forward with labels decides it
    batch = ft.pad_collate()(rows[:4])
    reference(**batch)
    assert reference.config.problem_type == kind
    assert state.model.config.problem_type == kind
    out = ft.export_pretrained(state, tmp_path / "export")
    assert AutoModelForSequenceClassification.from_pretrained(out).config.problem_type == kind
    # A checkpoint of it resumes into a fresh model, whose config has not recorded it yet.
    ft.save_checkpoint(state, tmp_path / "run")
    fresh = ft.TrainState.create(_bert_classifier(num_labels), ft.optim.adamw(), seed=0)
    resumed = ft.load_checkpoint(ft.latest_checkpoint(tmp_path / "run"), fresh)
    assert resumed.step == state.step


def test_pad_to_multiple_of_leaves_a_multi_label_batchs_label_vectors_alone():
    # DataCollatorWithPadding(pad_to_multiple_of=8) pads the tokens only. pad_collate padded
    # every row's multi-hot labels with -100 up to 8 too, past the model's 3 outputs: a valid
    # multi-label batch was refused by the loss (and a loss of your own trained on -100s).
    rows = [
        {"input_ids": [2, 3, 4][: 1 + i % 3], "labels": [float(i % 2), 1.0, 0.0]} for i in range(4)
    ]
    plain = ft.pad_collate()(rows)
    padded = ft.pad_collate(pad_to_multiple_of=8)(rows)
    assert padded["input_ids"].shape == padded["attention_mask"].shape == (4, 8)
    assert torch.equal(padded["labels"], plain["labels"])
    model = _bert_classifier(3).eval()
    loss, n = ft.losses.default_loss(model, padded)
    assert int(n) == 12
    assert torch.allclose(loss, ft.losses.default_loss(model, plain)[0])
    # One label per token (a tagger's) still pads to the multiple with the tokens.
    tags = ft.pad_collate(pad_to_multiple_of=8)([{"input_ids": [2, 3], "labels": [0, 1]}] * 2)
    assert tags["labels"].tolist() == [[0, 1] + [-100] * 6] * 2


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_label_padding_never_wraps_around_in_an_unsigned_dtype(dtype):
    # Tags stored compactly (numpy uint8, as a tokenized dataset saved to disk often has them)
    # were padded with -100 in their own dtype: 156 (65436 in uint16), a class to the loss.
    rows = [
        {"input_ids": [2, 3, 4][: 2 + i % 2], "labels": np.array([1, 2, 3][: 2 + i % 2], dtype)}
        for i in range(4)
    ]
    batch = ft.pad_collate()(rows)
    assert batch["labels"].tolist() == [[1, 2, -100], [1, 2, 3]] * 2
    wide = ft.pad_collate()([{**r, "labels": r["labels"].astype(np.int64)} for r in rows])
    assert torch.equal(batch["labels"], wide["labels"])


def _bert_tagger():
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_labels=3,
    )  # fmt: skip
    return BertForTokenClassification(cfg).eval()


def _gpt2(cls):
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16, num_labels=3,
        pad_token_id=3, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return cls(cfg).eval()


@pytest.mark.parametrize(
    ("cls", "label"),
    [
        (GPT2LMHeadModel, lambda ids: ids),
        (GPT2ForSequenceClassification, lambda ids: len(ids) % 3),
        (GPT2ForTokenClassification, lambda ids: [t % 3 for t in ids]),
        (BertForTokenClassification, lambda ids: [t % 3 for t in ids]),
    ],
)
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_of_a_model_with_learned_positions_scores_its_rows_alone(cls, label, side):
    # GPT-2 reads its learned positions from the token index, not the attention mask: each
    # left-padded row was read from position k (its padding) on, so its loss changed with the
    # rows padded beside it, though causal_targets promises left- and right-padded batches the
    # loss of their rows run alone (and a decoder tokenizer often pads on the left).
    model = _bert_tagger() if cls is BertForTokenClassification else _gpt2(cls)
    rows = [{"input_ids": ids, "labels": label(ids)} for ids in ([5, 6, 7, 8], [9, 10], [11])]
    alone = [ft.losses.default_loss(model, ft.pad_collate()([r])) for r in rows]
    with torch.no_grad():
        loss, n = ft.losses.default_loss(model, ft.pad_collate(padding_side=side)(rows))
    assert int(n) == sum(int(k) for _, k in alone)
    assert torch.allclose(loss, sum(s for s, _ in alone), atol=1e-5)


def test_every_model_type_given_positions_from_its_mask_is_one_transformers_knows():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from ftrain.losses import _MASK_BLIND_POSITIONS

    assert not _MASK_BLIND_POSITIONS - CONFIG_MAPPING_NAMES.keys()


@pytest.mark.parametrize("cls", [GPT2ForSequenceClassification, GPT2ForTokenClassification])
def test_predict_reads_a_left_padded_row_of_a_model_with_learned_positions_as_alone(cls):
    """`model_logits` (predict, the metrics, preference log-probs) counts positions from the
    mask as the losses do: predict's logits of a left-padded GPT-2 classifier's rows were those
    of rows read from their padding on (0.095 off), disagreeing with the loss."""
    model = _gpt2(cls)
    rows = [{"input_ids": ids, "labels": 1 if cls is GPT2ForSequenceClassification else
             [1] * len(ids)} for ids in ([5, 6, 7, 8], [9, 10], [11])]  # fmt: skip
    batch = ft.pad_collate(padding_side="left")(rows)
    with torch.no_grad():
        got = ft.losses.model_logits(model, batch)
        for i, r in enumerate(rows):
            alone = ft.losses.model_logits(model, ft.pad_collate()([r]))[0]
            n = len(r["input_ids"])
            mine = got[i] if cls is GPT2ForSequenceClassification else got[i, -n:]
            torch.testing.assert_close(mine, alone, atol=1e-5, rtol=1e-5)


def test_a_batch_with_label_instead_of_labels_is_told_to_rename_it():
    """GLUE-style datasets name the column `label`; HF's DataCollatorWithPadding renames it to
    `labels`, ft.pad_collate does not. The losses and classification_metrics raised a bare
    KeyError for 'labels' (or said nothing of `label`); they name the rename."""
    model = _gpt2(GPT2ForSequenceClassification)
    batch = ft.pad_collate()([{"input_ids": [5, 6], "label": 1}, {"input_ids": [7], "label": 0}])
    assert "label" in batch and "labels" not in batch
    for run in (
        lambda: ft.losses.default_loss(model, batch),
        lambda: ft.losses.classification_loss()(model, batch),
        lambda: ft.eval.classification_metrics(model, batch),
    ):
        with pytest.raises(KeyError, match=r"rename_column\('label', 'labels'\)"):
            run()


def test_lora_on_a_gpt2_classifier_without_targets_names_the_conv1d_layers():
    """GPT2ForSequenceClassification's only torch.nn.Linear is its `score` head, which trains in
    full: PEFT's "No modules were targeted" came instead of ftrain's Conv1D hint (given only
    when no Linear layer at all was found, GPT2LMHeadModel)."""
    pytest.importorskip("peft")
    with pytest.raises(ValueError, match=r"no layer to adapt .*targets=\['c_attn'"):
        ft.lora.apply(_gpt2(GPT2ForSequenceClassification), r=2)
    wrapped = ft.lora.apply(_gpt2(GPT2ForSequenceClassification), r=2, fan_in_fan_out=True,
                            targets=["c_attn", "c_proj", "c_fc"])  # fmt: skip
    assert any("lora_A" in n for n, p in wrapped.named_parameters() if p.requires_grad)


def test_positions_from_a_mask_of_segment_ids_count_each_token_once():
    """A packed batch's mask of segment ids (1, 1, 2, 2, 2: some packing libraries' form) gave
    positions 0, 1, 3, 5, 7 (its values summed), past n_positions on long rows: the review's."""
    from ftrain.losses import _with_mask_positions

    model = _gpt2(GPT2LMHeadModel)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
             "attention_mask": torch.tensor([[1, 1, 2, 2, 2]])}  # fmt: skip
    assert _with_mask_positions(model, batch)["position_ids"].tolist() == [[0, 1, 2, 3, 4]]
    left = {**batch, "attention_mask": torch.tensor([[0, 0, 1, 1, 1]])}
    assert _with_mask_positions(model, left)["position_ids"].tolist() == [[0, 0, 0, 1, 2]]
