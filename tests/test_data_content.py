"""Map-style positions keep a digest of a few rows: a resume over data of the same row count but
other contents (another tokenizer or max_length) raises instead of going on over other rows."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import ftrain as ft
from ftrain.data._content import content_digest

N = 24


def _rows(max_length):
    return [{"input_ids": list(range(1, 2 + i % 9))[:max_length]} for i in range(N)]


def _hf(max_length):
    import datasets

    raw = datasets.Dataset.from_dict({"ids": [list(range(1, 2 + i % 9)) for i in range(N)]})
    return raw.map(
        lambda r: {"input_ids": r["ids"][:max_length]}, remove_columns=["ids"], keep_in_memory=True
    )


def _loss(model, batch):
    x = batch["input_ids"].float().sum(-1, keepdim=True)
    return model(x).sum(), x.shape[0]


def _trained(data, steps=2):
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)
    for micro in ft.make_batches(data, state, batch_size=2, accum=2):
        grads, stats = ft.accumulate_grads(state, micro, _loss)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3)
        if state.step == steps:
            return state
    raise AssertionError("epoch too short")


def _at(data, cursor=3):
    """A state that trained `cursor` micro-batches of `data` (the position clip_and_step keeps)."""
    group = next(iter(ft.make_batches(data, batch_size=2, seed=0)))
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)
    pos = json.loads(group.position) | {"cursor": cursor, "row": 2 * cursor}
    return state.replace(data=state.data.replace(cursor=cursor, position=json.dumps(pos)))


def _ids(groups):
    return [b["input_ids"].tolist() for g in groups for b in g]


def test_a_checkpointed_run_resumed_over_other_tokenization_raises(tmp_path):
    """The attack: `--max-length` changed between the run and its resume; same 24 rows, so
    the position's row count matched and the resumed run went on over other rows."""
    path = ft.save_checkpoint(_trained(_hf(8)), tmp_path)
    fresh = lambda: ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)  # noqa: E731
    state = ft.load_checkpoint(path, fresh())
    with pytest.raises(ValueError, match=r"data holds other rows than when state\.data\.position"):
        ft.make_batches(_hf(4), state, batch_size=2, accum=2)
    # The same data, built again, resumes, and exactly.
    resumed = _ids(
        ft.make_batches(_hf(8), ft.load_checkpoint(path, fresh()), batch_size=2, accum=2)
    )
    whole = _ids(ft.make_batches(_hf(8), batch_size=2, accum=2, seed=0))
    assert resumed == whole[4:]


@pytest.mark.parametrize(
    "make",
    [
        _rows,
        _hf,
        lambda m: torch.arange(N * 3).reshape(N, 3) % (m + 1),
        lambda m: torch.utils.data.TensorDataset(torch.arange(N * 3).reshape(N, 3) % (m + 1)),
    ],
    ids=["list of dicts", "datasets.Dataset", "tensor", "TensorDataset"],
)
def test_other_rows_of_the_same_count_are_refused_naming_the_ways_on(make):
    state = _at(make(8))
    kw = {"batch_size": 2} | ({} if make in (_rows, _hf) else {"collate_fn": _stack})
    ft.make_batches(make(8), state, **kw)  # the same data: resumes
    with pytest.raises(ValueError, match="the same 24 rows, but a digest of a few") as e:
        ft.make_batches(make(4), state, **kw)
    assert "state.replace(data=state.data.replace(cursor=0, position=None))" in str(e.value)
    # The unchecked way on: from the same micro-batch, over the new rows.
    unchecked = state.replace(data=state.data.replace(position=None))
    assert len(list(ft.make_batches(make(4), unchecked, **kw))) == N // 2 - 3


def _stack(rows):
    return torch.stack([r[0] if isinstance(r, tuple) else r for r in rows])


def test_a_position_saved_before_the_digest_resumes_as_before():
    state = _at(_rows(8))
    pos = json.loads(state.data.position)
    del pos["content"]
    old = state.replace(data=state.data.replace(position=json.dumps(pos)))
    ft.data.check_position(old.data.position)
    groups = list(ft.make_batches(_rows(4), old, batch_size=2))  # nothing to compare with
    assert len(groups) == N // 2 - 3
    # From there on the position holds the digest of the rows it goes on over.
    now = next(iter(ft.make_batches(_rows(4), batch_size=2))).position
    assert json.loads(groups[0].position)["content"] == json.loads(now)["content"]


def test_the_digest_reads_eight_rows_whatever_the_size():
    reads = []

    class Rows(list):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    ft.make_batches(Rows([{"input_ids": [1, 2]}] * 100_000), batch_size=2)
    assert len(reads) == 8 and {0, 99_999} <= set(reads)


def test_a_torch_dataset_of_your_own_is_not_read_for_it():
    """Its __getitem__ may be costly, random or watched: only rows trained on are read."""

    class Watched(torch.utils.data.Dataset):
        reads = 0

        def __len__(self):
            return N

        def __getitem__(self, i):
            Watched.reads += 1
            return {"input_ids": [i]}

    group = next(iter(ft.make_batches(Watched(), batch_size=2, seed=0)))
    assert Watched.reads == 2 and json.loads(group.position)["content"] is None


@pytest.mark.parametrize("inner", ["list of dicts", "a torch dataset of your own"])
def test_a_subset_of_another_split_is_refused_without_reading_rows_of_your_own(inner):
    """`random_split` without a seeded generator draws another split in every run: the same
    row count, other rows (some of them the validation split's), which a resume went on over
    without a word (a Subset's rows were not digested)."""
    reads = []

    class Watched(torch.utils.data.Dataset):
        def __len__(self):
            return 2 * N

        def __getitem__(self, i):
            reads.append(i)
            return {"input_ids": [i]}

    base = [{"input_ids": [i]} for i in range(2 * N)] if inner == "list of dicts" else Watched()
    split = lambda seed: torch.utils.data.random_split(  # noqa: E731
        base, [N, N], generator=torch.Generator().manual_seed(seed)
    )[0]
    state = _at(split(0))  # read the first micro-batch's rows
    reads.clear()
    ft.make_batches(split(0), state, batch_size=2)  # the same split: resumes
    with pytest.raises(ValueError, match="the same 24 rows, but a digest of a few") as e:
        ft.make_batches(split(1), state, batch_size=2)
    assert "random_split without a seeded generator" in str(e.value)
    if inner != "list of dicts":
        assert reads == [] and json.loads(state.data.position)["content"] is not None


def test_a_concatenation_of_rows_of_other_contents_is_refused():
    """A torch ConcatDataset (several tokenized sources) was not read for the digest: a resume
    over its parts tokenized with another max_length went on without a word."""
    half = N // 2

    def data(max_length):
        rows = _rows(max_length)
        return torch.utils.data.ConcatDataset([rows[:half], rows[half:]])

    state = _at(data(8))
    ft.make_batches(data(8), state, batch_size=2)  # the same rows: resumes
    with pytest.raises(ValueError, match="the same 24 rows, but a digest of a few"):
        ft.make_batches(data(4), state, batch_size=2)
    swapped = torch.utils.data.ConcatDataset(data(8).datasets[::-1])  # the parts' order
    with pytest.raises(ValueError, match="the same 24 rows, but a digest of a few"):
        ft.make_batches(swapped, state, batch_size=2)


@pytest.mark.parametrize("kind", ["BatchEncoding", "UserDict"])
def test_rows_that_are_mappings_but_not_dicts_are_digested_by_their_contents(kind):
    """`[tokenizer(text) for text in texts]` is a list of BatchEncoding (a UserDict, not a
    dict): its rows were hashed by their type alone, so a resume over another tokenizer or
    max_length went on without a word."""
    if kind == "BatchEncoding":
        from transformers import BatchEncoding as Row
    else:
        from collections import UserDict as Row

    def rows(max_length):
        return [Row({"input_ids": r["input_ids"]}) for r in _rows(max_length)]

    state = _at(rows(8))
    ft.make_batches(rows(8), state, batch_size=2)  # the same rows: resumes
    with pytest.raises(ValueError, match="the same 24 rows, but a digest of a few"):
        ft.make_batches(rows(4), state, batch_size=2)
    assert content_digest(rows(8), N) == content_digest(_rows(8), N)  # as the same dicts


def test_a_position_saved_when_mappings_were_hashed_by_their_type_resumes():
    """Positions saved before mappings were read hold the digest of BatchEncoding rows by
    their type alone: they resume over the same rows (and keep today's digest from there on),
    as older positions do; any other digest is still refused."""
    from transformers import BatchEncoding

    rows = [BatchEncoding({"input_ids": [1 + i % 5] * 3}) for i in range(N)]
    state = _at(rows)
    pos = json.loads(state.data.position)
    older = pos | {"content": "c9eeca4b6a731df9"}  # what ftrain at 36c93fe saved for them
    state = state.replace(data=state.data.replace(position=json.dumps(older)))
    group = next(iter(ft.make_batches(rows, state, batch_size=2)))
    assert json.loads(group.position)["content"] == pos["content"] == content_digest(rows, N)
    other = pos | {"content": "0123456789abcdef"}
    state = state.replace(data=state.data.replace(position=json.dumps(other)))
    with pytest.raises(ValueError, match="the same 24 rows, but a digest of a few"):
        ft.make_batches(rows, state, batch_size=2)


def test_the_digest_ignores_a_transform_set_on_a_datasets_dataset():
    """An on-the-fly transform may be random: the stored rows are digested, not its output."""
    data = _hf(8)
    plain = next(iter(ft.make_batches(data, batch_size=2))).position
    noisy = data.with_transform(
        lambda batch: {"input_ids": torch.randint(9, (len(batch["input_ids"]), 3)).tolist()}
    )
    assert next(iter(ft.make_batches(noisy, batch_size=2))).position == plain


def test_a_malformed_digest_is_refused():
    pos = json.loads(_at(_rows(8)).data.position) | {"content": "not hex"}
    with pytest.raises(ValueError, match="content must be a hex digest or null"):
        ft.data.check_position(json.dumps(pos))


def _digest(row):
    return content_digest([row] * 3, 3)


def test_a_collate_that_turns_rows_into_tensors_in_place_resumes_in_a_fresh_process(tmp_path):
    """The collate converted each row's list to a tensor in place (same values): epoch 1's
    digest was taken over tensors, and a fresh process, with lists again, was refused."""

    def collate(rows):
        for r in rows:
            r["input_ids"] = torch.as_tensor(r["input_ids"])
        return {"input_ids": torch.stack([r["input_ids"] for r in rows])}

    def fresh():
        return ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)

    rows, state = [{"input_ids": [i % 7] * 3} for i in range(8)], fresh()
    for _ in ft.make_batches(rows, state, batch_size=2, collate_fn=collate):
        pass  # epoch 0 turned every row into tensors
    state = ft.next_epoch(state)
    for micro in ft.make_batches(rows, state, batch_size=2, collate_fn=collate):
        grads, stats = ft.accumulate_grads(state, micro, _loss)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3)
        break
    path = ft.save_checkpoint(state, tmp_path)
    pristine = [{"input_ids": [i % 7] * 3} for i in range(8)]
    resumed = ft.make_batches(pristine, ft.load_checkpoint(path, fresh()), batch_size=2)
    whole = ft.make_batches(pristine, batch_size=2, seed=0, epoch=1)
    assert _ids(resumed) == _ids(whole)[1:]


@pytest.mark.parametrize(
    "same",
    [
        [[[1, 2], [3, 4]], ((1, 2), (3, 4)), torch.tensor([[1, 2], [3, 4]])],
        [torch.tensor([[1, 2]], dtype=torch.int32), np.array([[1, 2]], np.uint8), [[1, 2]]],
        [[torch.tensor([1, 2]), torch.tensor([3, 4])], np.array([[1, 2], [3, 4]])],
        [[0.5, -1.25], torch.tensor([0.5, -1.25], dtype=torch.bfloat16), np.float16([0.5, -1.25])],
        [[float("nan")], torch.tensor([float("nan")]).neg(), np.array([np.nan], np.float32)],
        [[True, False], torch.tensor([True, False]), np.array([True, False])],
        [3, np.int32(3), torch.tensor(3)],
        [1.5, np.float32(1.5), torch.tensor(1.5, requires_grad=True)],
        [torch.arange(4.0).reshape(2, 2).t(), [[0.0, 2.0], [1.0, 3.0]]],
    ],
    ids=["ints", "int widths", "list of tensors", "floats", "nan", "bools", "int", "float", "view"],
)
def test_numbers_hash_by_kind_shape_and_value_whatever_holds_them(same):
    assert len({_digest(row) for row in same}) == 1


def test_numbers_of_other_kinds_shapes_or_values_hash_apart():
    rows = [1, 1.0, True, [1], [1.0], [True], [[1]], "1", [1, 2], [1, 3], [2**63], [2**64]]
    assert len({_digest(row) for row in rows}) == len(rows)
    # numpy makes [-1, 2**63] a float64 array: the ints keep all their digits all the same
    assert _digest([-1, 2**63]) != _digest([-1, 2**63 + 1])


def _quietly(make):
    with warnings.catch_warnings():  # nested and quantized tensors warn that they are beta
        warnings.simplefilter("ignore")
        return make()


def test_tensor_views_and_layouts_are_digested_by_their_values_without_raising():
    z = torch.tensor([1 + 2j, 3 - 4j])
    assert _digest(z.conj()) == _digest(z.conj().resolve_conj()) != _digest(z)
    assert _digest(z.conj().imag) == _digest(torch.tensor([-2.0, 4.0]))  # a negative view
    nested = [
        _quietly(lambda v=v: torch.nested.nested_tensor([torch.ones(2), torch.full((3,), v)]))
        for v in (1.0, 2.0)
    ]
    assert _digest(nested[0]) == _digest(nested[0]) != _digest(nested[1])
    sparse = [torch.eye(3).to_sparse(), (2 * torch.eye(3)).to_sparse()]
    assert _digest(sparse[0]) != _digest(sparse[1])
    quantized = [
        _quietly(lambda v=v: torch.quantize_per_tensor(torch.full((3,), v), 0.5, 0, torch.qint8))
        for v in (1.0, 2.0)
    ]
    assert _digest(quantized[0]) != _digest(quantized[1])
    assert _digest(torch.empty(2, 3, device="meta")) != _digest(torch.empty(3, 2, device="meta"))


def test_dict_keys_that_print_alike_are_hashed_whatever_their_order():
    assert _digest({1: "a", "1": "b"}) == _digest({"1": "b", 1: "a"})
    assert _digest({1: "a", "1": "b"}) != _digest({1: "b", "1": "a"})
    assert _digest({1, 2}) != _digest({3, 4})
