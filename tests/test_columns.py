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
