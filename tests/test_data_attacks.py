"""make_batches attacked for silent failures: each test pins a case that read other rows than
asked (or ignored an argument) without a word, and now acts or raises."""

import pytest
import torch

import ftrain as ft
from test_data_crossings import _advance, _state  # a state and clip_and_step's data advance


def _xs(groups):
    return [v for g in groups for b in g for v in b["x"].tolist()]


# --- packing a stream keeps only the tokens: padding would become content


@pytest.mark.parametrize("mode", ["concat", "examples"])
@pytest.mark.parametrize("mask", [[1, 1, 0], torch.tensor([1, 1, 0])])
def test_pack_refuses_rows_whose_attention_mask_marks_padding(mode, mask):
    rows = [{"input_ids": [5, 6, 0], "attention_mask": mask}]
    src = ft.data.pack(ft.data.IterableRows(rows), block_size=8, mode=mode)
    with pytest.raises(ValueError, match=rf'pack\(mode="{mode}"\).*attention_mask marks padding'):
        list(ft.make_batches(src, batch_size=1, shuffle=False, collate_fn=lambda r: r))


def test_pack_takes_rows_whose_attention_mask_marks_no_padding():
    rows = [
        {"input_ids": [5, 6], "attention_mask": [1, 1]},
        {"input_ids": [7], "attention_mask": [1]},
    ]
    src = ft.data.pack(ft.data.IterableRows(rows), block_size=3)
    blocks = [b for g in ft.make_batches(src, batch_size=1, shuffle=False) for b in g]
    assert [b["input_ids"].tolist() for b in blocks] == [[[5, 6, 7]]]


# --- a seeded datasets shuffle is told the epoch (HF's Trainer calls set_epoch)


def _hf_shuffled(num_shards):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"x": list(range(24))}).to_iterable_dataset(num_shards)
    return ds.shuffle(seed=3, buffer_size=6)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_seeded_hf_shuffle_reshuffles_every_epoch_and_resumes_exactly(num_shards):
    ds = _hf_shuffled(num_shards)
    kw = {"batch_size": 4, "accum": 1, "shuffle": False}
    epochs = [_xs(ft.make_batches(ds, _state().replace(epoch=e), **kw)) for e in range(2)]
    assert epochs[0] != epochs[1]  # it drew the same order every epoch
    assert all(sorted(e) == list(range(24)) for e in epochs)
    assert ds.epoch == 0  # the caller's dataset keeps its own epoch
    state = _state().replace(epoch=1)
    it = ft.make_batches(ds, state, **kw)
    first = [next(it), next(it)]
    state = _advance(_advance(state, first[0]), first[1])
    assert _xs(first) + _xs(ft.make_batches(ds, state, **kw)) == epochs[1]


# --- pad_collate and pack_examples: arguments that acted as another value than the one given


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"pad_id": 0.5}, r"pad_id must be an int, got 0.5"),  # padded with 0
        ({"pad_id": None}, r"pad_id must be an int, got None \(a tokenizer without a pad"),
        ({"label_pad_id": True}, r"label_pad_id must be an int, got True"),
        ({"attention_mask": "no"}, r"attention_mask must be True or False, got 'no'"),
    ],
)
def test_pad_collate_refuses_arguments_it_would_read_as_other_values(kw, match):
    with pytest.raises(TypeError, match=match):
        ft.data.pad_collate(**kw)


@pytest.mark.parametrize("multiple", [True, 2.5, 0])
def test_pad_collate_refuses_a_pad_to_multiple_of_that_is_not_a_positive_int(multiple):
    with pytest.raises(ValueError, match=r"pad_to_multiple_of must be an int >= 1"):
        ft.data.pad_collate(pad_to_multiple_of=multiple)


@pytest.mark.parametrize("max_length", [True, 2.5, 0])
def test_pack_examples_refuses_a_max_length_that_is_not_a_positive_int(max_length):
    rows = [{"input_ids": [1, 2], "labels": [1, 2]}]
    with pytest.raises(ValueError, match=r"max_length must be an int >= 1"):
        ft.data.pack_examples(rows, max_length)


def test_an_empty_row_keeps_the_batch_integer():
    batch = ft.data.pad_collate()(
        [{"input_ids": [], "labels": []}, {"input_ids": [1, 2], "labels": [1, 2]}]
    )
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long  # were float32
    assert batch["labels"].tolist() == [[-100, -100], [1, 2]]


def test_a_field_that_is_a_sequence_then_a_scalar_raises_naming_it():
    rows = [{"input_ids": [1], "label": [1]}, {"input_ids": [2], "label": 3}]
    with pytest.raises(TypeError, match=r"collate: cannot make a tensor of field 'label'"):
        ft.data.pad_collate()(rows)


# --- a shuffle buffer given where no rows are read was ignored


def test_a_shuffle_buffer_for_a_source_that_is_already_one_raises():
    rows = ft.data.IterableRows([{"input_ids": [i, i]} for i in range(8)])
    for source in (ft.data.stream(rows, shuffle_buffer=2), ft.data.pack(rows, block_size=2)):
        with pytest.raises(ValueError, match=r"shuffle_buffer=40 for data that is already a"):
            ft.data.stream(source, shuffle_buffer=40)  # kept its own buffer (2, or 1000) before
        assert ft.data.stream(source) is source


def test_pad_collate_refuses_an_attention_mask_of_another_length_than_input_ids():
    rows = [
        {"input_ids": [1, 2, 3], "attention_mask": [1, 1]},
        {"input_ids": [4], "attention_mask": [1]},
    ]
    with pytest.raises(ValueError, match=r"row 0 has 3 input_ids but an attention_mask of 2"):
        ft.data.pad_collate()(rows)  # a (2, 3) input_ids with a (2, 2) mask, which a model took
    rows[0]["attention_mask"] = torch.tensor([1, 1, 0])
    assert ft.data.pad_collate()(rows)["attention_mask"].tolist() == [[1, 1, 0], [1, 0, 0]]
