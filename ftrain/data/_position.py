"""Data positions: the JSON that `state.data.position` holds, checked before anything uses it.

A position says where an epoch stands and what it indexes. Two kinds, both version 2:

- `{"kind": "stream", "epoch", "seed", "cursor", "rows", "shuffle", "fp", "about", "src"}`:
  `src` is the source's own position (shards: `{"shard", "row", "first"}`, `first` a digest of
  the first row of the shard it stands in, absent in positions saved before it was kept and at
  the epoch's end; packing: `{"src", "tok"}`; mixing: `{"counts", "src"}`), `fp` a digest of
  what the source indexes (files, sizes, shard count, shuffle buffer, packing and mixing
  settings) and `about` a short readable copy of it, so that a resume over other data can say
  what changed.
- `{"kind": "map", "epoch", "seed", "n", "shuffle", "group", "lengths", "rows", "cursor",
  "row", "content"}`: micro-batch `cursor` began at `row` of the epoch order, and every
  micro-batch since holds `rows` rows (the global batch). A resume with another global batch
  continues from the row it reached; `group`/`lengths` pin a length-grouped order; `content`
  is a digest of a few rows (`_content.py`; null for data not read for it, absent in
  positions saved before it was kept), so that a resume over other rows of the same count
  raises.

`check_position` is the structural check a checkpoint load runs; whether a position fits the
data is checked by `make_batches` (`ValueError` naming `state.data.position`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from types import MappingProxyType
from typing import Any

__all__ = ["NOT_ITS_DATA", "check_position", "read_position", "resumable", "unchecked"]

VERSION = 2
_MAX_CHARS = 1 << 20  # a position is a few hundred bytes; a mix of many sources a few KB
_MAX_DEPTH = 64  # stages nest a few levels deep (pack(mix([pack(stream), ...])))
_MAX_INT = 2**63  # offsets and counts: what islice, torch and numpy take
_RESERVED = frozenset({"shard", "row", "tok", "counts"})  # keys of the built-in sources'
_COMMON = frozenset({"version", "kind", "epoch", "seed", "cursor", "rows"})
# Appended where the data differ from what state.data.position describes: the usual cause is
# evaluation data passed with the training state, which the advice to restart the epoch (the
# training cursor) does not fix.
NOT_ITS_DATA = (
    ". If this is not the data the state trains on (evaluation data given the training state: "
    "make_batches(val, state, ...)), the state's position and cursor are not its, and moving "
    "them would lose the training position: call make_batches(val, batch_size=..., "
    "shuffle=False, strategy=state.strategy) without the state, which reads it from its start"
)
_KEYS = MappingProxyType(
    {
        "stream": _COMMON | {"shuffle", "fp", "about", "src"},
        "map": _COMMON | {"n", "shuffle", "group", "lengths", "row"},
    }
)
# Keys a position may lack: those that older ftrain versions did not write yet.
_OPTIONAL = MappingProxyType({"stream": frozenset[str](), "map": frozenset({"content"})})


def check_position(text: str) -> None:
    """Check that `text` is a well-formed data position (`state.data.position`), without data.

    `load_checkpoint` runs it on the saved position; `make_batches` then checks that the
    position fits the data it is given. A position saved by an older ftrain (version 1) passes
    here so that its checkpoint loads; `make_batches` refuses to resume from it.

    Raises:
        TypeError: if `text` is not a string.
        ValueError: naming what is malformed: not JSON, nested deeper than 64 levels, an
            unknown version or kind, a missing or extra key, a count or offset that is not an
            int in [0, 2**63), a non-finite number, ...

    Example:
        >>> import ftrain as ft
        >>> ft.data.check_position('{"version": 2, "kind": "tape"}')
        Traceback (most recent call last):
        ...
        ValueError: malformed data position: kind must be 'stream' or 'map', got 'tape'
    """
    read_position(text)


def unchecked(position: str) -> str:
    """Return `position` without the digests of the rows it was saved over, so that a resume
    goes on over rows that changed on purpose (another tokenizer or preprocessing), unchecked.

    A stream's position keeps a digest of the first row of each shard it stands in, and a
    map-style position a digest of a few rows (`"content"`); `make_batches` refuses to resume
    over other rows. This drops them; the files, shards, row count and settings are still
    checked: `state.replace(data=state.data.replace(position=ft.data.unchecked(
    state.data.position)))`.

    Raises:
        TypeError: if `position` is not a string.
        ValueError: for a malformed position (as `check_position`).

    Example:
        >>> import ftrain as ft
        >>> rows = ft.data.IterableRows([{"x": i} for i in range(4)])
        >>> group = next(iter(ft.make_batches(rows, batch_size=1, shuffle=False)))
        >>> '"first"' in group.position, '"first"' in ft.data.unchecked(group.position)
        (True, False)
    """
    pos = read_position(position)
    if pos["version"] == 1:
        return position  # nothing of the rows kept (make_batches refuses it anyway)
    if pos["kind"] == "map":
        pos["content"] = None
    else:
        pos["src"] = _without_first(pos["src"])
    return json.dumps(pos, separators=(",", ":"))


def _without_first(p: Any) -> Any:
    """A built-in source position without its shards' first-row digests."""
    if not isinstance(p, dict):
        return p
    keys = set(p)
    if keys == {"shard", "row", "first"}:
        return {"shard": p["shard"], "row": p["row"]}
    if keys == {"src", "tok"}:
        return {"src": _without_first(p["src"]), "tok": p["tok"]}
    if keys == {"counts", "src"}:
        return {"counts": p["counts"], "src": [_without_first(q) for q in p["src"]]}
    return p


def read_position(text: str) -> dict[str, Any]:
    """The parsed position, checked as `check_position` documents."""
    if not isinstance(text, str):
        raise TypeError(f"a data position is a JSON string, got {type(text).__name__}")
    if len(text) > _MAX_CHARS:
        raise ValueError(f"malformed data position: {len(text)} characters (at most {_MAX_CHARS})")
    try:
        pos = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as e:  # not JSON, NaN, 1e999, a 5000-digit int, [[[...
        raise ValueError(f"malformed data position: not JSON ({_cut(e)})") from None
    _need(_depth(pos) <= _MAX_DEPTH, f"nested deeper than {_MAX_DEPTH} levels")
    _need(isinstance(pos, dict), "not a JSON object")
    if pos.get("version") == 1 and type(pos.get("version")) is int:
        return pos  # an older ftrain's; make_batches says why it cannot resume from it
    _need(pos.get("version") == VERSION and type(pos["version"]) is int, "unknown version")
    kind = pos.get("kind")  # a list or dict here would be unhashable for the lookup
    _need(
        isinstance(kind, str) and kind in _KEYS, f"kind must be 'stream' or 'map', got {_cut(kind)}"
    )
    keys = _KEYS[pos["kind"]]
    _need(not keys - pos.keys(), "keys missing: " + ", ".join(sorted(keys - pos.keys())))
    extra = pos.keys() - keys - _OPTIONAL[pos["kind"]]
    _need(not extra, "unknown keys: " + ", ".join(sorted(extra)))
    for name in ("epoch", "seed", "cursor"):
        _count(pos[name], name)
    _count(pos["rows"], "rows", low=1)
    _need(type(pos["shuffle"]) is bool, "shuffle must be true or false")
    if pos["kind"] == "stream":
        _need(is_hex(pos["fp"]), "fp must be a hex digest")
        _need(isinstance(pos["about"], dict), "about must be a JSON object")
        check_source_position(pos["src"])
    else:
        _check_map(pos)
    return pos


def resumable(raw: str, kind: str) -> dict[str, Any]:
    """The position `state.data.position` holds, checked, of `kind` ("stream" or "map")."""
    try:
        pos = read_position(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"state.data.position: {e}") from None
    if pos["version"] == 1:
        raise ValueError(
            "state.data.position was saved by an older ftrain (position version 1), which kept "
            "nothing of the data it indexes, so an exact resume cannot be checked: restart the "
            "epoch, state.replace(data=state.data.replace(cursor=0, position=None))"
        )
    if pos["kind"] != kind:
        data = {"map": "map-style data", "stream": "a stream"}
        raise ValueError(
            f"state.data.position is a position in {data[pos['kind']]}, but the data is "
            f"{data[kind]}: pass the data the state was trained on" + NOT_ITS_DATA
        )
    return pos


def _check_map(pos: dict[str, Any]) -> None:
    _count(pos["n"], "n", low=1)
    _count(pos["row"], "row")
    _need(pos["row"] <= pos["n"], f"row {pos['row']} is past the epoch's {pos['n']} rows")
    # Every position make_batches makes starts at (cursor 0, row 0), and a resume with another
    # global batch moves both forward together (or neither, resuming where it was saved).
    _need(
        (pos["cursor"] == 0) == (pos["row"] == 0),
        f"cursor {pos['cursor']} with row {pos['row']}: micro-batch 0 starts at row 0, and "
        "only it does",
    )
    _need(pos["group"] is None or (type(pos["group"]) is int and pos["group"] >= 1), "bad group")
    _need((pos["group"] is None) == (pos["lengths"] is None), "group and lengths go together")
    _need(pos["lengths"] is None or is_hex(pos["lengths"]), "lengths must be a hex digest")
    content = pos.get("content")
    _need(content is None or is_hex(content), "content must be a hex digest or null")


def check_source_position(p: Any, depth: int = 0) -> None:
    """The built-in sources' positions: `{"shard", "row"[, "first"]}`, `{"src", "tok"}`
    (packing) and `{"counts", "src"}` (mixing), nested; other JSON is a custom `Source`'s own."""
    _need(depth <= _MAX_DEPTH, f"nested deeper than {_MAX_DEPTH} levels")
    if not isinstance(p, dict) or not (p.keys() & _RESERVED):
        return
    keys = set(p)
    if keys in ({"shard", "row"}, {"shard", "row", "first"}):
        _count(p["shard"], "shard")
        _count(p["row"], "row")
        # the digest of the shard's first row (positions saved before it was kept lack it)
        _need("first" not in p or is_hex(p["first"]), "first must be a hex digest")
    elif keys == {"src", "tok"}:
        _count(p["tok"], "tok")
        check_source_position(p["src"], depth + 1)
    elif keys == {"counts", "src"}:
        counts, inner = p["counts"], p["src"]
        ok = isinstance(counts, list) and isinstance(inner, list) and 1 <= len(counts) == len(inner)
        _need(ok, "a mix position needs equally long, non-empty counts and src lists")
        for c in counts:
            _count(c, "counts")
        for q in inner:
            check_source_position(q, depth + 1)
    else:
        _need(False, f"a source position has keys {sorted(keys)}")


def _count(value: Any, name: str, *, low: int = 0) -> None:
    _need(
        type(value) is int and low <= value < _MAX_INT,
        f"{name} must be an int in [{low}, 2**63), got {_cut(value)}",
    )


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"malformed data position: {what}")


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        if d > _MAX_DEPTH:
            break
        if isinstance(v, dict):
            todo += [(x, d + 1) for x in v.values()]
        elif isinstance(v, list):
            todo += [(x, d + 1) for x in v]
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text[:20]} is not finite")
    return x


def is_hex(value: Any) -> bool:
    return (
        isinstance(value, str)
        and 8 <= len(value) <= 64
        and all(c in "0123456789abcdef" for c in value)
    )


def _cut(value: Any) -> str:
    text = str(value) if isinstance(value, BaseException) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- fingerprints: what a stream position indexes, and what changed since


def digest(value: Any) -> str:
    """A short digest of a JSON value (key order does not matter)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_ABOUT_CHARS = 2048  # above this, file lists are kept as a count and a digest


def summary(description: dict[str, Any]) -> dict[str, Any]:
    """The readable part of a description kept in the position: whole, or with its file lists
    replaced by their count and digest when it would make the position long; then, if it is
    still long (a custom `Source.describe` listing its 40,000 files, a `from_generator` stream
    whose arguments list 20,000 records), every long list (of any values), large dict and long
    string too; and if even that is long, its stage alone with the whole one's size and
    digest. (The position's `fp` digests the whole description.)

    A position is parsed again at every micro-batch (as `load_checkpoint` will): a short
    summary keeps that to microseconds."""
    if len(json.dumps(description)) <= _ABOUT_CHARS:
        return description
    short = _short_files(description)
    if len(json.dumps(short)) <= _ABOUT_CHARS:
        return dict(short)
    short = _short_values(short)
    if len(json.dumps(short)) <= 8 * _ABOUT_CHARS:
        return dict(short)
    text = json.dumps(description, sort_keys=True)
    return {"stage": description.get("stage"), "chars": len(text), "digest": digest(description)}


_LONG = 16  # items of a list, keys of a dict (below the top level), kept in a long summary


def _short_values(d: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        return {"digest": digest(d)}
    if isinstance(d, str) and len(d) > 256:
        return {"chars": len(d), "digest": digest(d)}
    if isinstance(d, list) and len(d) > _LONG:  # file names, or records: {"path", "start"}
        return {"n": len(d), "digest": digest(d)}
    if isinstance(d, list):
        return [_short_values(x, depth + 1) for x in d]
    if isinstance(d, dict) and depth and len(d) > _LONG and "stage" not in d:
        return {"keys": len(d), "digest": digest(d)}
    if isinstance(d, dict):
        return {k: _short_values(v, depth + 1) for k, v in d.items()}
    return d


def _short_files(d: Any) -> Any:
    if isinstance(d, list):
        return [_short_files(x) for x in d]
    if not isinstance(d, dict):
        return d
    out = {k: _short_files(v) for k, v in d.items()}
    if isinstance(d.get("files"), list):
        out["files"] = {"n": len(d["files"]), "digest": digest(d["files"])}
    rows = d.get("shard_rows")
    if isinstance(rows, list) and len(rows) > 16:
        out["shard_rows"] = {"n": len(rows), "rows": sum(rows), "digest": digest(rows)}
    return out


def without_shard_rows(description: Any) -> Any:
    """`description` as ftrain described it before it counted in-memory shards' rows: what
    the positions saved then digest, so that their resume still checks (and continues)."""
    return _without(description, "shard_rows")


def without_generator_arguments(description: Any) -> Any:
    """`description` as ftrain described it before it recorded a `from_generator` stream's
    arguments (as `without_shard_rows`)."""
    return _without(description, "gen_kwargs")


def without_interleave(description: Any) -> Any:
    """`description` as ftrain described it before it recorded a `datasets` interleave stage
    (as `without_shard_rows`)."""
    if isinstance(description, list):
        return [without_interleave(x) for x in description]
    if not isinstance(description, dict):
        return description
    out = {k: without_interleave(v) for k, v in description.items()}
    stages = out.get("pipeline")
    if isinstance(stages, list):
        kept = [s for s in stages if not (isinstance(s, dict) and "interleave" in s)]
        if kept:
            out["pipeline"] = kept
        else:
            del out["pipeline"]
    return out


def _without(description: Any, key: str) -> Any:
    if isinstance(description, list):
        return [_without(x, key) for x in description]
    if not isinstance(description, dict):
        return description
    return {k: _without(v, key) for k, v in description.items() if k != key}


_LABELS = MappingProxyType(
    {
        "shards": "number of shards",
        "shard_rows": "rows per shard",
        "sources": "number of sources",
        "stage": "source",
        "type": "source type",
    }
)


def changes(old: Any, new: Any, where: str = "") -> list[str]:
    """What differs between a saved summary and the data's: "shuffle_buffer 8 -> 16", ...

    `old` comes from a file, so any JSON; `new` is a source's `describe()`.
    """
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [f"{where}the sources"]
    if old.get("stage") != new.get("stage"):
        return [f"{where}source {_cut(old.get('stage'))} -> {_cut(new.get('stage'))}"]
    out: list[str] = []
    for key in sorted(old.keys() | new.keys()):
        a: Any = old.get(key)
        b: Any = new.get(key)
        if a == b:
            continue
        if key == "of":  # the source a packing stage reads
            out += changes(a, b, where)
        elif key == "sources" and _same_length(a, b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                out += changes(x, y, f"{where}mixed source {i}: ")
        elif key == "sources":
            out.append(f"{where}number of sources {_length(a)} -> {_length(b)}")
        elif key == "files":
            out.append(where + _file_changes(a, b))
        else:
            out.append(f"{where}{_LABELS.get(key, key)} {_cut(a)} -> {_cut(b)}")
    return out


def _same_length(a: Any, b: Any) -> bool:
    return isinstance(a, list) and isinstance(b, list) and len(a) == len(b)


def _length(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else _cut(value)


def _file_changes(old: Any, new: Any) -> str:
    if not (_is_file_list(old) and _is_file_list(new)):
        n_old = _cut(old.get("n")) if isinstance(old, dict) else _length(old)
        n_new = _cut(new.get("n")) if isinstance(new, dict) else _length(new)
        return f"shard files changed: {n_old} -> {n_new} files (too many to name them all)"
    sizes_old, sizes_new = dict(map(tuple, old)), dict(map(tuple, new))
    parts = [f"{name} removed" for name in sizes_old if name not in sizes_new]
    parts += [f"{name} added" for name in sizes_new if name not in sizes_old]
    parts += [
        f"{name} {size} -> {sizes_new[name]} bytes"
        for name, size in sizes_old.items()
        if name in sizes_new and size != sizes_new[name]
    ]
    if not parts:
        parts = ["their order changed"]
    more = f", and {len(parts) - 6} more" if len(parts) > 6 else ""
    return "shard files changed: " + ", ".join(parts[:6]) + more


def _is_file_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) for f in value
    )


def data_files(data: Any) -> list[list[Any]] | None:
    """`[[name, bytes], ...]`: the files a `datasets.IterableDataset` reads, shard by shard
    (names relative to their common folder, so that moving the data is no change; bytes None
    when not a local file), or None when it reads none (in memory, a generator, torch).

    datasets keeps them in the generator arguments of the examples iterable at the root of
    its pipeline (`files`, or `base_files` for the text formats); not a public attribute, so
    anything unexpected gives None.
    """
    kwargs = _root_kwargs(data)
    return None if kwargs is None else _files(kwargs)


def data_rows(data: Any) -> list[int] | None:
    """The rows of each shard of a `datasets.IterableDataset` made from an in-memory
    `Dataset` (`Dataset.to_iterable_dataset`), or None for any other: such data has no files
    whose sizes would show that it grew or shrank, and a shard of another length puts a saved
    `(shard, row)` on other rows."""
    kwargs = _root_kwargs(data)
    shards = None if kwargs is None else kwargs.get("shards")
    if not (isinstance(shards, list) and shards):
        return None
    rows = [getattr(s, "num_rows", None) for s in shards]
    if not all(type(r) is int for r in rows):
        return None
    return [int(r) for r in rows if r is not None]


def generator_arguments(data: Any) -> dict[str, Any] | None:
    """The `gen_kwargs` of a `datasets.IterableDataset.from_generator` stream that are plain
    JSON (its shards are the items of its list arguments: file names, URLs), or None for any
    other data. Such data has no files whose names and sizes would show another source."""
    root = _root(data)
    owner = getattr(getattr(root, "generate_examples_fn", None), "__self__", None)
    kwargs = getattr(root, "kwargs", None)
    if type(owner).__name__ != "Generator" or not isinstance(kwargs, dict):
        return None
    plain = {str(k): v for k, v in kwargs.items() if _plain_json(v, 0)}
    return plain or None


def _plain_json(value: Any, depth: int) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if depth < 8 and isinstance(value, (list, tuple)):
        return all(_plain_json(v, depth + 1) for v in value)
    if depth < 8 and isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json(v, depth + 1) for k, v in value.items())
    return False


def _root_kwargs(data: Any) -> dict[str, Any] | None:
    kwargs = getattr(_root(data), "kwargs", None)
    return kwargs if isinstance(kwargs, dict) else None


def _root(data: Any) -> Any:
    """The examples iterable at the root of a `datasets` pipeline (the one with `kwargs`)."""
    ex = getattr(data, "_ex_iterable", None)
    for _ in range(_MAX_DEPTH):  # down the chain of map/filter/shuffle wrappers
        if isinstance(getattr(ex, "kwargs", None), dict):
            return ex
        ex = getattr(ex, "ex_iterable", None)
        if ex is None:
            return None
    return None


def _files(kwargs: dict[str, Any]) -> list[list[Any]] | None:
    files = kwargs.get("files", kwargs.get("base_files"))
    if not (isinstance(files, list) and files and all(isinstance(f, str) for f in files)):
        return None
    parts = [f.split("/") for f in files]
    common = 0  # folders all paths share
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    names = ["/".join(p[common:]) for p in parts]
    groups = kwargs.get("row_groups_list")  # parquet after reshard(): a shard per row group
    if isinstance(groups, list) and len(groups) == len(names):
        names = [n if g is None else f"{n}#{list(g)}" for n, g in zip(names, groups, strict=True)]
    return [[n, _size(f)] for n, f in zip(names, files, strict=True)]


def _size(path: str) -> int | None:
    if "://" in path:
        return None
    try:
        return os.stat(path).st_size
    except OSError:
        return None
