import json

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


def test_packed_rows_that_carry_their_own_attention_mask_are_refused():
    """Examples concatenated with their tokenizer's masks (all ones) and position_ids that
    restart: pad_collate passed the mask on, and an HF model attended across the examples (a
    mask it made itself was refused already)."""
    packed = {"input_ids": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]}
    row = packed | {"attention_mask": [1] * 5, "labels": [5, 6, 7, 8, 9]}
    for collate in (pad_collate(), pad_collate(attention_mask=False)):
        with pytest.raises(ValueError, match=r"row 1 holds packed examples .* token 3\) and an"):
            collate([{**row, "position_ids": [0, 1, 2, 3, 4]}, row])
    assert "attention_mask" not in pad_collate(attention_mask=False)([packed])
    # A left-padded row: its position_ids are 0 up to its first real token, which is no packing.
    left = {"input_ids": [0, 0, 7, 8], "attention_mask": [0, 0, 1, 1], "position_ids": [0, 0, 0, 1]}
    assert pad_collate()([left])["position_ids"].tolist() == [[0, 0, 0, 1]]
    vision = {"input_ids": [1, 2], "attention_mask": [1, 1], "position_ids": [[0, 1]] * 3}
    assert pad_collate()([vision])["position_ids"].shape == (1, 3, 2)  # (3, L): not packing


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


# --- map-style resume across changed settings (issue 26 item 6): continue exactly, or raise


def _fresh(seed=1):
    return ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=seed)


def _advance(state, groups):
    """What clip_and_step does to state.data after each group: cursor and position."""
    for g in groups:
        d = state.data
        state = state.replace(data=d.replace(cursor=d.cursor + len(g), position=g.position))
    return state


def _epoch(data, state, *, batch_size, accum=1, world=1, **kw):
    """Rows of each group over all ranks (a global micro-batch's ranks in order), and rank 0's
    groups; every rank's groups carry the same positions."""
    ranks = [
        list(
            ft.make_batches(
                data,
                state.replace(strategy=FakeRank(r, world)),
                batch_size=batch_size,
                accum=accum,
                **kw,
            )
        )
        for r in range(world)
    ]
    assert len({tuple(g.position for g in groups) for groups in ranks}) == 1
    rows = [
        [i for micro in zip(*groups, strict=True) for b in micro for i in _ids([[b]])]
        for groups in zip(*ranks, strict=True)
    ]
    return rows, ranks[0]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    before=st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3)),
    after=st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3)),
    first=st.integers(1, 6),
    stops=st.lists(st.integers(0, 6), max_size=2),
    grouped=st.booleans(),
)
def test_property_resuming_with_another_batch_accum_or_world_continues_the_epoch_exactly(
    n, before, after, first, stops, grouped
):
    """Stop after some groups, resume with other (batch_size, accum, world) any number of
    times: every row of the epoch order (fixed by the first position saved) is read once, in
    order."""
    data = _indexed(n)
    kw = {"group_by_length": grouped}
    (bs, accum, world), state, seen = before, _fresh(), []
    order, _ = _epoch(data, state, batch_size=bs, accum=accum, world=world, **kw)
    for k, settings_ in zip([first, *stops], [after, before, after], strict=False):
        rows, groups = _epoch(data, state, batch_size=bs, accum=accum, world=world, **kw)
        seen += [i for g in rows[:k] for i in g]
        state = _advance(state, groups[:k])
        bs, accum, world = settings_
    rows, _ = _epoch(data, state, batch_size=bs, accum=accum, world=world, **kw)
    assert seen + [i for g in rows for i in g] == [i for g in order for i in g]


def test_a_checkpoint_saved_at_batch_size_8_resumes_at_4_without_repeating_rows(tmp_path):
    data, seen = _indexed(40), []

    def loss(model, batch):
        seen.extend(batch["idx"].tolist())
        return model(batch["idx"].float()[:, None]).sum(), batch["idx"].shape[0]

    def steps(state, batch_size, until):
        for micro in ft.make_batches(data, state, batch_size=batch_size):
            grads, stats = ft.accumulate_grads(state, micro, loss)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
            if state.step == until:
                break
        return state

    ft.save_checkpoint(steps(_fresh(), 8, 2), tmp_path)
    state = steps(ft.load_checkpoint(ft.latest_checkpoint(tmp_path), _fresh()), 4, None)
    assert seen == epoch_order(40, 1, 0).tolist()  # rows 8-15 once, not twice
    assert state.data.cursor == 2 + 6  # two micro-batches of 8, then six of 4


@pytest.mark.parametrize(
    "change, match",
    [
        ({"data": _indexed(41)}, r"rows 40 when state\.data\.position was saved, now 41"),
        ({"seed": 2}, r"seed 1 when state\.data\.position was saved, now 2"),
        ({"shuffle": False}, r"shuffle True when state\.data\.position was saved, now False"),
        ({"epoch": 1}, r"epoch 0 when state\.data\.position was saved, now 1"),
        ({"group_by_length": True}, r"lengths digest none \(no group_by_length\) when"),
        ({"cursor": 1}, r"state\.data\.cursor=1 is before micro-batch 2"),
        ({"cursor": 40}, r"start=40 is beyond the epoch's 11 micro-batches"),
        ({"cursor": 40, "batch_size": 2}, r"beyond the epoch's 11 micro-batches of 4 rows"),
        ({"position": "[]"}, r"state\.data\.position: malformed data position: not a JSON object"),
    ],
)
def test_a_resume_that_cannot_continue_the_epoch_raises_naming_the_setting(change, match):
    """Two micro-batches of 2 rows, then one of 4 (the position counts from row 4, cursor 2),
    then the change."""
    state = _advance(_fresh(), list(ft.make_batches(_indexed(40), _fresh(), batch_size=2))[:2])
    state = _advance(state, list(ft.make_batches(_indexed(40), state, batch_size=4))[:1])
    assert json.loads(state.data.position)["cursor"] == 2 and state.data.cursor == 3
    data, batch_size = change.pop("data", _indexed(40)), change.pop("batch_size", 4)
    moved = {k: change.pop(k) for k in ("cursor", "position") if k in change}
    state = state.replace(
        seed=change.pop("seed", 1), epoch=change.pop("epoch", 0), data=state.data.replace(**moved)
    )
    with pytest.raises(ValueError, match=match):
        ft.make_batches(data, state, batch_size=batch_size, **change)


def test_group_by_length_keeps_the_saved_order_through_a_resume_and_refuses_new_lengths():
    data = _indexed(40)
    kw = {"group_by_length": True}
    full = list(ft.make_batches(data, _fresh(), batch_size=2, accum=2, **kw))
    state = _advance(_fresh(), full[:3])
    rest = list(ft.make_batches(data, state, batch_size=3, accum=3, **kw))  # other mega-batches
    assert _ids(full[:3]) + _ids(rest) == _ids(full)
    with pytest.raises(ValueError, match="orders the epoch by the rows' lengths"):
        ft.make_batches(data, state, batch_size=2, accum=2, lengths=[1] * 40, **kw)


def test_map_positions_are_small_and_constant_while_the_global_batch_is():
    groups = list(ft.make_batches(_indexed(40), _fresh(), batch_size=4, accum=2))
    assert len({g.position for g in groups}) == 1 and len(groups[0].position) < 250
    # Without a position (start=, or a state never trained on this epoch) the cursor counts
    # micro-batches of the size asked for, as before.
    keyword = _ids(ft.make_batches(_indexed(40), batch_size=4, seed=1, start=3))
    state = _fresh().replace(data=_fresh().data.replace(cursor=3))
    assert _ids(ft.make_batches(_indexed(40), state, batch_size=4)) == keyword
    assert keyword == epoch_order(40, 1, 0).tolist()[12:]
