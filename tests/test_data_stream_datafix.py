"""A stream position keeps a digest of the first row of the shard it stands in: a stream state
given another stream of the same shape (another list of rows, other files of the same names
and sizes) raised nothing and resumed it from the training position. It raises now, on every
rank and from workers; positions saved before the digest was kept still resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ftrain as ft
from helpers import batch_ids as _ids
from helpers import id_rows
from helpers import id_step as _step
from helpers import linear_state as _state

N = 24
TRAIN = id_rows(N)
VAL = [{"input_ids": [100 + i]} for i in range(N)]
KW = {"batch_size": 2, "accum": 3}
OTHER = "shard 0's first row is not the one read when it was saved"


def _after_one_step(data, **kw):
    state = _state()
    group = next(iter(ft.make_batches(data, state, **(KW | kw))))
    return _step(state, group), _ids(group)


def _strip_first(position: str) -> str:
    """The position as the previous ftrain wrote it: no first-row digests."""

    def strip(p):
        if isinstance(p, dict):
            return {k: strip(v) for k, v in p.items() if k != "first"}
        return [strip(v) for v in p] if isinstance(p, list) else p

    return json.dumps(strip(json.loads(position)), separators=(",", ":"))


STAGES = {
    "rows": lambda rows: ft.data.IterableRows(rows),
    "packed": lambda rows: ft.data.pack(ft.data.IterableRows(rows), block_size=1),
    "mixed": lambda rows: ft.data.mix(
        [ft.data.IterableRows(rows), ft.data.IterableRows(rows[::-1])], weights=[0.5, 0.5]
    ),
}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_state_given_another_stream_of_the_same_shape_raises(stage, workers):
    """make_batches(IterableRows(val), state) after a step on IterableRows(train) went on over
    the validation rows from the training position, without a word."""
    state, _ = _after_one_step(STAGES[stage](TRAIN))
    other = STAGES[stage](VAL)
    with pytest.raises(Exception, match=OTHER) as e:
        next(iter(ft.make_batches(other, state, num_workers=workers, **KW)))
    assert "state.data.position does not fit this data" in str(e.value)
    assert "make_batches(val, batch_size=..., shuffle=False" in str(e.value)  # NOT_ITS_DATA


@pytest.mark.parametrize("stage", STAGES)
def test_the_same_stream_still_resumes_exactly(stage):
    data = STAGES[stage](TRAIN)
    full = [_ids(g) for g in ft.make_batches(data, **KW, seed=0)]
    state, first = _after_one_step(data)
    assert json.loads(state.data.position)["src"] != {}
    rest = [_ids(g) for g in ft.make_batches(data, state, **KW)]
    assert [first, *rest] == full


def test_a_position_saved_without_first_row_digests_still_resumes():
    """Checkpoints of the previous ftrain (no digest) load and resume, unchecked, as before."""
    full = [_ids(g) for g in ft.make_batches(ft.data.IterableRows(TRAIN), **KW, seed=0)]
    state, first = _after_one_step(ft.data.IterableRows(TRAIN))
    old = _strip_first(state.data.position)
    assert '"first"' not in old
    ft.data.check_position(old)
    state = state.replace(data=state.data.replace(position=old))
    rest = [_ids(g) for g in ft.make_batches(ft.data.IterableRows(TRAIN), state, **KW)]
    assert [first, *rest] == full  # in the uninterrupted order, not only the same rows


def test_the_digest_is_saved_loaded_and_checked_through_a_checkpoint(tmp_path):
    state, first = _after_one_step(ft.data.IterableRows(TRAIN))
    path = ft.save_checkpoint(state, tmp_path)
    saved = json.loads((Path(path) / "state.json").read_text())["fields"]["data.position"]
    assert json.loads(saved)["src"]["first"]
    loaded = ft.load_checkpoint(path, _state())
    assert loaded.data.position == state.data.position
    rest = [x for g in ft.make_batches(ft.data.IterableRows(TRAIN), loaded, **KW) for x in _ids(g)]
    assert sorted(first + rest) == list(range(1, N + 1))
    with pytest.raises(ValueError, match=OTHER):
        next(iter(ft.make_batches(ft.data.IterableRows(VAL), loaded, **KW)))


def _reseal(path: Path, position: str) -> None:
    import hashlib

    meta = json.loads((path / "state.json").read_text())
    meta["fields"]["data.position"] = position
    (path / "state.json").write_text(json.dumps(meta))
    digest = hashlib.sha256((path / "state.json").read_bytes()).hexdigest()
    (path / "COMMITTED").write_text(json.dumps({"state.json": digest}))


@pytest.mark.parametrize(
    "first, where",
    [(7, "load"), ("not hex", "load"), ("Z" * 16, "load"), ("0" * 16, "resume")],
)
def test_a_forged_first_row_digest_fails_cleanly(tmp_path, first, where):
    """A digest that is not one is refused at load (CheckpointError naming data.position); a
    well-formed one of other rows when make_batches reads the shard."""
    state, _ = _after_one_step(ft.data.IterableRows(TRAIN))
    path = Path(ft.save_checkpoint(state, tmp_path))
    pos = json.loads(state.data.position)
    pos["src"]["first"] = first
    _reseal(path, json.dumps(pos))
    if where == "load":
        with pytest.raises(ft.CheckpointError, match=r"data\.position.*first must be a hex"):
            ft.load_checkpoint(path, _state())
        return
    loaded = ft.load_checkpoint(path, _state())
    with pytest.raises(ValueError, match=OTHER):
        next(iter(ft.make_batches(ft.data.IterableRows(TRAIN), loaded, **KW)))


def _files(root: Path, offset: int) -> list[str]:
    """Two jsonl shards whose names and sizes do not depend on `offset`."""
    root.mkdir()
    paths = []
    for k in range(2):
        rows = [{"input_ids": [10 * k + i + offset]} for i in range(6)]
        path = root / f"part-{k}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return paths


def test_a_datasets_stream_over_other_files_of_the_same_names_and_sizes_raises(tmp_path):
    """train/part-*.jsonl and val/part-*.jsonl: the same names and sizes, so the same
    fingerprint (files are named from their common folder on), and the resume went on over
    the validation files."""
    import datasets

    def load(files):
        return datasets.load_dataset("json", data_files=files, streaming=True, split="train")

    train = load(_files(tmp_path / "train", 1))
    val = load(_files(tmp_path / "val", 2))
    state, _ = _after_one_step(train, batch_size=2, accum=1)
    with pytest.raises(ValueError, match=r"shard \d's first row is not the one read"):
        next(iter(ft.make_batches(val, state, batch_size=2, accum=1)))
    assert len(list(ft.make_batches(train, state, batch_size=2, accum=1))) == 5


def test_under_ddp_every_rank_refuses_another_stream(tmp_path):
    import datafix_workers as W
    from launch import run_ranks

    out = tmp_path / "got"
    run_ranks(W.other_stream, str(out))  # bounded: 240 s (a cold fork server under load)
    got = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for rank in got:
        assert OTHER in rank["val"], rank
        assert rank["train"] == "4 micro-batches", rank  # 6 of 4 rows, 2 stepped on


def test_the_first_rows_digest_costs_one_per_shard_not_one_per_row(monkeypatch):
    from ftrain.data import _stream

    calls = []
    real = _stream.row_digest
    monkeypatch.setattr(_stream, "row_digest", lambda row: calls.append(1) or real(row))
    list(ft.make_batches(ft.data.IterableRows(TRAIN), **KW))
    assert len(calls) == 1


def test_a_datasets_stream_mapped_by_another_function_raises(tmp_path):
    """Another tokenizer in .map(): the fingerprint does not see functions, and the resume
    went on over rows tokenized otherwise. The first row of the shard shows it now."""
    import datasets

    files = _files(tmp_path / "train", 1)
    ds = datasets.load_dataset("json", data_files=files, streaming=True, split="train")
    state, _ = _after_one_step(ds.map(lambda r: {"input_ids": r["input_ids"]}), accum=1)
    other = ds.map(lambda r: {"input_ids": [t + 1 for t in r["input_ids"]]})
    with pytest.raises(ValueError, match=r"shard \d's first row is not the one read"):
        next(iter(ft.make_batches(other, state, batch_size=2, accum=1)))


def test_unchecked_goes_on_over_rows_that_changed_on_purpose():
    """The way on the refusal names, for rows changed on purpose (a tokenizer fixed mid-run):
    the position without its row digests resumes from where it stood, over the new rows."""
    state, _ = _after_one_step(STAGES["mixed"](TRAIN))
    with pytest.raises(ValueError, match=r"ft\.data\.unchecked\(state\.data\.position\)"):
        next(iter(ft.make_batches(STAGES["mixed"](VAL), state, **KW)))
    goes_on = state.replace(
        data=state.data.replace(position=ft.data.unchecked(state.data.position))
    )
    assert '"first"' not in goes_on.data.position
    rest = [_ids(g) for g in ft.make_batches(STAGES["mixed"](VAL), goes_on, **KW)]
    want = [_ids(g) for g in ft.make_batches(STAGES["mixed"](VAL), seed=0, **KW)][1:]
    assert rest == want


def test_unchecked_map_positions_go_on_from_the_row_reached():
    """Map-style: the content digest dropped; another batch size still continues from the row
    the run reached (position=None, the map refusal's way, restarts that count)."""
    state, _ = _after_one_step(TRAIN)  # 3 micro-batches of 2 rows: rows 0-5 read
    with pytest.raises(ValueError, match="data holds other rows"):
        ft.make_batches(VAL, state, **KW)
    goes_on = state.replace(
        data=state.data.replace(position=ft.data.unchecked(state.data.position))
    )
    rest = [x for g in ft.make_batches(VAL, goes_on, batch_size=3, accum=2) for x in _ids(g)]
    assert len(rest) == N - 6


@pytest.mark.parametrize("bad", ["{", '{"version": 2, "kind": "tape"}', 3])
def test_unchecked_refuses_what_is_not_a_position(bad):
    with pytest.raises((ValueError, TypeError), match="data position"):
        ft.data.unchecked(bad)


def test_ranks_each_given_their_own_part_of_a_stream_raise_on_every_rank(tmp_path):
    """IterableRows(rows[rank::2]), or a torch stream that picks its rows by dist.get_rank():
    both ranks described their streams alike (one shard), each kept its half of its own half,
    and 12 of the 24 rows were never trained on, without a word. The first row of the epoch
    is compared across ranks with the other settings now (read once an epoch, only where
    there are ranks to compare)."""
    import datafix_workers as W
    from launch import run_ranks

    out = tmp_path / "got"
    run_ranks(W.split_stream, str(out))
    got = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for rank in got:
        for case in ("list", "self-split"):
            error = rank[case].get("error", "")
            assert "make_batches was given other content on this rank" in error, rank[case]
            assert "not a per-rank split" in error
        assert rank["same"]["opened"] == 2  # the peek at the epoch's first row, then the epoch
        for case in ("read once", "read once, mixed"):  # the peek must not lose its first row
            assert "than when make_batches read it a moment" in rank[case].get("error", "")
    for case in ("same", "same, workers"):
        assert sorted(got[0][case]["rows"] + got[1][case]["rows"]) == list(range(1, N + 1))
    twice = sorted(got[0]["same, mixed twice"]["rows"] + got[1]["same, mixed twice"]["rows"])
    assert twice == sorted(2 * list(range(1, N + 1)))


class _Counted(ft.data.IterableRows):
    opened = 0

    def __iter__(self):
        type(self).opened += 1
        return super().__iter__()


def test_one_process_reads_no_row_more_than_before():
    _Counted.opened = 0
    list(ft.make_batches(_Counted(TRAIN), **KW))
    assert _Counted.opened == 1


class _Shards(torch.utils.data.IterableDataset):
    """Two shards of rows; `empty` leaves shard 1 without rows."""

    num_shards = 2

    def __init__(self, empty=False, index=None):
        self.empty, self.index = empty, index

    def shard(self, num_shards, index):
        return _Shards(self.empty, index)

    def __iter__(self):
        for k in range(2) if self.index is None else [self.index]:
            if not (self.empty and k == 1):
                yield from TRAIN[12 * k : 12 * k + 12]


def test_a_resume_at_the_start_of_a_shard_that_is_empty_now_raises():
    """The position stood at row 0 of shard 1 (its first row read, by the look-ahead): with
    shard 1 empty now, the resume read nothing more and ended the epoch, without a word."""
    groups = ft.make_batches(_Shards(), batch_size=2, accum=3, seed=0, shuffle=False)
    next(groups)
    group = next(groups)  # rows 0-11: the position is (shard 1, row 0)
    assert json.loads(group.position)["src"]["shard"] == 1
    state = _state()
    state = state.replace(data=state.data.replace(cursor=6, position=group.position))
    kw = {"batch_size": 2, "accum": 3, "shuffle": False}
    with pytest.raises(ValueError, match="shard 1 has no row, but had when it was saved"):
        list(ft.make_batches(_Shards(empty=True), state, **kw))
    assert len(list(ft.make_batches(_Shards(), state, **kw))) == 2
