"""Silent failures of everyday fine-tuning (losses, collation, evaluation), each pinned by the
number the same data gives without the trap: the rows run alone, or HF's own computation."""

from __future__ import annotations

import warnings

import pytest
import torch

import ftrain as ft
from ftrain.losses import _items_before_forward, default_loss

TINY_LLAMA = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
ROWS = [
    {"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9]},
    {"input_ids": [10, 11, 12], "labels": [10, 11, 12]},
]


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config notes on tiny models
        return fn(*args)


def _llama(cls_name: str, **config):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY_LLAMA, **config)
    return _quiet(getattr(transformers, cls_name), cfg).eval()


def _alone(model, rows, collate):
    """The summed loss and item count of each row run by itself, added up."""
    parts = [default_loss(model, collate([r])) for r in rows]
    return sum(float(s) for s, _ in parts), sum(int(n) for _, n in parts)


def test_a_left_padded_causal_batch_scores_what_its_rows_score_alone():
    # HF's shift trained the last left pad to predict the row's first token: 7 items, not 6,
    # and eval_loss / gradients depended on which rows shared a batch.
    model = _llama("LlamaForCausalLM", pad_token_id=0)
    left = ft.pad_collate(padding_side="left")
    with torch.no_grad():
        loss, n = default_loss(model, left(ROWS))
        ref, ref_n = _alone(model, ROWS, left)
    assert int(n) == ref_n == 6
    assert float(loss) == pytest.approx(ref, rel=1e-5)
    # The count accumulate_grads takes before the forward (large models) agrees.
    assert int(_items_before_forward(default_loss, left(ROWS), model)) == 6
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    one, two = (
        ft.evaluate(state, ft.make_batches(ROWS, batch_size=b, shuffle=False, collate_fn=left))
        for b in (1, 2)
    )
    assert one["eval_items"] == two["eval_items"] == 6
    assert one["eval_loss"] == pytest.approx(two["eval_loss"], rel=1e-5)


def test_causal_targets_ignore_only_padding_positions():
    batch = {
        "labels": torch.tensor([[-100, -100, 5, 6], [7, 8, 9, -100]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]]),
    }
    assert ft.losses.causal_targets(batch).tolist() == [[-100, -100, 6, -100], [8, 9, -100, -100]]
    packed = {"labels": torch.tensor([[-100, 2, -100, 4]])}  # no mask: the plain shift
    assert ft.losses.causal_targets(packed).tolist() == [[2, -100, 4, -100]]


def test_a_sequence_classifier_padded_with_another_id_is_classified_from_its_last_token():
    # make_batches' default collate pads with 0; a Llama classifier finds each row's end by
    # config.pad_token_id (2 here): the short row was classified from a padding position.
    model = _llama("LlamaForSequenceClassification", pad_token_id=2, num_labels=3)
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": 1}, {"input_ids": [10, 11, 12], "labels": 2}]
    collate = ft.pad_collate()  # pad_id=0, the default
    batch = collate(rows)
    with torch.no_grad():
        loss, n = default_loss(model, batch)
        ref, _ = _alone(model, rows, collate)
        hf = model(**ft.pad_collate(pad_id=2)(rows)).loss * 2  # HF, padded with its pad id
    assert int(n) == 2
    assert float(loss) == pytest.approx(ref, rel=1e-5)
    assert float(loss) == pytest.approx(float(hf), rel=1e-5)
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    metrics = ft.evaluate(state, [batch], metrics_fn=ft.classification_metrics)
    assert metrics["eval_loss"] == pytest.approx(ref / 2, rel=1e-5)
    (out,) = ft.predict(state, [batch])
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([[10, 11, 12]])).logits
    assert torch.allclose(torch.from_numpy(out["logits"][1]), alone[0], atol=1e-5)


def test_pack_examples_refuses_padded_rows():
    row = {"input_ids": [5, 6, 0, 0], "attention_mask": [1, 1, 0, 0], "labels": [5, 6, 0, 0]}
    with pytest.raises(ValueError, match="attention_mask marks padding"):
        ft.data.pack_examples([row], max_length=8)
    unpadded = {"input_ids": [5, 6], "attention_mask": [1, 1], "labels": [5, 6]}
    assert ft.data.pack_examples([unpadded], max_length=8)[0]["input_ids"] == [5, 6]


def test_left_padding_refuses_seq2seq_targets():
    # Left-padded labels put padding between the decoder's start token and its target: a T5
    # row's loss changed with the rows padded beside it (23.08 against 23.41 alone).
    rows = [
        {"input_ids": [5, 6, 7, 8, 1], "labels": [9, 10, 11, 1]},
        {"input_ids": [12, 13, 1], "labels": [14, 1]},
    ]
    with pytest.raises(ValueError, match="padding_side='left', but row 0's labels"):
        ft.pad_collate(padding_side="left")(rows)
    right = ft.pad_collate()(rows)  # the right way still pads them
    assert right["labels"].tolist() == [[9, 10, 11, 1], [14, 1, -100, -100]]
    # One label per token (causal LM, token classification) and one per row still left-pad.
    left = ft.pad_collate(padding_side="left")
    assert left(ROWS)["labels"].tolist()[1] == [-100, -100, 10, 11, 12]
    rows = [{"input_ids": [1, 2, 3], "labels": 0}, {"input_ids": [4], "labels": 1}]
    assert left(rows)["labels"].tolist() == [0, 1]


def test_the_chunked_loss_and_multiple_choice_scores_agree_with_causal_lm_loss_on_left_padding():
    # Both shifted the labels themselves and kept the target the last left pad predicts (the
    # row's first token): on left-padded batches they counted one item per padded row more than
    # causal_lm_loss, and the chunked loss trained a different objective.
    from ftrain.extras.chunked_loss import chunked_causal_lm_loss
    from ftrain.extras.generation import multiple_choice_metrics

    model = _llama("LlamaForCausalLM", pad_token_id=0)
    batch = ft.pad_collate(padding_side="left")(ROWS)
    with torch.no_grad():
        ref, ref_n = default_loss(model, batch)
        loss, n = chunked_causal_lm_loss(chunk_size=3)(model, batch)
        rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, -100, 8]},
                {"input_ids": [10, 11, 9], "labels": [-100, -100, 9]}]  # fmt: skip
        left = ft.pad_collate(padding_side="left")(rows)
        mc = multiple_choice_metrics(choice_ids=[8, 9])(model, left)
        mc_ref, mc_n = default_loss(model, left)
    assert int(n) == int(ref_n) == 6
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    assert int(mc["loss"][1]) == int(mc_n) == 2
    assert float(mc["loss"][0]) == pytest.approx(float(mc_ref), rel=1e-5)


def test_token_classification_loss_refuses_packed_rows():
    # pack_examples marks every example's first label -100 (for a causal shift): a tagger lost
    # one label per example without a word.
    model = _llama("LlamaForTokenClassification", pad_token_id=0, num_labels=3)
    rows = [{"input_ids": [5, 6, 7], "labels": [0, 1, 2]}, {"input_ids": [8, 9], "labels": [1, 1]}]
    packed = ft.sft.packed_collate(pad_id=0)(ft.data.pack_examples(rows, max_length=5))
    with pytest.raises(ValueError, match="token_classification_loss got packed rows"):
        ft.losses.token_classification_loss()(model, packed)
    padded = ft.pad_collate()(rows)  # padded rows keep every label
    _, n = ft.losses.token_classification_loss()(model, padded)
    assert int(n) == 5
