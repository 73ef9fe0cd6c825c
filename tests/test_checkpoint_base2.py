"""The base-model record, continued (docs/checkpoints.md, "The base model"): what it leaves out
(a modules-to-save wrapper's original head), `ftrain export --base` comparing it, and what the
refusal says when the base is the right one but its weights changed in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain.extras.cli import main
from test_checkpoint_base import _meta, _reseal

MISMATCH = ft.checkpoint.CheckpointMismatchError
REFUSED = "the model's frozen weights differ from the checkpoint's"
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _state(model: torch.nn.Module) -> ft.TrainState:
    return ft.TrainState.create(model, ft.optim.adamw(), seed=0)


# --- a LoRA classifier: the head's original copy is no part of the base --------------------------


def _bert(directory: Path, seed: int) -> Path:
    """A tiny pretrained backbone ("bert-base-uncased"), drawn from `seed`."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    transformers.BertModel(cfg).save_pretrained(directory)
    return directory


def _classifier(backbone: Path, seed: int) -> torch.nn.Module:
    """The training script's model line: the head is new, drawn from `seed` (each process's)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(backbone, num_labels=3)
    return ft.lora.apply(model, r=2, targets=["query", "value"])


def _trained_classifier(backbone: Path, root: Path) -> tuple[Path, ft.TrainState]:
    state = _state(_classifier(backbone, seed=1))
    batch = {"input_ids": torch.randint(0, 50, (2, 6)), "labels": torch.tensor([0, 2])}
    grads, stats = ft.accumulate_grads(state, [batch])
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
    return ft.save_checkpoint(state, root), state


HEAD = "base_model.model.classifier"


def test_a_lora_classifier_resumes_in_a_new_process(tmp_path):
    """Was: refused. PEFT's modules-to-save wrapper keeps a frozen `original_module` copy of
    the new head, which every `from_pretrained` draws at random again; the forward reads the
    trained copy (saved), so the original is not recorded and the resume loads."""
    backbone = _bert(tmp_path / "bert", seed=0)
    path, trained = _trained_classifier(backbone, tmp_path / "run")
    recorded = _meta(path)["frozen_sums"]
    assert not [n for n in recorded if ".original_module." in n]
    assert "base_model.model.bert.embeddings.word_embeddings.weight" in recorded
    resumed = ft.load_checkpoint(path, _state(_classifier(backbone, seed=2)))  # another head
    name = f"{HEAD}.modules_to_save.default.weight"
    assert torch.equal(resumed.params[name], trained.params[name])


def test_a_record_of_the_original_head_from_before_is_not_compared(tmp_path):
    """A checkpoint saved while the original head was recorded (this morning's) resumes too."""
    backbone = _bert(tmp_path / "bert", seed=0)
    path, _ = _trained_classifier(backbone, tmp_path / "run")
    forged = {f"{HEAD}.original_module.weight": [123.0, 456.0]}
    _reseal(path, lambda meta: meta["frozen_sums"].update(forged))
    ft.load_checkpoint(path, _state(_classifier(backbone, seed=2)))


def test_a_lora_classifier_on_another_backbone_is_still_refused(tmp_path):
    path, _ = _trained_classifier(_bert(tmp_path / "bert", seed=0), tmp_path / "run")
    other = _bert(tmp_path / "other", seed=1)
    with pytest.raises(MISMATCH, match=REFUSED) as info:
        ft.load_checkpoint(path, _state(_classifier(other, seed=1)))
    assert "base_model.model.bert.embeddings.word_embeddings.weight" in info.value.summary
    assert not [d for d in info.value.differences if "original_module" in d]


class _Wrapper(torch.nn.Module):
    """Duck-typed like PEFT's ModulesToSaveWrapper: `original_module` and `modules_to_save`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.original_module = module
        self.modules_to_save = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 4)})


def test_an_original_module_tied_to_a_weight_the_forward_reads_is_still_recorded(tmp_path):
    """Only tensors held under `original_module` alone are left out: one tied to another
    module (an embedding that is also the LM head) is the base, and compared."""

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = torch.nn.Module()
        m.embed = _Wrapper(torch.nn.Embedding(4, 4))
        m.head = torch.nn.Linear(4, 4, bias=False)
        m.head.weight = m.embed.original_module.weight
        m.other = _Wrapper(torch.nn.Linear(4, 4))
        m.embed.original_module.requires_grad_(False)
        m.other.original_module.requires_grad_(False)
        return m

    path = ft.save_checkpoint(_state(model(0)), tmp_path)
    assert list(_meta(path)["frozen_sums"]) == ["embed.original_module.weight"]
    with pytest.raises(MISMATCH, match=r"\(1 parameter\(s\): embed.original_module.weight\)"):
        ft.load_checkpoint(path, _state(model(1)))


# --- ftrain export --base compares the base too --------------------------------------------------


def _llama(directory: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def partly_frozen(tmp_path_factory):
    """A checkpoint of a Llama trained on base A with layer 0 frozen, and bases A and B."""
    root = tmp_path_factory.mktemp("export")
    base_a, base_b = _llama(root / "base_a", 0), _llama(root / "base_b", 1)
    model = transformers.LlamaForCausalLM.from_pretrained(base_a)
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("lm_head") or "layers.1" in n)
    return ft.save_checkpoint(_state(model), root / "run"), base_a, base_b


def test_export_onto_another_base_is_refused(partly_frozen, tmp_path, capsys):
    """Was: `export --base B` merged the trained layers onto B's frozen ones, exit 0."""
    path, _, base_b = partly_frozen
    out = tmp_path / "hf"
    assert main(["export", str(path), "--base", str(base_b), "--to", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"error: {REFUSED} (" in err  # after transformers' progress bars
    assert "frozen weights model.layers.0.mlp.up_proj.weight: checkpoint has sum " in err
    assert "pass allow_other_base=True (export --allow-other-base) to export onto this base" in err
    assert not out.exists()
    with pytest.raises(MISMATCH, match=REFUSED):
        ft.export_checkpoint(path, out, base=base_b)
    with pytest.raises(TypeError, match="allow_other_base must be True or False, got 1"):
        ft.export_checkpoint(path, out, base=base_b, allow_other_base=1)


def test_export_onto_another_base_on_purpose_and_onto_its_own(partly_frozen, tmp_path, capsys):
    path, base_a, base_b = partly_frozen
    other, own = tmp_path / "other", tmp_path / "own"
    argv = ["export", str(path), "--base", str(base_b), "--to", str(other), "--allow-other-base"]
    assert main(argv) == 0
    assert main(["export", str(path), "--base", str(base_a), "--to", str(own)]) == 0
    capsys.readouterr()
    load = transformers.LlamaForCausalLM.from_pretrained
    frozen = "model.layers.0.mlp.up_proj.weight"
    for directory, base in ((other, base_b), (own, base_a)):
        exported = load(directory).get_parameter(frozen)
        assert torch.equal(exported, load(base).get_parameter(frozen))


def test_base_differences_names_what_load_would_refuse(partly_frozen):
    path, base_a, base_b = partly_frozen
    opened = ft.checkpoint.open_checkpoint(path, keep=())
    load = transformers.LlamaForCausalLM.from_pretrained
    assert ft.checkpoint.base_differences(opened, load(base_a)) == []
    names = [d.split(":")[0] for d in ft.checkpoint.base_differences(opened, load(base_b))]
    assert "frozen weights model.layers.0.self_attn.q_proj.weight" in names
    assert not [n for n in names if "layers.1" in n or "lm_head" in n]  # trained: saved


# --- the right base, changed in memory: the refusal names how ------------------------------------


def test_a_merge_and_unmerge_before_the_save_is_named_as_a_cause(tmp_path):
    """Was: "load into the base model it was trained on", which the user did. Merging and
    unmerging the adapters (around a fast evaluation) rounds the base's weights in place: the
    values do differ, so the load is refused, with that among the causes it names."""
    base = tmp_path / "base"
    _llama(base, 0)

    def fresh() -> torch.nn.Module:
        model = transformers.LlamaForCausalLM.from_pretrained(base)
        return ft.lora.apply(model, r=4, alpha=8)

    state = _state(fresh())
    for adapter in state.model.parameters():
        if adapter.requires_grad:
            with torch.no_grad():
                adapter.normal_(0, 0.5)  # trained adapters: B != 0, so a merge changes W
    state.model.merge_adapter()
    state.model.unmerge_adapter()
    path = ft.save_checkpoint(state, tmp_path / "run")
    with pytest.raises(MISMATCH, match=REFUSED) as info:
        ft.load_checkpoint(path, _state(fresh()))
    summary = info.value.summary
    assert "If it is that base, its weights changed in memory before the save or this" in summary
    assert "merging and unmerging adapters (merge_adapter/unmerge_adapter round them)" in summary
    assert "resize_token_embeddings" in summary
    assert "seed both runs alike before building" in summary
    assert summary.endswith("Pass allow_other_base=True to load onto this one on purpose")
    ft.load_checkpoint(path, _state(fresh()), allow_other_base=True)
