"""The example programs and the CLI across their flags: every flag acts or raises naming it, and
a resume that could not continue the checkpoint's run raises instead of running another one."""

from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain.extras import cli
from helpers import load_example

EXAMPLES = Path(__file__).parent.parent / "examples"
TINY = ["--eval-iters", "1", "--final-eval-iters", "1", "--log-interval", "1"]
TINY += ["--batch-size", "2", "--block-size", "8"]


@pytest.mark.parametrize(
    ("example", "flag", "value"),
    [
        ("shakespeare_char", "--batch-size", "0"),  # was a ZeroDivisionError
        ("shakespeare_char", "--eval-interval", "0"),  # was "every must be >= 1"
        ("shakespeare_char", "--final-eval-iters", "0"),  # was "evaluate got no batches"
        ("shakespeare_char", "--keep-last", "-1"),
        ("finetune_classifier", "--max-train", "0"),  # was ignored: every article trained
        ("sft_lora", "--stop-at", "0"),  # was ignored: trained to --max-steps
        ("grpo_addition", "--iterations", "0"),
        ("summarize_seq2seq", "--steps", "0"),  # was "total_steps must be an int >= 1"
        ("token_classification", "--steps", "-3"),
        ("dpo", "--rows", "0"),
    ],
)
def test_a_count_out_of_range_is_refused_naming_its_flag(example, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        load_example(example).main([flag, value])
    assert e.value.code == 2
    low = 0 if flag == "--keep-last" else 1
    assert f"argument {flag}: must be an integer >= {low}, got {value}" in capsys.readouterr().err


def test_shakespeare_char_refuses_another_seed_on_resume(tmp_path, capsys):
    """The checkpoint's seed orders the data on resume: --seed 1 would be ignored, silently."""
    example = load_example("shakespeare_char")
    run = ["--out", str(tmp_path), *TINY, "--eval-interval", "2"]
    example.main([*run, "--max-iters", "2"])
    with pytest.raises(ValueError, match=r"--seed 1, but .*step-2 was trained with --seed 1337"):
        example.main([*run, "--max-iters", "4", "--seed", "1"])
    example.main([*run, "--max-iters", "3"])  # the same seed resumes
    assert "resumed from" in capsys.readouterr().out


def test_grpo_refuses_updates_it_would_not_make_and_saves_it_would_not_write(tmp_path, capsys):
    example = load_example("grpo_addition")
    for argv, message in [
        (["--steps", "3", "--iterations", "2"], "--steps 3 is not a multiple of --iterations 2"),
        (["--save-every", "2"], "--save-every 2 saves into --root: pass --root DIR"),
    ]:
        with pytest.raises(SystemExit):
            example.main(argv)
        assert message in capsys.readouterr().err
    tiny = ["--prompts", "2", "--generations", "2", "--root", str(tmp_path), "--save-every", "1"]
    example.main([*tiny, "--steps", "2", "--iterations", "2"])
    # Resumed at step 2 with 3 updates a batch: steps 5, 8, ... and no save would ever fall on a
    # multiple of 3 (it ran past --steps, unsaved).
    with pytest.raises(ValueError, match=r"--iterations 3, but .*step-2 is at step 2"):
        example.main([*tiny, "--steps", "6", "--iterations", "3"])
    with pytest.raises(ValueError, match=r"--seed 4, but .*step-2 was trained with --seed 0"):
        example.main([*tiny, "--steps", "4", "--seed", "4"])


def test_sft_lora_refuses_pretrain_steps_its_reused_base_was_not_made_with(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "pretrain_steps.txt").write_text("30\n")
    with pytest.raises(ValueError, match=r"--pretrain-steps 50, but .* pretrained for 30 steps"):
        load_example("sft_lora").main(["--out", str(tmp_path), "--pretrain-steps", "50"])


@pytest.fixture
def run_dir(tmp_path):
    state = ft.TrainState.create(torch.nn.Linear(2, 2), ft.optim.sgd())
    ft.save_checkpoint(state, tmp_path / "runs" / "a")
    return tmp_path / "runs" / "a"


def test_cli_export_of_a_run_folder_names_its_checkpoints(run_dir, tmp_path, capsys):
    """Was "no COMMITTED marker (save cut short)": a run folder is not a cut-short save."""
    assert cli.main(["export", str(run_dir), "--to", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{run_dir} is a run folder" in err and f"e.g. {run_dir / 'step-0'}" in err
    assert not (tmp_path / "out").exists()


def test_cli_inspect_of_a_folder_of_runs_says_so(run_dir, capsys):
    assert cli.main(["inspect", str(run_dir.parent)]) == 1
    assert f"is a folder of run folders: inspect one, e.g. {run_dir}" in capsys.readouterr().out


def test_cli_plot_refuses_an_output_without_extension(tmp_path, capsys):
    """matplotlib writes `curves.png` for `-o curves`; the CLI said "wrote curves"."""
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(SystemExit) as e:
        cli.main(["plot", str(log), "-o", str(tmp_path / "curves")])
    assert e.value.code == 2 and "no file extension" in capsys.readouterr().err
    assert not (tmp_path / "curves.png").exists()
