"""Dataset columns the model does not take (issue 26, item 3): left out of the forward with a
warning naming them, kept in the batch for a loss_fn of your own; collation errors name the
field."""

from __future__ import annotations

import warnings

import pytest
import torch

import ftrain as ft
from helpers import ragged_rows, tiny_llama


def _hf_rows(n=12):
    """What a tokenised `datasets.Dataset` still holds when nobody removed the raw columns."""
    from datasets import Dataset

    rows = ragged_rows(n, seed=3)
    return Dataset.from_list(
        [{**r, "text": f"row {i} " * (i + 1), "id": f"ex-{i}"} for i, r in enumerate(rows)]
    )


def _steps(state, data, n=3):
    for group in ft.make_batches(data, state, batch_size=4, accum=1):
        grads, stats = ft.accumulate_grads(state, group)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2, max_norm=1.0)
        if state.step >= n:
            break
    return state


def test_unused_columns_are_left_out_with_a_warning_and_training_matches_without_them():
    full = _hf_rows()
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=0)
    with pytest.warns(UserWarning, match=r"takes no 'text', 'id': left out of its inputs"):
        with_columns = _steps(state, full)
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=0)
    without = _steps(state, full.remove_columns(["text", "id"]))
    for a, b in zip(with_columns.model.parameters(), without.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_custom_loss_fn_reads_the_kept_columns():
    seen: list[list[str]] = []

    def loss_fn(model, batch):
        seen.append(list(batch["id"]))  # a string column, as a list of the rows' values
        return ft.losses.causal_lm_loss()(model, batch)

    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=0)
    group = next(iter(ft.make_batches(_hf_rows(), state, batch_size=4, shuffle=False)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ft.accumulate_grads(state, group, loss_fn=loss_fn)
    assert seen == [["ex-0", "ex-1", "ex-2", "ex-3"]]


def test_the_warning_is_said_once_per_place_under_the_default_filter():
    model = tiny_llama()
    batch = ft.data.pad_collate()([{"input_ids": [1, 2], "labels": [1, 2], "id": "a"}])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            ft.losses.model_logits(model, batch)
    assert [str(w.message).count("'id'") for w in seen] == [1]


def test_wrappers_are_looked_through_for_the_forward_names():
    model = tiny_llama()
    compiled_like = torch.nn.Module()
    compiled_like._orig_mod = model  # what torch.compile's wrapper holds
    compiled_like.forward = lambda *a, **k: model(*a, **k)  # type: ignore[method-assign]
    batch = {"input_ids": torch.tensor([[1, 2]]), "position_ids": torch.tensor([[0, 1]])}
    assert sorted(ft.losses.model_inputs(compiled_like, batch)) == ["input_ids", "position_ids"]


def test_a_forward_that_takes_only_kwargs_gets_every_key():
    class Any_(torch.nn.Module):
        def forward(self, **kwargs):
            return kwargs

    batch = {"x": torch.zeros(1), "labels": torch.zeros(1), "text": ["a"]}
    assert sorted(ft.losses.model_inputs(Any_(), batch)) == ["text", "x"]


def test_a_forward_with_named_arguments_and_kwargs_gets_every_key():
    """A model of your own whose forward names some arguments and passes `**kwargs` on (here
    to a BERT encoder): the keys it does not name were left out with a warning that it took no
    such key, so BERT ran without the batch's token_type_ids, silently changing its outputs.
    Its **kwargs take the other keys holding tensors; a raw `text` column stays out with the
    warning (passed on, it failed in BERT: the Trainer's remove_unused_columns drops it)."""
    import warnings

    from transformers import BertConfig, BertModel

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.bert = BertModel(BertConfig(
                vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=16, type_vocab_size=2,
            ))  # fmt: skip
            self.head = torch.nn.Linear(16, 3)

        def forward(self, input_ids, attention_mask=None, **kwargs):
            out = self.bert(input_ids, attention_mask=attention_mask, **kwargs)
            return self.head(out.last_hidden_state)

    model = Tagger().eval()
    ids = torch.tensor([[2, 5, 6, 3, 7, 8]])
    types = torch.tensor([[0, 0, 0, 0, 1, 1]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": types,
             "labels": torch.zeros_like(ids)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(ft.losses.model_inputs(model, batch)) == [
            "attention_mask", "input_ids", "token_type_ids"
        ]  # fmt: skip
        with torch.no_grad():
            got = ft.losses.model_logits(model, batch)
            want = model(ids, torch.ones_like(ids), token_type_ids=types)
            without = model(ids, torch.ones_like(ids))
    assert torch.equal(got, want) and not torch.equal(got, without)
    with pytest.warns(UserWarning, match="takes no 'text'"):
        raw = ft.losses.model_inputs(model, {**batch, "text": ["a sentence"]})
    assert sorted(raw) == ["attention_mask", "input_ids", "token_type_ids"]


def test_an_hf_models_declared_kwargs_pass_and_undeclared_keys_stay_out():
    """An HF model passes any keyword on to its layers, so its **kwargs do not take every key:
    only those its `**kwargs: Unpack[TransformersKwargs]` declares, such as the flash-attention
    boundaries `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` adds, which were
    left out before. A raw column stays out with the warning; `position_ids` counts only where
    the forward names it (Bloom takes it through **kwargs and ignores it: still refused)."""
    from transformers import DataCollatorWithFlattening

    model = tiny_llama().eval()
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]},
            {"input_ids": [9, 10, 11], "labels": [9, 10, 11]}]  # fmt: skip
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(rows)
    with pytest.warns(UserWarning, match=r"takes no 'text': left out of its inputs.*an HF "
                      r"model's \*\*kwargs get only the keys they declare"):  # fmt: skip
        inputs = ft.losses.model_inputs(model, {**batch, "text": ["a b"]})
    assert sorted(inputs) == [
        "cu_seq_lens_k", "cu_seq_lens_q", "input_ids", "max_length_k", "max_length_q",
        "position_ids",
    ]  # fmt: skip
    with torch.no_grad():  # the packed row gives what its examples give alone (SDPA)
        packed = ft.losses.model_logits(model, batch)
        alone = [model(input_ids=torch.tensor([r["input_ids"]])).logits for r in rows]
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)
    # Without position_ids only flash-attention kernels would see the boundaries: refused.
    bare = DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_position_ids=False, return_tensors="pt"
    )(rows)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q, cu_seq_lens_k only .* runs 'sdpa' "
                       r"attention, so the examples would attend to each other"):  # fmt: skip
        ft.losses.model_logits(model, bare)
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=50, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"\(BloomForCausalLM\) takes no position_ids"):
        ft.losses.model_inputs(bloom, batch)


def test_a_missing_required_argument_is_named():
    class Net(torch.nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    with pytest.raises(TypeError, match=r"forward \(Net\) needs 'x', which the batch"):
        ft.losses.model_inputs(Net(), {"input_ids": torch.zeros(1), "labels": torch.zeros(1)})


def test_text_fields_stay_lists_and_numbers_become_tensors():
    rows = [{"input_ids": [1, 2], "text": "ab", "id": 7}, {"input_ids": [3], "text": None, "id": 8}]
    batch = ft.data.pad_collate()(rows)
    assert batch["text"] == ["ab", None]
    assert batch["id"].tolist() == [7, 8]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"input_ids": [1], "spans": [[1, 2], [3]]}, {"input_ids": [1], "spans": [[1], [2]]}],
            r"cannot make a tensor of field 'spans' \(list values\)",
        ),
        (
            [{"input_ids": [1], "meta": {"a": 1}}, {"input_ids": [2], "meta": {"a": 2}}],
            r"cannot make a tensor of field 'meta' \(dict values\)",
        ),
    ],
)
def test_a_field_no_tensor_can_hold_is_named(rows, message):
    with pytest.raises(TypeError, match=message):
        ft.data.pad_collate()(rows)


def test_a_row_without_a_field_is_named():
    with pytest.raises(KeyError, match=r"row 1 of the batch has no field 'labels'"):
        ft.data.pad_collate()([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])


def test_a_string_column_through_make_batches_no_longer_fails_in_torch():
    """The issue's case: a datasets.Dataset with raw text used to fail in collation with
    torch's `new(): invalid data type 'str'`, naming no column."""
    groups = list(ft.make_batches(_hf_rows(4), batch_size=4, shuffle=False))
    assert groups[0][0]["text"][0] == "row 0 "
