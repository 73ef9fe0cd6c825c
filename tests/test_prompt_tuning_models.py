"""PEFT prompt learning (prompt tuning, P-tuning) with ftrain's losses: the adapter puts its
virtual tokens in front of the inputs, so in front of the logits."""

from __future__ import annotations

import pytest
import torch
from peft import PromptEncoderConfig, PromptTuningConfig, TaskType, get_peft_model

import ftrain as ft
from helpers import ragged_rows, tiny_llama

CONFIGS = {
    "prompt_tuning": lambda: PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3),
    "p_tuning": lambda: PromptEncoderConfig(
        task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3, encoder_hidden_size=16
    ),
}


def _prompted(kind: str):
    return get_peft_model(tiny_llama().double(), CONFIGS[kind]())


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_prompt_tuned_causal_lm_trains_on_peft_s_own_loss(kind):
    """The logits held the virtual tokens' positions too, so ftrain's causal loss failed in
    torch with a size mismatch. The labels now go behind -100 for them, the last virtual token
    predicting the first label, as PEFT's own loss: the mean is the model's `.loss`."""
    model = _prompted(kind)
    (micro,) = list(ft.make_batches(ragged_rows(4, seed=1), batch_size=4, shuffle=False))
    batch = micro[0]
    for loss_fn in (ft.losses.default_loss, ft.losses.causal_lm_loss()):
        loss, n = loss_fn(model, batch)
        torch.testing.assert_close(loss / n, model(**batch).loss.double())
    first = int((batch["labels"][:, 0] != -100).sum())
    assert int(n) == int((ft.losses.causal_targets(batch) != -100).sum()) + first


def test_a_prompt_tuned_causal_lm_s_gradient_is_its_own_loss_s_also_when_counted_first(
    monkeypatch,
):
    """Large models count a step's items before the forward: the first labels the prompt
    predicts are counted too (it counts after the forward for such a model)."""
    import ftrain.grads as grads_module

    monkeypatch.setattr(grads_module, "COUNT_FIRST_NUMEL", 1)
    model = _prompted("prompt_tuning")
    (micro,) = list(ft.make_batches(ragged_rows(8, seed=2), batch_size=4, accum=2, shuffle=False))
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, stats = ft.accumulate_grads(state, micro)
    grads = {k: g.clone() for k, g in grads.items()}
    model.zero_grad()
    sums = [ft.losses.causal_lm_loss()(model, b) for b in micro]
    total = sum(int(n) for _, n in sums)
    assert int(stats.num_items) == total
    (sum(loss for loss, _ in sums) / total).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            (key,) = [k for k in grads if k.endswith(name.split("base_model.")[-1])] or [name]
            torch.testing.assert_close(grads[key], p.grad, msg=name)


def test_a_prompt_tuned_tagger_scores_its_own_tokens():
    """A token classifier's logits hold the virtual tokens too (PEFT's own loss fails on
    them): the labels line up with the input's tokens behind them."""
    from helpers import tiny_bert_tagger

    model = get_peft_model(
        tiny_bert_tagger(), PromptTuningConfig(task_type=TaskType.TOKEN_CLS, num_virtual_tokens=3)
    )
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[1, 2, -100, 3]])}
    loss, n = ft.losses.default_loss(model, batch)
    logits = model(input_ids=batch["input_ids"]).logits
    assert logits.shape[1] == 7 and int(n) == 3
    want = torch.nn.functional.cross_entropy(logits[0, 3:], batch["labels"][0], reduction="sum")
    torch.testing.assert_close(loss, want)


def test_cpt_is_refused_by_name():
    """CPT's own loss weights the prompt's tokens by type: no built-in loss computes it."""
    from peft import CPTConfig

    model = get_peft_model(
        tiny_llama(),
        CPTConfig(task_type=TaskType.CAUSAL_LM, cpt_token_ids=[5, 6, 7], cpt_mask=[1, 1, 1],
                  cpt_tokens_type_mask=[1, 2, 2]),
    )  # fmt: skip
    (micro,) = list(ft.make_batches(ragged_rows(2, seed=1), batch_size=2, shuffle=False))
    with pytest.raises(ValueError, match="a PEFT CPT adapter: its own loss weights"):
        ft.losses.default_loss(model, micro[0])


def test_a_prompt_tuned_causal_lm_is_still_refused_by_classification_metrics():
    """Its default loss stays the causal one (shifted labels): metrics that score logits
    unshifted refuse it, as for any causal LM."""
    model = _prompted("prompt_tuning")
    (micro,) = list(ft.make_batches(ragged_rows(2, seed=1), batch_size=2, shuffle=False))
    assert ft.losses.loss_for(model) is ft.losses.loss_for(tiny_llama())
    with pytest.raises(ValueError, match="causal LM or an encoder-decoder"):
        ft.classification_metrics(model, micro[0])


def test_a_model_of_your_own_with_one_label_a_row_still_takes_the_token_loss():
    """The length comparison that finds virtual tokens reads no dimension the batch lacks."""

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 4)

        def forward(self, x):
            return self.linear(x)

    batch = {"x": torch.randn(5, 3), "labels": torch.tensor([0, 1, 2, 3, -100])}
    _, n = ft.losses.token_classification_loss()(Rows(), batch)
    assert int(n) == 4


def test_a_prompt_tuned_decoder_classifier_keeps_its_left_padding():
    """Under prompt tuning PEFT passes HF inputs_embeds, so a decoder's classifier reads the
    last position (it cannot find the pad id): a left-padded row's own last token. Its rows are
    not right-aligned as other sequence classifiers' are (that read a pad)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         pad_token_id=0, num_labels=3)  # fmt: skip
    model = get_peft_model(
        LlamaForSequenceClassification(config).eval(),
        PromptTuningConfig(task_type=TaskType.SEQ_CLS, num_virtual_tokens=3),
    )
    left = {
        "input_ids": torch.tensor([[5, 6, 7], [0, 8, 9]]),
        "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]]),
        "labels": torch.tensor([0, 2]),
    }
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([[8, 9]])).logits[0]
        logits = ft.losses.model_logits(model, ft.losses.padded_as_model(model, left))
    torch.testing.assert_close(logits[1], alone, atol=2e-3, rtol=0)


def test_a_left_padded_row_of_a_prompt_tuned_causal_lm_counts_its_first_token():
    """The last virtual token was given the label of each row's first *slot*: a pad (-100) in
    a left-padded row, so the row's first token was never a target and its loss and count
    changed with the rows padded beside it. It is the label of the row's first token now."""
    model = _prompted("prompt_tuning").eval()
    ids, mask = torch.tensor([[0, 0, 9, 10]]), torch.tensor([[0, 0, 1, 1]])
    left = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    alone = {"input_ids": ids[:, 2:], "attention_mask": mask[:, 2:], "labels": ids[:, 2:]}
    with torch.no_grad():
        want, n = ft.losses.causal_lm_loss()(model, alone)
        got, m = ft.losses.causal_lm_loss()(model, left)
    assert int(m) == int(n) == 2
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_a_left_padded_prompt_tuned_encoder_classifier_reads_its_rows_as_right_padded():
    """A prompt-tuned BERT classifier's rows were kept where they are (an exclusion meant for
    decoders' classifiers): the left-padded row's [CLS] sat behind its pads, and the loss
    changed with the padding. Right-aligned as the encoder without the prompt is."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config = PromptTuningConfig(task_type=TaskType.SEQ_CLS, num_virtual_tokens=3)
    model = get_peft_model(BertForSequenceClassification(cfg), config).eval()
    row, labels = [5, 6, 7], torch.tensor([2])
    right = {
        "input_ids": torch.tensor([[*row, 0, 0]]),
        "attention_mask": torch.tensor([[1] * 3 + [0] * 2]),
    }
    left = {
        "input_ids": torch.tensor([[0, 0, *row]]),
        "attention_mask": torch.tensor([[0] * 2 + [1] * 3]),
    }
    with torch.no_grad():
        want, _ = ft.losses.default_loss(model, {**right, "labels": labels})
        got, _ = ft.losses.default_loss(model, {**left, "labels": labels})
    torch.testing.assert_close(got, want)
