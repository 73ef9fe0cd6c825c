"""Where two fine-tuning extras cross (LoRA with preference losses, rollouts, export, the chunked
loss, SFT collation): each test is a combination that used to give a silently wrong result and
now acts or raises ftrain's own message."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import ftrain as ft
from ftrain.eval import eval_mode
from helpers import tiny_llama

P = ft.preference


def _lora_llama(seed: int = 0):
    """A tiny LoRA Llama whose adapters already change the output (lora_B is 0 at init)."""
    model = ft.lora.apply(tiny_llama(seed=seed), r=4, alpha=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _pairs():
    g = torch.Generator().manual_seed(0)
    ids_c = torch.randint(1, 61, (2, 7), generator=g)
    ids_r = torch.randint(1, 61, (2, 7), generator=g)
    lab_c, lab_r = ids_c.clone(), ids_r.clone()
    lab_c[:, :3] = lab_r[:, :3] = -100
    return {"chosen_input_ids": ids_c, "chosen_labels": lab_c,
            "chosen_attention_mask": torch.ones_like(ids_c),
            "rejected_input_ids": ids_r, "rejected_labels": lab_r,
            "rejected_attention_mask": torch.ones_like(ids_r)}  # fmt: skip


def test_dpo_refuses_a_reference_that_shares_the_policys_adapters():
    """`reference=peft_model.get_base_model()` still runs the policy's adapters: every margin
    was 0 (loss log 2 at every step) and the "reference" moved with the policy, silently."""
    model = _lora_llama()
    state = ft.TrainState.create(model, ft.optim.sgd())
    dpo = functools.partial(P.dpo_loss, beta=0.1)
    for ref in (model.get_base_model(), model):
        loss_fn = P.preference_loss(dpo, reference=ref)
        with pytest.raises(ValueError, match=r"shares \d+ trained parameter"):
            ft.accumulate_grads(state, [_pairs()], loss_fn)
    # a frozen copy, and reference log-probs taken with the adapters off, are references
    frozen = copy.deepcopy(model).requires_grad_(False)
    ft.accumulate_grads(state, [_pairs()], P.preference_loss(dpo, reference=frozen))
    batch = _pairs()
    with model.disable_adapter(), eval_mode(model):
        for side in ("chosen", "rejected"):
            inputs = {"input_ids": batch[f"{side}_input_ids"], "labels": batch[f"{side}_labels"]}
            batch[f"reference_{side}"] = P.sequence_logps(model, inputs)
    _, stats = ft.accumulate_grads(state, [batch], P.preference_loss(dpo))
    assert float(stats.loss) != pytest.approx(0.6931, abs=1e-4)  # margins are no longer 0


def test_rollout_reference_must_not_run_the_policys_adapters():
    """The base model of a LoRA policy as `rollout_batches(reference=)` scored with the
    policy's own adapters: ref_logps equalled the sampling log-probs, a KL to the last step."""
    model = _lora_llama()
    model.generation_config.pad_token_id = 0
    state = ft.TrainState.create(model, ft.optim.sgd())
    ids = torch.tensor([[7, 8, 9, 0], [11, 12, 13, 14]])
    prompts = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    r = ft.rl.sample(state, prompts, index=[0, 1], num_generations=2, max_new_tokens=3)
    adv = [torch.zeros(4)]
    for ref in (model.get_base_model(), model):
        with pytest.raises(ValueError, match="runs trainable LoRA adapters"):
            ft.rl.rollout_batches([r], adv, reference=ref)
    with model.disable_adapter():  # the documented LoRA reference: the base, adapters off
        (batch,) = ft.rl.rollout_batches([r], adv, reference=model)
    assert model.training  # the policy's mode is restored
    with torch.no_grad():
        policy = ft.rl.token_logps(model.eval(), batch)
    model.train()
    mask = batch["completion_mask"].bool()
    assert not torch.allclose(batch["ref_logps"][mask], policy[mask])


def test_a_lora_checkpoint_refuses_an_adapter_of_other_settings(tmp_path):
    """Another lora_alpha (or rsLoRA) has tensors of the same names and shapes: the resumed
    model scaled every adapter's output otherwise and the load said nothing. (Targets and
    ranks show in the tensors; a dropout changes training only, as a model's own does.)"""
    state = ft.TrainState.create(_lora_llama(), ft.optim.adamw())
    path = ft.save_checkpoint(state, tmp_path)
    for kw, line in [
        ({"alpha": 32}, "adapter setting lora_alpha: checkpoint has 8, model has 32"),
        ({"alpha": 8, "use_rslora": True}, "adapter setting use_rslora: checkpoint has False"),
    ]:
        other = ft.TrainState.create(ft.lora.apply(tiny_llama(seed=0), r=4, **kw), ft.optim.adamw())
        with pytest.raises(
            ft.checkpoint.CheckpointMismatchError, match="LoRA adapter differs"
        ) as e:
            ft.load_checkpoint(path, other)
        assert line in str(e.value)
    same = ft.TrainState.create(ft.lora.apply(tiny_llama(seed=0), r=4, alpha=8), ft.optim.adamw())
    assert ft.load_checkpoint(path, same).step == 0
