import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_api_reference_is_up_to_date():
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build_api.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


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
