import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_docs_site_builds_strictly(tmp_path):
    """mkdocs build --strict: a broken link, a missing page or a docstring that mkdocstrings
    cannot parse (e.g. an Args entry for a parameter that does not exist) fails the build."""
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(site)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    api = (site / "api" / "index.html").read_text()
    for name in ["ftrain.make_batches", "ftrain.generate", "ftrain.optim.adamw",
                 "ftrain.extras.logging.MLflowSink", "ftrain.strategies.DDP"]:  # fmt: skip
        assert f'id="{name}"' in api, name
    assert (site / "img" / "curves.png").is_file()


def test_api_reference_covers_every_namespace():
    """docs/api.md renders each public namespace (`ft.<module>`) with mkdocstrings."""
    import inspect

    import ftrain as ft

    text = (ROOT / "docs" / "api.md").read_text()
    modules = [getattr(ft, n).__name__ for n in ft.__all__ if inspect.ismodule(getattr(ft, n))]
    assert "ftrain.extras.sft" in modules  # the lazy extras count too
    assert [m for m in modules if f"::: {m}\n" not in text] == []


def test_docs_links_resolve_in_the_readme():
    """README's links into docs/ name files that exist (the site checks links between pages)."""
    import re

    for target in re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text()):
        assert (ROOT / target).is_file(), target


def test_readme_has_setup_test_and_main_commands_on_first_screen():
    head = (ROOT / "README.md").read_text().splitlines()[:20]
    tags = {
        line.rsplit("#", 1)[1].split(":")[0].strip()
        for line in head
        if "#" in line and line[:1] != "#"
    }
    assert {"setup", "test", "main job"} <= tags


def test_migration_guide_names_every_training_argument():
    """docs/migrating_from_trainer.md maps every TrainingArguments field (in a table's first
    column), and the ftrain names it points to exist."""
    import dataclasses
    import re

    import transformers

    import ftrain as ft

    text = (ROOT / "docs" / "migrating_from_trainer.md").read_text()
    first_columns = " ".join(
        line.split("|")[1] for line in text.splitlines() if line.startswith("| `")
    )
    named = set(re.findall(r"`(\w+)`", first_columns))
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert fields - named == set()
    # The ftrain calls the guide relies on are real.
    for dotted in re.findall(r"`ft\.([\w.]+)\(", text):
        obj = ft
        for part in dotted.split("."):
            obj = getattr(obj, part)
        assert callable(obj), dotted
