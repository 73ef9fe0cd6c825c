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
