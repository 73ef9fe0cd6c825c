"""The load side seen from the command line and from HF models: config.json checked like every
file, `inspect` on a run folder, `plot --metrics`, and mismatch errors that say why first."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain.extras.cli import main
from helpers import tiny_llama


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reseal(path: Path) -> None:
    """Recompute the recorded sizes and digests, as a tool that rewrote the files would."""
    meta = json.loads((path / "state.json").read_text())
    for name, entry in meta["files"].items():
        entry["sha256"], entry["bytes"] = _sha(path / name), (path / name).stat().st_size
    (path / "state.json").write_text(json.dumps(meta))
    (path / "COMMITTED").write_text(json.dumps({"state.json": _sha(path / "state.json")}))


def llama_state(**config):
    model = tiny_llama()
    if config:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(model.config.__class__(**{**model.config.to_dict(), **config}))
    return ft.TrainState.create(model, ft.optim.adamw())


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    return ft.save_checkpoint(llama_state(), tmp_path_factory.mktemp("hf"))


# --- issue 20.6: config.json is checked ----------------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped byte", "invalid JSON, resealed", "a list, resealed"])
def test_a_damaged_config_json_is_refused_by_load_inspect_and_export(
    hf_ckpt, tmp_path, capsys, damage
):
    path = tmp_path / "ckpt"
    shutil.copytree(hf_ckpt, path)
    cfg = path / "config.json"
    if damage == "flipped byte":
        data = bytearray(cfg.read_bytes())
        data[len(data) // 2] ^= 0x01
        cfg.write_bytes(bytes(data))
    else:
        cfg.write_text("{not json" if damage.startswith("invalid") else "[1, 2]")
        reseal(path)
    with pytest.raises(ft.CheckpointError, match=r"config\.json"):
        ft.load_checkpoint(path, llama_state())
    assert main(["inspect", str(path)]) == 1
    assert "complete    no" in capsys.readouterr().out
    with pytest.raises(ft.CheckpointError, match=r"config\.json"):
        ft.export_checkpoint(path, tmp_path / "out")
    assert main(["export", str(path), "--to", str(tmp_path / "out")]) == 1
    assert "config.json" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_intact_config_json_still_exports(hf_ckpt, tmp_path):
    out = ft.export_checkpoint(hf_ckpt, tmp_path / "out")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    state = llama_state()
    for name, p in state.model.named_parameters():
        assert torch.equal(model.get_parameter(name), p), name


# --- issue 19.6: the one-line cause first ---------------------------------------------------------


def test_a_mismatch_opens_with_the_config_difference(hf_ckpt):
    with pytest.raises(ft.checkpoint.CheckpointMismatchError) as err:
        ft.load_checkpoint(hf_ckpt, llama_state(intermediate_size=48))
    first = str(err.value).splitlines()[0]
    assert first.startswith("the model's config differs from the checkpoint's"), first
    assert "intermediate_size 32 in the checkpoint, 48 in the model" in first
    assert err.value.summary == first
    assert len(err.value.differences) == 18  # 6 weights and their 2 Adam moments each
    assert all(d in str(err.value) for d in err.value.differences)


def test_a_mismatch_without_a_config_opens_with_counts(tmp_path):
    def mlp(hidden, extra=False):
        layers = [torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2)]
        return torch.nn.Sequential(*layers, *([torch.nn.Linear(2, 2)] if extra else []))

    path = ft.save_checkpoint(ft.TrainState.create(mlp(8), ft.optim.sgd()), tmp_path)
    with pytest.raises(ft.checkpoint.CheckpointMismatchError) as err:
        ft.load_checkpoint(path, ft.TrainState.create(mlp(5, extra=True), ft.optim.sgd()))
    first = str(err.value).splitlines()[0]
    assert first == "checkpoint does not fit the state: 2 missing, 3 mis-shaped (details below)"


# --- issue 19.4: inspect RUN_DIR, plot --metrics ------------------------------------------------


@pytest.fixture
def run_dir(tmp_path):
    state = ft.TrainState.create(torch.nn.Linear(3, 1), ft.optim.sgd())
    for step, loss, acc in [(10, 0.9, 0.5), (20, 0.4, 0.8), (30, 0.6, 0.7)]:
        ft.save_checkpoint(
            state.replace(step=step), tmp_path, metrics={"eval_loss": loss, "eval_accuracy": acc}
        )
    return tmp_path


def test_inspect_lists_a_run_folder(run_dir, capsys):
    assert main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("step ")}
    assert sorted(lines, key=int) == ["10", "20", "30"], out
    assert "complete" in lines["30"] and "latest" in lines["30"]
    assert "best eval_loss" in lines["20"] and "eval_loss=0.4" in lines["20"]
    assert "committed" in lines["10"] and "<-" not in lines["10"]
    assert main(["inspect", str(run_dir), "--metric", "eval_accuracy", "--mode", "max"]) == 0
    out = capsys.readouterr().out
    assert "best eval_accuracy" in next(ln for ln in out.splitlines() if ln.startswith("step 20"))


def test_inspect_run_folder_exits_1_when_the_newest_is_damaged(run_dir, capsys):
    model = run_dir / "step-30" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-4])
    assert main(["inspect", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "step 30" in out and "incomplete" in out and "truncated" in out
    shutil.rmtree(run_dir / "step-30")
    (run_dir / "step-30").mkdir()  # a step folder with nothing in it is not the latest
    assert main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "latest" in next(ln for ln in out.splitlines() if ln.startswith("step 20"))


def _log(path: Path) -> None:
    rows = [{"step": s, "loss": 2.0 / s, "learning_rate": 0.1} for s in range(1, 7)]
    rows += [{"step": 2, "eval_accuracy": 0.6}, {"step": 4, "eval_accuracy": 0.9}]
    rows += [{"step": 6, "eval_accuracy": 0.7}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_draws_named_metrics_and_marks_the_best_step(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    log, png = tmp_path / "metrics.jsonl", tmp_path / "acc.png"
    _log(log)
    drawn = []
    real = matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):
        drawn.append([t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()])
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    argv = ["plot", str(log), "-o", str(png), "--metrics", "eval_accuracy", "loss"]
    assert main([*argv, "--mode", "max"]) == 0
    assert png.stat().st_size > 0
    assert drawn[-1] == ["eval_accuracy", "best step 4", "loss"]
    assert main(argv) == 0  # mode min: the lowest accuracy
    assert "best step 2" in drawn[-1]
    assert main(["plot", str(log), "-o", str(png), "--metrics", "eval_f1"]) == 1
    err = capsys.readouterr().err
    assert "['eval_f1']" in err and "eval_accuracy" in err


def test_plot_metrics_validates_its_arguments(tmp_path):
    log = tmp_path / "metrics.jsonl"
    _log(log)
    with pytest.raises(ValueError, match="mode"):
        ft.logging.plot_metrics(log, tmp_path / "x.png", mode="best")
    with pytest.raises(ValueError, match="metrics"):
        ft.logging.plot_metrics(log, tmp_path / "x.png", metrics="eval_accuracy")


def test_inspect_reports_the_state_values_a_checkpoint_holds(tmp_path, capsys):
    # The counters live in sub-states (state.data, state.early_stopping): inspect must read
    # them under their dotted names, not print None for a renamed field.
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    state = state.replace(
        step=7,
        epoch=2,
        data=state.data.replace(
            cursor=5, tokens_seen=torch.tensor(123), samples_seen=torch.tensor(45)
        ),
        early_stopping=state.early_stopping.replace(best_metric=0.25, best_step=6),
    )
    path = ft.save_checkpoint(state, tmp_path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "epoch       2  (cursor 5 micro-batches)" in out, out
    assert "seen        123 tokens, 45 samples" in out, out
    assert "best        0.25 at step 6" in out, out
