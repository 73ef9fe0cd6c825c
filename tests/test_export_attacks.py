"""`python -m ftrain export` against `ft.export_pretrained` of the same state: dtypes, the
generation config, named LoRA adapters and classifiers; forged and older checkpoints."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

import ftrain as ft
from ftrain.extras.cli import main
from helpers import ragged_rows, tiny_llama

ROWS = ragged_rows(8, seed=3)
IDS = torch.tensor([[1, 5, 9, 13, 2, 7]])


def _trained(model, steps=2):
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    for micro in list(ft.make_batches(ROWS, batch_size=4, accum=1, seed=0))[:steps]:
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
    return state


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _cli_export(ckpt, out, *extra):
    assert main(["export", str(ckpt), "--to", str(out), *extra]) == 0


def _file_dtypes(directory, name="model.safetensors"):
    from safetensors import safe_open

    with safe_open(str(directory / name), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118


def _rewrite_meta(ckpt, tmp_path, edit, *, recommit=True):
    """A copy of `ckpt` whose state.json `edit` changed (an older writer's, or a forgery),
    committed again with its new digest unless `recommit` is False."""
    copy = tmp_path / "edited" / ckpt.name
    shutil.copytree(ckpt, copy)
    meta = json.loads((copy / "state.json").read_text())
    edit(meta)
    data = json.dumps(meta).encode()
    (copy / "state.json").write_bytes(data)
    if recommit:
        digest = hashlib.sha256(data).hexdigest()
        (copy / "COMMITTED").write_text(json.dumps({"state.json": digest}))
    return copy


# --- 1. dtypes: the checkpoint's, not the config's ------------------------------------------


def test_cli_export_of_a_bf16_run_is_bf16_like_export_pretrained(tmp_path):
    """Was: a bf16-trained model was exported as float32 (twice the size, config says so)."""
    from transformers import AutoModelForCausalLM

    state = _trained(tiny_llama(torch.bfloat16))
    ckpt = ft.save_checkpoint(state, tmp_path / "run")
    _cli_export(ckpt, tmp_path / "cli")
    ft.export_pretrained(state, tmp_path / "api")
    assert _file_dtypes(tmp_path / "cli") == _file_dtypes(tmp_path / "api")
    assert set(_file_dtypes(tmp_path / "cli").values()) == {"BF16"}
    cli = json.loads((tmp_path / "cli" / "config.json").read_text())
    api = json.loads((tmp_path / "api" / "config.json").read_text())
    assert cli["dtype"] == api["dtype"] == "bfloat16"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    assert torch.equal(_logits(exported), _logits(state.model))


def test_cli_export_keeps_float32_weights_whose_config_says_bf16(tmp_path):
    """Was: a config saying bf16 (a bf16 checkpoint upcast for training) rounded the trained
    float32 weights into bf16: logits off by 1.3e-3."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    model.config.dtype = torch.bfloat16
    state = _trained(model)
    ckpt = ft.save_checkpoint(state, tmp_path / "run")
    _cli_export(ckpt, tmp_path / "cli")
    assert set(_file_dtypes(tmp_path / "cli").values()) == {"F32"}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    assert torch.equal(_logits(exported), _logits(state.model))


def test_cli_export_keeps_each_parameters_dtype_in_a_mixed_model(tmp_path):
    model = tiny_llama()
    model.model.norm.to(torch.bfloat16)  # one bf16 parameter in a float32 model
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    ckpt = ft.save_checkpoint(state, tmp_path / "run")
    _cli_export(ckpt, tmp_path / "cli")
    ft.export_pretrained(state, tmp_path / "api")
    dtypes = _file_dtypes(tmp_path / "cli")
    assert dtypes == _file_dtypes(tmp_path / "api")
    assert dtypes["model.norm.weight"] == "BF16" and dtypes["lm_head.weight"] == "F32"


# --- 2. the generation config ------------------------------------------------------------------


@pytest.fixture(scope="module")
def generating_run(tmp_path_factory):
    """A checkpoint of a model with its own generation settings, and its state."""
    from transformers import GenerationConfig

    model = tiny_llama()
    model.generation_config = GenerationConfig(
        eos_token_id=[2, 7], temperature=0.6, top_p=0.9, do_sample=True, max_new_tokens=5
    )
    state = _trained(model)
    return ft.save_checkpoint(state, tmp_path_factory.mktemp("gen")), state


def _generation(directory):
    from transformers import GenerationConfig

    settings = GenerationConfig.from_pretrained(directory).to_dict()
    return {k: settings[k] for k in ("eos_token_id", "temperature", "top_p", "do_sample")}


def test_cli_export_writes_the_generation_config(generating_run, tmp_path):
    """Was: the CLI export lost generation_config.json (eos [2, 7], sampling settings)."""
    ckpt, state = generating_run
    _cli_export(ckpt, tmp_path / "cli")
    ft.export_pretrained(state, tmp_path / "api")
    want = {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    assert _generation(tmp_path / "api") == want
    assert _generation(tmp_path / "cli") == want


def test_a_checkpoint_without_a_generation_config_exports_as_before(generating_run, tmp_path):
    ckpt, _ = generating_run
    older = _rewrite_meta(ckpt, tmp_path, lambda m: m.pop("generation_config"))
    _cli_export(older, tmp_path / "cli")  # the model config's generation settings, as before
    assert _generation(tmp_path / "cli")["eos_token_id"] != [2, 7]


@pytest.mark.parametrize(
    "forged",
    [["eos"], {"__class__": "x"}, {"validate": 1}],
    ids=["list", "dunder", "method"],
)
def test_a_forged_generation_config_fails_cleanly(generating_run, tmp_path, forged):
    ckpt, _ = generating_run
    bad = _rewrite_meta(ckpt, tmp_path, lambda m: m.update(generation_config=forged))
    with pytest.raises(ft.CheckpointError, match="saved generation config"):
        ft.export_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_generation_config_changed_after_the_commit_fails_the_digest(generating_run, tmp_path):
    ckpt, _ = generating_run
    edit = lambda m: m["generation_config"].update(temperature=2.0)  # noqa: E731
    bad = _rewrite_meta(ckpt, tmp_path, edit, recommit=False)
    with pytest.raises(ft.CheckpointError, match=r"state\.json"):
        ft.export_checkpoint(bad, tmp_path / "out")


# --- 3. named LoRA adapters --------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tiny_llama().save_pretrained(path)
    return path


def _lora(base_dir, name, alpha=16):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj"])
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    return get_peft_model(base, config, adapter_name=name)


def test_a_named_adapter_with_other_settings_is_refused_on_load(base_dir, tmp_path):
    """Was: an adapter named "sft" with lora_alpha=16 loaded silently into an alpha=64 one."""
    ckpt = ft.save_checkpoint(_trained(_lora(base_dir, "sft")), tmp_path / "run")
    other = ft.TrainState.create(_lora(base_dir, "sft", alpha=64), ft.optim.adamw(), seed=0)
    refused = ft.checkpoint.CheckpointMismatchError
    with pytest.raises(refused, match="lora_alpha: checkpoint has 16"):
        ft.load_checkpoint(ckpt, other)
    same = ft.TrainState.create(_lora(base_dir, "sft"), ft.optim.adamw(), seed=0)
    ft.load_checkpoint(ckpt, same)


def test_a_named_adapter_exports_where_peft_loads_it(base_dir, tmp_path):
    """Was: the API wrote it to out/sft/ (PeftModel.from_pretrained(base, out) failed) and the
    CLI asked for --base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    state = _trained(_lora(base_dir, "sft"))
    ckpt = ft.save_checkpoint(state, tmp_path / "run")
    _cli_export(ckpt, tmp_path / "cli")
    ft.export_pretrained(state, tmp_path / "api")
    want = _logits(state.model)
    for out in ("cli", "api"):
        assert (tmp_path / out / "adapter_config.json").is_file()
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        assert torch.equal(_logits(PeftModel.from_pretrained(base, tmp_path / out)), want)


def test_an_older_default_adapter_checkpoint_still_exports(base_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    state = _trained(_lora(base_dir, "default"))
    ckpt = ft.save_checkpoint(state, tmp_path / "run")
    older = _rewrite_meta(ckpt, tmp_path, lambda m: m.pop("peft_adapters"))
    _cli_export(older, tmp_path / "cli")
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    got = _logits(PeftModel.from_pretrained(base, tmp_path / "cli"))
    assert torch.equal(got, _logits(state.model))


def test_a_checkpoint_with_several_adapters_is_refused_naming_them(base_dir, tmp_path):
    from peft import LoraConfig

    model = _lora(base_dir, "sft")
    model.add_adapter("dpo", LoraConfig(r=2, target_modules=["q_proj"]))
    ckpt = ft.save_checkpoint(ft.TrainState.create(model, ft.optim.adamw()), tmp_path / "run")
    with pytest.raises(ft.CheckpointError, match=r"2 PEFT adapters \(dpo, sft\)"):
        ft.export_checkpoint(ckpt, tmp_path / "out")


@pytest.mark.parametrize("name", ["../../escape", "a.b", ""])
def test_a_forged_adapter_name_fails_cleanly(base_dir, tmp_path, name):
    ckpt = ft.save_checkpoint(ft.TrainState.create(_lora(base_dir, "sft"), ft.optim.adamw()),
                              tmp_path / "run")  # fmt: skip
    forge = lambda m: m.update(peft_adapters={name: m["peft"]})  # noqa: E731
    bad = _rewrite_meta(ckpt, tmp_path, forge)
    with pytest.raises(ft.CheckpointError, match="saved adapter configs"):
        ft.export_checkpoint(bad, tmp_path / "out")


# --- 4. a classifier built from a config (no `architectures`) -----------------------------------


def _classifier():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=3, max_position_embeddings=32,
    ))  # fmt: skip


def test_a_classifier_exports_as_its_own_class(tmp_path):
    """Was: exported as a causal LM, refused as "frozen during training"."""
    from transformers import AutoModelForSequenceClassification

    model = _classifier()
    assert not model.config.architectures
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    ckpt = ft.save_checkpoint(state, tmp_path / "run")
    _cli_export(ckpt, tmp_path / "cli")
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "cli")
    assert type(exported).__name__ == "BertForSequenceClassification"
    assert torch.equal(_logits(exported), _logits(state.model))


def test_an_older_checkpoint_of_unknown_class_says_so(tmp_path):
    state = ft.TrainState.create(_classifier(), ft.optim.adamw(), seed=0)
    ckpt = ft.save_checkpoint(state, tmp_path / "run")
    older = _rewrite_meta(ckpt, tmp_path, lambda m: m.pop("model_class"))
    with pytest.raises(ft.CheckpointError, match="cannot tell which model class") as e:
        ft.export_checkpoint(older, tmp_path / "out")
    assert "frozen" not in str(e.value)
