"""Post-training inputs ft.rl hung on or refused wrongly (fourth attack session). Each test
failed before its fix; messages are ftrain's own."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import ftrain as ft
from helpers import load_example, rank_env, tiny_llama

PROMPTS = torch.tensor([[0, 0, 5, 9, 14], [7, 3, 22, 8, 40], [0, 31, 2, 17, 6]])


def _model() -> torch.nn.Module:
    m = tiny_llama(dtype=torch.float64)
    m.generation_config.pad_token_id, m.generation_config.eos_token_id = 0, 6
    return m


# --- data-parallel ranks sampling with different caps -------------------------------------------


def _caps_differ(rank: int, world: int, port: int, out: str) -> None:
    """Rank r samples with max_new_tokens 3 + 3r, then both gather advantages."""
    rank_env(rank, world, port)
    with ft.strategies.from_env("ddp", timeout=timedelta(seconds=60)) as strategy:
        state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0, strategy=strategy)
        ids = PROMPTS[rank : rank + 1]
        prompts = {"input_ids": ids, "attention_mask": (ids != 0).long()}
        kw = dict(index=[rank], num_generations=2, stop_token_ids=[])
        try:
            ft.rl.sample(state, prompts, max_new_tokens=3 + 3 * rank, **kw)
        except ValueError as e:
            Path(out, f"caps-{rank}.txt").write_text(str(e))
        r = ft.rl.sample(state, prompts, max_new_tokens=4, **kw)  # still in step
        adv = ft.rl.group_advantages(torch.tensor([1.0, 0.0]), 2, strategy=strategy)
        Path(out, f"same-{rank}.txt").write_text(f"{r.completion_ids.shape[1]} {adv.tolist()}")


def test_ranks_sampling_with_different_max_new_tokens_are_refused_on_every_rank(tmp_path):
    """Each rank decodes in step with the others (one all-reduce per token) up to its own
    `max_new_tokens`: a rank with a smaller cap (e.g. computed from its prompts' lengths) left
    the loop while the other waited in its all-reduce, a hang until the collective's timeout,
    with no message. Now every rank raises before decoding, and equal caps sample as before."""
    from launch import run_ranks

    run_ranks(_caps_differ, str(tmp_path), timeout=120)
    for rank in (0, 1):
        text = (tmp_path / f"caps-{rank}.txt").read_text()
        assert "max_new_tokens differs between the data-parallel ranks ([3, 6]" in text, text
        assert (tmp_path / f"same-{rank}.txt").read_text().startswith("4 ")


# --- logits that are not finite on one rank ----------------------------------------------------


def _nan_on_rank_1(rank: int, world: int, port: int, out: str) -> None:
    """Token 40's embedding is NaN: only rank 1's prompt holds it (one new token, so no rank
    feeds a sampled token back). Then both gather advantages."""
    rank_env(rank, world, port)
    with ft.strategies.from_env("ddp", timeout=timedelta(seconds=60)) as strategy:
        model = _model()
        with torch.no_grad():
            model.model.embed_tokens.weight[40] = float("nan")
        state = ft.TrainState.create(model, ft.optim.adamw(), seed=0, strategy=strategy)
        ids = PROMPTS[rank : rank + 1]
        prompts = {"input_ids": ids, "attention_mask": (ids != 0).long()}
        try:
            ft.rl.sample(state, prompts, index=[rank], num_generations=2, max_new_tokens=1)
        except ValueError as e:
            Path(out, f"nan-{rank}.txt").write_text(str(e))
        adv = ft.rl.group_advantages(torch.tensor([1.0, 0.0]), 2, strategy=strategy)
        Path(out, f"after-{rank}.txt").write_text(str(adv.tolist()))


def test_logits_not_finite_on_one_rank_are_refused_on_every_rank(tmp_path):
    """NaN logits from one rank's prompts alone (a poisoned embedding row, an fp16 overflow on
    a long prompt) raised on that rank only: the others went on into the next collective
    (`group_advantages`' gather) and waited there for the raising rank until the timeout. Now
    one gather of each rank's flag, and every rank raises, naming the rank."""
    from launch import run_ranks

    run_ranks(_nan_on_rank_1, str(tmp_path), timeout=120)
    texts = [(tmp_path / f"nan-{rank}.txt").read_text() for rank in (0, 1)]
    assert "not finite (NaN or inf) while sampling no row of this rank's" in texts[0], texts
    assert "while sampling rows [0, 1]" in texts[1], texts
    assert all("(on data-parallel rank(s) [1])" in t for t in texts), texts
    for rank in (0, 1):  # the ranks are still in step: groups [1, 0] on each
        assert (tmp_path / f"after-{rank}.txt").read_text().startswith("[0.707"), rank


# --- a model that takes logits_to_keep in **kwargs and ignores it --------------------------------


class _EveryLogit(LlamaForCausalLM):
    """A causal LM that takes `logits_to_keep` in `**kwargs` and returns every position's
    logits (as remote-code models and some of transformers' own do: xLSTM, TrOCR, Whisper's
    decoder): `logits_to_keep` is an optimisation a forward may ignore."""

    def forward(self, *args, logits_to_keep=0, **kwargs):
        return super().forward(*args, **kwargs)


def test_token_logps_of_a_model_returning_every_positions_logits():
    """`token_logps` took the first `width` of the logits a model returned, assuming it
    honoured `logits_to_keep`: for a model returning every position's, training failed with a
    broadcasting error of torch's (`sample`, which reads the last position, worked). Now it
    takes the last ones, and such a model trains as one that honours the argument."""
    plain = _model()
    every = _EveryLogit(plain.config).to(torch.float64)
    every.load_state_dict(plain.state_dict())
    every.generation_config.pad_token_id, every.generation_config.eos_token_id = 0, 6
    prompts = {"input_ids": PROMPTS, "attention_mask": (PROMPTS != 0).long()}
    grads = []
    for model in (plain, every):
        state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
        rollout = ft.rl.sample(state, prompts, index=[0, 1, 2], num_generations=2, max_new_tokens=4)
        adv = ft.rl.group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 2.0]), 2)
        micro = ft.rl.rollout_batches([rollout], [adv], reference=_model().requires_grad_(False))
        logps = ft.rl.token_logps(model, micro[0])
        torch.testing.assert_close(logps * rollout.completion_mask, rollout.logps)
        g, _ = ft.accumulate_grads(state, micro, ft.rl.policy_loss(beta=0.04))
        grads.append({k: v.clone() for k, v in g.items()})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k])


# --- the GRPO example's flags --------------------------------------------------------------------


def test_grpo_example_refuses_one_generation_naming_its_flag(capsys):
    """`--generations 1` was accepted, the model built and a first batch sampled and scored,
    then `group_advantages` raised (one completion per prompt: every advantage is 0) without
    naming the flag. Now argparse refuses it, naming `--generations`."""
    with pytest.raises(SystemExit) as e:
        load_example("grpo_addition").main(["--generations", "1", "--steps", "2"])
    assert e.value.code == 2
    assert "argument --generations: must be an integer >= 2, got 1" in capsys.readouterr().err


# --- rewards that carry a graph ----------------------------------------------------------------


def test_rewards_of_a_model_run_with_gradients_are_constants_of_the_update():
    """Rewards scored by a model with autograd on (a reward model called without no_grad, or
    the policy judging its own completions) gave advantages that carried the scorer's graph
    into the loss: the policy's gradient flowed through its own rewards (another gradient than
    the policy gradient's wherever the loss weighs a group's rows unequally: completions of
    different lengths under dapo, clipped tokens), and a second update on the same rollouts
    (num_iterations=2) failed with torch's 'backward through the graph a second time'. Now
    advantages are detached (TRL scores without gradients): the gradient is the one of the
    same rewards given as plain numbers, and every iteration runs."""
    state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0)
    prompts = {"input_ids": PROMPTS, "attention_mask": (PROMPTS != 0).long()}
    rollout = ft.rl.sample(state, prompts, index=[0, 1, 2], num_generations=2, max_new_tokens=4)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    # the policy as its own judge: its logit of token 7 after the completion, with gradients
    rewards = state.model(input_ids=ids).logits[:, -1, 7]
    assert rewards.requires_grad
    adv = ft.rl.group_advantages(rewards, 2)
    assert not adv.requires_grad
    plain = ft.rl.rollout_batches([rollout], [ft.rl.group_advantages(rewards.detach(), 2)])
    want, _ = ft.accumulate_grads(state, plain, ft.rl.policy_loss())
    want = {k: v.clone() for k, v in want.items()}
    # advantages computed by hand from such rewards are taken as constants too
    hand = rewards - rewards.view(-1, 2).mean(1).repeat_interleave(2)
    for advantages in (adv, hand):
        micro = ft.rl.rollout_batches([rollout], [advantages])
        for _ in range(2):  # num_iterations=2: the same micro-batches twice
            got, _ = ft.accumulate_grads(state, micro, ft.rl.policy_loss())
        if advantages is adv:
            for k in want:
                torch.testing.assert_close(got[k], want[k])


def test_old_log_probs_recomputed_with_gradients_on_still_train():
    """TRL recomputes the old log-probs with a forward of the policy; done by hand with
    `token_logps` and autograd on, `old_logps` held the policy's graph and policy_loss used it
    as it was: the ratio exp(logp - old) had a gradient of exactly 0, so no update moved the
    policy, silently. Now the old (and reference) log-probs are taken as constants: the
    gradient is the one of the same values computed without gradients."""
    state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0)
    prompts = {"input_ids": PROMPTS, "attention_mask": (PROMPTS != 0).long()}
    rollout = ft.rl.sample(state, prompts, index=[0, 1, 2], num_generations=2, max_new_tokens=4)
    adv = ft.rl.group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0]), 2)
    grads = []
    for grad_on in (False, True):
        (batch,) = ft.rl.rollout_batches([rollout], [adv])
        with torch.set_grad_enabled(grad_on):
            old = ft.rl.token_logps(state.model, batch) * rollout.completion_mask
        micro = [{**batch, "old_logps": old}]
        g, _ = ft.accumulate_grads(state, micro, ft.rl.policy_loss())
        grads.append({k: v.clone() for k, v in g.items()})
    assert max(v.abs().max().item() for v in grads[0].values()) > 1e-3
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k])


def test_rollouts_sampled_under_inference_mode_train():
    """Sampling and scoring under `torch.inference_mode()` (what PyTorch recommends for
    generation) gave a Rollout of inference tensors, which autograd cannot save: the update
    failed in the embedding's backward with torch's 'Inference tensors cannot be saved for
    backward'. Now rollout_batches copies them: the update is the one of a rollout sampled
    under no_grad."""
    state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0)
    prompts = {"input_ids": PROMPTS, "attention_mask": (PROMPTS != 0).long()}
    reference = _model().requires_grad_(False)
    grads = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            rollout = ft.rl.sample(
                state, prompts, index=[0, 1, 2], num_generations=2, max_new_tokens=4
            )
            adv = ft.rl.group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0]), 2)
        micro = ft.rl.rollout_batches([rollout], [adv], reference=reference)
        g, _ = ft.accumulate_grads(state, micro, ft.rl.policy_loss(beta=0.1))
        grads.append({k: v.clone() for k, v in g.items()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k])
