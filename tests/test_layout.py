"""The layout rules of DESIGN.md ("Layout": two rings, one way), checked on the source with `ast`.

1. The import graph of `ftrain/` has no cycle.
2. The core (every module under `ftrain/` outside `ftrain/extras/`, except the front doors
   `ftrain/__init__.py` and `ftrain/__main__.py`) never imports `ftrain.extras`.
3. No module imports another package's `_private` names: a `_name` belongs to the directory
   that holds it, and only modules of that same directory may import it. So
   `ftrain.strategies._base`, `from ftrain.strategies import _preempt` and
   `from ftrain.losses import _upcast` are private outside `ftrain/strategies/` and `ftrain/`
   respectively. Dunders (`__version__`) are public.
4. The extras use only the core's public names: rule 3 read from `ftrain/extras/`.

What counts as an import: every `import`/`from ... import` anywhere in a module (module level,
inside functions, under `if TYPE_CHECKING:`), and `importlib.import_module("...")` /
`__import__("...")` calls with a literal name. An import of `a.b.c` also runs the `__init__` of
`a.b` and `a.b.c`'s other parents, so the graph gets an edge to each parent package the importer
is not itself inside (never to the top-level `ftrain/__init__`, which every module would get).

TYPE_CHECKING-only imports count for rules 2-4 (a core signature that names an extra, or a
private class of another package, is a coupling all the same) but not for cycles: they never run.
Imports inside functions count for everything: deferring an import of an ftrain module hides a
cycle, it does not remove it. The front doors may reach the extras: `ftrain/__init__.py` through
its lazy table (`import_module` of a name from `_LAZY` on first attribute access, which the
checker does not see; `test_ftrain_lazy_names_resolve` checks the table) and its TYPE_CHECKING
imports, `ftrain/__main__.py` through the CLI.

The checker is tested on small synthetic packages first, so these tests cannot pass by
finding nothing.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "ftrain"


@dataclass(frozen=True)
class Import:
    """One imported name: `target` is the dotted path (`ftrain.losses._upcast`), `module` the
    module that loads (`ftrain.losses`)."""

    importer: str
    target: str
    module: str
    line: int
    type_checking: bool

    def __str__(self) -> str:
        where = " (TYPE_CHECKING)" if self.type_checking else ""
        return f"{self.importer}:{self.line} imports {self.target}{where}"


def find_modules(root: Path, package: str) -> dict[str, Path]:
    """Map each module of `package` under `root` to its file (a package to its __init__.py)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def is_package(name: str, modules: dict[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def directory_of(name: str, modules: dict[str, Path]) -> str:
    """The package whose directory holds `name` (a package's __init__ is in its own)."""
    return name if is_package(name, modules) else name.rpartition(".")[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    """Gather (module, name or None, line, TYPE_CHECKING?) for every import in one module."""

    def __init__(self, package: str) -> None:
        self.package = package  # what `from . import` means here
        self.found: list[tuple[str, str | None, int, bool]] = []
        self.type_checking = False

    def _add(self, module: str, attr: str | None, line: int) -> None:
        self.found.append((module, attr, line, self.type_checking))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            return self.generic_visit(node)
        saved, self.type_checking = self.type_checking, True
        for child in node.body:
            self.visit(child)
        self.type_checking = saved
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, None, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: resolve against the importer's package
            anchor = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            self._add(base, None if alias.name == "*" else alias.name, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        first = node.args[0] if node.args else None
        name = first.value if isinstance(first, ast.Constant) else None
        if called in ("import_module", "__import__") and isinstance(name, str):
            self._add(name, None, node.lineno)
        self.generic_visit(node)


def find_imports(root: Path, package: str) -> tuple[dict[str, Path], list[Import]]:
    """Every import of a module of `package` into another of its modules."""
    modules = find_modules(root, package)
    imports = []
    for name, path in modules.items():
        collector = _Collector(directory_of(name, modules))
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        for module, attr, line, type_checking in collector.found:
            if module != package and not module.startswith(package + "."):
                continue  # third-party or standard library
            target = f"{module}.{attr}" if attr else module
            loaded = target if target in modules else module
            imports.append(Import(name, target, loaded, line, type_checking))
    return modules, imports


def import_graph(modules: dict[str, Path], imports: list[Import]) -> dict[str, set[str]]:
    """module -> modules its import runs: the one named and the parent packages' __init__ that
    the importer is not inside. TYPE_CHECKING-only imports never run and are left out."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports:
        if imp.type_checking:
            continue
        inside = {imp.importer.rsplit(".", k)[0] for k in range(imp.importer.count(".") + 1)}
        parts = imp.module.split(".")
        parents = {".".join(parts[:k]) for k in range(2, len(parts))} - inside
        graph[imp.importer] |= {m for m in parents | {imp.module} if m in modules}
    for name in graph:
        graph[name].discard(name)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (each one a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the ~100 modules
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module: a -> b -> ... -> a."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parent:
                    parent[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"{component} is not a cycle")


def cycles(root: Path, package: str) -> list[list[str]]:
    """One cycle path per strongly connected component of the import graph."""
    modules, imports = find_imports(root, package)
    graph = import_graph(modules, imports)
    return [cycle_path(graph, c) for c in strongly_connected(graph)]


def is_core(name: str, package: str = PACKAGE) -> bool:
    extras = f"{package}.extras"
    doors = {package, f"{package}.__main__"}
    return name not in doors and name != extras and not name.startswith(extras + ".")


def core_to_extras(root: Path, package: str) -> list[Import]:
    """Imports of `package.extras` (anything under it) by a core module."""
    extras = f"{package}.extras"
    _, imports = find_imports(root, package)
    return [
        imp
        for imp in imports
        if is_core(imp.importer, package)
        and (imp.target == extras or imp.target.startswith(extras + "."))
    ]


def owner_of_private(target: str, modules: dict[str, Path]) -> str | None:
    """The directory (as a package name) whose private name `target` reaches, or None if public.

    `ftrain.strategies._base` -> `ftrain.strategies`; `ftrain.losses._upcast` -> `ftrain`
    (`losses.py` sits in `ftrain/`)."""
    parts = target.split(".")
    for k in range(1, len(parts)):
        if parts[k].startswith("_") and not parts[k].endswith("__"):
            holder = ".".join(parts[:k])
            return directory_of(holder, modules)
    return None


def private_imports(root: Path, package: str) -> list[Import]:
    """Imports of a `_private` name from outside the directory that holds it."""
    modules, imports = find_imports(root, package)
    found = []
    for imp in imports:
        here = directory_of(imp.importer, modules)
        owner = owner_of_private(imp.target, modules)
        if owner is not None and owner != here:
            found.append(imp)
    return found


def ftrain_cycles() -> list[list[str]]:
    """The cycles of ftrain's import graph."""
    modules, imports = find_imports(ROOT, PACKAGE)
    graph = import_graph(modules, imports)
    return [cycle_path(graph, c) for c in strongly_connected(graph)]


def _show_cycles(found: list[list[str]]) -> str:
    return "\n".join("  " + " -> ".join(c) for c in found)


# The checker on synthetic packages: each rule finds what it should, and nothing else.


def _write(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


CLEAN = {
    "pkg/__init__.py": """
        import importlib
        from pkg import core as core
        def __getattr__(name):
            return importlib.import_module("pkg.extras.tool")
    """,
    "pkg/core.py": "from pkg.sub import helper as helper\n",
    "pkg/sub/__init__.py": "from pkg.sub._impl import helper as helper\n",
    "pkg/sub/_impl.py": "import torch\ndef helper(): ...\n",
    "pkg/sub/_other.py": "from pkg.sub import _impl\n",
    "pkg/extras/__init__.py": "",
    "pkg/extras/tool.py": "from pkg.sub import helper\nfrom pkg.core import helper as h\n",
}


def test_checker_finds_nothing_in_a_clean_package(tmp_path):
    root = _write(tmp_path, CLEAN)
    _, imports = find_imports(root, "pkg")
    assert len(imports) >= 6  # it did read them
    assert cycles(root, "pkg") == []
    assert core_to_extras(root, "pkg") == []
    assert private_imports(root, "pkg") == []


def test_checker_reports_a_cycle_with_its_path(tmp_path):
    root = _write(
        tmp_path,
        {
            **CLEAN,
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": "def f():\n    from pkg.c import x\n",  # one in a function counts
            "pkg/c.py": "from pkg import a\nx = 1\n",
        },
    )
    assert cycles(root, "pkg") == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_checker_reports_a_cycle_through_a_parent_package(tmp_path):
    # pkg.sub._impl -> pkg.core runs pkg.core; pkg.core -> pkg.sub runs pkg/sub/__init__.
    root = _write(tmp_path, {**CLEAN, "pkg/sub/_impl.py": "from pkg.core import x\n"})
    assert cycles(root, "pkg") == [["pkg.core", "pkg.sub", "pkg.sub._impl", "pkg.core"]]


def test_checker_leaves_type_checking_imports_out_of_cycles(tmp_path):
    root = _write(
        tmp_path,
        {
            **CLEAN,
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        },
    )
    assert cycles(root, "pkg") == []


def test_checker_reports_core_to_extras_imports(tmp_path):
    files = {
        **CLEAN,
        "pkg/core.py": "def f():\n    from pkg.extras.tool import x\n",
        "pkg/sub/_impl.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg import extras\n",
        "pkg/sub/_other.py": "import importlib\nimportlib.import_module('pkg.extras.tool')\n",
    }
    found = {str(imp) for imp in core_to_extras(_write(tmp_path, files), "pkg")}
    assert found == {
        "pkg.core:2 imports pkg.extras.tool.x",
        "pkg.sub._impl:3 imports pkg.extras (TYPE_CHECKING)",
        "pkg.sub._other:2 imports pkg.extras.tool",
    }


def test_checker_reports_private_imports_across_packages(tmp_path):
    files = {
        **CLEAN,
        "pkg/core.py": "from pkg.sub._impl import helper\nfrom pkg.sub import _impl\n",
        "pkg/extras/tool.py": "import pkg.sub._impl\nfrom pkg.core import _hidden, __version__\n",
        "pkg/other.py": "from pkg.core import _hidden\nfrom . import _x\n",  # same directory
    }
    found = {str(imp) for imp in private_imports(_write(tmp_path, files), "pkg")}
    assert found == {
        "pkg.core:1 imports pkg.sub._impl.helper",
        "pkg.core:2 imports pkg.sub._impl",
        "pkg.extras.tool:1 imports pkg.sub._impl",
        "pkg.extras.tool:2 imports pkg.core._hidden",
    }


# The rules on ftrain itself.


def _show(found: list[Import]) -> str:
    return "\n".join(f"  {imp}" for imp in found)


def test_no_import_cycle():
    found = ftrain_cycles()
    assert not found, "import cycles (break each one; see DESIGN.md, Layout):\n" + _show_cycles(
        found
    )


def test_the_core_never_imports_the_extras():
    found = core_to_extras(ROOT, PACKAGE)
    assert not found, "the core imports the extras (only ftrain/__init__'s lazy table may):\n" + (
        _show(found)
    )


def test_no_module_imports_another_packages_private_names():
    found = private_imports(ROOT, PACKAGE)
    assert not found, (
        "private names imported from another package (import the package's public name, or "
        "make the name public with a docstring and add it to __all__):\n" + _show(found)
    )


def test_the_extras_use_only_public_names_of_the_core():
    # Rule 4 is rule 3 read from the extras; reported on its own for a clearer failure.
    found = [
        i for i in private_imports(ROOT, PACKAGE) if not is_core(i.importer) and is_core(i.target)
    ]
    assert not found, "the extras use private names of the core:\n" + _show(found)


# What `import ftrain` must not load on top of `import torch` (issue 25, item 6): the extras,
# the HF stack, and the heavy parts of torch that only some paths need (compile, DCP).
HEAVY = (
    "ftrain.extras",
    "transformers",
    "datasets",
    "peft",
    "accelerate",
    "matplotlib",
    "tensorboard",
    "sympy",
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.checkpoint",
)


def test_import_ftrain_loads_no_extra_and_nothing_heavy():
    # In a fresh interpreter; timing is bench/bench_import.py's job, this only checks names.
    probe = (
        "import sys, torch; before = set(sys.modules); import ftrain; "
        "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    loaded = out.stdout.split()
    assert "ftrain.checkpoint" in loaded  # the probe saw the core load
    heavy = [m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert not heavy, "import ftrain loaded: " + ", ".join(heavy)


def test_ftrain_lazy_names_resolve():
    # The lazy table names real modules and attributes (the rules above never import them).
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ftrain; [getattr(ftrain, n) for n in ftrain._LAZY]; print('ok')",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
