"""ft.rl: sampling (greedy equal to HF generate, HF's warpers, seeds that follow the completion,
not the batch), advantages and the policy loss against TRL 1.16's own code, the example's loop
learning, 2 DDP ranks equal to one process, and SIGKILL + resume bit for bit."""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import signal
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ftrain as ft
import rl_resume
import rl_workers as W
from launch import exit_codes, run_ranks

REPO = Path(__file__).resolve().parent.parent


def _state(model=None, seed=0):
    return ft.TrainState.create(model or W.model(), ft.optim.adamw(), seed=seed)


def _prompts(ids=W.PROMPTS):
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


# --- sampling ----------------------------------------------------------------------------------


def test_greedy_sampling_equals_hf_generate():
    """top_k=1 is greedy: the same tokens as `generate(do_sample=False)` on left-padded ragged
    prompts, stopping at the stop token (two rows do, one runs to the end; padding after it),
    every generation of a prompt alike."""
    state = _state()
    r = ft.rl.sample(
        state,
        _prompts(),
        index=[0, 1, 2],
        num_generations=2,
        max_new_tokens=8,
        top_k=1,
        stop_token_ids=[4],
    )
    with torch.no_grad():
        out = state.model.generate(**_prompts(), do_sample=False, max_new_tokens=8, eos_token_id=4)
    want = out[:, W.PROMPTS.shape[1] :]
    got = r.completion_ids
    assert torch.equal(got[0::2], got[1::2])
    assert torch.equal(got[0::2], want[:, : got.shape[1]])
    assert (want[:, got.shape[1] :] == 0).all()  # HF pads the rows that stopped
    stopped = (want == 4).any(1)
    assert torch.equal(r.truncated[0::2], ~stopped) and stopped.any() and not stopped.all()


def test_warp_logits_equals_hf_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for t, k, p in [(0.7, 5, 1.0), (1.0, None, 0.8), (1.3, 10, 0.5), (1.0, 1, 1.0)]:
        want = TemperatureLogitsWarper(t)(None, logits.clone())
        want = TopKLogitsWarper(k)(None, want) if k else want
        want = TopPLogitsWarper(p)(None, want) if p < 1 else want
        torch.testing.assert_close(
            ft.rl.warp_logits(logits, temperature=t, top_k=k, top_p=p), want, rtol=0, atol=0
        )


def test_a_completion_samples_the_same_whatever_its_batch_and_only_its_seed_counts():
    state = _state()
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=0.9)
    full = ft.rl.sample(state, _prompts(), index=[0, 1, 2], num_generations=4, **kw)
    # prompt 1 alone, one completion per row, numbered as in the full batch
    rows = W.PROMPTS[[1, 1, 1, 1]]
    alone = ft.rl.sample(state, _prompts(rows), index=[4, 5, 6, 7], num_generations=1, **kw)
    width = alone.completion_ids.shape[1]
    assert torch.equal(alone.completion_ids, full.completion_ids[4:8, :width])
    assert torch.equal(full.completion_index, torch.arange(12))
    again = ft.rl.sample(state, _prompts(), index=[0, 1, 2], num_generations=4, **kw)
    assert torch.equal(again.completion_ids, full.completion_ids)
    later = ft.rl.sample(
        state.replace(step=1), _prompts(), index=[0, 1, 2], num_generations=4, **kw
    )
    assert not torch.equal(later.completion_ids[:, :3], full.completion_ids[:, :3])
    # the sampling log-probs are the model's, recomputed in one forward (TRL's old log-probs)
    batch = ft.rl.rollout_batches([full], [torch.zeros(12)])[0]
    with torch.no_grad():
        logps = ft.rl.token_logps(state.model, batch)
    torch.testing.assert_close(logps * full.completion_mask, full.logps, rtol=0, atol=1e-10)
    # masks: 1 up to and including the stop token (6), padding (0) after it
    for ids, m in zip(full.completion_ids, full.completion_mask, strict=True):
        n = int(m.sum())
        assert (ids[n:] == 0).all() and (n == len(ids) or ids[n - 1] == 6)


def test_sampling_draws_from_the_warped_distribution():
    """Inverse-CDF draws over 4000 seeds match the top-k/temperature probabilities."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    u = torch.stack([ft.rl.rollout._uniforms(0, 0, [c], 1)[0] for c in range(4000)])
    scaled = logits / 0.8
    warped = ft.rl.warp_logits(scaled, top_k=4)
    tokens = [int(ft.rl.rollout._draw(scaled, warped, x)[0]) for x in u]
    freq = torch.bincount(torch.tensor(tokens), minlength=6) / 4000
    want = warped.softmax(-1)[0]
    assert freq[4:].sum() == 0  # outside the top 4: never
    assert (freq - want).abs().max() < 0.03  # 4 standard errors at 4000 draws


def test_sampling_and_losses_refuse_bad_arguments():
    state = _state()
    for bad in [
        dict(temperature=0.0),
        dict(top_k=0),
        dict(top_p=1.5),
        dict(max_new_tokens=0),
        dict(num_generations=0),
    ]:
        kw = dict(index=[0, 1, 2], max_new_tokens=4) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            ft.rl.sample(state, _prompts(), **kw)
    with pytest.raises(ValueError, match="index has 2 numbers for 3 prompts"):
        ft.rl.sample(state, _prompts(), index=[0, 1], max_new_tokens=4)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        ft.rl.policy_loss(loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        ft.rl.policy_loss(loss_type="dr_grpo", max_completion_length=0)
    with pytest.raises(ValueError, match="beta"):
        ft.rl.policy_loss(beta=-1.0)
    with pytest.raises(ValueError, match="scale must be one of"):
        ft.rl.group_advantages(torch.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match="multiple of num_generations=3"):
        ft.rl.group_advantages(torch.zeros(4), 3)
    r = ft.rl.sample(state, _prompts(), index=[0, 1, 2], max_new_tokens=3)
    with pytest.raises(ValueError, match="one advantages tensor"):
        ft.rl.rollout_batches([r], [])
    micro = ft.rl.rollout_batches([r], [torch.zeros(3)])
    with pytest.raises(KeyError, match="ref_logps"):
        ft.accumulate_grads(state, micro, ft.rl.policy_loss(beta=0.1))


# --- against TRL's code ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl():
    pytest.importorskip("trl")
    from trl.trainer import grpo_trainer, utils

    return types.SimpleNamespace(GRPOTrainer=grpo_trainer.GRPOTrainer, nanstd=utils.nanstd)


REWARDS = torch.tensor(
    [1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.3, float("nan"), 0.9, 0.1], dtype=torch.float64
)


@pytest.mark.slow  # importing TRL takes ~10 s of CPU
def test_advantages_equal_trl(trl):
    """TRL 1.16 grpo_trainer.py lines 2763-2800 (`sum_then_normalize`, one reward function)
    and rloo_trainer.py lines 1682-1699, on rewards with a NaN (unscorable) and a flat group."""
    G, r = 4, REWARDS
    mean = torch.nanmean(r.view(-1, G), dim=1).repeat_interleave(G)
    for scale in ("group", "batch", "none"):
        std = trl.nanstd(r.view(-1, G), dim=1).repeat_interleave(G)
        std = trl.nanstd(r).expand_as(r) if scale == "batch" else std
        want = r - mean
        want = torch.nan_to_num(want / (std + 1e-4) if scale != "none" else want, nan=0.0)
        torch.testing.assert_close(ft.rl.group_advantages(r, G, scale=scale), want)
    grouped = r.view(-1, G)
    n = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (n - 1)).view(-1)
    want = r - baselines
    torch.testing.assert_close(ft.rl.rloo_advantages(r, G), torch.nan_to_num(want, nan=0.0))
    normed = (want - torch.nanmean(want)) / (trl.nanstd(want) + 1e-4)
    torch.testing.assert_close(
        ft.rl.rloo_advantages(r, G, normalize=True), torch.nan_to_num(normed, nan=0.0)
    )


def _trl_self(trl, model, logps_of, *, loss_type, beta, eps, eps_high, delta, ga, max_len):
    """What `GRPOTrainer._compute_loss` reads from `self`, with its per-token log-probs taken
    from `logps_of(input_ids)` (ours) and everything else TRL's code."""

    def per_token(model, input_ids, attention_mask, logits_to_keep, **kw):
        lp = logps_of(input_ids)
        return lp, torch.zeros_like(lp), None

    nothing = lambda x, **kw: x  # noqa: E731 (one process: gather and reduce are identities)
    return types.SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        use_vllm=False,
        model=model,
        current_gradient_accumulation_steps=ga,
        max_completion_length=max_len,
        accelerator=types.SimpleNamespace(num_processes=1, gather=nothing, reduce=nothing),
        args=types.SimpleNamespace(
            use_bias_correction_kl=True, delta=delta, steps_per_generation=ga
        ),
        _entropy_bonus_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_loss_equals_trl_compute_loss(trl, loss_type):
    """Two micro-batches of 6 completions of unequal lengths (one optimizer step, TRL's
    gradient accumulation of 2), old and reference log-probs off the current ones so that both
    clip sides and the KL act: the loss and every gradient equal TRL's `_compute_loss` summed
    over the micro-batches."""
    state = _state()
    gen = torch.Generator().manual_seed(1)
    micro = []
    for i, rows in enumerate([[0, 1, 2], [2, 0, 1]]):  # equal rows (TRL: per-device batch)
        prompts = W.PROMPTS[rows]
        r = ft.rl.sample(
            state,
            _prompts(prompts),
            index=[10 * i + j for j in range(len(rows))],
            num_generations=2,
            max_new_tokens=6,
        )
        adv = torch.randn(len(rows) * 2, generator=gen, dtype=torch.float64)
        b = dict(ft.rl.rollout_batches([r], [adv])[0])
        with torch.no_grad():
            lp = ft.rl.token_logps(state.model, b)
        b["old_logps"] = lp + 0.8 * (torch.rand(lp.shape, generator=gen, dtype=lp.dtype) - 0.5)
        b["ref_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=gen, dtype=lp.dtype)
        micro.append(b)
    kw = dict(beta=0.04, epsilon=0.2, epsilon_high=0.28, delta=1.15, max_completion_length=6)
    grads, stats = ft.accumulate_grads(state, micro, ft.rl.policy_loss(loss_type=loss_type, **kw))
    ours = {k: v.clone() for k, v in grads.items()}

    model = state.model
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    num_items = sum(b["completion_mask"].sum() for b in micro)
    for b in micro:
        fake = _trl_self(
            trl,
            model,
            lambda ids, b=b: ft.rl.token_logps(model, b),
            loss_type=loss_type,
            beta=0.04,
            eps=0.2,
            eps_high=0.28,
            delta=1.15,
            ga=2,
            max_len=6,
        )
        inputs = {
            "prompt_ids": b["prompt_ids"],
            "prompt_mask": b["prompt_mask"],
            "completion_ids": b["completion_ids"],
            "completion_mask": b["completion_mask"],
            "advantages": b["advantages"],
            "old_per_token_logps": b["old_logps"],
            "ref_per_token_logps": b["ref_logps"],
            "num_items_in_batch": num_items,
        }
        loss = trl.GRPOTrainer._compute_loss(fake, model, inputs)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(stats.loss.double(), total, rtol=1e-6, atol=0)  # stats: float32
    for name, p in state.params.items():
        # accumulate_grads divides the summed gradients by the item count after backward, TRL
        # each loss before it: equal to rounding (float64 here), not bit for bit
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(ours[name], p.grad, rtol=0, atol=1e-6 * scale, msg=name)
    # the inputs reach both clip sides: ratios below 1 - 0.2 and above 1 + 0.28
    with torch.no_grad():
        ratios = torch.cat(
            [
                (ft.rl.token_logps(model, b) - b["old_logps"]).exp()[b["completion_mask"].bool()]
                for b in micro
            ]
        )
    assert (ratios < 0.8).any() and (ratios > 1.28).any()


# --- the loop ----------------------------------------------------------------------------------


def _example():
    spec = importlib.util.spec_from_file_location(
        "grpo_addition", REPO / "examples" / "grpo_addition.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_example_loop_learns_to_add(one_thread, tmp_path):
    """30 updates of examples/grpo_addition.py (15 rollout batches, 2 updates each): the mean
    reward of the last 3 batches is clearly above the first 3 (about 0.08 -> 0.4; the full
    run's curve is in docs/post_training.md)."""
    log = tmp_path / "metrics.jsonl"
    curve = _example().main(["--steps", "30", "--prompts", "16", "--log", str(log)])
    assert len(curve) == 15
    assert sum(curve[-3:]) / 3 > sum(curve[:3]) / 3 + 0.15, curve
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(0, 30, 2))


# --- data-parallel -----------------------------------------------------------------------------


def _spawn_bounded(fn, *args, timeout=150):
    """2 spawned ranks; killed (and the test failed) past `timeout` seconds, never hanging."""
    run_ranks(fn, *args, timeout=timeout)


@pytest.mark.slow
def test_two_ddp_ranks_equal_one_process(tmp_path):
    """Prompt 1's four completions lie on both ranks: the same completions, rewards and
    group advantages as one process, and after two updates (grpo, dapo + KL) the same
    parameters to float64 rounding."""
    _spawn_bounded(W.dp, str(tmp_path))
    one = W.run(None)
    got = [json.loads((tmp_path / f"rl-{r}.json").read_text()) for r in (0, 1)]
    for key in ("ids", "rewards"):
        assert got[0][key] + got[1][key] == one[key], key
    adv = torch.tensor(got[0]["advantages"] + got[1]["advantages"])
    torch.testing.assert_close(adv, torch.tensor(one["advantages"]), rtol=0, atol=1e-12)
    assert adv[4:8].abs().sum() > 0  # the straddling group has a signal
    for r in (0, 1):
        params = load_file(tmp_path / f"params-{r}.safetensors")
        for k, v in one["params"].items():
            torch.testing.assert_close(params[k], v, rtol=1e-9, atol=1e-12, msg=k)


# --- exact resume ------------------------------------------------------------------------------

TIMEOUT = 120  # seconds per worker process; one takes 2-9 s on a busy 2-core machine


def _run(root: Path, kill: str | None = None) -> int | None:
    """rl_resume's run in a process forked from the suite's server; its exit code."""
    root.mkdir(parents=True, exist_ok=True)
    (code,) = exit_codes(rl_resume.ranked, str(root), kill, world=1, timeout=TIMEOUT)
    return code


def _effective(root: Path) -> dict[int, dict]:
    """Each rollout step's last record (a resumed run samples the killed step again)."""
    return {r["step"]: r for r in map(json.loads, (root / "trace.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_sigkill_while_sampling_and_while_updating_then_resume_is_bit_exact(tmp_path):
    """Killed in the 9th sampling forward (the third rollout batch), resumed, killed again in
    the 3rd update forward of the resumed run (an update after a checkpoint), resumed to the
    end: the same completions and rewards at every step and bit-equal parameters and
    optimizer state as the uninterrupted run."""
    ref, got = tmp_path / "ref", tmp_path / "got"
    assert _run(ref) == 0  # the ranks' output is in the test's captured stdout
    assert _run(got, "sample:9") == -signal.SIGKILL
    killed_at = max(_effective(got))
    assert _run(got, "update:3") == -signal.SIGKILL
    assert _run(got) == 0
    want, have = _effective(ref), _effective(got)
    assert sorted(have) == sorted(want) == [0, 2, 4, 6]
    assert killed_at < 6  # the kills landed mid-run
    for step in want:
        assert have[step]["ids"] == want[step]["ids"], step
        assert have[step]["rewards"] == want[step]["rewards"], step
    a, b = load_file(ref / "final.safetensors"), load_file(got / "final.safetensors")
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert math.isfinite(float(a["param/model.embed_tokens.weight"].sum()))
