"""The default losses against each HF task head's own `.loss`, and what they refuse: multi-label
and multi-output regression classifiers, masked-LM heads named `*WithLMHeadModel` and XLNet,
question answering and bare encoder-decoders, the decoders of seq2seq families offered as causal
LMs, mixture-of-experts router losses, packed rows of a model that caches or takes no
position_ids; `classification_metrics` on a model it cannot score; collation and packing
of odd rows; the SFT collator's BOS and EOS."""

from __future__ import annotations

import collections
import warnings
from typing import Any

import pytest
import torch

import ftrain as ft
import packing_scan
from helpers import digit_tokenizer, tiny_mixtral


def _bert_classifier(**config):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=16, **config)  # fmt: skip
    return BertForSequenceClassification(cfg).eval()


IDS = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(1))
MULTI_HOT = torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "config, labels",
    [
        ({"num_labels": 3, "problem_type": "multi_label_classification"}, MULTI_HOT),
        ({"num_labels": 3}, MULTI_HOT),  # float labels, several outputs: multi-label, as HF infers
        ({"num_labels": 3}, MULTI_HOT.bool()),  # bool multi-hot labels too
        ({"num_labels": 2, "problem_type": "regression"}, torch.randn(4, 2)),
        ({"num_labels": 1}, torch.randn(4)),
        ({"num_labels": 1}, torch.randn(4, 1)),  # HF squeezes both: no (4, 4) broadcast
        ({"num_labels": 3}, torch.tensor([0, 2, 1, -100])),
    ],
)
def test_the_sequence_classifier_loss_is_the_models_own_for_every_problem_type(config, labels):
    model = _bert_classifier(**config)
    batch = {"input_ids": IDS, "labels": labels}
    with torch.no_grad():
        loss_sum, n = ft.losses.default_loss(model, batch)
        hf_labels = labels.float() if labels.dtype == torch.bool else labels
        expected = model(input_ids=IDS, labels=hf_labels).loss
    torch.testing.assert_close(loss_sum / n, expected)


def test_a_classification_loss_refuses_what_its_problem_type_cannot_mean():
    single = _bert_classifier(num_labels=3, problem_type="single_label_classification")
    with pytest.raises(ValueError, match=r"float labels .* for a single-label classifier"):
        ft.losses.default_loss(single, {"input_ids": IDS, "labels": MULTI_HOT})
    multi = _bert_classifier(num_labels=3, problem_type="multi_label_classification")
    with pytest.raises(ValueError, match=r"labels of shape \(4, 2\) do not match"):
        ft.losses.default_loss(multi, {"input_ids": IDS, "labels": MULTI_HOT[:, :2]})
    regression = _bert_classifier(num_labels=1)
    smoothed = ft.losses.classification_loss(label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing=0\.1 applies to single-label"):
        smoothed(regression, {"input_ids": IDS, "labels": torch.randn(4)})
    with pytest.raises(ValueError, match=r"regression: labels of shape \(4, 2\)"):
        ft.losses.default_loss(regression, {"input_ids": IDS, "labels": torch.randn(4, 2)})


def _xlm():
    from transformers import XLMConfig, XLMWithLMHeadModel

    torch.manual_seed(0)
    return XLMWithLMHeadModel(XLMConfig(vocab_size=50, emb_dim=16, n_layers=1, n_heads=2))


def _xlnet():
    from transformers import XLNetConfig, XLNetLMHeadModel

    torch.manual_seed(0)
    return XLNetLMHeadModel(XLNetConfig(vocab_size=50, d_model=16, n_layer=1, n_head=2, d_inner=16))


@pytest.mark.parametrize("make", [_xlm, _xlnet], ids=["XLMWithLMHeadModel", "XLNetLMHeadModel"])
def test_lm_heads_that_score_labels_unshifted_get_the_unshifted_loss(make):
    """Their names end like a causal LM's (`LMHeadModel`), their loss is a masked LM's."""
    model = make().eval()
    labels = IDS.clone()
    labels[:, :2] = -100
    batch = {"input_ids": IDS, "labels": labels}
    assert ft.losses.loss_for(model) is ft.losses.loss_for(_bert_token_model())
    with torch.no_grad():
        loss_sum, n = ft.losses.default_loss(model, batch)
        torch.testing.assert_close(loss_sum / n, model(**batch).loss)


def _bert_token_model():
    from helpers import tiny_bert_tagger

    return tiny_bert_tagger()


def _bart(cls_name: str):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BartConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
    )  # fmt: skip
    return getattr(transformers, cls_name)(cfg)


@pytest.mark.parametrize("cls_name", ["BartForQuestionAnswering", "BartModel"])
def test_question_answering_and_bare_encoder_decoders_have_no_default_loss(cls_name):
    with pytest.raises(TypeError, match=f"the default loss does not know {cls_name}.*loss_fn="):
        ft.losses.loss_for(_bart(cls_name))
    seq2seq = ft.losses.loss_for(_bart("BartForConditionalGeneration"))
    assert ft.losses.loss_for(_marian()) is seq2seq  # an LM head without the usual name


def _marian():
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    cfg = MarianConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, pad_token_id=0,
        decoder_start_token_id=0,
    )  # fmt: skip
    return MarianMTModel(cfg)


def test_a_router_loss_the_default_loss_would_leave_out_raises():
    batch = {"input_ids": IDS, "labels": IDS}
    with pytest.raises(ValueError, match=r"returned aux_loss \(its config sets output_router"):
        ft.losses.default_loss(tiny_mixtral(router_logits=True), batch)
    model = tiny_mixtral(router_logits=False).eval()  # the default: no router loss to leave out
    with torch.no_grad():
        loss_sum, n = ft.losses.default_loss(model, batch)
        torch.testing.assert_close(loss_sum / n, model(**batch).loss)


class _Outputs:
    """A model output that is neither a dataclass nor a tuple, holding a router loss."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.aux_loss = logits, logits.sum()


class _Routed(torch.nn.Module):
    def __init__(self, wrap: Any) -> None:
        super().__init__()
        self.emb, self.wrap = torch.nn.Embedding(10, 10), wrap

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.wrap(self.emb(input_ids))


@pytest.mark.parametrize(
    "wrap",
    [_Outputs, lambda logits: collections.namedtuple("Out", "logits aux_loss")(logits, logits)],
    ids=["object", "namedtuple"],
)
def test_a_router_loss_on_an_output_of_your_own_type_raises(wrap):
    """The router fields are read by type (a ModelOutput that declares none is not asked,
    issue 30); an output of another type is still asked for each, a namedtuple included."""
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
    with pytest.raises(ValueError, match=r"returned aux_loss"):
        ft.losses.causal_lm_loss()(_Routed(wrap), batch)
    plain = _Routed(lambda logits: (logits,))  # a plain tuple holds no router field
    loss, n = ft.losses.causal_lm_loss()(plain, batch)
    assert int(n) == 2 and torch.isfinite(loss)


def test_packed_rows_stay_apart_in_a_model_whose_config_caches():
    """HF models given a key/value cache build a plain causal mask: packed rows (position_ids
    restarting, no attention mask) attended across examples while config.use_cache was True."""
    from helpers import tiny_llama

    model = tiny_llama().eval()
    assert model.config.use_cache  # the model's default
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]},
            {"input_ids": [9, 10, 11], "labels": [9, 10, 11]}]  # fmt: skip
    packed = ft.sft.packed_collate(pad_id=0)(ft.data.pack_examples(rows, max_length=16))
    loss = ft.losses.causal_lm_loss()
    with torch.no_grad():
        together, n = loss(model, packed)
        alone = [loss(model, ft.pad_collate(pad_id=0)([r])) for r in rows]
    assert int(n) == sum(int(k) for _, k in alone) == 5
    torch.testing.assert_close(together, sum(s for s, _ in alone))


def test_classification_metrics_refuses_models_whose_labels_it_would_score_unshifted():
    from helpers import tiny_llama

    batch = {"input_ids": IDS % 50, "labels": IDS % 50}
    with pytest.raises(ValueError, match=r"classification_metrics scores logits.*LlamaForCausalLM"):
        ft.classification_metrics(tiny_llama(), batch)
    with pytest.raises(ValueError, match="BartForConditionalGeneration is a causal LM or an enc"):
        ft.classification_metrics(_bart("BartForConditionalGeneration"), batch)
    with pytest.raises(ValueError, match="needs integer class labels"):
        ft.classification_metrics(
            _bert_classifier(num_labels=1), {"input_ids": IDS, "labels": torch.randn(4)}
        )
    got = ft.classification_metrics(
        _bert_classifier(num_labels=3), {"input_ids": IDS, "labels": torch.tensor([0, 1, 2, -100])}
    )
    assert int(got["accuracy"][1]) == 3  # -100 not counted


def test_pad_collate_keeps_a_later_rows_floats():
    batch = ft.pad_collate(pad_id=0)([{"labels": [1, 0]}, {"labels": [0.5, 1.5]}, {"labels": [2]}])
    assert batch["labels"].dtype == torch.float32
    torch.testing.assert_close(batch["labels"], torch.tensor([[1, 0], [0.5, 1.5], [2, -100]]))


def test_pack_examples_refuses_rows_whose_lengths_differ_even_when_both_are_cut():
    row = {"input_ids": list(range(12)), "labels": list(range(20))}
    with pytest.raises(ValueError, match=r"row 0: input_ids \(12 tokens\) and labels \(20\)"):
        ft.data.pack_examples([row], max_length=10)


def test_the_sft_collator_refuses_a_missing_eos_and_a_second_bos():
    tok = digit_tokenizer()
    row = {"input": "1 2", "output": "3"}
    assert ft.sft.SFTCollator(tok).encode(row)["input_ids"][-1] == tok.eos_token_id
    no_eos = digit_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="add_eos=True, but the tokenizer has no EOS"):
        ft.sft.SFTCollator(no_eos)
    ft.sft.SFTCollator(no_eos, add_eos=False)  # said so: fine
    with_bos = digit_tokenizer()
    with_bos.bos_token = "</s>"  # a chat template would write it at the prompt's start
    with pytest.raises(ValueError, match="row 1: the prompt already starts with BOS"):
        ft.sft.SFTCollator(with_bos).encode_batch([row, {"input": "</s> 1", "output": "2"}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ft.sft.SFTCollator(with_bos, add_bos=False).encode({"input": "</s> 1", "output": "2"})
    assert got["input_ids"][:2] == [with_bos.bos_token_id, 4]


def _decoder(cls_name: str):
    """A seq2seq family's decoder offered as a causal LM (labels not shifted in its loss)."""
    import transformers

    torch.manual_seed(0)
    if cls_name == "TrOCRForCausalLM":
        cfg = transformers.TrOCRConfig(
            vocab_size=50, d_model=16, decoder_layers=1, decoder_attention_heads=2,
            decoder_ffn_dim=16, max_position_embeddings=32,
        )  # fmt: skip
    else:
        cfg = _bart("BartModel").config
    return getattr(transformers, cls_name)(cfg).eval()


@pytest.mark.parametrize("cls_name", ["BartForCausalLM", "TrOCRForCausalLM"])
def test_decoders_whose_own_loss_does_not_shift_have_no_default_loss(cls_name):
    """Their names say causal LM, but their own loss scores labels[t] at position t: the
    default loss shifted the labels, one token off the model's own loss, without a word."""
    model = _decoder(cls_name)
    batch = {"input_ids": IDS, "labels": IDS.roll(-1, dims=1)}  # shifted left, as HF asks
    with pytest.raises(TypeError, match=f"cannot tell how {cls_name}'s labels line up"):
        ft.losses.default_loss(model, batch)
    with pytest.raises(
        TypeError, match=r"token_classification_loss\(\) for labels already shifted"
    ):
        ft.losses.loss_for(torch.nn.DataParallel(model))  # through wrappers too
    with torch.no_grad():  # the loss the message names for such labels is the model's own
        loss_sum, n = ft.losses.token_classification_loss()(model, batch)
        torch.testing.assert_close(loss_sum / n, model(**batch).loss)


def test_packed_rows_for_a_model_that_takes_no_position_ids_raise():
    """Bloom (ALiBi) takes no position_ids: packed rows reached it as one sequence, their
    examples attending to each other, behind a warning that a column was left out."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=50, hidden_size=16, n_layer=1, n_head=2))
    rows = [
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
        {"input_ids": [9, 10], "labels": [9, 10]},
    ]
    packed = ft.sft.packed_collate(pad_id=0)(ft.data.pack_examples(rows, max_length=8))
    with pytest.raises(ValueError, match=r"\(BloomForCausalLM\) takes no position_ids: without"):
        ft.losses.causal_lm_loss()(model, packed)
    padded = ft.pad_collate(pad_id=0)(rows)  # with an attention mask: no position_ids needed
    with pytest.warns(UserWarning, match="takes no 'position_ids'"):
        ft.losses.causal_lm_loss()(model, {**padded, "position_ids": torch.arange(3).expand(2, 3)})


def test_a_router_loss_computed_only_with_labels_raises_too():
    """NLLB-MoE computes its router loss only when given labels, which the built-in losses
    keep from the model: no aux_loss field was set, and the loss left it out without a word."""
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    torch.manual_seed(0)
    cfg = NllbMoeConfig(
        vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_experts=2,
        expert_capacity=4, encoder_sparse_step=2, decoder_sparse_step=2,
        max_position_embeddings=32, decoder_start_token_id=2, pad_token_id=1,
        output_router_logits=True,
    )  # fmt: skip
    model = NllbMoeForConditionalGeneration(cfg).eval()
    batch = {"input_ids": IDS[:1, :4], "labels": IDS[:1, :3]}
    with pytest.raises(ValueError, match="returned encoder_router_logits, decoder_router_logits"):
        ft.losses.default_loss(model, batch)


@pytest.mark.parametrize(
    ("model_type", "leaks"),
    [("opt", True), ("xglm", True), ("qwen3_next", True), ("llama", False), ("gpt2", False)],
)
def test_packed_rows_for_a_model_that_ignores_their_boundaries_raise(model_type, leaks):
    """OPT, XGLM (their mask ignores position_ids) and Qwen3-Next (its linear attention carries
    state across examples) took packed rows silently: each example's loss then depended on the
    examples before it in the row. Measured here as the losses' check assumes."""
    model = packing_scan.tiny_causal_lm(model_type)
    assert packing_scan.leaks(model) is leaks  # the model does what the check says of it
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]},
        {"input_ids": [9, 10, 11], "labels": [9, 10, 11]},
    ]
    packed = ft.sft.packed_collate(pad_id=0)(ft.data.pack_examples(rows, max_length=8))
    loss = ft.losses.causal_lm_loss()
    if leaks:
        with pytest.raises(ValueError, match=rf"model_type '{model_type}'\) does not keep"):
            loss(model, packed)
        loss(model, ft.pad_collate(pad_id=0)(rows))  # padded rows, with a mask: fine
    else:
        loss(model, packed)


def test_every_model_type_refused_for_packed_rows_is_one_transformers_knows():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from ftrain.losses import _PACKING_LEAKS

    assert not _PACKING_LEAKS - CONFIG_MAPPING_NAMES.keys()


def test_packed_rows_for_a_vlm_whose_text_model_ignores_their_boundaries_raise():
    """Qwen3.5's VLM class has model_type "qwen3_5"; its text model ("qwen3_5_text", linear
    attention) carries state across a packed row's examples: the check reads the text config."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.for_model("qwen3_5")
    text = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=64, max_position_embeddings=64, head_dim=8,
        pad_token_id=0, use_cache=False, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    for key, value in text.items():
        setattr(cfg.text_config, key, value)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)
    for key, value in vision.items():
        setattr(cfg.vision_config, key, value)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    assert model.config.model_type == "qwen3_5"
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]},
        {"input_ids": [9, 10, 11], "labels": [9, 10, 11]},
    ]
    packed = ft.sft.packed_collate(pad_id=0)(ft.data.pack_examples(rows, max_length=8))
    with torch.no_grad():
        second = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        by_itself = model(input_ids=torch.tensor([[9, 10, 11]])).logits
    assert not torch.allclose(second[0, 4:7], by_itself[0], atol=1e-4)  # it does leak
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5_text'\) does not keep them apart"):
        ft.losses.causal_lm_loss()(model, packed)
