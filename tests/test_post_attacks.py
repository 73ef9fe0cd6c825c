"""Silent failures found by attacking LoRA, preference losses, the chunked loss and generation:
each test failed before its fix (a wrong value or a dropped argument, without an error)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

import ftrain as ft

P = ft.preference


def _llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


class _StopOn(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("eos", [None, [39, 38]])
def test_generate_ends_a_row_where_its_stopping_criteria_hold_as_for_the_prompt_alone(eos):
    # HF stops a batch row that meets a stopping criterion but, without an eos criterion, keeps
    # sampling it, and with one fills it with pad ids: ft.generate returned those tokens.
    model = _llama()
    model.generation_config.eos_token_id = eos
    prompts = [[5, 6, 7], [9, 3], [11, 12, 13, 14]]
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    free = model.generate(torch.tensor([prompts[0]]), **kw)[0, 3:].tolist()
    stop = free[2]  # the first prompt meets the criterion after 3 new tokens

    def alone(p):
        crit = StoppingCriteriaList([_StopOn(stop)])
        return model.generate(torch.tensor([p]), stopping_criteria=crit, **kw)[0, len(p) :].tolist()

    state = ft.TrainState.create(model, ft.optim.sgd())
    batches = ft.make_batches([{"input_ids": p} for p in prompts], batch_size=3, shuffle=False)
    crit = StoppingCriteriaList([_StopOn(stop)])
    got = [
        r for b in ft.generate(state, batches, stopping_criteria=crit, **kw) for r in b["token_ids"]
    ]
    assert got[0] == free[:3]
    assert got == [alone(p) for p in prompts]


def test_generate_refuses_stop_strings_it_cannot_find_or_trace():
    model = _llama()
    state = ft.TrainState.create(model, ft.optim.sgd())
    batches = [{"input_ids": torch.tensor([[5, 6]])}]
    with pytest.raises(ValueError, match=r"stop_strings=\.\.\. needs tokenizer"):
        list(ft.generate(state, batches, max_new_tokens=2, stop_strings=["x"]))
    crit = StoppingCriteriaList([_StopOn(3)])
    with pytest.raises(ValueError, match="num_beams > 1 is not supported"):
        list(ft.generate(state, batches, max_new_tokens=2, num_beams=2, stopping_criteria=crit))


def test_lora_refuses_a_target_or_module_to_save_that_matches_nothing():
    # PEFT raises only when no target matches: a misspelt name beside good ones was dropped.
    with pytest.raises(ValueError, match=r"targets \['qproj'\] match no module"):
        ft.lora.apply(_llama(), r=2, targets=["q_proj", "qproj"])
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_haed'\] match no module"):
        ft.lora.apply(_llama(), r=2, modules_to_save=["lm_haed"])
    model = ft.lora.apply(_llama(), r=2, targets=["q_proj"], modules_to_save=["lm_head"])
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("q_proj.lora_A" in n for n in trained) and any("lm_head" in n for n in trained)


def test_lora_refuses_a_model_with_adapters_and_one_without_linear_layers():
    model = ft.lora.apply(_llama(), r=2)
    # get_peft_model nested a second PeftModel, adapting the first one's own layers.
    with pytest.raises(ValueError, match="already holds PEFT adapters"):
        ft.lora.apply(model, r=2)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"found no torch\.nn\.Linear layer.*pass targets"):
        ft.lora.apply(gpt2, r=2)


_PAIRS = {
    "chosen_input_ids": torch.tensor([[1, 5, 6, 7, 8], [1, 9, 3, 4, 0]]),
    "chosen_labels": torch.tensor([[-100, -100, 6, 7, 8], [-100, -100, 3, 4, -100]]),
    "rejected_input_ids": torch.tensor([[1, 5, 6, 2, 0, 0], [1, 9, 3, 11, 12, 13]]),
    "rejected_labels": torch.tensor([[-100, -100, 6, 2, -100, -100], [-100, -100, 3, 11, 12, 13]]),
    "chosen_attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
    "rejected_attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
}


@pytest.mark.parametrize(
    "loss", [P.simpo_loss, P.orpo_loss, functools.partial(P.simpo_loss, beta=1)]
)
def test_preference_loss_averages_the_log_probs_of_simpo_and_orpo_by_default(loss):
    # SimPO and ORPO are defined on length-averaged log-probs (IPO too, in TRL): the default
    # average=False gave another loss without a word.
    model = _llama()
    with torch.no_grad():
        got, n = P.preference_loss(loss)(model, _PAIRS)
        averaged, _ = P.preference_loss(loss, average=True)(model, _PAIRS)
        summed, _ = P.preference_loss(loss, average=False)(model, _PAIRS)
    assert torch.equal(got, averaged) and not torch.allclose(got, summed) and int(n) == 2


def test_ipo_averages_by_default_and_dpo_sums():
    model, ref = _llama(), _llama().requires_grad_(False)
    with torch.no_grad():
        ref.lm_head.weight.mul_(1.5)  # margins != 0: sums and averages give other losses
        for loss, average in ((P.ipo_loss, True), (functools.partial(P.dpo_loss, beta=0.1), False)):
            got, _ = P.preference_loss(loss, reference=ref)(model, _PAIRS)
            want, _ = P.preference_loss(loss, reference=ref, average=average)(model, _PAIRS)
            other, _ = P.preference_loss(loss, reference=ref, average=not average)(model, _PAIRS)
            assert torch.equal(got, want) and not torch.allclose(got, other)


def test_chunked_loss_keeps_no_weight_gradient_for_a_frozen_head():
    # LoRA x chunked loss: a (vocab, hidden) float32 weight gradient was built for the frozen
    # head on every call, the memory the chunked loss exists to save.
    model = ft.lora.apply(_llama(), r=2)
    batch = {
        "input_ids": torch.tensor([[1, 5, 6, 7, 8, 9]]),
        "labels": torch.tensor([[1, 5, 6, 7, 8, 9]]),
    }
    loss, _ = ft.chunked_causal_lm_loss(chunk_size=2)(model, batch)
    assert [t is None for t in loss.grad_fn.saved_tensors] == [False, True, True]
    plain, _ = ft.losses.causal_lm_loss()(model, batch)
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    want = torch.autograd.grad(plain, [p for p in model.parameters() if p.requires_grad])
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_loop_body_of_generate_runs_with_the_callers_grad_mode_and_precision():
    # generate held no_grad and the strategy's autocast across its yields: both are
    # thread-wide, so the caller's loop body ran without gradients and in bf16.
    model = _llama()
    strategy = ft.strategies.SingleDevice(precision="bf16")
    state = ft.TrainState.create(model, ft.optim.sgd(), strategy=strategy)
    batches = ft.make_batches([{"input_ids": [5, 6, 7]}], batch_size=1, shuffle=False)
    w = torch.ones(3, 3, requires_grad=True)
    for out in ft.generate(state, batches, max_new_tokens=2, do_sample=False):
        y = torch.ones(1, 3) @ w
        assert torch.is_grad_enabled() and y.requires_grad
        assert y.dtype == torch.float32
        assert not model.training  # eval mode holds across the yields
        assert len(out["token_ids"][0]) == 2
    assert torch.is_grad_enabled()


def test_multiple_choice_metrics_refuses_a_subject_index_outside_the_subjects():
    model = _llama()
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, -100, 8], "subject": 2}]
    state = ft.TrainState.create(model, ft.optim.sgd())
    metrics_fn = ft.multiple_choice_metrics(choice_ids=[8, 9], subjects=["a", "b"])
    with pytest.raises(ValueError, match=r"subject index is outside \[0, 2\)"):
        ft.evaluate(
            state, ft.make_batches(rows, batch_size=1, shuffle=False), metrics_fn=metrics_fn
        )
