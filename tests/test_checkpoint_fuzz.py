"""Fuzzing the checkpoint loader and `inspect` together (issue 20): a seeded mutation loop over
real small checkpoints — byte flips, truncations, JSON field mutations (types, shapes, sizes,
nesting), safetensors header edits, file-type swaps — each case run through `load_checkpoint`
and `python -m ftrain inspect` under a per-case alarm.

Accepted: a clean load or `CheckpointError` (`CheckpointMismatchError` included) from load, and
exit code 0 or 1 from inspect, with the two agreeing: inspect exits 1 exactly when load refuses
the files (a mismatch with the live state is load's alone). Anything else — another exception,
a hang, inspect calling complete what load refuses — fails the test with the case's recipe.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import ftrain as ft
from ftrain.checkpoint import CheckpointMismatchError
from ftrain.extras.cli import inspect
from helpers import within

# More cases, away from CI:
#   FTRAIN_FUZZ_CASES=5000 FTRAIN_FUZZ_FIRST=300 pytest tests/test_checkpoint_fuzz.py
CASES = int(os.environ.get("FTRAIN_FUZZ_CASES", "300"))
FIRST = int(os.environ.get("FTRAIN_FUZZ_FIRST", "0"))
FILES = ["model.safetensors", "optimizer.safetensors", "state.json", "COMMITTED", "config.json"]
KINDS = {
    "adamw": lambda: ft.optim.adamw(),
    "from_torch": lambda: ft.optim.from_torch(torch.optim.AdamW),
}


def template(kind: str) -> ft.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    # A config.json rides along (recorded and checksummed like an HF model's).
    model.config = SimpleNamespace(to_json_string=lambda: '{"model_type": "mlp", "width": 4}')
    return ft.TrainState.create(model, KINDS[kind]())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """{kind: checkpoint after two real steps}."""
    out = {}
    for kind in KINDS:
        state = template(kind)
        for _ in range(2):
            grads = {n: torch.randn_like(p) for n, p in state.params.items()}
            state, _ = ft.clip_and_step(state, grads, lr=0.01)
        root = tmp_path_factory.mktemp(kind)
        out[kind] = ft.save_checkpoint(state, root, metrics={"eval_loss": 0.25})
    return out


# --- mutations: each takes (rng, path, outside) and returns a short recipe -----------------------


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _plain(f: Path) -> bool:
    """A regular file, not a symlink: safe for the harness itself to read (a FIFO is not)."""
    return f.is_file() and not f.is_symlink()


def reseal(path: Path) -> None:
    """Recompute recorded sizes and digests where the JSON still allows it."""
    state, marker = path / "state.json", path / "COMMITTED"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        meta = json.loads(state.read_text()) if _plain(state) else None
        for name, entry in meta["files"].items():
            if isinstance(entry, dict) and _plain(path / name):
                entry["sha256"], entry["bytes"] = _sha(path / name), (path / name).stat().st_size
        state.write_text(json.dumps(meta))
    if _plain(state) and (_plain(marker) or not os.path.lexists(marker)):
        marker.write_text(json.dumps({"state.json": _sha(state)}))


def _bytes(rng: random.Random, path: Path) -> str:
    name = rng.choice(FILES)
    f = path / name
    if not _plain(f):
        return f"nothing ({name} not a plain file)"
    data = bytearray(f.read_bytes())
    op = rng.choice(["flip", "truncate", "append", "zero-run"])
    pos = rng.randrange(len(data) + 1)
    if op == "flip" and data:
        pos = min(pos, len(data) - 1)
        data[pos] ^= rng.randrange(1, 256)
    elif op == "truncate":
        del data[pos:]
    elif op == "append":
        data += rng.randbytes(rng.randrange(1, 64))
    else:
        data[pos : pos + 16] = bytes(min(16, len(data) - pos))
    f.write_bytes(bytes(data))
    return f"{op} {name}@{pos}"


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(14 if depth < 3 else 9)
    return [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.choice([0, 1, -1, 7, 2**31, 2**63, -(2**70), 10**400 // 10**390]),
        lambda: rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf")]),
        lambda: rng.choice(["", "x", "float32", "int64", "tuple:AdamState", "../etc", "a/b"]),
        lambda: [rng.randrange(-2, 2**48) for _ in range(rng.randrange(0, 6))],
        lambda: [2**47] * rng.choice([64, 65, 5000]),
        lambda: rng.choice([[], {}, [[]], {"": None}]),
        lambda: "[" * 50,
        lambda: [_random_json(rng, depth + 1) for _ in range(rng.randrange(1, 3))],
        lambda: {"tensor": "float32", "shape": _random_json(rng, depth + 1)},
        lambda: {"value": _random_json(rng, depth + 1)},
        lambda: {"dtype": rng.choice(["int64", "float32", "x"]), "value": _random_json(rng, 3)},
        lambda: {k: _random_json(rng, depth + 1) for k in ("node", "bytes", "sha256")[:2]},
    ][pick]()


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree[:8]):
            out += _paths(v, (*prefix, i))
    return out


def _json_field(rng: random.Random, path: Path) -> str:
    f = path / "state.json"
    try:
        meta = json.loads(f.read_text()) if _plain(f) else None
        if not isinstance(meta, dict):
            raise ValueError
    except (OSError, ValueError):
        return "nothing (state.json unreadable)"
    if rng.random() < 0.15:
        meta["sharded"] = True
        meta.setdefault("tensors", {})
        recipe = "claim sharded"
    else:
        recipe = ""
    target = rng.choice([p for p in _paths(meta) if p])
    parent = meta
    for k in target[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[target[-1]]
        recipe += f" delete {target}"
    else:
        parent[target[-1]] = _random_json(rng)
        recipe += f" set {target} = {str(parent[target[-1]])[:60]}"
    f.write_text(json.dumps(meta))
    return recipe.strip()


def _header(rng: random.Random, path: Path) -> str:
    name = rng.choice(["model.safetensors", "optimizer.safetensors"])
    f = path / name
    if not _plain(f):
        return f"nothing ({name} not a plain file)"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + n])
        key = rng.choice(sorted(k for k in header if k != "__metadata__"))
    except (ValueError, IndexError):
        return f"nothing ({name} header unreadable)"
    field = rng.choice(["dtype", "shape", "data_offsets"])
    if not isinstance(header[key], dict):  # an earlier mutation replaced the entry
        return f"nothing ({name}[{key}] not an entry)"
    shape = header[key].get("shape")
    grown = [shape[0] + 1] if isinstance(shape, list) and shape and type(shape[0]) is int else [2]
    header[key][field] = (
        _random_json(rng)
        if rng.random() < 0.5
        else {
            "dtype": rng.choice(["F16", "I64", "BOOL", "F8"]),
            "shape": grown,
            "data_offsets": [0, 2**40],
        }[field]
    )
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    return f"header {name}[{key}].{field}"


def _swap(rng: random.Random, path: Path, outside: Path) -> str:
    name = rng.choice([*FILES, "model", "optimizer"])
    f = path / name
    copy = outside / f"{rng.randrange(10**9)}-{name}"
    if _plain(f):
        shutil.copy(f, copy)  # identical bytes outside: checksums would still match
    if f.is_dir() and not f.is_symlink():
        shutil.rmtree(f)
    else:
        f.unlink(missing_ok=True)
    kind = rng.choice(["fifo", "dir", "symlink-out", "dev-null", "dangling", "loop", "deleted"])
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "dir":
        f.mkdir()
        (f / "x").write_text("{}")
    elif kind == "symlink-out":
        f.symlink_to(copy if copy.exists() else outside)
    elif kind == "dev-null":
        f.symlink_to("/dev/null")  # /dev/zero is tested under a memory cap, in a child process
    elif kind == "dangling":
        f.symlink_to(outside / "nowhere")
    elif kind == "loop":
        f.symlink_to(f)
    return f"{name} -> {kind}"


MUTATIONS = [_bytes, _bytes, _json_field, _json_field, _json_field, _header, _swap]


def run_case(seed: int, pristine: dict, work: Path) -> str:
    """One mutated checkpoint through load and inspect; returns load's outcome."""
    rng = random.Random(seed)
    kind = rng.choice(sorted(pristine))
    path, outside = work / f"case-{seed}" / "step-2", work / f"outside-{seed}"
    shutil.copytree(pristine[kind], path)
    outside.mkdir()
    recipe: list[str] = []
    resealed = rng.random() < 0.6
    with within(5, f"mutating case {seed}: {recipe}"):
        for _ in range(rng.randrange(1, 4)):
            mutate = rng.choice(MUTATIONS)
            recipe.append(mutate(rng, path, outside) if mutate is _swap else mutate(rng, path))
        if resealed:
            reseal(path)
    verify = rng.random() < 0.75
    what = f"case {seed} ({kind}, {'; '.join(recipe)}, resealed={resealed}, verify={verify})"
    with within(5, what):
        try:
            state = ft.load_checkpoint(path, template(kind), verify=verify)
            load = "loaded"
        except CheckpointMismatchError:
            load = "mismatch"
        except ft.CheckpointError:
            load = "refused"
        except Exception as e:
            raise AssertionError(f"{what}: load raised {type(e).__name__}: {e}") from e
        try:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                rc = inspect(path, verify=verify)
        except Exception as e:
            raise AssertionError(f"{what}: inspect raised {type(e).__name__}: {e}") from e
    text = out.getvalue()
    assert rc in (0, 1), f"{what}: inspect returned {rc!r}"
    assert (rc == 1) == (load == "refused"), f"{what}: load {load}, inspect said\n{text}"
    if load == "loaded" and not resealed and verify:
        # Past intact checksums the loaded state is the saved one.
        assert state.step == 2, what
    shutil.rmtree(work / f"case-{seed}", ignore_errors=True)
    return load


def test_fuzzed_checkpoints_fail_cleanly_in_load_and_inspect_alike(pristine, tmp_path):
    outcomes = {"loaded": 0, "mismatch": 0, "refused": 0}
    for seed in range(FIRST, FIRST + CASES):
        outcomes[run_case(seed, pristine, tmp_path)] += 1
    # The mutations reach every outcome: not all refused at the door, nor all harmless.
    assert outcomes["refused"] > CASES // 2 and outcomes["loaded"] > 0, outcomes
