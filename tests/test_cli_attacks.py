"""The examples' flags against a reused run folder: a resume or a reuse that could not be the
run the flags describe raises naming the flag (an adversarial review's reproducers)."""

import shutil

import pytest
import torch

import ftrain as ft
from helpers import load_example

TINY = ["--eval-iters", "1", "--final-eval-iters", "1", "--log-interval", "50"]
TINY += ["--batch-size", "2", "--block-size", "8"]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A 4-step shakespeare_char run folder and the flags that made it."""
    run = ["--out", str(tmp_path_factory.mktemp("run")), *TINY, "--eval-interval", "4"]
    load_example("shakespeare_char").main([*run, "--max-iters", "4"])
    return run


def test_shakespeare_char_refuses_fewer_max_iters_or_another_batch_size_on_resume(four_steps):
    """Each was accepted: a 4-step checkpoint printed its val_loss for --max-iters 2, and
    another --batch-size trained the rest of the run on it."""
    example = load_example("shakespeare_char")
    with pytest.raises(ValueError, match=r"--max-iters 2, but .*step-4 already trained 4 steps"):
        example.main([*four_steps, "--max-iters", "2"])
    with pytest.raises(ValueError, match=r"--batch-size 4, but .* with --batch-size 2"):
        example.main([*four_steps, "--max-iters", "6", "--batch-size", "4"])


def test_shakespeare_char_refuses_another_data_file_on_resume(four_steps, tmp_path):
    example = load_example("shakespeare_char")
    text = example.DATA.read_text(encoding="utf-8")[::-1]  # the same characters and length
    (tmp_path / "reversed.txt").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=r"--data .*reversed.txt holds another text"):
        example.main([*four_steps, "--max-iters", "6", "--data", str(tmp_path / "reversed.txt")])


def test_shakespeare_char_resumes_with_more_max_iters_inside_the_warmup(
    four_steps, tmp_path, capsys
):
    """The lr of steps 0-3 is the same for any --max-iters (warmup): a longer run goes on."""
    out = four_steps.index("--out") + 1
    shutil.copytree(four_steps[out], tmp_path / "run")
    run = [*four_steps[:out], str(tmp_path / "run"), *four_steps[out + 1 :]]
    load_example("shakespeare_char").main([*run, "--max-iters", "5"])
    assert "resumed from" in capsys.readouterr().out


def test_shakespeare_char_refuses_another_max_iters_past_the_warmup(tmp_path):
    """After the 100 warmup steps the cosine decays over --max-iters: resuming with another one
    followed neither schedule (the checks on a checkpoint at step 150 of a 200-step run)."""
    example = load_example("shakespeare_char")
    args = example.argparse.Namespace(
        seed=0, max_iters=200, batch_size=2, data=example.DATA, eval_iters=20
    )
    state = ft.TrainState.create(torch.nn.Linear(2, 2), ft.optim.sgd(), seed=0).replace(step=150)
    ckpt = ft.save_checkpoint(state, tmp_path, metrics=example.run_record(args))
    example.refuse_another_run(args, ckpt, state)  # the same flags go on
    with pytest.raises(ValueError, match=r"--max-iters 300, but .*150 steps .* decaying over 200"):
        example.refuse_another_run(
            example.argparse.Namespace(**{**vars(args), "max_iters": 300}), ckpt, state
        )


def test_shakespeare_char_refuses_another_eval_iters_on_resume(four_steps, capsys):
    """The best checkpoint is picked by eval_loss: a resume evaluating on another number of
    batches ranked losses over different data (accepted before)."""
    example = load_example("shakespeare_char")
    with pytest.raises(ValueError, match=r"--eval-iters 2, but .* on --eval-iters 1 batches"):
        example.main([*four_steps, "--max-iters", "6", "--eval-iters", "2"])
    with pytest.raises(SystemExit):  # accepted and ignored before
        example.main([*TINY, "--max-iters", "1", "--out", "", "--keep-last", "3"])
    assert "--keep-last keeps checkpoints in --out" in capsys.readouterr().err


STREAM = ["--steps", "2", "--batch-size", "2", "--accum", "1", "--workers", "0"]
STREAM += ["--block-size", "16", "--format", "jsonl", "--max-chars", "3000", "--save-every", "2"]


def test_pretrain_stream_refuses_shards_written_with_other_flags(tmp_path):
    """--shards 4 --max-chars 1000 on a reused --out read the 2 shards of 3000 characters."""
    example = load_example("pretrain_stream")
    example.main([*STREAM, "--out", str(tmp_path), "--shards", "2"])
    with pytest.raises(ValueError, match=r"written with --shards 2, --max-chars 3000, not --sh"):
        example.main([*STREAM, "--out", str(tmp_path), "--shards", "4", "--max-chars", "1000"])
    with pytest.raises(ValueError, match=r"--stop-at 1, but .*step-2 is at step 2"):
        example.main([*STREAM, "--out", str(tmp_path), "--shards", "2", "--steps", "4",
                      "--stop-at", "1"])  # fmt: skip


def test_pretrain_stream_refuses_a_stop_at_it_never_reaches(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_example("pretrain_stream").main([*STREAM, "--out", str(tmp_path), "--stop-at", "9"])
    assert "--stop-at 9 is not a step before --steps 2" in capsys.readouterr().err
