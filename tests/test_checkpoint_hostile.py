"""Hostile and corrupted checkpoints: every one fails with CheckpointError, nothing executes.

"Resealed" files have their checksums recomputed after the damage, as an attacker (or a tool
that rewrote the file) would do, so that the parsers behind the checksums are tested too.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftrain as ft
from helpers import opt_state_tensors, within

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
        lambda m: m["fields"].pop("data.cursor"),
        lambda m: m["fields"].update({"data.tokens_seen": [1, 2]}),
        lambda m: m["fields"].update({"data.tokens_seen": {"dtype": "int64", "value": 2**70}}),
        lambda m: m["fields"].update(step=True),
        lambda m: m["fields"].update({"early_stopping.best_metric": "low"}),
        lambda m: m["fields"].update({"early_stopping.patience_counter": None}),
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
    # found only after the tensors have been read and matched
    meta["fields"]["data.cursor"] = "seven"
    (path / "state.json").write_text(json.dumps(meta))
    reseal(path)
    template = _template()
    before = {n: p.clone() for n, p in template.params.items()}
    with pytest.raises(ft.CheckpointError, match=r"data\.cursor"):
        ft.load_checkpoint(path, template)
    assert all(torch.equal(before[n], p) for n, p in template.params.items())
    assert not template.consumed


# --- issue 20: the red team's defects ------------------------------------------------------------


def inspect_cli(path: Path, capsys, *, verify: bool = True) -> tuple[int, str]:
    """`python -m ftrain inspect` in-process: its exit code and what it printed."""
    from ftrain.extras.cli import inspect

    rc = inspect(path, verify=verify)
    return rc, capsys.readouterr().out


def assert_refused(path: Path, capsys, **kw) -> None:
    """load_checkpoint raises CheckpointError, inspect says "complete no" and exits 1."""
    with within(20):
        with pytest.raises(ft.CheckpointError):
            load(path, **kw)
        rc, out = inspect_cli(path, capsys, verify=kw.get("verify", True))
    assert rc == 1 and "complete    no" in out and "yes" not in out, out


def _edit_meta(path: Path, edit) -> None:
    meta = json.loads((path / "state.json").read_text())
    edit(meta)
    (path / "state.json").write_text(json.dumps(meta))
    reseal(path)


_OPTIMIZERS = {
    "adamw": lambda: ft.optim.adamw(),
    "from_torch_adamw": lambda: ft.optim.from_torch(torch.optim.AdamW),
    "from_torch_sgd": lambda: ft.optim.from_torch(torch.optim.SGD, momentum=0.9),
    "from_torchopt": lambda: ft.optim.from_torchopt(__import__("torchopt").adamw(lr=1.0)),
}


def _mlp_state(kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return ft.TrainState.create(model, _OPTIMIZERS[kind]())


@pytest.fixture(scope="module")
def per_optimizer(tmp_path_factory):
    """A checkpoint after one step with each kind of optimizer."""
    out = {}
    for kind in _OPTIMIZERS:
        state = _mlp_state(kind)
        grads = {n: torch.ones_like(p) for n, p in state.params.items()}
        state, _ = ft.clip_and_step(state, grads, lr=0.01)
        out[kind] = ft.save_checkpoint(state, tmp_path_factory.mktemp(kind))
    return out


def _damage_optimizer(path: Path, how: str) -> None:
    """Resize, retype or replace by a string the first optimizer tensor shaped like 0.weight."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "optimizer.safetensors")
    key = next(k for k, t in sorted(tensors.items()) if list(t.shape) == [8, 4])
    meta = json.loads((path / "state.json").read_text())
    if how == "string":
        del tensors[key]
        meta["optimizer"][key] = {"value": "not a tensor"}
    else:
        bad = torch.zeros(3, 4) if how == "resize" else torch.zeros(8, 4, dtype=torch.int64)
        tensors[key] = bad
        meta["optimizer"][key] = {"tensor": str(bad.dtype)[6:], "shape": list(bad.shape)}
    save_file(tensors, path / "optimizer.safetensors")
    (path / "state.json").write_text(json.dumps(meta))
    reseal(path)


@pytest.mark.parametrize("how", ["resize", "string", "dtype"])
@pytest.mark.parametrize("kind", list(_OPTIMIZERS))
def test_optimizer_state_that_does_not_fit_its_parameters_is_refused(
    per_optimizer, tmp_path, kind, how
):
    """Issue 20.2: a resized or retyped `exp_avg` (or a string in its place) would reach the
    fused kernels (out-of-bounds reads) or fail at the next step; it fails the load instead,
    for every kind of optimizer."""
    path = tmp_path / "ckpt"
    shutil.copytree(per_optimizer[kind], path)
    ft.load_checkpoint(path, _mlp_state(kind))  # the undamaged copy loads
    _damage_optimizer(path, how)
    template = _mlp_state(kind)
    with pytest.raises(ft.CheckpointError, match="optimizer"):
        ft.load_checkpoint(path, template)
    assert not template.consumed


def test_torch_optimizer_state_is_checked_against_live_state_where_there_is_one(
    per_optimizer, tmp_path
):
    """A template whose torch optimizer has already stepped is the exact reference."""
    path = tmp_path / "ckpt"
    shutil.copytree(per_optimizer["from_torch_adamw"], path)
    _damage_optimizer(path, "resize")
    state = _mlp_state("from_torch_adamw")
    state, _ = ft.clip_and_step(
        state, {n: torch.ones_like(p) for n, p in state.params.items()}, lr=0.01
    )
    with pytest.raises(ft.CheckpointError, match=r"state has float32\[8, 4\]"):
        ft.load_checkpoint(path, state)


def _outside_copy(path: Path, name: str, tmp_path: Path) -> Path:
    """A byte-identical copy of `name` outside the checkpoint folder (checksums still match)."""
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(path / name, outside)
    return outside


@pytest.mark.parametrize("name", ["model.safetensors", "state.json", "COMMITTED", "config.json"])
@pytest.mark.parametrize("kind", ["fifo", "symlink-outside", "directory"])
def test_only_regular_files_inside_the_folder_are_read(good, tmp_path, capsys, name, kind):
    """Issue 20.3: a FIFO would block forever, a symlink leads out of the folder: both fail
    fast with CheckpointError, in load_checkpoint and in inspect, with and without verify."""
    path = _copy(good, tmp_path)
    if name == "config.json":  # an unrecorded config.json is still parsed (export uses it)
        (path / name).write_text("{}")
    outside = _outside_copy(path, name, tmp_path)
    (path / name).unlink()
    if kind == "fifo":
        os.mkfifo(path / name)
    elif kind == "directory":
        (path / name).mkdir()
    else:
        (path / name).symlink_to(outside)
    for verify in (True, False):
        assert_refused(path, capsys, verify=verify)


def test_a_symlinked_sub_folder_of_a_sharded_checkpoint_is_refused(tmp_path):
    from ftrain.checkpoint._io import read_regular

    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_bytes(b"x")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model").symlink_to(tmp_path / "real")
    with pytest.raises(ft.CheckpointError, match=r"cannot read|symlink"):
        read_regular(tmp_path / "ckpt", "model/f")
    assert read_regular(tmp_path / "real", "f") == b"x"
    with pytest.raises(ft.CheckpointError, match="plain file name"):
        read_regular(tmp_path / "ckpt", "../real/f")


def test_a_symlink_to_dev_zero_fails_without_reading_it(tmp_path):
    """Issue 20.3, in a child process capped at 6 GB of address space (a regression must fail
    here, not exhaust the machine): a symlink to /dev/zero in place of each file."""
    script = Path(__file__).parent / "workers" / "hostile_child.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert results and all(r == "CheckpointError" for r in results.values()), results


_MALFORMED = {
    "step as a string": lambda m: m["fields"].update(step="12"),
    "negative dimension": lambda m: m["params"][0].__setitem__(2, [-1, 4]),
    "dimension not an int": lambda m: m["params"][0].__setitem__(2, ["8", 4]),
    "200k dimensions": lambda m: m["params"][0].__setitem__(2, [2**47] * 200_000),
    "files entry a list": lambda m: m["files"].update({"model.safetensors": [1, 2]}),
    "checksum a number": lambda m: m["files"].update({"extra.bin": {"bytes": 1, "sha256": 5}}),
    "size missing": lambda m: m["files"].update({"extra.bin": {"sha256": None}}),
    "tokens overflow": lambda m: m["fields"].update(
        {"data.tokens_seen": {"dtype": "int64", "value": 2**70}}
    ),
    "optimizer record differs from its file": lambda m: m["optimizer"]["mu/0.weight"].update(
        shape=[4, 8]
    ),
    "optimizer entry with two kinds": lambda m: m["optimizer"]["mu/0.weight"].update(value=1),
    "best_metric a string": lambda m: m["fields"].update({"early_stopping.best_metric": "low"}),
    "metrics holding a list": lambda m: m["metrics"].update(eval_loss=[1]),
    "world_size zero": lambda m: m.update(world_size=0),
    "dtype unknown": lambda m: m["params"][0].__setitem__(1, "float99"),
}


@pytest.mark.parametrize("edit", list(_MALFORMED))
def test_inspect_refuses_exactly_what_load_refuses(good, tmp_path, capsys, edit):
    """Issue 20.4: inspect runs load's own validator: a resealed state.json that load refuses
    is "complete no" (exit 1), never a traceback, never "checksums verified"; a 200k-dimension
    shape is refused at once rather than multiplied out."""
    path = _copy(good, tmp_path)
    _edit_meta(path, _MALFORMED[edit])
    assert_refused(path, capsys)


_SHARDED = {
    "record without a shape": {"tensor": "float32"},
    "shape of None": {"tensor": "float32", "shape": [None]},
    "shape a string": {"tensor": "float32", "shape": "8,4"},
    "unknown dtype": {"tensor": "complex1024", "shape": [2]},
    "record a list": ["float32", [2]],
}


@pytest.mark.parametrize("record", list(_SHARDED))
def test_a_forged_sharded_layout_with_a_malformed_tensor_record(good, tmp_path, capsys, record):
    """Issue 20.5: state.json claiming the sharded layout with a malformed tensor record is a
    CheckpointError (was KeyError / TypeError)."""
    path = _copy(good, tmp_path)

    def edit(m):
        m.update(sharded=True, tensors={"0.weight": _SHARDED[record]}, files={})

    _edit_meta(path, edit)
    assert_refused(path, capsys)


def test_permission_denied_is_a_checkpoint_error(good, tmp_path, capsys, monkeypatch):
    """Issue 20.8: a folder the process may not read (emulated: the tests run as root, which
    no permission stops) raises CheckpointError, in load and inspect."""
    path = _copy(good, tmp_path)
    inside = str(path) + os.sep
    denied = OSError(13, "Permission denied")

    def guard(real):
        def call(p, *args, **kwargs):
            name = os.fspath(p) if isinstance(p, (str, os.PathLike)) else ""
            if name.startswith(inside) or (real is os.open and name == str(path)):
                raise PermissionError(*denied.args)
            return real(p, *args, **kwargs)

        return call

    for fn in ("stat", "lstat", "open", "scandir", "listdir"):
        monkeypatch.setattr(os, fn, guard(getattr(os, fn)))
    assert_refused(path, capsys)


def test_export_compares_a_forged_config_on_the_meta_device_first(tmp_path, monkeypatch):
    """Issue 20.7: a forged (resealed) config.json claiming 65 GB of parameters is compared
    with the checkpoint on the meta device and refused before anything is allocated. (A guard
    turns any real allocation of a big embedding into a RuntimeError, so that a regression
    fails here instead of exhausting the machine.)"""
    from helpers import tiny_llama

    path = ft.save_checkpoint(ft.TrainState.create(tiny_llama(), ft.optim.adamw()), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = 2**30  # x hidden 16 x 4 bytes: a 64 GB embedding, and its head
    (path / "config.json").write_text(json.dumps(config))
    reseal(path)
    real_init = torch.nn.Embedding.__init__

    def guarded(self, num, dim, *args, **kwargs):
        meta = torch.get_default_device().type == "meta" or kwargs.get("device") == "meta"
        if num * dim > 2**28 and not meta:
            raise RuntimeError(f"allocating a {num} x {dim} embedding")
        real_init(self, num, dim, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Embedding, "__init__", guarded)
    with pytest.raises(ft.CheckpointError, match="1073741824"):
        ft.export_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
