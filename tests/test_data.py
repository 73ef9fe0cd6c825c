import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ftrain as ft
from ftrain.data import epoch_order, length_grouped_order, pad_collate
from helpers import FakeRank, ragged_rows


def _ids(groups):
    """Row ids in yield order; ZeroWeight stand-ins hold no row of their own."""
    return [
        i
        for g in groups
        for b in g
        if not isinstance(b, ft.data.ZeroWeight)
        for i in b["idx"].tolist()
    ]


def _indexed(n):
    return [{"idx": i, "input_ids": [i % 7 + 1] * (i % 5 + 1)} for i in range(n)]


def test_order_is_pure_function_of_seed_and_epoch():
    data = _indexed(50)
    a = _ids(ft.make_batches(data, batch_size=4, seed=1, epoch=2))
    b = _ids(ft.make_batches(data, batch_size=4, seed=1, epoch=2))
    c = _ids(ft.make_batches(data, batch_size=4, seed=1, epoch=3))
    d = _ids(ft.make_batches(data, batch_size=4, seed=2, epoch=2))
    assert a == b and sorted(a) == list(range(50))
    assert a != c and a != d


def test_groups_of_accum_and_short_last_group():
    groups = list(ft.make_batches(_indexed(23), batch_size=4, accum=2, shuffle=False))
    assert [len(g) for g in groups] == [2, 2, 2]
    assert [b["idx"].shape[0] for g in groups for b in g] == [4, 4, 4, 4, 4, 3]
    dropped = list(ft.make_batches(_indexed(23), batch_size=4, accum=2, drop_last=True))
    assert [b["idx"].shape[0] for g in dropped for b in g] == [4, 4, 4, 4, 4]


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.reads = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads.append(i)
        return {"idx": i, "input_ids": [1, 2]}


def test_start_skips_without_reading_and_resumes_the_same_order():
    full = _ids(ft.make_batches(_indexed(40), batch_size=3, accum=2, seed=5))
    ds = CountingDataset(40)
    resumed = list(ft.make_batches(ds, batch_size=3, accum=2, seed=5, start=4))
    assert _ids(resumed) == full[4 * 3 :]
    assert len(ds.reads) == 40 - 12, "skipped rows were read"
    assert set(ds.reads) == set(full[12:])


def test_accepts_datasets_dataset_and_torch_tensor_dataset():
    import datasets

    rows = _indexed(10)
    hf = datasets.Dataset.from_list(rows)
    assert _ids(ft.make_batches(hf, batch_size=3, seed=0)) == _ids(
        ft.make_batches(rows, batch_size=3, seed=0)
    )
    tds = torch.utils.data.TensorDataset(torch.arange(10), torch.arange(10) * 2)
    ((x, y),) = next(iter(ft.make_batches(tds, batch_size=4, shuffle=False)))
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [0, 2, 4, 6]


def test_default_collate_pads_and_masks():
    batch = pad_collate(pad_id=5)(
        [
            {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "label": 1},
            {"input_ids": [4], "labels": [4], "label": 0},
        ]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 5]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["label"].tolist() == [1, 0]
    left = pad_collate(padding_side="left", pad_to_multiple_of=4)([{"input_ids": [1, 2, 3]}])
    assert left["input_ids"].tolist() == [[0, 1, 2, 3]]
    assert left["attention_mask"].tolist() == [[0, 1, 1, 1]]


def test_group_by_length_equals_hf_length_grouped_sampler():
    from transformers.trainer_pt_utils import get_length_grouped_indices

    from ftrain.data._common import _generator

    lengths = [len(r["input_ids"]) for r in ragged_rows(300, seed=3)]
    ours = length_grouped_order(lengths, 8, seed=4, epoch=1).tolist()
    theirs = get_length_grouped_indices(lengths, 8, generator=_generator(4, 1))
    assert ours == theirs
    rows = [{"idx": i, "input_ids": [1] * n} for i, n in enumerate(lengths)]
    groups = list(
        ft.make_batches(rows, batch_size=4, accum=2, seed=4, epoch=1, group_by_length=True)
    )
    assert _ids(groups) == theirs
    first = groups[0][0]
    assert first["input_ids"].shape[1] == max(lengths), "longest batch must come first"


def test_data_parallel_split_unions_to_single_process():
    data = _indexed(37)
    one = _ids(ft.make_batches(data, batch_size=6, accum=2, seed=9))
    per_rank = [
        list(ft.make_batches(data, batch_size=3, accum=2, seed=9, strategy=FakeRank(r, 2)))
        for r in range(2)
    ]
    # 37 rows, 6 per global micro-batch: the 7th holds one row, which goes to rank 0; rank 1
    # gets a ZeroWeight stand-in, so both run the same number of micro-batches.
    assert [len(g) for g in per_rank[0]] == [2, 2, 2, 1]
    assert [len(g) for g in per_rank[1]] == [2, 2, 2, 1]
    stand_in = per_rank[1][-1][0]
    assert isinstance(stand_in, ft.data.ZeroWeight)
    assert stand_in.batch["idx"].tolist() == per_rank[0][-1][0]["idx"].tolist()
    r0 = [b["idx"].tolist() for g in per_rank[0] for b in g]
    r1 = [b["idx"].tolist() for g in per_rank[1] for b in g if not isinstance(b, tuple)] + [[]]
    merged = [i for b0, b1 in zip(r0, r1, strict=True) for i in b0 + b1]
    assert merged == one
    assert per_rank[0][0][0]["idx"].shape[0] == 3


@pytest.mark.parametrize(
    "bad", [{"batch_size": 0}, {"batch_size": 2, "accum": 0}, {"batch_size": 2, "start": -1}]
)
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError, match=next(iter(k for k in bad if bad[k] in (0, -1)))):
        list(ft.make_batches(_indexed(4), **bad))


def test_unindexable_data_raises_type_error():
    with pytest.raises(TypeError, match="indexing"):
        list(ft.make_batches(iter(range(3)), batch_size=1))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    bs=st.integers(1, 7),
    accum=st.integers(1, 4),
    start=st.integers(0, 20),
    world=st.integers(1, 3),
    drop_last=st.booleans(),
)
def test_property_epoch_partition_and_resume(n, bs, accum, start, world, drop_last):
    """Every row appears at most once per epoch (exactly once without drop_last), and resuming at
    `start` yields exactly the tail of the full epoch, for any rank count."""
    total = ft.data.num_micro_batches(n, bs, world_size=world, drop_last=drop_last)
    assume(total > 0)  # an epoch without a micro-batch raises (test_empty_epoch_raises)
    start = min(start, total)
    data = _indexed(n)
    full = [
        _ids(
            ft.make_batches(
                data,
                batch_size=bs,
                accum=accum,
                seed=1,
                drop_last=drop_last,
                strategy=FakeRank(r, world),
            )
        )
        for r in range(world)
    ]
    everything = sorted(i for f in full for i in f)
    assert len(everything) == len(set(everything))
    # Every rank runs the same number of steps and micro-batches (DDP would hang otherwise).
    shapes = {
        tuple(len(g) for g in ft.make_batches(
            data, batch_size=bs, accum=accum, seed=1, drop_last=drop_last,
            strategy=FakeRank(r, world),
        ))
        for r in range(world)
    }  # fmt: skip
    assert len(shapes) == 1
    if not drop_last:
        assert everything == list(range(n))
    tail = _ids(
        ft.make_batches(
            data, batch_size=bs * world, accum=accum, seed=1, drop_last=drop_last, start=start
        )
    )
    assert (
        tail
        == _ids(
            ft.make_batches(data, batch_size=bs * world, accum=accum, seed=1, drop_last=drop_last)
        )[start * bs * world :]
    )


def test_epoch_order_is_read_only_and_a_pure_function():
    o = epoch_order(10, 0, 0)
    assert (o == epoch_order(10, 0, 0)).all() and not (o == epoch_order(10, 0, 1)).all()
    with pytest.raises(ValueError):
        o[0] = 3
    assert isinstance(o, np.ndarray)


def test_find_batch_size_backs_off_like_hf_and_is_kept_on_resume(tmp_path):
    tried = []

    def probe(state, size):
        tried.append(size)
        if size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")

    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    found = ft.data.find_batch_size(state, probe, start=64)  # HF/accelerate: x0.9 per failure
    assert tried == [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19]
    assert found.data.batch_size == 19 and state.data.batch_size is None
    tried.clear()
    assert ft.data.find_batch_size(state, probe, start=64, factor=0.5).data.batch_size == 16
    assert tried == [64, 32, 16]
    # Saved with the state; a resumed run keeps it and does not probe again.
    path = ft.save_checkpoint(found, tmp_path)
    resumed = ft.load_checkpoint(path, ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()))
    tried.clear()
    assert ft.data.find_batch_size(resumed, probe, start=64).data.batch_size == 19 and tried == []


def test_find_batch_size_recognises_a_real_allocation_failure_and_passes_other_errors():
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())

    def probe(state, size):  # above 3 the host allocator really refuses (exabytes)
        torch.empty(max(size - 3, 0) * 2**60 + size, dtype=torch.uint8)

    assert ft.data.find_batch_size(state, probe, start=8, factor=0.5).data.batch_size == 2
    with pytest.raises(RuntimeError, match="no batch size"):
        ft.data.find_batch_size(state, lambda s, n: torch.empty(2**60, dtype=torch.uint8), start=4)

    def broken(state, size):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        ft.data.find_batch_size(state, broken, start=4)
    for bad in ({"start": 0}, {"start": 4, "factor": 1.0}):
        with pytest.raises(ValueError):
            ft.data.find_batch_size(state, broken, **bad)
