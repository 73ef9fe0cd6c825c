"""Generate docs/api.md from the docstrings of ftrain's public names.

python docs/build_api.py          # rewrite docs/api.md
python docs/build_api.py --check  # exit 1 if docs/api.md is stale (run by the tests)
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import ftrain as ft

OUT = Path(__file__).with_name("api.md")
NAMESPACES = [
    "optim", "schedules", "strategies", "precision", "losses", "checkpoint", "sft", "lora", "data",
    "preference", "guard",
]  # fmt: skip


def _entry(qualname: str, obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        sig = ""
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
    doc = inspect.getdoc(obj) or "(no docstring)"
    text = f"### `{qualname}{sig if kind != 'value' else ''}`\n\n*{kind}*\n\n```text\n{doc}\n```\n"
    if inspect.isclass(obj):
        for name, member in vars(obj).items():
            if name.startswith("_") or not (
                callable(member) or isinstance(member, (classmethod, property))
            ):
                continue
            target = member.__func__ if isinstance(member, classmethod) else member
            target = target.fget if isinstance(target, property) else target
            mdoc = inspect.getdoc(target)
            if mdoc:
                text += f"\n- `{name}`: " + mdoc.split("\n\n")[0].replace("\n", " ") + "\n"
    return text


def render() -> str:
    parts = [
        "# ftrain API reference\n",
        "Generated from the docstrings by `python docs/build_api.py`; do not edit.\n",
        "## `ftrain`\n",
    ]
    for name in ft.__all__:
        obj = getattr(ft, name)
        if inspect.ismodule(obj):
            continue
        parts.append(_entry(f"ft.{name}", obj))
    for ns in NAMESPACES:
        module = getattr(ft, ns)
        parts.append(f"## `ftrain.{ns}`\n\n{inspect.getdoc(module) or ''}\n")
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if getattr(ft, name, None) is obj:  # documented above under its short name
                parts.append(f"- `ft.{ns}.{name}`: same as `ft.{name}`\n")
            else:
                parts.append(_entry(f"ft.{ns}.{name}", obj))
    return "\n".join(parts)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    text = render()
    if p.parse_args().check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python docs/build_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
