"""make_batches over streams: datasets streaming and torch IterableDatasets, exact resume from
the JSON position kept in state.data.position, epochs, shuffle buffer, ranks, packing, mixing,
and the fingerprint that refuses a resume over other data."""

import json
import math

import numpy as np
import pytest
import torch

import ftrain as ft
from ftrain.data import _position as P
from helpers import FakeRank

SHARDS, PER_SHARD = 4, 7  # 28 rows
READS: list[int] = []


def _count_read(row):
    READS.append(row["idx"])
    return row


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    paths = []
    for k in range(SHARDS):
        path = root / f"part-{k}.jsonl"
        rows = [{"idx": k * PER_SHARD + i, "input_ids": [k + 1] * (i % 4 + 1)} for i in range(7)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def hf_stream(files):
    import datasets

    ds = datasets.load_dataset("json", data_files=files, streaming=True, split="train")
    return ds.map(_count_read)


def _flat(groups):
    return [i for g in _ids(groups) for i in g]


def _ids(groups):
    return [
        [i for b in g if not isinstance(b, ft.data.ZeroWeight) for i in b["idx"].tolist()]
        for g in groups
    ]


def _micro(groups):
    return [
        [] if isinstance(b, ft.data.ZeroWeight) else b["idx"].tolist() for g in groups for b in g
    ]


def _resumed(data, group, cursor, *, seed=0, epoch=0, **kw):
    """make_batches from the state clip_and_step left after `group` (cursor and position)."""
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=seed)
    state = state.replace(
        epoch=epoch, data=state.data.replace(cursor=cursor, position=group.position)
    )
    return ft.make_batches(data, state, **kw)


def _resume_all(data, **kw):
    """The uninterrupted epoch, and for each stop point k the epoch resumed after k groups."""
    full = list(ft.make_batches(data, **kw))
    cursor = 0
    for k, group in enumerate(full[:-1]):
        cursor += len(group)
        READS.clear()
        resumed = list(_resumed(data, group, cursor, **kw))
        yield k, full, resumed


def test_hf_json_stream_covers_every_row_once_and_reshuffles_shards_per_epoch(hf_stream):
    kw = {"batch_size": 3, "accum": 2, "seed": 1}
    e0 = _flat(ft.make_batches(hf_stream, epoch=0, **kw))
    e1 = _flat(ft.make_batches(hf_stream, epoch=1, **kw))
    assert sorted(e0) == sorted(e1) == list(range(SHARDS * PER_SHARD))
    assert [i // PER_SHARD for i in e0[::PER_SHARD]] != [i // PER_SHARD for i in e1[::PER_SHARD]]
    plain = _flat(ft.make_batches(hf_stream, shuffle=False, **kw))
    assert plain == list(range(SHARDS * PER_SHARD))


def test_exact_resume_at_every_step_rereads_at_most_one_shard(hf_stream):
    src = ft.data.stream(hf_stream, shuffle_buffer=3)  # windows of 3 rows, shuffled
    for k, full, resumed in _resume_all(src, batch_size=2, accum=2, seed=5, epoch=2):
        assert _ids(resumed) == _ids(full[k + 1 :]), k
        consumed = {i for g in _ids(full[: k + 1]) for i in g}
        assert len(set(READS) & consumed) < PER_SHARD, k  # never the consumed prefix


def test_resuming_twice_equals_resuming_once(hf_stream):
    kw = {"batch_size": 2, "accum": 1, "seed": 3}
    full = list(ft.make_batches(hf_stream, **kw))
    once = list(_resumed(hf_stream, full[3], 4, **kw))
    twice = list(_resumed(hf_stream, once[4], 9, **kw))
    assert _ids(twice) == _ids(full[9:])
    assert [g.position for g in twice] == [g.position for g in full[9:]]


def test_ranks_split_each_global_micro_batch_and_resume_on_another_rank_count(hf_stream):
    kw = {"accum": 2, "seed": 7}
    one = list(ft.make_batches(hf_stream, batch_size=6, **kw))
    two = [
        list(ft.make_batches(hf_stream, batch_size=3, strategy=FakeRank(r, 2), **kw))
        for r in (0, 1)
    ]
    assert [len(g) for g in two[0]] == [len(g) for g in two[1]] == [len(g) for g in one]
    assert sorted(_flat(two[0]) + _flat(two[1])) == list(range(28))
    # Global micro-batch b: rank 0 takes its first half, rank 1 the second.
    halves = [b0 + b1 for b0, b1 in zip(_micro(two[0]), _micro(two[1]), strict=True)]
    assert halves == _micro(one)
    assert [g.position for g in two[0]] == [g.position for g in two[1]] == [g.position for g in one]
    # 28 rows, 6 per global micro-batch: the last holds 4, ranks take 2 each; resume the 2-rank
    # run's checkpoint in one process with the same global batch.
    # 3 ranks x 3 rows: the last global micro-batch holds 1 row; ranks 1 and 2 get stand-ins
    # and still run as many micro-batches as rank 0 (no hang at the end of the stream).
    three = [
        list(ft.make_batches(hf_stream, batch_size=3, strategy=FakeRank(r, 3), **kw))
        for r in range(3)
    ]
    assert len({tuple(len(g) for g in groups) for groups in three}) == 1
    assert [isinstance(groups[-1][-1], ft.data.ZeroWeight) for groups in three] == [0, 1, 1]
    assert sorted(_flat(three[0]) + _flat(three[1]) + _flat(three[2])) == list(range(28))
    resumed = list(_resumed(hf_stream, two[1][0], 2, batch_size=6, **kw))
    assert _ids(resumed) == _ids(one[1:])
    with pytest.raises(ValueError, match="batch_size=4 x 1 rank"):
        _resumed(hf_stream, two[1][0], 2, batch_size=4, **kw)


def test_stream_errors_name_the_argument(hf_stream):
    with pytest.raises(ValueError, match="resuming a stream at micro-batch 2 needs its position"):
        ft.make_batches(hf_stream, batch_size=2, start=2)
    group = next(iter(ft.make_batches(hf_stream, batch_size=2, epoch=0)))
    with pytest.raises(ValueError, match=r"but the state is at \{'epoch': 1"):
        _resumed(hf_stream, group, 1, batch_size=2, epoch=1)
    import datasets.distributed

    split = datasets.distributed.split_dataset_by_node(hf_stream, rank=0, world_size=2)
    with pytest.raises(ValueError, match="split_dataset_by_node"):
        ft.make_batches(split, batch_size=2)
    with pytest.raises(ValueError, match="data is empty"):
        list(ft.make_batches(ft.data.IterableRows([]), batch_size=2))
    with pytest.raises(ValueError, match="shuffle_buffer"):
        ft.data.stream(hf_stream, shuffle_buffer=0)


class Tokens(torch.utils.data.IterableDataset):
    """A torch IterableDataset with datasets' shard protocol and a random augmentation."""

    num_shards = 3

    def __init__(self, index=None):
        self.index = index

    def shard(self, num_shards, index, contiguous=True):
        return Tokens(index)

    def __iter__(self):
        for k in range(3) if self.index is None else [self.index]:
            for i in range(10):
                yield {"idx": 10 * k + i, "input_ids": [k] * (1 + i % 3), "noise": torch.rand(())}


def test_torch_iterable_with_workers_equals_in_process_and_resumes():
    kw = {"batch_size": 2, "accum": 2, "seed": 2}
    base = list(ft.make_batches(Tokens(), **kw))
    workers = list(ft.make_batches(Tokens(), num_workers=2, **kw))
    assert _ids(base) == _ids(workers)
    noise = [b["noise"].tolist() for g in base for b in g]
    assert noise == [b["noise"].tolist() for g in workers for b in g]
    resumed = list(_resumed(Tokens(), base[2], 6, num_workers=2, **kw))
    assert _ids(resumed) == _ids(base[3:])
    assert [b["noise"].tolist() for g in resumed for b in g] == noise[6:]


def _tokens(groups):
    return [t for g in groups for b in g for row in b["input_ids"].tolist() for t in row if t]


def test_concat_packing_uses_every_token_once_and_resumes_mid_block():
    rows = [{"idx": i, "input_ids": [i + 1] * (i % 5 + 1)} for i in range(40)]
    src = ft.data.pack(ft.data.IterableRows(rows), block_size=4)
    kw = {"batch_size": 2, "accum": 1, "shuffle": False}
    blocks = list(ft.make_batches(src, **kw))
    assert _tokens(blocks) == [t for r in rows for t in r["input_ids"]]
    assert all(b["input_ids"].shape[1] == 4 for g in blocks[:-1] for b in g)
    for k, full, resumed in _resume_all(src, **kw):
        assert _tokens(resumed) == _tokens(full[k + 1 :]), k


def test_example_packing_keeps_examples_whole_and_resumes():
    rows = [{"input_ids": [i + 1] * (i % 4 + 1)} for i in range(30)]
    src = ft.data.pack(ft.data.IterableRows(rows), block_size=6, mode="examples")
    kw = {"batch_size": 1, "accum": 2, "shuffle": False}
    blocks = list(ft.make_batches(src, collate_fn=ft.sft.packed_collate(0), **kw))
    assert _tokens(blocks) == [t for r in rows for t in r["input_ids"]]
    for g in blocks:
        for b in g:
            ids, pos = b["input_ids"][0].tolist(), b["position_ids"][0].tolist()
            starts = [i for i, p in enumerate(pos) if p == 0 and ids[i]]
            ends = [*starts[1:], len(ids)]
            assert all(len(set(ids[a:z])) == 1 for a, z in zip(starts, ends, strict=True))
    for k, full, resumed in _resume_all(src, collate_fn=ft.sft.packed_collate(0), **kw):
        assert _tokens(resumed) == _tokens(full[k + 1 :]), k


def test_mixing_follows_the_weights_and_resumes():
    a = ft.data.IterableRows([{"src": 0, "i": i} for i in range(300)])
    b = ft.data.IterableRows([{"src": 1, "i": i} for i in range(100)])
    src = ft.data.mix([a, b], weights=[0.7, 0.3])
    kw = {"batch_size": 10, "accum": 3, "seed": 0, "shuffle": False}
    groups = list(ft.make_batches(src, **kw))
    sources = [s for g in groups for x in g for s in x["src"].tolist()]
    assert sources.count(1) == 100 and abs(len(sources) - 100 / 0.3) < 3  # b ran out first
    # Every prefix holds the weights' shares to within one row.
    assert all(abs(sum(sources[:n]) - 0.3 * n) <= 1 for n in range(1, len(sources)))
    for k, full, resumed in _resume_all(src, **kw):
        assert [x["i"].tolist() for g in resumed for x in g] == [
            x["i"].tolist() for g in full[k + 1 :] for x in g
        ]
    with pytest.raises(ValueError, match="weights"):
        ft.data.mix([a, b], weights=[1.0])


def test_readme_loop_on_a_stream_resumes_from_a_checkpoint(hf_stream, tmp_path):
    """The README loop with only the dataset line changed: stop, load, go on = uninterrupted."""

    def run(state, steps, stop=None):
        while state.step < steps:
            for micro in ft.make_batches(hf_stream, state, batch_size=2, accum=2):
                grads, stats = ft.accumulate_grads(state, micro, loss)
                state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
                if state.step == stop:
                    ft.save_checkpoint(state, tmp_path)
                    return state
                if state.step >= steps:
                    break
            else:
                state = ft.next_epoch(state)
        return state

    def loss(model, batch):
        return model(batch["idx"].float()[:, None]).sum(), batch["idx"].shape[0]

    def fresh():
        torch.manual_seed(0)
        return ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)

    straight = run(fresh(), 10)  # 28 rows, 4 per step: 7 steps an epoch
    run(fresh(), 10, stop=5)
    saved = json.loads((tmp_path / "step-5" / "state.json").read_text())["fields"]
    assert json.loads(saved["data.position"])["cursor"] == 10
    loaded = ft.load_checkpoint(ft.latest_checkpoint(tmp_path), fresh())
    assert loaded.data.cursor == 10 and loaded.data.position == saved["data.position"]
    resumed = run(loaded, 10)
    assert (resumed.epoch, resumed.data.cursor) == (straight.epoch, straight.data.cursor)
    torch.testing.assert_close(resumed.params["weight"], straight.params["weight"])


@pytest.mark.slow
def test_pretrain_stream_example_stopped_and_resumed_equals_the_straight_run(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "pretrain_stream.py"
    spec = importlib.util.spec_from_file_location("pretrain_stream", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--steps", "4", "--save-every", "2", "--log-every", "1", "--max-chars", "20000",
            "--block-size", "32", "--batch-size", "4", "--workers", "1"]  # fmt: skip
    straight = example.main([*args, "--out", str(tmp_path / "a")])
    assert example.main([*args, "--out", str(tmp_path / "b"), "--stop-at", "3"]) == {"stopped": 3}
    resumed = example.main([*args, "--out", str(tmp_path / "b")])
    assert "resumed from" in capsys.readouterr().out  # from step-2: steps 3 and 4 run again
    assert len(resumed["losses"]) == 2
    assert resumed["losses"] == straight["losses"][-len(resumed["losses"]) :]
    assert (resumed["epoch"], resumed["cursor"]) == (straight["epoch"], straight["cursor"])
    for name, p in straight["params"].items():
        assert torch.equal(resumed["params"][name], p), name


# --- what a position indexes: a resume over other data or settings raises, naming the change


def _write(folder, k, n=10):
    path = folder / f"data-{k}.jsonl"
    rows = [{"idx": 100 * k + i, "input_ids": [k + 1] * (i % 3 + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _hf(files):
    import datasets

    return datasets.load_dataset("json", data_files=files, streaming=True, split="train")


def test_a_resume_over_changed_shard_files_raises_naming_them(tmp_path):
    import shutil

    files = [_write(tmp_path, k) for k in range(4)]
    kw = {"batch_size": 4, "seed": 0}
    full = list(ft.make_batches(_hf(files), **kw))

    def resume(paths):
        return list(_resumed(_hf(paths), full[2], 3, **kw))

    with pytest.raises(ValueError, match=r"shard files changed: data-3\.jsonl removed"):
        resume(files[:3])
    with pytest.raises(ValueError, match=r"shard files changed: data-4\.jsonl added"):
        resume([*files, _write(tmp_path, 4)])
    with pytest.raises(ValueError, match="number of shards 4 -> 3"):
        resume(files[:3])
    # The same files elsewhere (another machine, another mount) are the same data.
    (tmp_path / "moved").mkdir()
    moved = [shutil.copy(f, tmp_path / "moved") for f in files]
    assert _ids(resume(moved)) == _ids(full[3:])
    with open(files[1], "a") as f:  # a shard that grew
        f.write(json.dumps({"idx": 999, "input_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match=r"data-1.jsonl (\d+) -> (\d+) bytes") as e:
        resume(files)
    assert "state.data.position was saved for other data" in str(e.value)


def _content(groups):
    return [{k: v.tolist() for k, v in b.items()} for g in groups for b in g]


def _numbers(n=40):
    return ft.data.IterableRows(
        [{"idx": i, "input_ids": [i % 5 + 1] * (i % 3 + 1)} for i in range(n)]
    )


def _torch_shards(n):
    return type("Sharded", (Tokens,), {"num_shards": n})()


@pytest.mark.parametrize(
    "before, after, match",
    [
        (lambda: ft.data.stream(_numbers(), shuffle_buffer=8),
         lambda: ft.data.stream(_numbers(), shuffle_buffer=16), "shuffle_buffer 8 -> 16"),
        (lambda: ft.data.pack(_numbers(), block_size=4),
         lambda: ft.data.pack(_numbers(), block_size=8), "block_size 4 -> 8"),
        (lambda: ft.data.pack(_numbers(), block_size=4),
         lambda: ft.data.pack(_numbers(), block_size=4, mode="examples"),
         "mode 'concat' -> 'examples'"),
        (lambda: ft.data.mix([_numbers(), _numbers()], weights=[0.7, 0.3]),
         lambda: ft.data.mix([_numbers(), _numbers()], weights=[0.5, 0.5]),
         r"weights \[0.7, 0.3\] -> \[0.5, 0.5\]"),
        (lambda: ft.data.mix([_numbers(), _numbers()], weights=[1, 1]),
         lambda: ft.data.mix([_numbers(), _numbers(), _numbers()], weights=[1, 1, 1]),
         "number of sources 2 -> 3"),
        (lambda: ft.data.mix([_numbers(), ft.data.stream(_numbers(), shuffle_buffer=3)],
                             weights=[1, 1]),
         lambda: ft.data.mix([_numbers(), ft.data.stream(_numbers(), shuffle_buffer=4)],
                             weights=[1, 1]),
         "mixed source 1: shuffle_buffer 3 -> 4"),
        (lambda: _torch_shards(3), lambda: _torch_shards(2), "number of shards 3 -> 2"),
        (lambda: _numbers(), lambda: ft.data.pack(_numbers(), block_size=4),
         "source 'shards' -> 'pack'"),
    ],
)  # fmt: skip
def test_a_resume_with_other_stream_settings_raises_naming_them(before, after, match):
    kw = {"batch_size": 3, "seed": 1}
    full = list(ft.make_batches(before(), **kw))
    assert _content(_resumed(before(), full[1], 2, **kw)) == _content(full[2:])  # unchanged
    with pytest.raises(ValueError, match=match):
        _resumed(after(), full[1], 2, **kw)


def test_shuffle_and_old_positions_are_refused():
    kw = {"batch_size": 3, "seed": 1}
    group = next(iter(ft.make_batches(_numbers(), **kw)))
    with pytest.raises(
        ValueError, match=r"shuffle=False, but state\.data\.position was saved with"
    ):
        _resumed(_numbers(), group, 1, shuffle=False, **kw)
    # A position from before fingerprints (version 1) says nothing about its data.
    v1 = {
        "version": 1,
        "epoch": 0,
        "cursor": 1,
        "seed": 1,
        "rows": 3,
        "src": {"shard": 0, "row": 3},
    }
    old = ft.data.MicroBatches((), json.dumps(v1))
    with pytest.raises(ValueError, match=r"older ftrain \(position version 1\)"):
        _resumed(_numbers(), old, 1, **kw)


def test_a_long_file_list_keeps_the_position_short_and_still_names_the_change(tmp_path):
    files = [_write(tmp_path, k, n=1) for k in range(150)]
    group = list(ft.make_batches(_hf(files), batch_size=4))[3]
    assert len(group.position) < 500
    with pytest.raises(ValueError, match=r"shard files changed: 150 -> 149 files"):
        _resumed(_hf(files[:-1]), group, 4, batch_size=4)


def _rows_of(shards):
    for name in shards:
        for i in range(5):
            yield {"idx": 100 * (ord(name) - ord("a")) + i}


def _generated(shards):
    import datasets

    return datasets.IterableDataset.from_generator(_rows_of, gen_kwargs={"shards": shards})


def test_a_from_generator_stream_over_other_shards_is_refused_naming_them():
    """`from_generator(gen, gen_kwargs={"shards": files})` reads no files ftrain can see: a
    resume over other shards of the same count went on over other rows without a word."""
    full = list(ft.make_batches(_generated(["a", "b"]), batch_size=3, shuffle=False))
    rest = list(_resumed(_generated(["a", "b"]), full[1], 2, batch_size=3, shuffle=False))
    assert _flat(full[:2]) + _flat(rest) == _flat(full)
    with pytest.raises(ValueError, match=r"gen_kwargs \{'shards': \['a', 'b'\]\} -> .*'c'"):
        _resumed(_generated(["a", "c"]), full[1], 2, batch_size=3, shuffle=False)
    # A position saved before the arguments were described resumes as before.
    pos = json.loads(full[1].position)
    pos["about"] = P.without_generator_arguments(pos["about"])
    pos["fp"] = P.digest(pos["about"])
    old = ft.data.MicroBatches((), json.dumps(pos))
    assert _flat(_resumed(_generated(["a", "b"]), old, 2, batch_size=3, shuffle=False)) == _flat(
        rest
    )


def _chunks_of(chunks):
    for c in chunks[:12]:
        yield {"idx": c["start"]}


def _chunked(n):
    import datasets

    chunks = [{"path": f"/data/part-{i % 64:02d}.bin", "start": i} for i in range(n)]
    return datasets.IterableDataset.from_generator(_chunks_of, gen_kwargs={"chunks": chunks})


def test_a_from_generator_stream_over_a_list_of_records_keeps_its_positions_short():
    """`gen_kwargs={"chunks": [{"path", "start"}, ...]}` was kept whole in every position (117k
    characters for 2,000 chunks, parsed at every micro-batch), and 20,000 chunks were refused
    as "a custom Source's positions": a long list of any values is kept as a count and digest."""
    assert len(next(iter(ft.make_batches(_chunked(20_000), batch_size=4))).position) < 500
    full = list(ft.make_batches(_chunked(200), batch_size=4, shuffle=False))
    assert all(len(g.position) < 500 for g in full)
    rest = _resumed(_chunked(200), full[0], 1, batch_size=4, shuffle=False)
    assert _flat(rest) == _flat(full[1:])
    with pytest.raises(ValueError, match=r"gen_kwargs \{'chunks': \{'n': 200, .* 199"):
        _resumed(_chunked(199), full[0], 1, batch_size=4, shuffle=False)


class _ManyFiles(ft.data.Source):
    """A custom source over many files, described by their names (its `describe`)."""

    def __init__(self, paths, *, seen=False):
        self.paths, self.seen = paths, seen

    def describe(self, shuffle):
        return {"stage": "custom", "paths": self.paths}

    def items(self, epoch, pos, seed, shuffle):
        for i in range(0 if pos is None else pos["i"], 40):
            # `seen`: a position that lists what was read, where an index would do
            yield {"idx": i}, {"i": i + 1} | ({"seen": "r" * (100_000 * i)} if self.seen else {})


def test_a_custom_source_describing_many_files_saves_checkpoints_that_load(tmp_path):
    """A custom Source listing its 40,000 files in describe() made every position over 1 MiB:
    each checkpoint of the run was saved, and refused by load_checkpoint."""
    paths = [f"/data/shard-{i:06d}.parquet" for i in range(40_000)]
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)
    group = next(iter(ft.make_batches(_ManyFiles(paths), state, batch_size=4)))
    state = state.replace(data=state.data.replace(cursor=1, position=group.position))
    assert len(group.position) < 500
    path = ft.save_checkpoint(state, tmp_path)
    fresh = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)
    loaded = ft.load_checkpoint(path, fresh)
    assert _flat(ft.make_batches(_ManyFiles(paths), loaded, batch_size=4)) == list(range(4, 40))
    with pytest.raises(ValueError, match=r"paths \{'n': 40000, .*\} -> \{'n': 39999"):
        ft.make_batches(_ManyFiles(paths[:-1]), loaded, batch_size=4)


def test_a_custom_source_describing_many_records_keeps_its_positions_short():
    """Files described as records, `[{"path", "rows"}, ...]` (as ftrain's own sources do), were
    kept whole: 880k characters for 20,000, parsed again at every micro-batch."""
    files = [{"path": f"/data/part-{i:05d}.bin", "rows": 1000} for i in range(20_000)]
    groups = list(ft.make_batches(_ManyFiles(files), batch_size=4))
    assert max(len(g.position) for g in groups) < 500
    assert _flat(groups) == list(range(40))


def test_a_too_long_position_names_the_description_when_that_is_what_is_long(monkeypatch):
    """The refusal blamed "a custom Source's positions" when they were a few characters."""
    monkeypatch.setattr(P, "_MAX_CHARS", 1500)  # a description summarized whole is 2,048 at most
    with pytest.raises(ValueError, match=r"description in it .* keep a custom Source's describe"):
        next(iter(ft.make_batches(_Named({"note": "n" * 1600}), batch_size=2)))


def test_a_position_too_long_for_a_checkpoint_raises_at_once_and_is_never_saved(tmp_path):
    with pytest.raises(ValueError, match=r"stream position after micro-batch 1 is .* characters"):
        for _ in ft.make_batches(_ManyFiles([], seen=True), batch_size=20):
            pass
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
    forged = json.dumps({"version": 2, "kind": "stream", "pad": "x" * (1 << 20)})
    with pytest.raises(ft.CheckpointError, match=r"field 'data.position' could not be loaded"):
        ft.save_checkpoint(state.replace(data=state.data.replace(position=forged)), tmp_path)
    assert ft.latest_checkpoint(tmp_path) is None


class _Named(ft.data.Source):
    """A custom source whose positions name the file they are in (what a load refuses)."""

    def __init__(self, about=None):
        self.about = about or {}

    def describe(self, shuffle):
        return {"stage": "custom", **self.about}

    def items(self, epoch, pos, seed, shuffle):
        for i in range(0 if pos is None else pos["row"], 10):
            yield {"idx": i}, {"shard": "part-0.parquet", "row": i + 1}


@pytest.mark.parametrize(
    "source, why",
    [
        (_Named(), r"shard must be an int"),
        (_Named({"max_len": math.inf}), r"Infinity is not a number"),
    ],
)
def test_a_position_a_checkpoint_could_not_load_raises_at_the_micro_batch_that_makes_it(
    tmp_path, source, why
):
    """A custom Source's position naming its file under the key "shard", or a describe()
    holding an infinity, made positions that load_checkpoint refuses: every checkpoint of the
    run was saved, and none could be resumed."""
    with pytest.raises(ValueError, match=rf"after micro-batch 1 could not be loaded back.*{why}"):
        next(iter(ft.make_batches(source, batch_size=2)))


class ShardOnly(torch.utils.data.IterableDataset):
    """The torch shard protocol docs/data.md describes: `shard(num_shards, index)`, no more."""

    num_shards = 3

    def __init__(self, index=None):
        self.index = index

    def shard(self, num_shards, index):
        return ShardOnly(index)

    def __iter__(self):
        for k in range(3) if self.index is None else [self.index]:
            yield from ({"idx": 10 * k + i} for i in range(10))


def test_a_torch_dataset_with_a_two_argument_shard_streams_and_resumes():
    kw = {"batch_size": 4, "accum": 2, "seed": 3}
    full = list(ft.make_batches(ShardOnly(), **kw))
    assert sorted(_flat(full)) == list(range(30))
    assert _ids(_resumed(ShardOnly(), full[1], 4, **kw)) == _ids(full[2:])


@pytest.mark.parametrize(
    "weights, error, match",
    [
        ([math.inf, 1], ValueError, r"weights must be finite and >= 0, got inf in \[inf, 1\]"),
        ([1, math.nan], ValueError, "weights must be finite and >= 0, got nan"),
        ([-0.5, 1], ValueError, "weights must be finite and >= 0, got -0.5"),
        ([0, 0.0], ValueError, r"weights must not all be 0, got \[0, 0.0\]"),
        ([True, 1], TypeError, r"weights must be numbers, got True \(bool\)"),
        ([np.bool_(True), 1], TypeError, "weights must be numbers, got "),
        (["1", 1], TypeError, "weights must be numbers, got '1'"),
        ([1.0], ValueError, r"one weight per source: 2 sources, 1 weights \[1.0\]"),
        ("ab", TypeError, "weights must be a sequence of numbers, got 'ab'"),
        (3, TypeError, "weights must be a sequence of numbers, got 3"),
    ],
)
def test_mix_refuses_weights_that_would_silently_starve_a_source(weights, error, match):
    with pytest.raises(error, match=match):
        ft.data.mix([_numbers(), _numbers()], weights=weights)


def test_mix_weights_of_any_finite_scale_and_zero_weights():
    a = ft.data.IterableRows([{"src": 0}] * 30)
    b = ft.data.IterableRows([{"src": 1}] * 30)

    def sources(weights):
        g = ft.make_batches(ft.data.mix([a, b], weights=weights), batch_size=10, shuffle=False)
        return [s for group in g for x in group for s in x["src"].tolist()]

    assert sources([1e308, 1e308]) == sources([1, 1]) == sources([np.float32(2), 2])
    assert sources([1, 0]) == [0] * 30  # a zero weight leaves its source unread


class EpochOrdered(torch.utils.data.IterableDataset):
    """A torch IterableDataset that orders its rows by the epoch it is told (`set_epoch`, as
    HF's Trainer calls it on a dataset that has one)."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(8, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        for i in order:
            yield {"idx": i, "input_ids": [i + 1, i + 2]}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_torch_stream_with_set_epoch_is_told_the_epoch(workers):
    """It was never told: every epoch read the rows in epoch 0's order."""
    kw = {"batch_size": 2, "accum": 1, "shuffle": False, "num_workers": workers}
    orders = [_ids(list(ft.make_batches(EpochOrdered(), epoch=e, **kw))) for e in (0, 1)]
    for e, groups in enumerate(orders):
        ids = [i for g in groups for i in g]
        expected = torch.randperm(8, generator=torch.Generator().manual_seed(e)).tolist()
        assert ids == expected
    full = list(ft.make_batches(EpochOrdered(), epoch=1, **kw))
    resumed = list(_resumed(EpochOrdered(), full[1], 2, epoch=1, **kw))  # mid-epoch 1
    assert _ids(resumed) == _ids(full[2:])
