"""Hostile and corrupted checkpoints: every one fails with CheckpointError, nothing executes.

"Resealed" files have their checksums recomputed after the damage, as an attacker (or a tool
that rewrote the file) would do, so that the parsers behind the checksums are tested too.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftrain as ft
from helpers import opt_state_tensors

FILES = ["model.safetensors", "optimizer.safetensors", "state.json", "COMMITTED"]


def _template():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    return ft.TrainState.create(model, ft.optim.adamw())


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A checkpoint after two real steps, and the state it holds."""
    state = _template()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(2):
        loss = ((state.model(x) - y) ** 2).sum()
        ps = list(state.params.values())
        grads = dict(zip(state.params, torch.autograd.grad(loss, ps), strict=True))
        state, _ = ft.clip_and_step(state, grads, lr=0.01)
    root = tmp_path_factory.mktemp("good")
    return ft.save_checkpoint(state, root, metrics={"eval_loss": 0.5}), state


def _copy(good, tmp_path) -> Path:
    dst = tmp_path / "ckpt" / good[0].name
    shutil.copytree(good[0], dst)
    return dst


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reseal(path: Path) -> None:
    """Recompute the recorded checksums so that damage gets past them."""
    try:
        meta = json.loads((path / "state.json").read_text())
        for name, entry in meta["files"].items():
            if (path / name).is_file():
                entry["sha256"], entry["bytes"] = _sha(path / name), (path / name).stat().st_size
        (path / "state.json").write_text(json.dumps(meta))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass
    if (path / "state.json").is_file():
        (path / "COMMITTED").write_text(json.dumps({"state.json": _sha(path / "state.json")}))


def load(path: Path, **kw):
    return ft.load_checkpoint(path, _template(), **kw)


def assert_equal_state(a, b):
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n]), n
    ta, tb = opt_state_tensors(a.opt_state), opt_state_tensors(b.opt_state)
    assert all(torch.equal(ta[p], tb[p]) for p in ta)
    assert a.step == b.step


def test_the_good_checkpoint_loads(good):
    assert_equal_state(load(good[0]), good[1])


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "state.json"])
@pytest.mark.parametrize("keep", [0, 7, 8, 40, 0.5])
def test_truncated_files(good, tmp_path, name, keep):
    path = _copy(good, tmp_path)
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(ft.CheckpointError):
        load(path)
    reseal(path)
    with pytest.raises(ft.CheckpointError):
        load(path)
    with pytest.raises(ft.CheckpointError):
        load(path, verify=False)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "state.json"])
def test_a_flipped_byte_anywhere_is_caught_by_the_checksum(good, tmp_path, name):
    path = _copy(good, tmp_path)
    size = (path / name).stat().st_size
    for pos in range(0, size, max(1, size // 23)):
        data = bytearray((path / name).read_bytes())
        data[pos] ^= 0x10
        (path / name).write_bytes(bytes(data))
        with pytest.raises(ft.CheckpointError, match=r"checksum|JSON|header|malformed"):
            load(path)
        data[pos] ^= 0x10
        (path / name).write_bytes(bytes(data))
    assert_equal_state(load(path), good[1])


def test_missing_pieces(good, tmp_path):
    for name in FILES:
        path = _copy(good, tmp_path / name)
        (path / name).unlink()
        with pytest.raises(ft.CheckpointError):
            load(path)
    with pytest.raises(ft.CheckpointError, match="not a checkpoint directory"):
        load(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ft.CheckpointError, match="not a checkpoint directory"):
        load(tmp_path / "file")


class _Payload:
    """Unpickling this would create a file: the side effect that must never happen."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return (Path.touch, (self.flag,))


@pytest.mark.parametrize("maker", ["pickle", "torch.save"])
def test_pickle_payload_under_a_safetensors_name_never_runs(good, tmp_path, maker):
    flag = tmp_path / "pwned"
    path = _copy(good, tmp_path)
    target = path / "model.safetensors"
    if maker == "pickle":
        target.write_bytes(pickle.dumps(_Payload(flag)))
    else:
        torch.save({"w": _Payload(flag)}, target)
    for verify in (True, False):
        with pytest.raises(ft.CheckpointError):
            load(path, verify=verify)
    reseal(path)
    for verify in (True, False):
        with pytest.raises(ft.CheckpointError):
            load(path, verify=verify)
    assert not flag.exists()


def _forge(entries: dict, body: bytes, header_len: int | None = None) -> bytes:
    header = json.dumps(entries).encode()
    n = len(header) if header_len is None else header_len
    return struct.pack("<Q", n) + header + body


@pytest.mark.parametrize(
    "blob",
    [
        _forge({}, b"", header_len=2**63),  # header length beyond any file
        _forge({}, b"", header_len=2**40),
        _forge(
            {"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}, b"0" * 16
        ),
        _forge({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 2**62]}}, b"0" * 16),
        _forge({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"0" * 16),
        _forge({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"0" * 16),
        _forge(
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            b"0" * 24,
        ),
        _forge({"w": {"dtype": "OBJECT", "shape": [1], "data_offsets": [0, 8]}}, b"0" * 8),
        _forge({"w": [1, 2, 3]}, b""),
        _forge([], b""),  # type: ignore[arg-type]
        b"\x05\x00\x00\x00\x00\x00\x00\x00[[[[[",
        b"\x00" * 3,
    ],
)
def test_forged_safetensors_headers(good, tmp_path, blob):
    path = _copy(good, tmp_path)
    (path / "optimizer.safetensors").write_bytes(blob)
    reseal(path)
    for verify in (True, False):
        with pytest.raises(ft.CheckpointError):
            load(path, verify=verify)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(format="something-else"),
        lambda m: m.update(format_version=99),
        lambda m: m["fields"].update(step="12"),
        lambda m: m["fields"].update(step=-1),
        lambda m: m["fields"].pop("cursor"),
        lambda m: m["fields"].update(tokens_seen=[1, 2]),
        lambda m: m["fields"].update(tokens_seen={"dtype": "int64", "value": 2**70}),
        lambda m: m["fields"].update(step=True),
        lambda m: m["fields"].update(best_metric="low"),
        lambda m: m["fields"].update(patience_counter=None),
        lambda m: m.update(params=[["x", "float32"]]),
        lambda m: m.update(world_size="1"),
        lambda m: m.update(optimizer={"": {"node": "tuple:AdamState"}}),
        lambda m: m["optimizer"].update(steps={"value": [1] * 10}),
        lambda m: m["files"].pop("model.safetensors"),
        lambda m: m.clear(),
    ],
)
def test_forged_metadata(good, tmp_path, edit):
    path = _copy(good, tmp_path)
    meta = json.loads((path / "state.json").read_text())
    edit(meta)
    (path / "state.json").write_text(json.dumps(meta))
    with pytest.raises(ft.CheckpointError):
        load(path)  # the marker's digest no longer matches
    reseal(path)
    with pytest.raises(ft.CheckpointError):
        load(path)


def test_deeply_nested_json_is_an_error_not_a_crash(good, tmp_path):
    path = _copy(good, tmp_path)
    (path / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    reseal(path)
    with pytest.raises(ft.CheckpointError):
        load(path)


# --- fuzzing ----------------------------------------------------------------------------------

_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("overwrite"), st.integers(0, 10**6), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("replace"), st.binary(max_size=256)),
    st.tuples(st.just("delete")),
)


def _mutate(data: bytes, op: tuple) -> bytes | None:
    kind, *args = op
    if kind == "delete":
        return None
    if kind == "replace":
        return args[0]
    pos = args[0] % (len(data) + 1)
    if kind == "flip":
        return (
            data[:pos] + bytes([data[pos] ^ args[1]]) + data[pos + 1 :] if pos < len(data) else data
        )
    if kind == "truncate":
        return data[:pos]
    if kind == "insert":
        return data[:pos] + args[1] + data[pos:]
    return data[:pos] + args[1] + data[pos + len(args[1]) :]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mutations=st.lists(st.tuples(st.sampled_from(FILES), _mutation), min_size=1, max_size=3),
    resealed=st.booleans(),
    verify=st.booleans(),
)
def test_fuzzed_checkpoints_fail_cleanly_or_load_intact(
    good, tmp_path_factory, mutations, resealed, verify
):
    path = _copy(good, tmp_path_factory.mktemp("fuzz"))
    for name, op in mutations:
        f = path / name
        data = _mutate(f.read_bytes() if f.exists() else b"", op)
        if data is None:
            f.unlink(missing_ok=True)
        else:
            f.write_bytes(data)
    if resealed:
        reseal(path)
    try:
        state = load(path, verify=verify)
    except ft.CheckpointError:
        return
    if not resealed and verify:
        # Past the checksums, the only way to load is to be unchanged where it matters.
        assert_equal_state(state, good[1])


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    section=st.sampled_from([None, "fields", "optimizer", "files", "metrics"]),
    key_index=st.integers(0, 100),
    value=_json,
)
def test_fuzzed_metadata_fails_cleanly(good, tmp_path_factory, section, key_index, value):
    """Well-formed JSON with wrong contents, resealed: a clean error or a consistent load."""
    path = _copy(good, tmp_path_factory.mktemp("meta"))
    meta = json.loads((path / "state.json").read_text())
    target = meta if section is None else meta[section]
    keys = sorted(target) or ["x"]
    target[keys[key_index % len(keys)]] = value
    (path / "state.json").write_text(json.dumps(meta))
    reseal(path)
    try:
        state = load(path)
    except ft.CheckpointError:
        return
    assert isinstance(state.step, int) and state.step >= 0
    assert_equal_state(state.replace(step=good[1].step), good[1])


def test_a_rejected_file_leaves_the_state_untouched(good, tmp_path):
    path = _copy(good, tmp_path)
    meta = json.loads((path / "state.json").read_text())
    meta["fields"]["cursor"] = "seven"  # found only after the tensors have been read and matched
    (path / "state.json").write_text(json.dumps(meta))
    reseal(path)
    template = _template()
    before = {n: p.clone() for n, p in template.params.items()}
    with pytest.raises(ft.CheckpointError, match="cursor"):
        ft.load_checkpoint(path, template)
    assert all(torch.equal(before[n], p) for n, p in template.params.items())
    assert not template.consumed
