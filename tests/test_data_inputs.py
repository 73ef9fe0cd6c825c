"""Data-pipeline inputs that used to be accepted and then silently ignored or misread: each is
now refused upfront with a message naming the argument or stage (or, where ftrain can, acted
on exactly)."""

import json

import pytest
import torch

import ftrain as ft


def _jsonl(root, name, sizes, base=0):
    """A streaming `datasets.IterableDataset` over one jsonl file per size: rows {"id": ...}."""
    import datasets

    folder = root / name
    folder.mkdir()
    paths = []
    for f, n in enumerate(sizes):
        path = folder / f"part-{f}.jsonl"
        path.write_text("".join(json.dumps({"id": base + 100 * f + i}) + "\n" for i in range(n)))
        paths.append(str(path))
    return datasets.load_dataset("json", data_files=paths, streaming=True, split="train")


def _ids(data, state=None, **kw):
    groups = ft.make_batches(data, state, batch_size=2, **kw)
    return [i for g in groups for b in g for i in b["id"].tolist()]


# --- 1. datasets pipelines that reading shard by shard would change


@pytest.mark.parametrize("stage", ["take", "skip"])
def test_take_or_skip_on_a_sharded_hf_stream_raises_naming_the_stage(tmp_path, stage):
    ds = getattr(_jsonl(tmp_path, "a", [6, 6]), stage)(4)
    with pytest.raises(ValueError, match=rf"has a {stage}\(4\) stage .* 2 shards .*data_files"):
        ft.make_batches(ds, batch_size=2, shuffle=False)


def test_take_on_a_one_file_hf_stream_is_read_exactly_and_in_the_fingerprint(tmp_path):
    ds = _jsonl(tmp_path, "a", [6])
    assert _ids(ds.take(4), shuffle=False) == [0, 1, 2, 3]
    assert ft.data.stream(ds.skip(2)).describe(False)["pipeline"] == [{"skip": 2}]


@pytest.mark.parametrize("strategy", ["first_exhausted", "all_exhausted"])
def test_interleave_datasets_raises_pointing_to_mix(tmp_path, strategy):
    import datasets

    a, b = _jsonl(tmp_path, "a", [4, 4]), _jsonl(tmp_path, "b", [1, 6], base=1000)
    mixed = datasets.interleave_datasets([a, b], stopping_strategy=strategy)
    with pytest.raises(ValueError, match=r"interleave_datasets.*ft\.data\.mix"):
        ft.make_batches(mixed, batch_size=2, shuffle=False)


def test_interleave_with_probabilities_needs_a_seed_and_its_settings_are_fingerprinted(tmp_path):
    """interleave_datasets(probabilities=...) of one-file streams, without a seed: datasets
    drew another mixture in every process, so each rank and each resume read other rows (the
    same within one process, so a test in one process saw nothing)."""
    import datasets

    from ftrain.data import _position as P

    a, b = _jsonl(tmp_path, "a", [8]), _jsonl(tmp_path, "b", [8], base=1000)
    mixed = lambda **kw: datasets.interleave_datasets([a, b], **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"interleave_datasets\(probabilities=\[0.5, 0.5\]\) wi"):
        ft.make_batches(mixed(probabilities=[0.5, 0.5]), batch_size=2, shuffle=False)
    seeded = mixed(probabilities=[0.5, 0.5], seed=7)
    assert ft.data.stream(seeded).describe(False)["pipeline"] == [
        {"interleave": 2, "stopping_strategy": "first_exhausted", "probabilities": [0.5, 0.5],
         "seed": 7}
    ]  # fmt: skip
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)
    full = list(ft.make_batches(seeded, state, batch_size=2, shuffle=False))
    moved = state.replace(data=state.data.replace(cursor=1, position=full[0].position))
    rest = [i for g in ft.make_batches(seeded, moved, batch_size=2, shuffle=False) for b in g
            for i in b["id"].tolist()]  # fmt: skip
    assert [i for b in full[0] for i in b["id"].tolist()] + rest == _ids(seeded, shuffle=False)
    for other in (mixed(probabilities=[0.3, 0.7], seed=7), mixed(probabilities=[0.5, 0.5], seed=8)):
        with pytest.raises(ValueError, match=r"saved for other data.*pipeline"):
            ft.make_batches(other, moved, batch_size=2, shuffle=False)
    # A position saved before the interleave stage was described resumes as before.
    pos = json.loads(full[0].position)
    pos["about"] = P.without_interleave(pos["about"])
    pos["fp"] = P.digest(pos["about"])
    old = state.replace(data=state.data.replace(cursor=1, position=json.dumps(pos)))
    assert len(list(ft.make_batches(seeded, old, batch_size=2, shuffle=False))) == len(full) - 1


def test_concatenate_map_and_filter_keep_every_row_once(tmp_path):
    import datasets

    a, b = _jsonl(tmp_path, "a", [4, 4]), _jsonl(tmp_path, "b", [1, 6], base=1000)
    both = datasets.concatenate_datasets([a, b])
    assert _ids(both, shuffle=False) == [r["id"] for r in both]
    piped = both.map(lambda r: {"id": r["id"] + 1}).filter(lambda r: r["id"] % 2 == 0)
    assert sorted(_ids(piped)) == sorted(r["id"] for r in piped)
    assert "pipeline" not in ft.data.stream(piped).describe(True)  # fingerprints unchanged


# --- 2. a datasets shuffle buffer


def test_hf_shuffle_without_a_seed_raises_pointing_to_make_batches_shuffle(tmp_path):
    ds = _jsonl(tmp_path, "a", [6, 6]).shuffle(buffer_size=4)
    with pytest.raises(ValueError, match=r"shuffle\(buffer_size=4\) without a seed.*shuffle=True"):
        ft.make_batches(ds, batch_size=2, shuffle=False)


def test_a_seeded_hf_shuffle_reads_every_row_once_and_its_seed_is_in_the_fingerprint(tmp_path):
    ds = _jsonl(tmp_path, "a", [6, 6])
    assert sorted(_ids(ds.shuffle(seed=3, buffer_size=4))) == sorted(r["id"] for r in ds)
    about = ft.data.stream(ds.shuffle(seed=3, buffer_size=4)).describe(False)
    assert about["pipeline"] == [{"shuffle_buffer": 4, "seed": 3}]

    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)
    g = next(iter(ft.make_batches(ds.shuffle(seed=3, buffer_size=4), state, batch_size=2)))
    moved = state.replace(data=state.data.replace(cursor=1, position=g.position))
    with pytest.raises(ValueError, match=r"saved for other data.*pipeline"):
        ft.make_batches(ds.shuffle(seed=4, buffer_size=4), moved, batch_size=2)


# --- 3, 4. length grouping arguments

ROWS = [{"input_ids": [i] * (1 + i % 5), "id": i} for i in range(20)]


@pytest.mark.parametrize("n", [12, 17, 25])
def test_lengths_of_another_length_than_the_data_raise_naming_lengths(n):
    with pytest.raises(ValueError, match=rf"lengths must give one length per row.*20 rows.*{n}"):
        ft.make_batches(ROWS, batch_size=4, group_by_length=True, lengths=[3] * n)


def test_lengths_without_group_by_length_change_nothing():
    """They only feed grouping: passed unconditionally with grouping behind a flag is fine."""
    plain = [b for (b,) in ft.make_batches(ROWS, batch_size=4, seed=3)]
    given = [b for (b,) in ft.make_batches(ROWS, batch_size=4, seed=3, lengths=[1] * 20)]
    assert len(plain) == len(given) and all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(plain, given, strict=True)
    )


def test_group_by_length_with_shuffle_false_raises():
    with pytest.raises(ValueError, match=r"group_by_length=True with shuffle=False"):
        ft.make_batches(ROWS, batch_size=4, group_by_length=True, shuffle=False)


@pytest.mark.parametrize(
    ("kw", "named"),
    [({"group_by_length": True}, "group_by_length=True"), ({"lengths": [1] * 20}, "lengths=")],
)
def test_length_grouping_on_a_stream_raises(kw, named):
    src = ft.data.stream(ft.data.IterableRows(ROWS), shuffle_buffer=4)
    with pytest.raises(ValueError, match=rf"{named} on a stream"):
        ft.make_batches(src, batch_size=4, **kw)


# --- 5. concat packing of labelled rows


def test_concat_packing_of_rows_with_labels_raises_and_examples_keeps_them():
    rows = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
        {"input_ids": [5, 6], "labels": [-100, 6]},
    ]
    src = ft.data.stream(ft.data.IterableRows(rows))
    with pytest.raises(ValueError, match=r'pack\(mode="concat"\) on rows with labels.*"examples"'):
        list(ft.make_batches(ft.data.pack(src, block_size=6), batch_size=1, shuffle=False))
    packed = ft.data.pack(src, block_size=6, mode="examples")
    with pytest.raises(ValueError, match="packed examples"):  # a mask would join the examples
        next(iter(ft.make_batches(packed, batch_size=1, shuffle=False)))
    unmasked = ft.data.pad_collate(attention_mask=False)  # as ft.sft.packed_collate
    b = next(iter(ft.make_batches(packed, batch_size=1, shuffle=False, collate_fn=unmasked)))[0]
    assert b["labels"].tolist() == [[-100, -100, 3, 4, -100, 6]]


# --- 6. pad_collate


def test_pad_collate_refuses_a_field_that_row_0_lacks():
    collate = ft.data.pad_collate()
    with pytest.raises(KeyError, match=r"row 1 of the batch has field 'labels', which row 0"):
        collate([{"input_ids": [1]}, {"input_ids": [2], "labels": [2]}])
    with pytest.raises(KeyError, match=r"row 1 of the batch has no field 'labels'"):
        collate([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])


# --- 7. seeds


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64])
def test_seeds_outside_0_to_2_63_raise_upfront(seed):
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=seed)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        ft.make_batches(ROWS, batch_size=4, seed=seed)


def test_the_largest_seed_is_accepted_and_its_position_checks():
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=2**63 - 1)
    ft.data.check_position(next(iter(ft.make_batches(ROWS, state, batch_size=4))).position)


# --- 8. map positions


def test_a_map_position_at_cursor_0_past_row_0_is_refused():
    g = next(iter(ft.make_batches(ROWS, batch_size=4, seed=1)))
    forged = json.loads(g.position)
    forged["row"] = 8
    with pytest.raises(ValueError, match=r"cursor 0 with row 8"):
        ft.data.check_position(json.dumps(forged))


# --- 9. SpikeGuard.rollback(skip=<int>) on map-style data


def test_guard_int_skip_keeps_the_map_position_after_a_batch_size_change(tmp_path):
    rows = [{"idx": i, "input_ids": [1]} for i in range(40)]
    order = ft.data.epoch_order(40, 1, 0).tolist()

    def loss(model, batch):
        return model(batch["idx"].float()[:, None]).sum(), batch["idx"].shape[0]

    def fresh():
        return ft.guard.GuardedState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=1)

    def steps(state, bs, n):
        for micro in ft.make_batches(rows, state, batch_size=bs):
            grads, stats = ft.accumulate_grads(state, micro, loss)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.0)
            n -= 1
            if n == 0:
                return state

    ft.save_checkpoint(steps(fresh(), 8, 2), tmp_path)  # rows 0..15 of the epoch order
    for how in ("micro", "int"):
        state = steps(ft.load_checkpoint(ft.latest_checkpoint(tmp_path), fresh()), 4, 2)
        spiking = next(iter(ft.make_batches(rows, state, batch_size=4)))  # rows 24..27
        state = ft.guard.SpikeGuard().rollback(
            state, tmp_path, skip=spiking if how == "micro" else len(spiking)
        )
        assert state.data.position is not None
        first = next(iter(ft.make_batches(rows, state, batch_size=4)))[0]["idx"].tolist()
        assert [order.index(i) for i in first] == [28, 29, 30, 31], how


def test_pad_collate_pads_each_sides_sequences_as_their_kind_and_masks_them():
    """`chosen_labels` was padded with 0 (a label token, counted in the row's log-prob) and
    `chosen_input_ids` with 0 whatever pad_id, and no side got a mask."""
    from ftrain.data import pad_collate

    rows = [
        {"chosen_input_ids": [5, 6], "chosen_labels": [-100, 6], "rejected_input_ids": [5],
         "rejected_labels": [5], "decoder_input_ids": [2], "margin": 0.5},
        {"chosen_input_ids": [7], "chosen_labels": [7], "rejected_input_ids": [8, 9],
         "rejected_labels": [-100, 9], "decoder_input_ids": [2, 4], "margin": 0.25},
    ]  # fmt: skip
    b = pad_collate(pad_id=3)(rows)
    assert b["chosen_input_ids"].tolist() == [[5, 6], [7, 3]]
    assert b["chosen_labels"].tolist() == [[-100, 6], [7, -100]]
    assert b["rejected_labels"].tolist() == [[5, -100], [-100, 9]]
    assert b["chosen_attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert b["rejected_attention_mask"].tolist() == [[1, 0], [1, 1]]
    assert b["decoder_input_ids"].tolist() == [[2, 3], [2, 4]]  # padded, its mask its own
    assert "decoder_attention_mask" not in b and "attention_mask" not in b
    assert b["margin"].tolist() == [0.5, 0.25]
    left = pad_collate(pad_id=3, padding_side="left")(rows)
    assert left["chosen_attention_mask"].tolist() == [[1, 1], [0, 1]]
    bare = pad_collate(pad_id=3, attention_mask=False)(rows)
    assert not any(k.endswith("attention_mask") for k in bare)
    own = [{**r, "chosen_attention_mask": [1] * len(r["chosen_input_ids"])} for r in rows]
    assert pad_collate(pad_id=3)(own)["chosen_attention_mask"].tolist() == [[1, 1], [1, 0]]
