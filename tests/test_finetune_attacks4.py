"""Silent failures of everyday fine-tuning, fifth pass: multi-task evaluation lists, LoRA on a
multiple-choice model, and the loose ends of LoRA's task type and generate's seed."""

from __future__ import annotations

import inspect
import json
import warnings

import pytest
import torch

import ftrain as ft


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(3, 1)


def _task_loss(model, batch):
    # One loss_fn for two tasks, picking the task by the batch's keys.
    if "x_reg" in batch:
        err = model.a(batch["x_reg"]).squeeze(-1) - batch["y_reg"]
        return err.square().sum(), torch.tensor(len(batch["y_reg"]))
    err = model.b(batch["x_cls"]).squeeze(-1) - batch["t_cls"]
    return err.square().sum(), torch.tensor(len(batch["t_cls"]))


def _task_batches(n=2):
    g = torch.Generator().manual_seed(0)
    a = [{"x_reg": torch.randn(2, 4, generator=g), "y_reg": torch.randn(2, generator=g)}]
    b = [{"x_cls": torch.randn(3, 3, generator=g), "t_cls": torch.randn(3, generator=g)}]
    return a * n, b * n


@pytest.mark.parametrize("n", [1, 2])
def test_a_list_of_two_tasks_batches_evaluates_as_an_iterator_of_them(n):
    # Every dict disjoint from the first was refused as "the parts of one batch": a multi-task
    # list of 4 batches raised, saying 4 dicts "share no key" though pairs of them did.
    state = ft.TrainState.create(_TwoHeads(), ft.optim.adamw())
    a, b = _task_batches(n)
    want = ft.evaluate(state, iter(a + b), _task_loss)
    assert want["eval_items"] == 5 * n
    # A flat list, batches and a group, and (of 4) one group; a group of 2 such is refused.
    for batches in (a + b, [*a, [*b]], *([[a + b]] if n == 2 else [])):
        assert ft.evaluate(state, batches, _task_loss) == want
    rows = [r["n"].tolist() for r in ft.predict(state, a + b, lambda m, x: _rows(x))]
    assert rows == [r["n"].tolist() for r in ft.predict(state, iter(a + b), lambda m, x: _rows(x))]


def _rows(batch):
    return {"n": torch.full((len(next(iter(batch.values()))),), float(len(batch)))}


def test_two_dicts_sharing_no_key_in_place_of_a_batch_are_still_refused_by_their_keys():
    # What can only be one batch's parts: a DataLoader's [inputs, labels] where a batch was
    # expected, or one (inputs, labels) tuple given as the batches. The message names both
    # dicts' keys and no longer claims more dicts than two.
    state = ft.TrainState.create(_TwoHeads(), ft.optim.adamw())
    inputs, labels = {"x_reg": torch.zeros(2, 4)}, {"y_reg": torch.zeros(2)}
    nested = r"a batch is a list of 2 dicts that share no key \(\['x_reg'\] and \['y_reg'\]\)"
    with pytest.raises(TypeError, match=nested):
        ft.evaluate(state, [[inputs, labels]], _task_loss)
    with pytest.raises(TypeError, match=r"batches is a tuple of 2 dicts that share no key"):
        ft.evaluate(state, (inputs, labels), _task_loss)
    with pytest.raises(TypeError, match=r"give them in a flat list of batches"):
        list(ft.predict(state, [[inputs, labels]], lambda m, x: _rows(x)))


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on tiny configs
        return fn(*args, **kwargs)


def _bert_multiple_choice(path=None):
    from transformers import BertConfig, BertForMultipleChoice

    if path is not None:
        return _quiet(BertForMultipleChoice.from_pretrained, path)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return _quiet(BertForMultipleChoice, cfg)


def _choice_loss(model, batch):
    out = model(**batch)  # HF's mean cross-entropy over the questions
    n = batch["labels"].shape[0]
    return out.loss * n, torch.tensor(n)


def test_lora_trains_and_saves_a_multiple_choice_models_new_head(tmp_path):
    # PEFT has no multiple-choice task type, and the head was only saved for SEQ_CLS-like
    # types: the new classifier stayed frozen at its random init and out of the adapter.
    from peft import PeftModel
    from safetensors.torch import load_file

    base = _bert_multiple_choice()
    base.save_pretrained(tmp_path / "base")
    model = _quiet(ft.lora.apply, _bert_multiple_choice(tmp_path / "base"), r=2, alpha=4)
    assert model.peft_config["default"].modules_to_save == ["classifier"]
    trained = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert trained == {
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    }
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.0), seed=0)
    g = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(3, 50, (4, 3, 6), generator=g),
        "labels": torch.arange(4) % 3,
    }
    for _ in range(3):
        grads, stats = ft.accumulate_grads(state, [batch], _choice_loss)
        state, _ = ft.clip_and_step(state, grads, lr=0.05, stats=stats)
    head = state.model.get_base_model().classifier.modules_to_save["default"]
    assert not torch.equal(head.weight, base.classifier.weight)  # it trained
    with torch.no_grad():
        want = state.model.eval()(**batch).logits
    ft.export_pretrained(state, tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {k for k in saved if "classifier" in k} == {
        "base_model.model.classifier.weight",
        "base_model.model.classifier.bias",
    }
    loaded = PeftModel.from_pretrained(
        _bert_multiple_choice(tmp_path / "base"), tmp_path / "adapter"
    )
    with torch.no_grad():
        got = loaded.eval()(**batch).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _llama_classifier():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return _quiet(LlamaForSequenceClassification, cfg)


def test_lora_modules_to_save_names_each_module_once(tmp_path):
    # PEFT's classifier wrapper appends its guesses to the names given: the adapter config
    # said ['classifier', 'classifier', 'score'].
    model = _quiet(ft.lora.apply, _llama_classifier(), r=2, modules_to_save=["score", "score"])
    assert model.peft_config["default"].modules_to_save == ["score", "classifier"]
    ft.export_pretrained(ft.TrainState.create(model, ft.optim.adamw()), tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert sorted(config["modules_to_save"]) == ["classifier", "score"]


def test_lora_refuses_a_task_type_peft_does_not_know_as_unknown_not_contradicting():
    # "seq_cls" was reported as contradicting the model's SEQ_CLS; PEFT knows no such name.
    with pytest.raises(ValueError, match=r"task_type='seq_cls' is not one of PEFT's task types "):
        ft.lora.apply(_llama_classifier(), r=2, task_type="seq_cls")
    with pytest.raises(ValueError, match=r"did you mean 'SEQ_CLS'\?"):
        ft.lora.apply(_llama_classifier(), r=2, task_type="seq_cls")
    with pytest.raises(ValueError, match=r"task_type='SEQ' is not one of PEFT's task types"):
        ft.lora.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)), r=2, task_type="SEQ")


def test_generates_docstring_says_which_devices_sampling_is_seeded_on():
    # It promised "CPU and the strategy's device" when only CPU and CUDA were seeded; the
    # accelerators' generators are seeded now (ftrain.rng.default_generators, tests/test_rng*).
    from ftrain.rng import default_generators

    assert default_generators(torch.device("meta")) == [torch.default_generator]
    doc = " ".join(inspect.getdoc(ft.generate).split())
    assert "the CPU one and the accelerator's (CUDA, XPU, MPS, ...:" in doc
    assert "a device without a generator ftrain can seed is named by a `RuntimeWarning`" in doc
