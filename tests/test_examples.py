"""Examples are real programs; run them (shortened) so they never rot."""

import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ftrain as ft
from helpers import load_example

EXAMPLES = Path(__file__).parent.parent / "examples"

# Golden loss curve of examples/minimal_loop.py (steps 10..60), recorded with torch 2.13 on CPU.
# Tolerance covers other CPUs' kernel choices; a change in the loop's maths moves it by far more.
GOLDEN = [3.4612, 2.7026, 2.1871, 1.8308, 1.6586, 1.5400]


def test_minimal_loop_golden_loss_curve():
    losses = load_example("minimal_loop").main([])
    assert losses == pytest.approx(GOLDEN, rel=3e-3)


def test_minimal_loop_is_at_most_30_lines_of_loop():
    src = (EXAMPLES / "minimal_loop.py").read_text()
    loop = src.split("# --- the loop")[1].split("# -----")[0]
    lines = [ln for ln in loop.splitlines()[1:] if ln.strip()]
    assert 10 < len(lines) <= 30


def test_shakespeare_char_loop_fits_on_one_screen():
    """From `while` to the end of the loop (issue 11: the log step is one call)."""
    src = (EXAMPLES / "shakespeare_char.py").read_text().splitlines()
    first = next(i for i, ln in enumerate(src) if ln.strip().startswith("while state.step"))
    last = next(i for i in range(first, len(src)) if "ft.next_epoch(state)" in src[i])
    assert len([ln for ln in src[first : last + 1] if ln.strip()]) <= 30
    assert "destroy_process_group" not in "\n".join(src)  # the strategy owns its lifetime


SHORT = "--max-iters 40 --eval-interval 20 --eval-iters 2 --final-eval-iters 4 --log-interval 10"
SHORT = SHORT.split()


def test_shakespeare_char_short_run(capsys, tmp_path):
    out_dir = tmp_path / "run"
    final = load_example("shakespeare_char").main(
        ["--out", str(out_dir), "--keep-last", "2", *SHORT]
    )
    out = capsys.readouterr().out
    assert re.search(r"^val_loss=\d+\.\d+$", out, re.M)
    # No terminal here: the progress bar prints one line per record (train and eval).
    assert re.search(r"^step 40/40  loss \d", out, re.M) and "step 40/40  eval_loss" in out
    assert final < math.log(65) - 0.5, "40 steps must learn something beyond uniform"
    # Checkpoints at each evaluation (the last one blocking), and the exported final model.
    assert ft.latest_checkpoint(out_dir).name == "step-40"
    # The export is the trained model: CharGPT.from_pretrained loads the last step's weights.
    example = sys.modules["shakespeare_char"]
    exported = example.CharGPT.from_pretrained(out_dir / "final").state_dict()
    trained = safetensors.torch.load_file(out_dir / "step-40" / "model.safetensors")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    records = ft.logging.read_jsonl(out_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 10, 20, 30, 40]
    assert [r["step"] for r in records if "eval_loss" in r] == [20, 40]

    # Resuming the example from its step-20 checkpoint ends exactly where the full run did.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(out_dir / "step-20", resumed_dir / "step-20")
    again = load_example("shakespeare_char").main(["--out", str(resumed_dir), *SHORT])
    assert "resumed from" in capsys.readouterr().out
    assert again == final


def test_shakespeare_char_model_refuses_what_it_cannot_compute():
    example = load_example("shakespeare_char")
    with pytest.raises(ValueError, match="n_embd=130 is not divisible by n_head=4"):
        example.CharGPTConfig(n_embd=130)
    model = example.CharGPT(example.CharGPTConfig(block_size=8, n_layer=1))
    # nanoGPT's init: N(0, 0.02), the residual projections 0.02 / sqrt(2 n_layer), norms 1.
    big = example.CharGPT(example.CharGPTConfig(n_layer=4, n_embd=256))
    stds = {n: float(p.detach().std()) for n, p in big.named_parameters() if p.dim() == 2}
    for name, std in stds.items():
        residual = name.endswith(("attn_proj.weight", "mlp_proj.weight"))
        want = 0.02 / math.sqrt(2 * 4) if residual else 0.02
        assert std == pytest.approx(want, rel=0.05), name
    assert all(float(p.detach().min()) == 1.0 for n, p in big.named_parameters() if p.dim() == 1)
    assert model(input_ids=torch.zeros(2, 8, dtype=torch.long)).logits.shape == (2, 8, 65)
    with pytest.raises(ValueError, match="input_ids has 9 positions; block_size is 8"):
        model(input_ids=torch.zeros(2, 9, dtype=torch.long))


@pytest.mark.parametrize("precision", ["bf16"])  # fp16 autocast is slow on CPU (22 s)
def test_shakespeare_char_mixed_precision(capsys, precision):
    """The example's --precision flag: the same loop learns under autocast (and loss scaling)."""
    args = ["--max-iters", "30", "--eval-interval", "30", "--eval-iters", "1",
            "--final-eval-iters", "4", "--log-interval", "10", "--out", ""]  # fmt: skip
    final = load_example("shakespeare_char").main([*args, "--precision", precision])
    assert "val_loss=" in capsys.readouterr().out
    assert final < math.log(65) - 0.5


@pytest.mark.slow
def test_shakespeare_char_compiled_learns_and_resumes(tmp_path, capsys):
    """--compile compiles the model with its loss (one graph, the way nanoGPT's forward holds
    it; compiling the model alone was 1.13x slower on a GPU): the compiled loop learns, its
    eval runs compiled too, and a run resumed from its step-15 checkpoint ends where the whole
    run did, to float rounding: compiled CPU kernels add some gradients in an order that varies
    from run to run (two whole compiled runs differ in the 8th digit; eager ones are equal)."""
    args = ["--compile", *SHORT, "--max-iters", "30", "--eval-interval", "15", "--keep-last", "2"]
    final = load_example("shakespeare_char").main([*args, "--out", str(tmp_path / "run")])
    assert "val_loss=" in capsys.readouterr().out and final < math.log(65) - 0.5
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "run" / "step-15", tmp_path / "resumed" / "step-15")
    again = load_example("shakespeare_char").main([*args, "--out", str(tmp_path / "resumed")])
    assert "resumed from" in capsys.readouterr().out
    assert again == pytest.approx(final, rel=1e-6, abs=0)


def test_finetune_classifier_short_run(tmp_path, capsys):
    """A few steps of the real example: pretrained MiniLM, BBC News, held-out accuracy."""
    out_dir = tmp_path / "clf"
    args = ["--epochs", "1", "--max-train", "64", "--max-test", "40", "--max-length", "32"]
    final = load_example("finetune_classifier").main([*args, "--out", str(out_dir)])
    out = capsys.readouterr().out
    assert final["eval_items"] == 40 and 0.0 <= final["eval_accuracy"] <= 1.0
    assert re.search(r"^test_accuracy=\d\.\d{4} on 40 articles$", out, re.M)
    assert "epoch 1: test accuracy" in out
    records = ft.logging.read_jsonl(out_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [4]  # 64 / 16 steps; logged at the end
    assert [r["step"] for r in records if "eval_accuracy" in r] == [4]
    assert ft.latest_checkpoint(out_dir).name == "step-4"
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    AutoTokenizer.from_pretrained(out_dir / "final")
    assert AutoModelForSequenceClassification.from_pretrained(out_dir / "final").num_labels == 5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_shakespeare_char_under_torchrun(tmp_path, capsys, strategy):
    """The same example, 2 processes with DDP or FSDP (global batch unchanged): same result;
    FSDP checkpoints are sharded, and the exported model is whole."""
    import subprocess

    args = ["--max-iters", "20", "--eval-interval", "10", "--eval-iters", "2",
            "--final-eval-iters", "4", "--log-interval", "10"]  # fmt: skip
    single = load_example("shakespeare_char").main([*args, "--out", str(tmp_path / "one")])
    capsys.readouterr()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", str(EXAMPLES / "shakespeare_char.py"), "--strategy", strategy,
         *args, "--out", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (val,) = re.findall(r"^val_loss=(\d+\.\d+)$", run.stdout, re.M)  # printed by rank 0 only
    assert float(val) == pytest.approx(single, abs=2e-4)
    assert ft.latest_checkpoint(tmp_path / "two").name == "step-20"
    meta = ft.checkpoint.read_meta(tmp_path / "two" / "step-20")
    assert meta["world_size"] == 2
    assert meta.get("sharded", False) == (strategy == "fsdp")
    model_class = sys.modules["shakespeare_char"].CharGPT  # an HF PreTrainedModel
    exported = model_class.from_pretrained(tmp_path / "two" / "final")
    reference = model_class.from_pretrained(tmp_path / "one" / "final")
    for (n, a), (_, b) in zip(
        exported.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)


def test_sft_lora_short_run_saves_adapters_and_resumes_exactly(tmp_path, capsys):
    """qlora.py's recipe as a short ftrain run: eval loss falls, checkpoints hold only the
    trained tensors (adapters and the trained head copy), the exported adapter loads with
    peft, and a run interrupted at step 20 and run again ends where the straight run did."""
    args = [
        "--max-steps",
        "40",
        "--pretrain-steps",
        "30",
        "--eval-every",
        "20",
        "--group-by-length",
    ]  # fmt: skip  (resuming mid-epoch in HF's length-grouped order)
    straight = load_example("sft_lora").main([*args, "--out", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert straight["final"] < straight["first"] - 1.0
    assert "pretrained the base for 30 steps" in out and out.count(" -> ") == 4
    ckpt = ft.latest_checkpoint(tmp_path / "a")
    assert ckpt.name == "step-40"
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all("lora_" in n or "modules_to_save" in n for n in names)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "base")
    PeftModel.from_pretrained(base, tmp_path / "a" / "adapter")  # loads
    # Interrupted at 20 (same base), then run again: it resumes and finishes identically.
    shutil.copytree(tmp_path / "a" / "base", tmp_path / "b" / "base")
    load_example("sft_lora").main([*args, "--stop-at", "20", "--out", str(tmp_path / "b")])
    again = load_example("sft_lora").main([*args, "--out", str(tmp_path / "b")])
    assert "resumed from" in capsys.readouterr().out
    assert again["final"] == straight["final"]


def test_migration_guide_load_best_model_at_end_recipe_runs_as_written(tmp_path):
    """The guide's complete recipe, executed verbatim: the state ends at the best step."""
    from helpers import ragged_rows, tiny_llama

    guide = (EXAMPLES.parent / "docs" / "migrating_from_trainer.md").read_text()
    block = guide.split("<!-- recipe: load_best_model_at_end -->")[1].split("<!-- end recipe")[0]
    code = block.split("```python\n")[1].split("```")[0]
    torch.manual_seed(0)
    scope = {"model": tiny_llama(), "train": ragged_rows(8, seed=1), "total_steps": 4,
             "val": ragged_rows(4, seed=2), "root": str(tmp_path), "eval_steps": 1}  # fmt: skip
    exec(compile(code, "migrating_from_trainer.md", "exec"), scope)
    state = scope["state"]
    assert (
        state.early_stopping.best_step in (1, 2, 3, 4)
        and state.step == state.early_stopping.best_step
    )
    kept = {p.name for p in tmp_path.iterdir() if p.name.startswith("step-")}
    assert kept == {f"step-{state.early_stopping.best_step}", "step-4"}  # keep_last=1 plus the best


def test_summarize_seq2seq_short_run(capsys):
    """A tiny T5 with the README loop and the default loss (no shift for encoder-decoder
    models): the loss falls well below uniform, and ft.generate completes the inputs."""
    out = load_example("summarize_seq2seq").main(["--steps", "40"])
    losses = out["losses"]
    assert len(losses) == 2 and losses[-1] < math.log(16) - 0.8
    assert out["eval_loss"] < math.log(16) - 0.8
    assert "reversed exactly" in capsys.readouterr().out


def test_token_classification_short_run(capsys):
    """A tiny BERT tagger with the README loop and the default loss (no shift for token
    classifiers): per-token accuracy from classification_metrics beats tagging everything 'O'
    (about 70% of the tokens), which only a tagger reading its left neighbour can do."""
    out = load_example("token_classification").main(["--steps", "40"])
    rows = load_example("token_classification").make_data(256, seed=1)
    tags = [t for r in rows for t in r["labels"] if t != -100]
    majority = tags.count(0) / len(tags)
    assert out["eval_accuracy"] > majority + 0.1
    assert out["losses"][-1] < out["losses"][0]
    assert "token accuracy" in capsys.readouterr().out


def test_every_cookbook_recipe_names_an_example_and_a_test_that_exist():
    """docs/cookbook.md backs each recipe with a runnable example and the test that runs it."""
    root = EXAMPLES.parent
    text = (root / "docs" / "cookbook.md").read_text(encoding="utf-8")
    sections = text.split("\n## ")[1:]
    assert len(sections) == 5
    here = (root / "tests" / "test_examples.py").read_text(encoding="utf-8")
    for section in sections:
        examples = re.findall(r"`examples/(\w+)\.py`", section)
        tests = re.findall(r"test: `(test_\w+)`", section)
        assert examples and tests, section.splitlines()[0]
        assert (root / "examples" / f"{examples[0]}.py").is_file()
        assert f"def {tests[0]}(" in here and f'load_example("{examples[0]}")' in here
