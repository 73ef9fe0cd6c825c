"""Data positions (`state.data.position`): the structural check a checkpoint load runs, and the
checks make_batches runs against the data. A forged position fails with `CheckpointError` at
load or `ValueError` naming `state.data.position` in make_batches: never a raw error from deep
inside, and never other data read silently."""

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftrain as ft


class Shards(torch.utils.data.IterableDataset):
    """A torch IterableDataset of 3 shards of 8 rows."""

    num_shards = 3

    def __init__(self, index=None):
        self.index = index

    def shard(self, num_shards, index):
        return Shards(index)

    def __iter__(self):
        for k in range(3) if self.index is None else [self.index]:
            yield from ({"idx": 8 * k + i, "input_ids": [k + 1] * (i % 3 + 1)} for i in range(8))


def _source():
    packed = ft.data.pack(Shards(), block_size=4)
    plain = ft.data.stream(
        ft.data.IterableRows([{"input_ids": [7] * 4, "labels": [7] * 4}] * 30), shuffle_buffer=3
    )
    return ft.data.mix([packed, plain], weights=[0.6, 0.4])


MAP = [{"input_ids": [i % 5 + 1] * (i % 3 + 1)} for i in range(30)]
KW = {"batch_size": 2}
STREAM_GROUPS = list(ft.make_batches(_source(), seed=0, **KW))
POSITIONS = [g.position for g in STREAM_GROUPS[:6]] + [
    next(iter(ft.make_batches(MAP, seed=0, **KW))).position
]


def _state(text, cursor):
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)
    return state.replace(data=state.data.replace(cursor=cursor, position=text))


def _cursor(text):
    pos = json.loads(text)
    cursor = pos.get("cursor") if isinstance(pos, dict) else None
    return cursor if type(cursor) is int and cursor >= 0 else 1


def _resume(text):
    """Both kinds of data, resumed from `text`: each yields, or raises a ValueError of ours."""
    for data in (_source(), MAP):
        try:
            for _ in ft.make_batches(data, _state(text, _cursor(text)), **KW):
                pass
        except ValueError as e:
            assert str(e).startswith(("state.data.position", "start=")) or "state.data" in str(e), e


def _with_src(text, src):
    pos = json.loads(text)
    pos["src"] = src
    return json.dumps(pos)


def test_real_positions_pass_and_resume():
    for text in POSITIONS:
        ft.data.check_position(text)
    cursor = 3
    resumed = list(ft.make_batches(_source(), _state(POSITIONS[cursor - 1], cursor), **KW))
    flat = [b["input_ids"].tolist() for g in resumed for b in g]
    assert flat == [b["input_ids"].tolist() for g in STREAM_GROUPS[cursor:] for b in g]


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "not JSON"),
        ("[" * 100_000 + "]" * 100_000, "not JSON|nested deeper"),
        ('{"a":' * 70 + "1" + "}" * 70, "nested deeper than 64"),
        ("[]", "not a JSON object"),
        ('{"version": 3}', "unknown version"),
        ('{"version": true}', "unknown version"),
        ('{"version": 2, "kind": "tape"}', "kind must be 'stream' or 'map'"),
        ('{"version": 2, "kind": "map"}', "keys missing: cursor, epoch"),
        ("9" * 5000, "not JSON"),
        ('{"x": NaN}', "not JSON"),
        ('{"x": 1e999}', "not JSON"),
        ("x" * (1 << 21), "characters"),
    ],
)
def test_malformed_text_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        ft.data.check_position(text)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("cursor", -1, r"cursor must be an int in \[0, 2\*\*63\), got -1"),
        ("cursor", 2**63, "cursor must be an int"),
        ("epoch", "0", "epoch must be an int"),
        ("rows", 0, r"rows must be an int in \[1, 2\*\*63\)"),
        ("shuffle", 1, "shuffle must be true or false"),
        ("fp", "nothex!!", "fp must be a hex digest"),
        ("about", [], "about must be a JSON object"),
        ("extra", 1, "unknown keys: extra"),
        ("src", {"shard": -3, "row": 0}, "shard must be an int"),
        ("src", {"shard": 0, "row": 0, "tok": 1}, "a source position has keys"),
        ("src", {"src": None, "tok": 1.5}, "tok must be an int"),
        ("src", {"counts": [-1, 2], "src": [None, None]}, "counts must be an int"),
        ("src", {"counts": [1], "src": [None, None]}, "equally long"),
    ],
)
def test_malformed_fields_are_named(key, value, match):
    pos = json.loads(POSITIONS[2])
    pos[key] = value
    with pytest.raises(ValueError, match=match):
        ft.data.check_position(json.dumps(pos))


def test_a_position_that_does_not_fit_the_data_raises_naming_it():
    """Well-formed positions that would read other data: refused before or while reading."""
    text = POSITIONS[2]
    src = json.loads(text)["src"]  # {"counts": [a, b], "src": [packed position, rows position]}
    packed, plain = src["src"]
    cases = [
        (src | {"counts": [40, 1]}, "do not follow the weights"),
        (src | {"counts": [src["counts"][0], 0]}, "counts .* and source positions disagree"),
        (src | {"src": [packed | {"tok": 99}, plain]}, "token offset 99"),
        (src | {"src": [packed | {"src": {"shard": 1, "row": 50}}, plain]}, "has no row 50"),
        (src | {"src": [packed | {"src": {"shard": 4, "row": 0}}, plain]}, "3 shard"),
        (src | {"src": [packed | {"src": {"shard": 3, "row": 2}}, plain]}, "past the last"),
        (src | {"src": [{"shard": 0, "row": 1}, plain]}, "positions {src, tok}"),
        (src | {"src": [packed, packed]}, "positions {shard, row}"),
        ({"shard": 0, "row": 0}, "a mix of 2 sources has positions"),
        ([1, 2], "a mix of 2 sources"),
    ]
    for forged, match in cases:
        forged_text = _with_src(text, forged)
        ft.data.check_position(forged_text)  # well-formed: only the data can refuse it
        with pytest.raises(ValueError, match=match) as e:
            list(ft.make_batches(_source(), _state(forged_text, 3), **KW))
        assert str(e.value).startswith("state.data.position does not fit this data: "), e.value
    with pytest.raises(ValueError, match="is a position in map-style data, but the data is a"):
        ft.make_batches(_source(), _state(POSITIONS[-1], 1), **KW)
    with pytest.raises(ValueError, match="is a position in a stream, but the data is map-style"):
        ft.make_batches(MAP, _state(POSITIONS[0], 1), **KW)


# --- fuzzing: any forged position fails cleanly

_KEYS = ["shard", "row", "src", "tok", "counts", "version", "kind", "cursor", "rows", "x"]
_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2, 2**63 - 1, 2**63, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner),
    max_leaves=6,
)


def _paths(obj, path=()):
    yield path
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        yield from _paths(v, (*path, k))


def _set(obj, path, value):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    node = obj
    for k in path[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return obj


_DELETE = object()


@st.composite
def forged(draw):
    text = draw(st.sampled_from(POSITIONS))
    obj = json.loads(text)
    how = draw(st.sampled_from(["src", "replace", "delete", "truncate", "nest", "literal"]))
    if how in ("src", "replace"):  # any node, or one inside the source's own position
        paths = [p for p in _paths(obj) if how == "replace" or p[:1] in (("src",), ("row",))]
        return json.dumps(_set(obj, draw(st.sampled_from(paths)), draw(_VALUES)))
    if how == "delete":
        return json.dumps(_set(obj, draw(st.sampled_from(list(_paths(obj))[1:])), _DELETE))
    if how == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if how == "nest":  # the source position wrapped in packing stages, deeper than any real one
        depth = draw(st.sampled_from([1, 3, 63, 64, 65, 3000]))
        head = json.dumps({k: v for k, v in obj.items() if k != "src"})[:-1]
        src = json.dumps(obj.get("src"))
        return head + ',"src":' + '{"src":' * depth + src + ',"tok":0}' * depth + "}"
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    at = draw(st.sampled_from(digits))
    literal = draw(st.sampled_from(["9" * 5000, "NaN", "1e999", "-1", "1.5", "true", '"1"']))
    return text[:at] + literal + text[at + 1 :]


@settings(max_examples=300, deadline=None)
@given(text=forged())
def test_property_a_forged_position_is_refused_or_fails_cleanly(text):
    try:
        ft.data.check_position(text)
    except ValueError:
        return  # load_checkpoint refuses it with a CheckpointError (below)
    _resume(text)


# --- the same through a resealed checkpoint


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _forge(good, dst, text):
    shutil.copytree(good, dst)
    meta = json.loads((dst / "state.json").read_text())
    meta["fields"]["data.position"] = text
    (dst / "state.json").write_text(json.dumps(meta))
    (dst / "COMMITTED").write_text(json.dumps({"state.json": _sha(dst / "state.json")}))


def _template():
    return ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd(), seed=0)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    state = _template()
    state = state.replace(data=state.data.replace(cursor=3, position=POSITIONS[2]))
    return ft.save_checkpoint(state, tmp_path_factory.mktemp("good"))


def test_a_resealed_checkpoint_with_a_forged_position_is_refused_at_load(good, tmp_path):
    loaded = ft.load_checkpoint(good, _template())
    assert loaded.data.position == POSITIONS[2]
    pos = json.loads(POSITIONS[2])
    for i, text in enumerate(
        [
            "[" * 100_000,
            json.dumps(pos | {"cursor": -1}),
            json.dumps(pos | {"src": {"counts": [-5, 9], "src": [None, None]}}),
            json.dumps(pos | {"rows": 10**400}),
            POSITIONS[2][:-7],
        ]
    ):
        _forge(good, tmp_path / str(i) / good.name, text)
        with pytest.raises(ft.CheckpointError, match=r"'data\.position': malformed data position"):
            ft.load_checkpoint(tmp_path / str(i) / good.name, _template())


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=forged())
def test_property_a_resealed_forged_position_fails_cleanly(good, text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / good.name
        _forge(good, path, text)
        try:
            state = ft.load_checkpoint(path, _template())
        except ft.CheckpointError as e:
            assert "data.position" in str(e)
            return
    assert state.data.position == text
    _resume(text)
