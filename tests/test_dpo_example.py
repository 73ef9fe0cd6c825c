"""examples/dpo.py, shortened: DPO after SFT widens the preferred answers' likelihood margin."""

import importlib.util
from pathlib import Path

import pytest


@pytest.mark.slow
def test_dpo_example_grows_the_margin(capsys):
    path = Path(__file__).parents[1] / "examples" / "dpo.py"
    spec = importlib.util.spec_from_file_location("dpo_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(
        [
            "--sft-steps",
            "10",
            "--dpo-steps",
            "6",
            "--rows",
            "96",
            "--hidden",
            "32",
            "--dpo-lr",
            "3e-3",
        ]
    )
    assert out["margin_dpo"] > out["margin_sft"] + 0.1
    assert "after DPO (6 steps, beta 0.1)" in capsys.readouterr().out
