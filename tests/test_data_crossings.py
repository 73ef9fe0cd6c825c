"""make_batches where two features cross: find_batch_size with ranks and resume, a strategy's
rank, packing rows without tokens, in-memory streams that change length between save and
resume, and resumes that change the global batch and the world size more than once."""

import json

import pytest
import torch

import ftrain as ft
from ftrain.data import _position as P
from helpers import FakeRank


def _state(**kw):
    return ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), **kw)


def _advance(state, group):
    """What clip_and_step does to state.data after a group: cursor and position."""
    d = state.data
    return state.replace(data=d.replace(cursor=d.cursor + len(group), position=group.position))


def _rows(groups):
    """The rows of one step over all ranks, global micro-batch by global micro-batch."""
    return [
        i
        for micro in zip(*groups, strict=True)
        for b in micro
        if not isinstance(b, ft.data.ZeroWeight)
        for i in b["x"].tolist()
    ]


def _run(data, state, *, steps=None, world=1, **kw):
    """Every simulated rank's rows for `steps` groups (None: to the epoch's end), and the state
    after them (rank 0's: all ranks' groups carry the same positions)."""
    its = [
        ft.make_batches(data, state.replace(strategy=FakeRank(r, world)), **kw)
        for r in range(world)
    ]
    seen = []
    while steps is None or steps > 0:
        groups = [next(it, None) for it in its]
        if groups[0] is None:
            assert all(g is None for g in groups)
            break
        assert len({g.position for g in groups}) == 1
        seen += _rows(groups)
        state = _advance(state, groups[0])
        steps = None if steps is None else steps - 1
    return seen, state


# --- find_batch_size: one size on every rank, kept (and checked) on resume


class _OtherRankOutOfMemory(ft.strategies.SingleDevice):
    """Rank 0 of 2, whose peer runs out of memory above `limit` rows: the sum over processes
    adds the peer's out-of-memory flag for the size being probed."""

    def __init__(self, limit):
        super().__init__("cpu")
        self.rank, self.world_size, self.limit, self.size = 0, 2, limit, None

    def sum_over_processes(self, tensor):
        if self.size is None:  # TrainState.create's seed check: the peer has the same seed
            return tensor * 2
        return tensor + float(self.size > self.limit)


def test_find_batch_size_settles_every_rank_on_one_size():
    """A size that fits here but not on another rank is dropped here too: ranks of other sizes
    would read overlapping rows (and run different numbers of micro-batches)."""
    strategy = _OtherRankOutOfMemory(limit=12)
    tried = []

    def probe(state, size):  # fits on this rank at any size
        tried.append(size)
        strategy.size = size

    state = _state(strategy=strategy)
    found = ft.data.find_batch_size(state, probe, start=32, factor=0.5)
    assert tried == [32, 16, 8] and found.data.batch_size == 8


def test_find_batch_size_checks_its_arguments_on_a_resumed_state():
    resumed = _state().replace(data=_state().data.replace(batch_size=8))
    for bad, name in (({"start": 0}, "start"), ({"start": 4, "factor": 1.5}, "factor")):
        with pytest.raises(ValueError, match=name):
            ft.data.find_batch_size(resumed, lambda s, n: None, **bad)
    assert ft.data.find_batch_size(resumed, lambda s, n: None, start=64).data.batch_size == 8


def test_make_batches_refuses_a_batch_size_other_than_the_found_one():
    state = _state().replace(data=_state().data.replace(batch_size=3))
    rows = [{"x": i} for i in range(10)]
    with pytest.raises(ValueError, match=r"batch_size=4, but state.data.batch_size=3"):
        ft.make_batches(rows, state, batch_size=4)
    assert len(list(ft.make_batches(rows, state, batch_size=3))) == 4


# --- the strategy's rank


@pytest.mark.parametrize("rank, world", [(-1, 2), (2, 2), (0, 0)])
def test_a_rank_outside_the_world_raises_naming_the_strategy(rank, world):
    """Rank -1 of 2 took rank 1's rows (numpy's negative index): two ranks, the same rows."""
    rows = [{"x": i} for i in range(8)]
    stream = ft.data.IterableRows(rows)
    for data in (rows, stream):
        with pytest.raises(ValueError, match=rf"strategy has rank {rank} of world_size {world}"):
            list(ft.make_batches(data, batch_size=2, strategy=FakeRank(rank, world)))


# --- packing rows without tokens


def test_pack_examples_of_rows_without_tokens_yields_no_empty_block():
    rows = [{"input_ids": [1, 2]}, {"input_ids": []}, {"input_ids": []}]
    packed = ft.data.pack(ft.data.IterableRows(rows), block_size=2, mode="examples")
    blocks = [b["input_ids"].tolist() for g in ft.make_batches(packed, batch_size=1) for b in g]
    assert blocks == [[[1, 2]]]
    empty = ft.data.pack(ft.data.IterableRows(rows[1:]), block_size=2, mode="examples")
    with pytest.raises(ValueError, match="data is empty"):  # was an IndexError
        list(ft.make_batches(empty, batch_size=1))


# --- in-memory streams (Dataset.to_iterable_dataset) that change length


def _in_memory(values, shards=2):
    import datasets

    return datasets.Dataset.from_dict({"x": values}).to_iterable_dataset(num_shards=shards)


def test_in_memory_stream_of_another_length_refuses_to_resume():
    """No files whose sizes would show it: a row added to shard 0 put the saved (shard, row)
    one row back, and the resumed run read row 2 twice."""
    data = _in_memory(list(range(10)))
    first, state = _run(data, _state(), steps=1, batch_size=3, shuffle=False)
    assert first == [0, 1, 2]
    grown = _in_memory([100, *range(10)])
    with pytest.raises(ValueError, match=r"rows per shard \[5, 5\] -> \[6, 5\]"):
        _run(grown, state, batch_size=3, shuffle=False)
    rest, _ = _run(data, state, batch_size=3, shuffle=False)
    assert first + rest == list(range(10))


def test_in_memory_stream_position_saved_before_rows_were_described_still_resumes():
    data = _in_memory(list(range(10)))
    first, state = _run(data, _state(), steps=1, batch_size=3, shuffle=False)
    pos = json.loads(state.data.position)
    old_about = P.without_shard_rows(pos["about"])
    pos.update(fp=P.digest(old_about), about=old_about)  # as the previous version wrote it
    state = state.replace(data=state.data.replace(position=json.dumps(pos)))
    rest, _ = _run(data, state, batch_size=3, shuffle=False)
    assert first + rest == list(range(10))


# --- checked and right: resumes that change the global batch, accum and world size twice


@pytest.mark.parametrize(
    "n, phases, grouped",
    [
        (23, [(3, 1, 2, 2), (2, 3, 1, 1), (5, 2, 3, None)], False),
        (17, [(1, 2, 3, 1), (4, 1, 2, 0), (2, 2, 1, None)], True),
        (9, [(2, 1, 2, 2), (20, 1, 1, None)], False),  # fewer rows left than one batch
    ],
)
def test_map_resumes_changing_batch_accum_and_world_see_every_row_once(n, phases, grouped):
    rows = [{"x": i, "input_ids": [1] * (i % 4 + 1)} for i in range(n)]
    kw = {"group_by_length": True} if grouped else {}
    state, seen = _state(seed=3), []
    for batch_size, accum, world, steps in phases:
        got, state = _run(
            rows, state, steps=steps, world=world, batch_size=batch_size, accum=accum, **kw
        )
        seen += got
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_resumed_on_other_ranks_and_workers_sees_every_row_once(workers):
    rows = [{"x": i} for i in range(13)]
    data = ft.data.stream(ft.data.IterableRows(rows), shuffle_buffer=4)
    whole, _ = _run(data, _state(), batch_size=4)
    first, state = _run(data, _state(), steps=2, world=2, batch_size=2, num_workers=workers)
    rest, _ = _run(data, state, world=4, batch_size=1, accum=3)
    assert first + rest == whole and sorted(whole) == list(range(13))
    with pytest.raises(ValueError, match=r"batch_size=3 x 2 rank\(s\) = 6 rows"):
        _run(data, state, world=2, batch_size=3)
