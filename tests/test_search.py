"""examples/search.py, shortened: the Optuna study prunes bad trials early and its best trial
beats the default configuration."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.mark.slow
def test_search_prunes_early_and_beats_the_default(capsys):
    path = Path(__file__).parent.parent / "examples" / "search.py"
    spec = importlib.util.spec_from_file_location("search_example", path)
    search = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(search)
    result = search.main(["--trials", "6", "--steps", "40", "--eval-every", "10"])
    assert result["complete"] >= 1 and result["pruned"] >= 1
    assert all(step < 40 for step in result["pruned_at"])  # stopped before the end
    assert result["best"] < result["default"]
    out = capsys.readouterr().out
    assert f"eval_loss={result['default']:.4f}" in out and f"eval_loss={result['best']:.4f}" in out
