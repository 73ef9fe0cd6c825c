"""Process-wide state lives in ftrain/process_state.py and nowhere else (DESIGN.md, Layout)."""

from __future__ import annotations

import ast
import dataclasses
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain import process_state

pytest_plugins = ["pytester"]

SRC = Path(ft.__file__).parent
HOME = "process_state.py"

# Known exceptions, as "path:name"; each one says who removes it. None today.
ALLOWED: frozenset[str] = frozenset()

# Calls that build a mutable container or a synchronisation object (by their last name).
MUTABLE_CALLS = {
    "dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque",
    "ChainMap", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "Lock", "RLock",
    "Event", "Condition", "Semaphore", "BoundedSemaphore", "Barrier", "local", "Queue",
}  # fmt: skip
CACHES = {"cache", "lru_cache", "cached_property"}
MUTABLE_DISPLAYS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Subscript):  # WeakKeyDictionary[K, V]()
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, MUTABLE_DISPLAYS):
        return True
    return isinstance(value, ast.Call) and _last_name(value) in MUTABLE_CALLS


def _targets(stmt: ast.Assign | ast.AnnAssign) -> list[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _module_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """The statements that run at import, including those under `if`/`try` at the top."""
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        stmt = todo.pop(0)
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try)):
            todo += [*stmt.body, *stmt.orelse, *getattr(stmt, "finalbody", [])]
            todo += [s for h in getattr(stmt, "handlers", []) for s in h.body]


def findings(path: Path, rel: str) -> list[tuple[str, str]]:
    """(`rel:line`, what) for each piece of module-level mutable state in one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    found = []
    for stmt in _module_level(tree):
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _mutable(stmt.value):
            found += [(f"{rel}:{stmt.lineno}", n) for n in _targets(stmt) if n != "__all__"]
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in stmt.decorator_list:
                if _last_name(d) in CACHES:
                    found.append((f"{rel}:{d.lineno}", stmt.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found += [(f"{rel}:{node.lineno}", f"global {n}") for n in node.names]
    return found


def test_the_checker_finds_each_kind_of_module_level_state(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import functools, threading, weakref, re\n"
        "A = {}\nB: list[int] = []\nC = weakref.WeakKeyDictionary()\nD = threading.Lock()\n"
        "try:\n    E = {1}\nexcept ImportError:\n    pass\n"
        "@functools.lru_cache(maxsize=4)\ndef f(): pass\n"
        "def g():\n    global A\n"
        "__all__ = ['f']\nK = (1, 2)\nR = re.compile('x')\nF = frozenset({1})\n"
        "def h():\n    local = {}\n    return local\n"
    )
    assert findings(source, "m.py") == [
        ("m.py:2", "A"), ("m.py:3", "B"), ("m.py:4", "C"), ("m.py:5", "D"),
        ("m.py:10", "f"), ("m.py:7", "E"), ("m.py:13", "global A"),
    ]  # fmt: skip


def test_no_module_but_process_state_keeps_module_level_mutable_state():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).as_posix()
        if path.name == HOME and path.parent == SRC:
            continue
        found += [(where, what) for where, what in findings(path, rel)]
    left = [(w, n) for w, n in found if f"{w.split(':')[0]}:{n}" not in ALLOWED]
    assert not left, (
        "module-level mutable state outside ftrain/process_state.py (move it there and list it "
        "in its docstring, or make a read-only table a tuple/frozenset/MappingProxyType):\n"
        + "\n".join(f"  {where}: {what}" for where, what in left)
    )
    stale = ALLOWED - {f"{w.split(':')[0]}:{n}" for w, n in found}
    assert not stale, f"allowed but gone (remove from ALLOWED): {sorted(stale)}"


def test_the_docstring_lists_every_item():
    doc = process_state.__doc__ or ""
    items = [f.name for f in dataclasses.fields(process_state.STATE)]
    for name in items:
        assert re.search(rf"^\s*`?{name}`?\s", doc, re.M), f"{name} is not in the docstring"
    listed = re.findall(r"^    `(\w+)`", doc, re.M)
    assert sorted(listed) == sorted(items), "the docstring lists items STATE does not have"


def test_snapshot_sees_a_background_save_until_it_is_reported(tmp_path):
    before = process_state.snapshot()
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.adamw())
    ft.save_checkpoint(state, tmp_path, blocking=False)
    assert process_state.snapshot() != before
    ft.wait_for_checkpoint()
    assert process_state.snapshot() == before


def test_snapshot_sees_an_active_preemption_handler():
    before = process_state.snapshot()
    with ft.strategies.on_preemption(signals=(signal.SIGUSR2,)):
        assert process_state.snapshot() != before
    assert process_state.snapshot() == before


@pytest.mark.parametrize("leak", ["threads", "preemption", "save", "group", "signal"])
def test_the_suite_fails_a_test_that_leaks(pytester, leak):
    """The autouse fixture in tests/conftest.py, run on a test that leaves something changed."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(
        test_leak=(
            "import signal, torch, ftrain as ft\n"
            "def test_leak(tmp_path):\n"
            f"    leak = {leak!r}\n"
            "    if leak == 'threads':\n"
            "        torch.set_num_threads(torch.get_num_threads() + 1)\n"
            "    if leak == 'preemption':\n"
            "        ft.strategies.on_preemption(signals=(signal.SIGUSR2,))\n"
            "    if leak == 'save':\n"
            "        s = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())\n"
            "        ft.save_checkpoint(s, tmp_path, blocking=False)\n"
            "    if leak == 'group':\n"
            "        import torch.distributed as dist\n"
            "        store = dist.HashStore()\n"
            "        dist.init_process_group('gloo', rank=0, world_size=1, store=store)\n"
            "    if leak == 'signal':\n"
            "        signal.signal(signal.SIGUSR2, lambda *a: None)\n"
            "def test_after():\n"
            "    pass\n"
        ),
    )
    threads = torch.get_num_threads()
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    assert torch.get_num_threads() == threads
    result.assert_outcomes(passed=2, errors=1)  # the leak is restored: the next test passes
    result.stdout.fnmatch_lines(["*left process-wide state changed*"])
