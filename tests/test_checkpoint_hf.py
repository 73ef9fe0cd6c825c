"""HF interop: export_pretrained for from_pretrained, PEFT adapters, HF Trainer checkpoints, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ftrain as ft
from helpers import ragged_rows, tiny_llama

ROWS = ragged_rows(16, seed=1)


def train(state, steps):
    for micro in ft.make_batches(ROWS, batch_size=4, accum=2, seed=0):
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
        if state.step >= steps:
            break
    return state


def logits(model, ids=None):
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]]) if ids is None else ids
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_pretrained_loads_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    state = train(ft.TrainState.create(tiny_llama(), ft.optim.adamw()), 2)
    out = ft.export_pretrained(state, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(loaded), logits(state.model))
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not list(tmp_path.glob(".export*")), "temporary directory left behind"
    with pytest.raises(FileExistsError, match="overwrite"):
        ft.export_pretrained(state, out)
    ft.export_pretrained(state, out, overwrite=True)


def test_plain_modules_export_as_safetensors(tmp_path):
    from safetensors.torch import load_model

    model = torch.nn.Linear(3, 2)
    out = ft.export_pretrained(ft.TrainState.create(model, ft.optim.sgd()), tmp_path / "m")
    other = torch.nn.Linear(3, 2)
    load_model(other, out / "model.safetensors")
    assert torch.equal(other.weight, model.weight)


def _lora(seed=0):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(tiny_llama(seed=seed), cfg)


def test_peft_adapter_checkpoint_resumes_exactly_and_exports(tmp_path):
    from peft import PeftModel

    full = train(ft.TrainState.create(_lora(), ft.optim.adamw()), 4)
    assert all("lora_" in n for n in full.params)

    mid = train(ft.TrainState.create(_lora(), ft.optim.adamw()), 2)
    path = ft.save_checkpoint(mid, tmp_path / "run")
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        assert all("lora_" in k for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    resumed = ft.load_checkpoint(path, ft.TrainState.create(_lora(), ft.optim.adamw()))
    state = resumed
    for micro in list(ft.make_batches(ROWS, resumed, batch_size=4, accum=2)):
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
    for n in full.params:
        assert torch.equal(full.params[n], state.params[n]), n

    out = ft.export_pretrained(state, tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(tiny_llama(seed=0), out)
    assert torch.equal(logits(loaded), logits(state.model))


def test_weights_of_an_hf_trainer_checkpoint_start_an_ftrain_run(tmp_path):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=4,
        max_steps=2,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    data = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in ([1, 2, 3, 4],) * 8]
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data)
    trainer.train()
    ckpt = tmp_path / "hf" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file()  # HF's pickled optimizer: deliberately not read

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    state = ft.TrainState.create(model, ft.optim.adamw())
    for name, p in trainer.model.named_parameters():
        assert torch.equal(state.model.get_parameter(name), p.detach()), name
    state = train(state, 1)
    assert state.step == 1


# --- CLI -----------------------------------------------------------------------------------------


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "ftrain", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_inspect_reports_contents_and_completeness(tmp_path):
    state = train(ft.TrainState.create(tiny_llama(), ft.optim.adamw()), 2)
    path = ft.save_checkpoint(state, tmp_path, metrics={"eval_loss": 2.5})
    run = cli("inspect", path)
    assert run.returncode == 0, run.stderr
    n = sum(p.numel() for p in state.params.values())
    for line in ["complete    yes", "step        2", "epoch       0", "eval_loss = 2.5", f"{n:,}"]:
        assert line in run.stdout, run.stdout
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    run = cli("inspect", path)
    assert run.returncode == 1 and "complete    no" in run.stdout and "checksum" in run.stdout


def test_cli_export_writes_an_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    state = train(ft.TrainState.create(tiny_llama(), ft.optim.adamw()), 2)
    path = ft.save_checkpoint(state, tmp_path / "run")
    run = cli("export", path, "--to", tmp_path / "hf")
    assert run.returncode == 0, run.stderr
    assert torch.equal(
        logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), logits(state.model)
    )


def test_cli_export_needs_a_base_for_frozen_parameters(tmp_path, capsys):
    """The CLI's `main` in this process (`python -m ftrain` itself runs in the tests above)."""
    from transformers import AutoModelForCausalLM

    from ftrain.extras.cli import main

    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    state = train(ft.TrainState.create(model, ft.optim.adamw()), 2)
    path = ft.save_checkpoint(state, tmp_path / "run")
    hf, base = str(tmp_path / "hf"), str(tmp_path / "base")
    assert main(["export", str(path), "--to", hf]) == 1
    assert "--base" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    tiny_llama().save_pretrained(base)
    code = main(["export", str(path), "--to", hf, "--base", base])
    assert code == 0, capsys.readouterr().err
    assert torch.equal(
        logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), logits(state.model)
    )


def test_export_of_a_model_type_transformers_does_not_know_names_the_way_out(tmp_path):
    """The main example's CharGPT (model_type "char_gpt"): the export failed with
    transformers' message listing every model type it knows (kilobytes, no way out)."""
    from transformers import LlamaConfig

    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw())
    path = ft.save_checkpoint(state, tmp_path / "run")
    config = LlamaConfig.from_pretrained(path).to_dict() | {"model_type": "char_gpt"}
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    with pytest.raises(ft.checkpoint.CheckpointError, match="'char_gpt' is not registered") as e:
        ft.export_checkpoint(path, tmp_path / "hf", config=tmp_path / "config.json")
    assert "ft.export_pretrained" in str(e.value) and len(str(e.value)) < 600
