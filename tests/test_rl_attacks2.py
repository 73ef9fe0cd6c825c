"""Post-training inputs ft.rl and ft.preference used silently wrong (third attack session):
equal rewards given non-zero advantages by rounding, a reference whose KL a zero `beta` drops,
dropout in the policy's forward against log-probs computed without it. Each test failed before
its fix; messages are ftrain's own."""

from __future__ import annotations

import math

import pytest
import torch

import ftrain as ft
import rl_workers as W
from helpers import tiny_llama


def _prompts(ids=W.PROMPTS):
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def _model(dropout: float = 0.0) -> torch.nn.Module:
    m = tiny_llama(dtype=torch.float64, dropout=dropout)
    m.generation_config.pad_token_id, m.generation_config.eos_token_id = 0, 6
    return m


def _rollout(state, **kw):
    kw = dict(index=[0, 1, 2], num_generations=2, max_new_tokens=4) | kw
    return ft.rl.sample(state, _prompts(), **kw)


# --- advantages of equal rewards are 0, whatever the rewards' dtype -------------------------------


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (1000.1, torch.float32),
        (0.1, torch.float16),
        (3.3, torch.bfloat16),
        (12345.6, torch.float32),
    ],
)
def test_equal_rewards_give_zero_advantages_not_rounding_over_1e4(value, dtype):
    """A group whose rewards are all equal has nothing to learn: its advantages are exactly 0.
    The group mean in the rewards' own dtype rounded (1000.1 three times in float32 has a mean
    one ulp off), and `(r - mean) / (std + 1e-4)` blew the ulp up to advantages of +-0.35
    (float16: +-0.6), pushing every completion of an uninformative group one way."""
    rewards = torch.tensor([value] * 3 + [value + 1] * 3, dtype=dtype)
    for scale in ("group", "batch", "none"):
        adv = ft.rl.group_advantages(rewards, 3, scale=scale)
        assert adv.dtype == torch.promote_types(dtype, torch.float32)  # as before
        if scale != "batch":  # batch: the groups differ, so both are non-zero
            assert adv.abs().max().item() == 0.0, (scale, adv)
        else:  # both groups equal inside: +-(distance to the batch mean) / std, equal magnitude
            assert torch.allclose(adv[:3], -adv[3:]), adv
    same = torch.tensor([value] * 6, dtype=dtype)
    assert ft.rl.group_advantages(same, 3, scale="batch").abs().max().item() == 0.0
    assert ft.rl.rloo_advantages(same, 3, normalize=True).abs().max().item() == 0.0
    assert ft.rl.rloo_advantages(same, 3).abs().max().item() == 0.0


# --- a reference whose KL is dropped -----------------------------------------------------------


def test_a_reference_with_beta_0_is_refused_not_ignored():
    """`rollout_batches(reference=ref)` computes `ref_logps` for a KL; `policy_loss()`'s
    default `beta=0.0` dropped them without a word (no KL penalty while the user paid for a
    reference forward and believed one applied)."""
    state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0)
    rollout = _rollout(state)
    ref = _model().eval().requires_grad_(False)
    micro = ft.rl.rollout_batches([rollout], [torch.ones(6)], reference=ref)
    with pytest.raises(ValueError, match=r"policy_loss\(beta=0\.0\) would ignore"):
        ft.accumulate_grads(state, micro, ft.rl.policy_loss())
    ft.accumulate_grads(state, micro, ft.rl.policy_loss(beta=0.04))  # the KL applies
    plain = ft.rl.rollout_batches([rollout], [torch.ones(6)])
    ft.accumulate_grads(state, plain, ft.rl.policy_loss())  # no reference, no KL: fine


# --- dropout in the policy's forward -----------------------------------------------------------


def test_policy_loss_refuses_a_policy_that_runs_dropout():
    """`sample` computes the old log-probs in eval mode and `rollout_batches` the reference's
    too, while `accumulate_grads` runs the policy in training mode: with dropout the ratio is not
    1 before any update (clipping acts on dropout noise) and the KL compares a dropped-out
    forward with a clean one. It ran silently; now it raises, naming dropout."""
    state = ft.TrainState.create(_model(dropout=0.3), ft.optim.adamw(), seed=0)
    rollout = _rollout(state)
    micro = ft.rl.rollout_batches([rollout], [torch.ones(6)])
    # what it did: a ratio away from 1 at the very first update
    state.model.train()
    logps = ft.rl.token_logps(state.model, micro[0])
    mask = rollout.completion_mask.bool()
    assert (logps - rollout.logps)[mask].abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"dropout.*attention_dropout \(p=0\.3\)"):
        ft.accumulate_grads(state, micro, ft.rl.policy_loss())
    # an nn.Dropout module (GPT-2's, a LoRA adapter's) counts too
    model = _model()
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.1))
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    micro = ft.rl.rollout_batches([_rollout(state)], [torch.ones(6)])
    with pytest.raises(ValueError, match=r"dropout.*model\.layers\.0\.mlp\.act_fn\.1"):
        ft.accumulate_grads(state, micro, ft.rl.policy_loss())
    # dropout of probability 0 is no dropout
    state = ft.TrainState.create(_model(dropout=0.0), ft.optim.adamw(), seed=0)
    micro = ft.rl.rollout_batches([_rollout(state)], [torch.ones(6)])
    ft.accumulate_grads(state, micro, ft.rl.policy_loss())


# --- data-parallel ranks drawing the same samples ------------------------------------------------


def test_ranks_passing_the_same_index_are_refused_on_every_rank(tmp_path):
    """Completions are seeded by their number `index[i] * G + g`, not by the rank: two ranks
    passing their local row numbers (index=[0, 1] each) drew the same random numbers for their
    completions, silently (correlated samples; identical ones for equal prompts). Now every
    rank raises, after one gather of the numbers; distinct numbers sample as before."""
    import rl_attack2_workers
    from launch import run_ranks

    run_ranks(rl_attack2_workers.same_index_on_both_ranks, str(tmp_path), timeout=120)
    for rank in (0, 1):
        text = (tmp_path / f"same-{rank}.txt").read_text()
        assert "completion numbers [0, 1, 2, 3] are sampled on more than one" in text, text
        assert "index" in text
    assert (tmp_path / "distinct-0.txt").read_text() == "[0, 1, 2, 3]"
    assert (tmp_path / "distinct-1.txt").read_text() == "[4, 5, 6, 7]"


# --- preference log-probs of left-padded rows --------------------------------------------------


def test_sequence_logps_of_a_left_padded_row_equal_the_unpadded_rows():
    """With labels copied from the input ids (no -100 at the pads), `sequence_logps` scored the
    pads' targets: the last pad "predicting" the row's first token and each pad its neighbour,
    so a row's DPO log-prob (and its length average) depended on how much padding the rows
    batched with it added. The core's loss drops those targets (`ft.losses.causal_targets`);
    now the preference log-probs do too."""
    model = tiny_llama(dtype=torch.float64).eval()
    row = torch.tensor([[5, 6, 7, 8]])
    alone = {"input_ids": row, "labels": row, "attention_mask": torch.ones_like(row)}
    ids = torch.tensor([[0, 0, 5, 6, 7, 8]])
    padded = {"input_ids": ids, "labels": ids, "attention_mask": (ids != 0).long()}
    for average in (False, True):
        want = ft.preference.sequence_logps(model, alone, average=average)
        got = ft.preference.sequence_logps(model, padded, average=average)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# --- dropout in a preference policy ------------------------------------------------------------


def _pairs():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10]])
    labels = torch.tensor([[-100, -100, 7, 8], [-100, -100, 9, 10]])
    mask = torch.ones_like(ids)
    return {
        "chosen_input_ids": ids[:1],
        "chosen_labels": labels[:1],
        "chosen_attention_mask": mask[:1],
        "rejected_input_ids": ids[1:],
        "rejected_labels": labels[1:],
        "rejected_attention_mask": mask[1:],
    }


def test_dpo_refuses_a_policy_that_runs_dropout_against_its_reference():
    """DPO's margin compares the policy's log-probs with a reference's computed in eval mode
    (or precomputed): a policy that drops out (in training mode, as accumulate_grads runs it)
    started with a non-zero margin and a loss away from log 2 with policy == reference (the DPO
    authors and TRL's `disable_dropout=True` turn it off). It ran silently; now it raises.
    A reference-free loss (SimPO) has no such comparison: dropout is left alone there."""
    import functools

    policy = tiny_llama(dtype=torch.float64, dropout=0.3)
    reference = tiny_llama(dtype=torch.float64).eval().requires_grad_(False)
    state = ft.TrainState.create(policy, ft.optim.adamw(), seed=0)
    dpo = functools.partial(ft.preference.dpo_loss, beta=0.1)
    with pytest.raises(ValueError, match=r"dropout.*attention_dropout \(p=0\.3\)"):
        ft.accumulate_grads(
            state, [_pairs()], ft.preference.preference_loss(dpo, reference=reference)
        )
    with torch.no_grad():
        pre = {
            f"reference_{side}": ft.preference.sequence_logps(
                reference, {k.removeprefix(f"{side}_"): v for k, v in _pairs().items() if side in k}
            )
            for side in ("chosen", "rejected")
        }
    with pytest.raises(ValueError, match=r"dropout"):
        ft.accumulate_grads(state, [_pairs() | pre], ft.preference.preference_loss(dpo))
    ft.accumulate_grads(state, [_pairs()], ft.preference.preference_loss(ft.preference.simpo_loss))
    ft.rng.disable_dropout(policy)  # what the error says to do: the same state trains
    ft.accumulate_grads(state, [_pairs()], ft.preference.preference_loss(dpo, reference=reference))
    clean = ft.TrainState.create(tiny_llama(dtype=torch.float64), ft.optim.adamw(), seed=0)
    ft.accumulate_grads(clean, [_pairs()], ft.preference.preference_loss(dpo, reference=reference))


# --- what lies outside the completion mask ------------------------------------------------------


def _no_pad_model() -> torch.nn.Module:
    """A model that never emits its pad token (its logit is -inf, as for a suppressed or
    padded-vocabulary id): the pads after a stop token have log-prob -inf."""
    m = _model()
    m.generation_config.pad_token_id = 60

    def never_pad(module, args, out):
        return out.index_fill(-1, torch.tensor([60]), -float("inf"))

    m.lm_head.register_forward_hook(never_pad)
    return m


def test_tokens_after_the_stop_do_not_reach_the_loss_even_at_log_prob_minus_inf():
    """The per-token loss was masked by multiplying with the completion mask: a pad after a stop
    token of log-prob -inf made the k3 KL `exp(ref - logp)` NaN there, and NaN * 0 is NaN, so
    the loss and every gradient were NaN and each update was skipped (beta > 0), silently.
    Positions outside the mask are now inert: the loss equals the one with any other token
    there."""
    import copy

    policy = _no_pad_model()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    state = ft.TrainState.create(policy, ft.optim.adamw(), seed=0)
    rollout = _rollout(state, max_new_tokens=12)
    assert (rollout.completion_mask == 0).any()  # some rows stopped early
    adv = ft.rl.group_advantages(torch.arange(6.0), 2)
    (batch,) = ft.rl.rollout_batches([rollout], [adv], reference=reference)
    loss_fn = ft.rl.policy_loss(beta=0.04)
    with torch.no_grad():
        assert torch.isinf(ft.rl.token_logps(policy, batch)).any()
    loss, _ = loss_fn(policy, batch)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters())
    other = dict(batch)
    outside = batch["completion_mask"] == 0
    other["completion_ids"] = batch["completion_ids"].masked_fill(outside, 6)
    other["ref_logps"] = batch["ref_logps"].masked_fill(outside, float("nan"))
    other["old_logps"] = batch["old_logps"].masked_fill(outside, -float("inf"))
    torch.testing.assert_close(loss_fn(policy, other)[0], loss, rtol=0, atol=1e-12)


# --- max_completion_length with a loss that does not divide by it ------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_max_completion_length_is_checked_for_every_loss_type(loss_type):
    """Only `dr_grpo` divides by `max_completion_length`; with the other loss types any value
    was accepted and dropped (0, "abc", or a length other than the rollouts'), though the
    example passes it for every `--loss-type`. Now it is what it says for every loss type:
    validated, and checked against the batch's `max_new_tokens` and width."""
    with pytest.raises(ValueError, match="max_completion_length must be an int >= 1"):
        ft.rl.policy_loss(loss_type=loss_type, max_completion_length=0)
    with pytest.raises(ValueError, match="max_completion_length must be an int >= 1"):
        ft.rl.policy_loss(loss_type=loss_type, max_completion_length="4")
    state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0)
    micro = ft.rl.rollout_batches([_rollout(state)], [torch.ones(6)])
    with pytest.raises(ValueError, match=r"policy_loss\(max_completion_length=8\) differs"):
        ft.accumulate_grads(
            state, micro, ft.rl.policy_loss(loss_type=loss_type, max_completion_length=8)
        )
    ft.accumulate_grads(
        state, micro, ft.rl.policy_loss(loss_type=loss_type, max_completion_length=4)
    )


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_token_logps_names_a_bad_chunk_rows(bad):
    """chunk_rows=-1 gave torch.cat's "expected a non-empty list", 0 range()'s error, True
    and 2.0 ran or failed as Python saw fit; now ftrain's message names the argument."""
    state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0)
    (batch,) = ft.rl.rollout_batches([_rollout(state)], [torch.ones(6)])
    with pytest.raises(ValueError, match="chunk_rows must be an int >= 1"):
        ft.rl.token_logps(state.model, batch, chunk_rows=bad)


@pytest.mark.parametrize(
    ("kw", "phrase"),
    [
        (dict(stop_token_ids=[61]), r"stop_token_ids \[61\] are not token ids of the model's 61"),
        (dict(stop_token_ids=-1), r"stop_token_ids must be ints >= 0, got \[-1\]"),
        (dict(stop_token_ids=True), r"stop_token_ids must be ints >= 0, got \[True\]"),
        (dict(pad_token_id=True), r"pad_token_id must be an int >= 0, got True"),
        (dict(pad_token_id=61), r"pad_token_id 61 is not a token id of the model's 61"),
    ],
)
def test_sample_refuses_stop_and_pad_ids_that_are_no_tokens(kw, phrase):
    """A stop id outside the vocabulary (or -1) never matched: every completion ran to
    max_new_tokens and counted as truncated, silently; `True` stopped at token 1 and padded
    with it. Now each raises, naming the argument."""
    state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0)
    with pytest.raises(ValueError, match=phrase):
        _rollout(state, **kw)


def test_kto_refuses_both_weights_zero():
    """desirable_weight=0 and undesirable_weight=0 made every KTO loss 0 (nothing trained)."""
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="desirable_weight and undesirable_weight are both 0"):
        ft.preference.kto_loss(
            x, x, torch.tensor([True, False]), kl=0.0, desirable_weight=0, undesirable_weight=0
        )
    ft.preference.kto_loss(x, x, torch.tensor([True, False]), kl=0.0, desirable_weight=0)


def test_reduce_loss_keeps_a_fractional_mask_as_weights_and_drops_nan_outside():
    per_token = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1.0, 0.5, 0.0], [1.0, 0.0, 1.0]])
    got, items = ft.rl.reduce_loss(per_token, mask, loss_type="dapo")
    assert got.item() == 1.0 + 1.0 + 4.0 + 6.0 and items.item() == 3.5


@pytest.mark.parametrize("flag", ["--rounds", "--generations", "--threads"])
def test_bench_rollout_refuses_a_count_below_one_naming_its_flag(flag, capsys):
    """--rounds 0 warmed both samplers up, then failed in statistics.median ("no median for
    empty data"); --threads 0 in torch. Now argparse names the flag before any work."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "bench_rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as e:
        module.main([flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_a_clean_eval_mode_pass_does_not_vouch_for_training():
    """The dropout check runs once per model; a first call in eval mode (no dropout runs) must
    not let a later training-mode call through."""
    state = ft.TrainState.create(_model(dropout=0.3), ft.optim.adamw(), seed=0)
    micro = ft.rl.rollout_batches([_rollout(state)], [torch.ones(6)])
    loss_fn = ft.rl.policy_loss()
    state.model.eval()
    loss_fn(state.model, micro[0])
    with pytest.raises(ValueError, match="dropout"):
        ft.accumulate_grads(state, micro, loss_fn)


@pytest.mark.parametrize("arch", ["gpt2", "t5", "bart", "llama", "falcon"])
def test_dropout_sites_finds_each_architectures_dropout_and_disable_dropout_removes_it(arch):
    """T5's and BART's layers keep float rates that their forward passes to a functional
    dropout (`self.dropout`, `activation_dropout`), Llama's attention `attention_dropout`,
    GPT-2 nn.Dropout modules: each is found, and after `disable_dropout` two training-mode
    forwards are equal."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        FalconConfig,
        FalconForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    small = {"vocab_size": 32, "d_model": 16}
    model = {
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2)),
        "t5": lambda: T5ForConditionalGeneration(
            T5Config(**small, d_kv=8, d_ff=16, num_layers=1, num_heads=2, dropout_rate=0.2)
        ),
        "bart": lambda: BartForConditionalGeneration(
            BartConfig(
                **small,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=16,
                decoder_ffn_dim=16,
                dropout=0.2,
                activation_dropout=0.2,
                attention_dropout=0.2,
            )
        ),
        "llama": lambda: tiny_llama(dtype=torch.float64, dropout=0.3),
        "falcon": lambda: FalconForCausalLM(  # reads its rates from self.config in forward
            FalconConfig(
                vocab_size=32,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                attention_dropout=0.3,
                hidden_dropout=0.2,
                parallel_attn=False,
                new_decoder_architecture=False,
            )
        ),
    }[arch]().train()
    assert ft.rng.dropout_sites(model)
    assert ft.rng.disable_dropout(model) is model
    assert ft.rng.dropout_sites(model) == []
    ids = torch.tensor([[1, 2, 3, 4]])
    kw = {"decoder_input_ids": ids} if arch in ("t5", "bart") else {}
    torch.manual_seed(0)
    a = model(input_ids=ids, **kw).logits
    torch.manual_seed(1)
    b = model(input_ids=ids, **kw).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_post_training_refuses_a_policy_that_still_adds_neftune_noise():
    """The Trainer turns NEFTune off at the end of train(); ft.sft.neftune's hook stays until
    its handle is removed, so an SFT stage's noise reached GRPO (the ratio not 1 before any
    update) and DPO (margins of a noisy forward against a clean reference), silently."""
    import functools

    state = ft.TrainState.create(_model(), ft.optim.adamw(), seed=0)
    rollout = _rollout(state)
    handle = ft.sft.neftune(state.model, alpha=5.0)
    assert ft.sft.neftune_sites(state.model) == ["model.embed_tokens"]
    micro = ft.rl.rollout_batches([rollout], [torch.ones(6)])
    with pytest.raises(ValueError, match=r"policy_loss: .*NEFTune noise .*model\.embed_tokens"):
        ft.accumulate_grads(state, micro, ft.rl.policy_loss())
    dpo = functools.partial(ft.preference.dpo_loss, beta=0.1)
    reference = _model().eval().requires_grad_(False)
    with pytest.raises(ValueError, match=r"preference_loss: .*NEFTune noise"):
        ft.accumulate_grads(
            state, [_pairs()], ft.preference.preference_loss(dpo, reference=reference)
        )
    ft.accumulate_grads(state, [_pairs()], ft.preference.preference_loss(ft.preference.simpo_loss))
    handle.remove()  # what the errors say to do: the same state trains
    assert ft.sft.neftune_sites(state.model) == []
    ft.accumulate_grads(state, micro, ft.rl.policy_loss())
    ft.accumulate_grads(state, [_pairs()], ft.preference.preference_loss(dpo, reference=reference))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_a_completion_without_tokens_adds_nothing_and_counts_as_trl_counts_it(loss_type):
    """No log-prob stands in for an empty completion (its mask all 0, as `mask_truncated` makes
    it), unlike a preference side without label tokens: whatever its old and reference
    log-probs hold, it adds exactly 0 to the loss and to every gradient. grpo and dr_grpo count
    it as a row (TRL's mean over rows), bnpo and dapo count its 0 tokens. (Checked when the
    preference losses' empty sides were fixed; this one held already.)"""
    import copy

    policy = _model()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    state = ft.TrainState.create(policy, ft.optim.adamw(), seed=0)
    rollout = _rollout(state)
    adv = ft.rl.group_advantages(torch.arange(6.0), 2)
    (batch,) = ft.rl.rollout_batches([rollout], [adv], reference=reference)
    empty = dict(batch)
    empty["completion_mask"] = batch["completion_mask"].clone()
    empty["completion_mask"][1] = 0
    empty["attention_mask"] = torch.cat([batch["prompt_mask"], empty["completion_mask"]], 1)
    empty["old_logps"] = batch["old_logps"].clone().index_fill(0, torch.tensor([1]), -math.inf)
    empty["ref_logps"] = batch["ref_logps"].clone().index_fill(0, torch.tensor([1]), math.nan)
    rest = [0, 2, 3, 4, 5]
    without = {k: v[rest] if isinstance(v, torch.Tensor) else v for k, v in empty.items()}
    loss_fn = ft.rl.policy_loss(loss_type=loss_type, beta=0.04)
    grads = []
    for b in (empty, without):
        policy.zero_grad()
        total, items = loss_fn(policy, b)
        total.backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
        if b is empty:
            got = (total.detach(), items)
    torch.testing.assert_close(got[0], total.detach(), rtol=1e-12, atol=0)
    rows = loss_type in ("grpo", "dr_grpo")
    assert float(got[1]) == float(items) + (1 if rows else 0)
    for n, g in grads[0].items():
        assert torch.isfinite(g).all(), n
        torch.testing.assert_close(g, grads[1][n], rtol=1e-10, atol=1e-14, msg=n)
