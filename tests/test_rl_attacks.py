"""Inputs ft.rl used silently wrong (a review's repros): a reference that trains, a reference
scored outside the sampling autocast, padded prompts without a mask, a `dr_grpo` length other
than the rollouts'. Each test failed before its fix; messages are ftrain's own."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re

import pytest
import torch

import ftrain as ft
import rl_workers as W
from ftrain.eval import eval_mode
from ftrain.precision import Precision
from helpers import tiny_llama


def _state(model=None, **kw):
    return ft.TrainState.create(model or W.model(), ft.optim.adamw(), seed=0, **kw)


def _prompts(ids=W.PROMPTS):
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def _rollout(state, **kw):
    kw = dict(index=[0, 1, 2], num_generations=2, max_new_tokens=4) | kw
    return ft.rl.sample(state, _prompts(), **kw)


# --- the reference must be frozen ---------------------------------------------------------------


def test_a_reference_that_shares_the_policys_parameters_is_refused():
    """`reference=state.model` was accepted: ref_logps were the policy's, the KL 0 at every
    step however far the policy moved, and the beta penalty never acted."""
    state = _state()
    r = _rollout(state)
    adv = [torch.zeros(6)]
    with pytest.raises(ValueError, match=r"parameter\(s\) that the policy trains .*deepcopy"):
        ft.rl.rollout_batches([r], adv, reference=state.model)
    # A separate model is a reference whether it requires grad (from_pretrained's default,
    # a copy) or not: it runs without gradients and no step touches it.
    frozen = copy.deepcopy(state.model).eval().requires_grad_(False)
    (want,) = ft.rl.rollout_batches([r], adv, reference=frozen)
    for ref in (W.model(), copy.deepcopy(state.model)):
        (batch,) = ft.rl.rollout_batches([r], adv, reference=ref)
        assert batch["ref_logps"].shape == r.logps.shape
    torch.testing.assert_close(batch["ref_logps"], want["ref_logps"], rtol=0, atol=0)


def test_a_hand_built_or_pickled_rollout_needs_a_frozen_reference():
    """A rollout built by hand records no policy, nor does one pickled (another process's
    object ids would match nothing, and the policy itself would pass as a reference)."""
    state = _state()
    adv = [torch.zeros(6)]
    sampled = _rollout(state)
    assert sampled.trained
    unpickled = pickle.loads(pickle.dumps(sampled))
    assert not unpickled.trained and torch.equal(unpickled.logps, sampled.logps)
    with pytest.raises(ValueError, match=r"parameter\(s\) that require grad"):
        ft.rl.rollout_batches([unpickled], adv, reference=state.model)
    r = dataclasses.replace(sampled, trained=frozenset())
    partly = copy.deepcopy(state.model).requires_grad_(False)
    partly.lm_head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) that require grad .*lm_head"):
        ft.rl.rollout_batches([r], adv, reference=partly)
    (batch,) = ft.rl.rollout_batches([r], adv, reference=partly.requires_grad_(False))
    assert batch["ref_logps"].shape == r.logps.shape


def _lora_with_saved_head():
    """A LoRA Llama whose adapters and trained copy of the head change the output."""
    model = ft.lora.apply(
        tiny_llama(), r=4, alpha=8, targets=["q_proj"], modules_to_save=["lm_head"]
    )
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def test_a_lora_reference_with_the_adapters_off_is_still_a_reference():
    """Inside `disable_adapter()` the adapters and the trained head copy (still
    requires_grad) do not run: accepted, and the log-probs are the base model's."""
    base = tiny_llama()
    model = _lora_with_saved_head()
    state = ft.TrainState.create(model, ft.optim.sgd(), seed=0)
    r = _rollout(state, num_generations=1)
    adv = [torch.zeros(3)]
    for ref in (model.get_base_model(), model):
        with pytest.raises(ValueError, match=r"runs trainable LoRA adapters|require grad"):
            ft.rl.rollout_batches([r], adv, reference=ref)
    with model.disable_adapter():
        (batch,) = ft.rl.rollout_batches([r], adv, reference=model)
    with torch.no_grad(), eval_mode(base):
        want = ft.rl.token_logps(base, batch)
        policy = ft.rl.token_logps(model.eval(), batch)
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(batch["ref_logps"][mask], want[mask], rtol=0, atol=1e-6)
    assert not torch.allclose(policy[mask], want[mask])


# --- the reference runs under the sampling autocast ---------------------------------------------


def test_reference_logps_use_the_rollouts_autocast_so_step_0_kl_is_exactly_0():
    """With precision="bf16" the reference was scored in float32 while the policy's log-probs
    are autocast: at step 0 (policy == reference) the KL and its gradient were not 0."""
    torch.manual_seed(0)
    model = W.model().float()
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    state = _state(model, strategy=ft.strategies.SingleDevice(precision="bf16"))
    r = _rollout(state, max_new_tokens=6)
    assert r.precision == Precision.of("bf16")
    (batch,) = ft.rl.rollout_batches([r], [torch.zeros(6)], reference=reference)
    with torch.no_grad(), eval_mode(model), state.strategy.autocast():
        policy = ft.rl.token_logps(model, batch, temperature=r.temperature)
    mask = batch["completion_mask"].bool()
    assert torch.equal(ft.rl.kl_k3(policy, batch["ref_logps"])[mask], torch.zeros(int(mask.sum())))
    grads, stats = ft.accumulate_grads(state, [batch], ft.rl.policy_loss(beta=0.04))
    assert float(stats.loss) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


# --- padded prompts need their mask -------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, rows",
    [
        ([[5, 9, 14, 0, 0], [7, 3, 22, 8, 40]], [0]),  # right-padded
        ([[0, 0, 5, 9, 14], [7, 3, 22, 8, 40]], [0]),  # left-padded
        ([[5, 0, 14, 9, 9], [7, 3, 22, 8, 0]], [0, 1]),  # inside and at the end
    ],
)
def test_sample_refuses_prompts_holding_the_pad_id_without_a_mask(ids, rows):
    """Without attention_mask every pad token was prompt text (prompt_mask all 1): the
    completions were conditioned on padding, silently."""
    state = _state()
    with pytest.raises(
        ValueError, match=rf"pad id 0 \(rows {re.escape(str(rows))}\) but no attention_mask"
    ):
        ft.rl.sample(state, {"input_ids": torch.tensor(ids)}, index=[0, 1], max_new_tokens=2)


def test_sample_without_a_mask_takes_unpadded_prompts_and_a_real_pad_token_with_a_mask():
    state = _state()
    ids = torch.tensor([[5, 9, 14, 20], [7, 3, 22, 8]])
    kw = dict(index=[0, 1], max_new_tokens=3)
    plain = ft.rl.sample(state, {"input_ids": ids}, **kw)
    ones = ft.rl.sample(state, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, **kw)
    assert torch.equal(plain.completion_ids, ones.completion_ids)
    real = torch.tensor([[5, 0, 14, 20], [7, 3, 22, 8]])  # the pad id as a real prompt token
    r = ft.rl.sample(state, {"input_ids": real, "attention_mask": torch.ones_like(real)}, **kw)
    assert r.prompt_mask.tolist() == [[1] * 4] * 2


# --- dr_grpo's length is the rollouts' ----------------------------------------------------------


def test_dr_grpo_takes_the_rollouts_max_new_tokens_and_refuses_another():
    """A max_completion_length larger than the rollouts' max_new_tokens was accepted and
    divided the loss and gradient by it (64 instead of 4: a 16x smaller update)."""
    state = _state()
    r = _rollout(state, stop_token_ids=[])
    assert r.max_new_tokens == 4
    micro = ft.rl.rollout_batches([r], [torch.linspace(-1, 1, 6, dtype=torch.float64)])
    assert micro[0]["max_new_tokens"] == 4
    default, _ = ft.accumulate_grads(state, micro, ft.rl.policy_loss(loss_type="dr_grpo"))
    given, _ = ft.accumulate_grads(
        state, micro, ft.rl.policy_loss(loss_type="dr_grpo", max_completion_length=4)
    )
    assert all(torch.equal(default[k], given[k]) for k in default)
    for length in (8, 64):
        loss_fn = ft.rl.policy_loss(loss_type="dr_grpo", max_completion_length=length)
        with pytest.raises(ValueError, match=rf"\(max_completion_length={length}\) differs .* 4"):
            ft.accumulate_grads(state, micro, loss_fn)
    # a hand-built batch records nothing: the length must be given
    plain = [{k: v for k, v in micro[0].items() if k != "max_new_tokens"}]
    with pytest.raises(ValueError, match="dr_grpo' needs max_completion_length"):
        ft.accumulate_grads(state, plain, ft.rl.policy_loss(loss_type="dr_grpo"))
    ft.accumulate_grads(
        state, plain, ft.rl.policy_loss(loss_type="dr_grpo", max_completion_length=8)
    )


def test_a_rollout_from_before_the_new_fields_still_loads_and_works():
    """A Rollout pickled without `max_new_tokens` and `precision` unpickles with None and full
    precision (what it was used with); dr_grpo then asks for the length."""
    state = _state()
    r = _rollout(state)
    Rollout = type(r)
    fields = {k: v for k, v in vars(r).items() if k not in ("max_new_tokens", "precision")}
    old = Rollout.__new__(Rollout)
    old.__dict__.update(fields)  # what unpickling an older Rollout restores
    old = pickle.loads(pickle.dumps(old))
    assert old.max_new_tokens is None and old.precision is None
    frozen = copy.deepcopy(state.model).requires_grad_(False)
    (batch,) = ft.rl.rollout_batches([old], [torch.zeros(6)], reference=frozen)
    assert "max_new_tokens" not in batch
    with pytest.raises(ValueError, match="dr_grpo' needs max_completion_length"):
        ft.accumulate_grads(state, [batch], ft.rl.policy_loss(loss_type="dr_grpo", beta=0.04))
