"""The pytest process itself: what tests/conftest.py sets up for every test."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

TASKS = Path("/proc/self/task")
NAMES = (
    "import os\n"
    "print(sorted(open(f'/proc/self/task/{t}/comm').read().strip()"
    " for t in os.listdir('/proc/self/task')))"
)


def _thread_names() -> list[str]:
    names = []
    for task in TASKS.iterdir():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            names.append((task / "comm").read_text().strip())
    return names


@pytest.mark.skipif(not TASKS.exists(), reason="thread names come from Linux's /proc")
def test_pyarrow_starts_no_jemalloc_background_thread_in_the_suite():
    """conftest.py turns jemalloc's background thread off (a fault in it kills pytest without a
    traceback), here and in the processes tests launch."""
    pytest.importorskip("pyarrow")
    import pyarrow  # noqa: F401

    assert "jemalloc_bg_thd" not in _thread_names()
    child = subprocess.run([sys.executable, "-c", f"import pyarrow\n{NAMES}"],
                           capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert "jemalloc_bg_thd" not in child.stdout
    # Without the setting pyarrow 26 starts the thread (checked when this was written; not
    # asserted, so that a pyarrow that stops doing so does not fail CI for nothing).
