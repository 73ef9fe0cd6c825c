"""ft.rl refuses inputs it would otherwise use silently wrong: each test asserts the error type
and a phrase of ftrain's own message (never a backend's)."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
import rl_workers as W


def _state(model=None):
    return ft.TrainState.create(model or W.model(), ft.optim.adamw(), seed=0)


def _prompts(ids=W.PROMPTS):
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


@pytest.fixture(scope="module")
def state():
    return _state()


# --- sample ------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [4, 6])
def test_sample_refuses_attention_mask_of_another_shape(state, width):
    """A narrower mask used to drop the prompts' last tokens; a wider one hit an IndexError."""
    ids = torch.tensor([[5, 9, 14, 20, 33], [7, 3, 22, 8, 40]])
    bad = {"input_ids": ids, "attention_mask": torch.ones(2, width, dtype=torch.long)}
    with pytest.raises(ValueError, match=rf"attention_mask.*\(2, 5\), got \(2, {width}\)"):
        ft.rl.sample(state, bad, index=[0, 1], max_new_tokens=2)


def test_sample_refuses_empty_prompts(state):
    ids = torch.tensor([[0, 0, 0, 0, 0], [7, 3, 22, 8, 40], [0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"prompt rows \[0, 2\] are all padding"):
        ft.rl.sample(state, _prompts(ids), index=[0, 1, 2], max_new_tokens=2)
    zero = {"input_ids": torch.zeros(2, 0, dtype=torch.long)}
    with pytest.raises(ValueError, match="prompts are zero-length"):
        ft.rl.sample(state, zero, index=[0, 1], max_new_tokens=2)


@pytest.mark.parametrize(
    "index, phrase",
    [
        (torch.tensor([0.9, 1.5, 2.7]), "index must be a 1-D integer tensor"),
        ([0.0, 1.0, 2.0], "index must hold ints"),
        ([True, False, 2], "index must hold ints"),
        ([-1, 0, 1], "index must hold numbers >= 0"),
        ([3, 3, 4], r"index must hold distinct numbers .* \[3\] more than once"),
        (torch.tensor([1, 1, 2]), "index must hold distinct numbers"),
    ],
)
def test_sample_refuses_bad_index(state, index, phrase):
    with pytest.raises(ValueError, match=phrase):
        ft.rl.sample(state, _prompts(), index=index, max_new_tokens=2)


def test_sample_accepts_integer_index_and_one_generation(state):
    """int64 tensors and Python ints both work; num_generations=1 stays allowed (a
    data-parallel rank samples single completions of a group that spans ranks)."""
    a = ft.rl.sample(state, _prompts(), index=torch.tensor([4, 5, 6]), max_new_tokens=2)
    b = ft.rl.sample(state, _prompts(), index=[4, 5, 6], num_generations=1, max_new_tokens=2)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert a.completion_index.tolist() == [4, 5, 6]


def test_sample_refuses_nonfinite_logits():
    model = W.model()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"model's output \(logits\) is not finite"):
        ft.rl.sample(_state(model), _prompts(), index=[0, 1, 2], max_new_tokens=3)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(temperature=True),
        dict(top_k=True),
        dict(top_p=float("nan")),
        dict(max_new_tokens=True),
        dict(num_generations=True),
    ],
)
def test_sample_refuses_loose_arguments(state, bad):
    kw = dict(index=[0, 1, 2], max_new_tokens=2) | bad
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
        ft.rl.sample(state, _prompts(), **kw)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=0.0),
        dict(temperature=-1.0),
        dict(temperature=float("inf")),
        dict(top_p=0.0),
        dict(top_p=-0.5),
        dict(top_p=1.5),
        dict(top_k=0),
        dict(top_k=-2),
    ],
)
def test_warp_logits_validates_like_sample(bad):
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
        ft.rl.warp_logits(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), **bad)


# --- advantages --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("inf"), -float("inf")])
def test_advantages_refuse_inf_rewards(value):
    rewards = torch.tensor([1.0, value, 0.0, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"rewards hold inf at rows \[1\]"):
        ft.rl.group_advantages(rewards, 2)
    with pytest.raises(ValueError, match=r"rewards hold inf at rows \[1\]"):
        ft.rl.rloo_advantages(rewards, 3)


def test_advantages_keep_nan_as_unscorable():
    r = torch.tensor([float("nan"), float("nan"), 0.0, 1.0])
    torch.testing.assert_close(
        ft.rl.group_advantages(r, 2, scale="none"), torch.tensor([0.0, 0.0, -0.5, 0.5])
    )


@pytest.mark.parametrize("g", [1, 0, True])
def test_advantages_refuse_fewer_than_two_generations(g):
    rewards = torch.tensor([1.0, 0.0, 0.5])
    for fn in (ft.rl.group_advantages, ft.rl.rloo_advantages):
        with pytest.raises(ValueError, match="num_generations must be an int >= 2"):
            fn(rewards, g)


def test_advantages_refuse_bad_rewards_and_flags():
    with pytest.raises(ValueError, match="rewards must be a floating-point tensor"):
        ft.rl.group_advantages(torch.tensor([1, 0, 1, 1]), 2)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        ft.rl.rloo_advantages(torch.ones(4, 1), 2)
    with pytest.raises(ValueError, match="normalize must be a bool"):
        ft.rl.rloo_advantages(torch.tensor([1.0, 2.0]), 2, normalize="yes")


# --- rollout_batches ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rollout(state):
    return ft.rl.sample(state, _prompts(), index=[0, 1, 2], num_generations=2, max_new_tokens=4)


def test_rollout_batches_refuses_advantages_of_another_shape(rollout):
    n, t = rollout.completion_ids.shape
    for adv in (
        torch.ones(1),
        torch.tensor(1.0),
        torch.ones(n, 1),
        torch.ones(1, t),
        torch.ones(2 * n),
    ):
        with pytest.raises(ValueError, match=rf"advantages\[0\] must have shape \({n},\)"):
            ft.rl.rollout_batches([rollout], [adv])
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"advantages\[0\] holds NaN or inf"):
            ft.rl.rollout_batches([rollout], [torch.full((n,), value)])
    with pytest.raises(ValueError, match="mask_truncated must be a bool"):
        ft.rl.rollout_batches([rollout], [torch.zeros(n)], mask_truncated=1)
    # the two accepted shapes
    assert ft.rl.rollout_batches([rollout], [torch.zeros(n)])[0]["advantages"].shape == (n,)
    assert ft.rl.rollout_batches([rollout], [torch.zeros(n, t)])[0]["advantages"].shape == (n, t)


def test_temperature_follows_the_rollout(state):
    """A rollout sampled at T=0.7 used to train (policy_loss's default 1.0) and to score the
    reference (rollout_batches' default 1.0) at T=1: a ratio of the new policy at 1.0 over the
    old at 0.7, not 1 at the first iteration, and a KL between two temperatures."""
    r = ft.rl.sample(
        state, _prompts(), index=[0, 1, 2], num_generations=2, max_new_tokens=4, temperature=0.7
    )
    assert r.temperature == 0.7
    n = r.completion_ids.shape[0]
    ref = W.model().requires_grad_(False)
    (batch,) = ft.rl.rollout_batches([r], [torch.zeros(n)], reference=ref)
    assert batch["temperature"] == 0.7
    with torch.no_grad():
        want = ft.rl.token_logps(ref, batch, temperature=0.7)
        now = ft.rl.token_logps(state.model, batch, temperature=0.7)
    assert torch.equal(batch["ref_logps"], want)
    # the first iteration's ratio is 1 at the rollout's temperature: the policy's log-probs
    # equal the sampling ones on the mask
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(now[mask], batch["old_logps"][mask], rtol=0, atol=1e-5)
    # policy_loss without a temperature trains at the batch's; equal to the explicit one
    loss_fn = ft.rl.policy_loss(beta=0.1)
    got = loss_fn(state.model, batch)
    same = ft.rl.policy_loss(beta=0.1, temperature=0.7)(state.model, batch)
    assert torch.equal(got[0], same[0])
    with pytest.raises(ValueError, match=r"policy_loss\(temperature=1.0\) differs from the batch"):
        ft.rl.policy_loss(beta=0.1, temperature=1.0)(state.model, batch)
    with pytest.raises(ValueError, match=r"rollout_batches\(temperature=1.0\) differs from rol"):
        ft.rl.rollout_batches([r], [torch.zeros(n)], reference=ref, temperature=1.0)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        ft.rl.rollout_batches([r], [torch.zeros(n)], temperature=0.0)
    # the matching value is accepted; a hand-built batch without one trains at 1.0
    ft.rl.rollout_batches([r], [torch.zeros(n)], reference=ref, temperature=0.7)
    plain = {k: v for k, v in batch.items() if k != "temperature"}
    torch.testing.assert_close(
        ft.rl.policy_loss(beta=0.1)(state.model, plain)[0],
        ft.rl.policy_loss(beta=0.1, temperature=1.0)(state.model, plain)[0],
        rtol=0, atol=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="the batch's temperature must be a finite number > 0"):
        ft.rl.policy_loss(beta=0.1)(state.model, {**batch, "temperature": -1.0})


def test_temperature_reaches_accumulate_grads(state):
    """The batch's float passes the strategy's to_device and the token counts."""
    r = ft.rl.sample(
        state, _prompts(), index=[0, 1, 2], num_generations=2, max_new_tokens=4, temperature=0.5
    )
    micro = ft.rl.rollout_batches([r], [torch.linspace(-1, 1, r.completion_ids.shape[0])])
    grads, stats = ft.accumulate_grads(state, micro, ft.rl.policy_loss())
    assert grads and bool(torch.isfinite(stats.loss))
    with pytest.raises(ValueError, match=r"differs from the batch's temperature 0\.5"):
        ft.accumulate_grads(state, micro, ft.rl.policy_loss(temperature=1.0))


# --- losses ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, phrase",
    [
        (dict(temperature=float("inf")), "temperature must be a finite number > 0"),
        (dict(beta=float("inf")), "beta must be a finite number >= 0"),
        (dict(beta=float("nan")), "beta must be a finite number >= 0"),
        (dict(epsilon=True), "epsilon must be a finite number >= 0"),
        (dict(epsilon=float("inf")), "epsilon must be a finite number >= 0"),
        (dict(epsilon_high=-0.1), "epsilon_high must be a finite number >= 0"),
        (dict(delta=0.5), "delta must be a finite number > 1"),
        (dict(delta=1.0), "delta must be a finite number > 1"),
        (dict(bias_correction_kl="no"), "bias_correction_kl must be a bool"),
        (dict(loss_type="dr_grpo", max_completion_length=True), "max_completion_length"),
    ],
)
def test_policy_loss_refuses_loose_arguments(bad, phrase):
    with pytest.raises(ValueError, match=phrase):
        ft.rl.policy_loss(**bad)


def test_dr_grpo_refuses_completions_wider_than_max_length(state):
    r = ft.rl.sample(
        state, _prompts(), index=[0, 1, 2], num_generations=2, max_new_tokens=6, stop_token_ids=[]
    )
    micro = ft.rl.rollout_batches([r], [torch.ones(6, dtype=torch.float64)])
    loss_fn = ft.rl.policy_loss(loss_type="dr_grpo", max_completion_length=2)
    with pytest.raises(ValueError, match="completions are 6 tokens wide, more than"):
        ft.accumulate_grads(state, micro, loss_fn)
    ft.accumulate_grads(
        state, micro, ft.rl.policy_loss(loss_type="dr_grpo", max_completion_length=6)
    )


@pytest.mark.parametrize("length", [0, -6, 2.5, None])
def test_reduce_loss_validates_max_completion_length(length):
    per_token, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs max_completion_length"):
        ft.rl.reduce_loss(per_token, mask, loss_type="dr_grpo", max_completion_length=length)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        ft.rl.reduce_loss(per_token, mask, loss_type="ppo")


@pytest.mark.parametrize(
    "bad, phrase",
    [
        (dict(epsilon=-0.5), "epsilon must be a finite number >= 0"),
        (dict(epsilon_high=float("nan")), "epsilon_high must be a finite number >= 0"),
        (dict(delta=0.9), "delta must be a finite number > 1"),
    ],
)
def test_clipped_objective_validates_like_policy_loss(bad, phrase):
    with pytest.raises(ValueError, match=phrase):
        ft.rl.clipped_objective(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([1.0]), **bad)


def test_an_inf_reward_on_one_rank_raises_on_every_rank(tmp_path):
    """Checked after the gather: the ranks without the inf raise too, none waits."""
    import rl_workers
    from launch import run_ranks

    run_ranks(rl_workers.inf_on_one_rank, str(tmp_path), timeout=120)
    for name in ("group_advantages", "rloo_advantages"):
        for rank in (0, 1):
            text = (tmp_path / f"{name}-{rank}.txt").read_text()
            assert "rewards hold inf at rows [6] of the global batch" in text, (name, rank)


@pytest.mark.parametrize("advantages", [ft.rl.group_advantages, ft.rl.rloo_advantages])
def test_advantages_without_a_strategy_under_several_ranks_are_refused(monkeypatch, advantages):
    """Under a process group of several ranks `strategy=None` grouped this rank's rewards alone:
    a group split over ranks broken, `scale="batch"` divided by this rank's std."""
    import torch.distributed as dist

    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0])
    local = advantages(rewards, 2, strategy=ft.strategies.SingleDevice())  # on purpose: allowed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match=r"strategy is None under .* of 2 ranks.*state\.strategy"):
        advantages(rewards, 2)
    torch.testing.assert_close(advantages(rewards, 2, strategy=ft.strategies.SingleDevice()), local)


def test_sample_refuses_prompt_inputs_it_would_leave_out(state):
    """Packed prompts' position_ids (or a VLM's pixel_values) were dropped: every row was decoded
    as one prompt, the completions of other prompts than the ones given."""
    ids = torch.tensor([[5, 9, 14, 20, 33, 7]])
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    with pytest.raises(ValueError, match=r"also hold \['position_ids'\], which LlamaForCausalLM"):
        ft.rl.sample(state, packed, index=[0], max_new_tokens=2)
    extra = {"input_ids": ids, "index": torch.tensor([3]), "labels": ids, "text": ["a"]}
    got = ft.rl.sample(state, extra, index=[3], max_new_tokens=2)  # no model inputs: not read
    want = ft.rl.sample(state, {"input_ids": ids}, index=[3], max_new_tokens=2)
    assert torch.equal(got.completion_ids, want.completion_ids)


def test_sample_and_token_logps_refuse_an_encoder_decoder_model():
    """T5 got HF's error about the encoder's inputs ("exactly one of input_ids or
    inputs_embeds"), from its decoder, which sampling never fed."""
    from helpers import tiny_t5

    model = tiny_t5()
    model.generation_config.pad_token_id = 0
    with pytest.raises(ValueError, match=r"sample takes a decoder-only .* T5ForConditionalGen"):
        ft.rl.sample(_state(model), {"input_ids": torch.tensor([[5, 6, 7]])}, index=[0],
                     max_new_tokens=2)  # fmt: skip
    ids, ones = torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long)
    batch = {"prompt_ids": ids, "prompt_mask": ones, "completion_ids": ids, "completion_mask": ones}
    with pytest.raises(ValueError, match="token_logps takes a decoder-only"):
        ft.rl.token_logps(model, batch)


def test_sample_refuses_a_zero_weight_stand_in(state):
    """The rank left without prompts at an epoch's end gets another rank's prompt as a
    ZeroWeight: sample failed on it with a TypeError of tuple indices (unwrapped, it would be
    sampled and trained twice); now ftrain's error says to drop the last batch."""

    class Rank1(ft.strategies.SingleDevice):
        rank, world_size = 1, 2

    rows = [{"input_ids": [5, 6, i + 7], "index": i} for i in range(5)]
    (*_, last) = ft.make_batches(rows, batch_size=2, shuffle=False, strategy=Rank1())
    assert isinstance(last[0], ft.data.ZeroWeight)
    stand_in = last[0]
    with pytest.raises(ValueError, match=r"ZeroWeight stand-in .* drop_last=True"):
        ft.rl.sample(state, stand_in, index=stand_in.batch["index"], max_new_tokens=2)
    kept = ft.make_batches(rows, batch_size=2, shuffle=False, strategy=Rank1(), drop_last=True)
    assert all(isinstance(p, dict) for micro in kept for p in micro)


def test_rollouts_of_one_step_that_drew_the_same_numbers_are_refused(state):
    """Micro-batches of one step given their local row numbers as `index` drew the same uniforms
    for their first, second, ... prompts (sample checks one call and the ranks, not the calls
    of one process): correlated completions, silently."""
    first = {"input_ids": torch.tensor([[5, 9, 14], [7, 3, 22]])}
    second = {"input_ids": torch.tensor([[8, 40, 2], [31, 2, 17]])}
    local = [ft.rl.sample(state, p, index=[0, 1], max_new_tokens=3) for p in (first, second)]
    with pytest.raises(
        ValueError, match=r"rollouts 0 and 1 both hold completion number 0 .* step 0"
    ):
        ft.rl.rollout_batches(local, [torch.zeros(2), torch.zeros(2)])
    rows = [
        ft.rl.sample(state, p, index=i, max_new_tokens=3)
        for p, i in ((first, [0, 1]), (second, [2, 3]))
    ]
    assert len(ft.rl.rollout_batches(rows, [torch.zeros(2), torch.zeros(2)])) == 2
    later = ft.rl.sample(state.replace(step=1), second, index=[0, 1], max_new_tokens=3)
    assert len(ft.rl.rollout_batches([local[0], later], [torch.zeros(2), torch.zeros(2)])) == 2


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_reduce_loss_checks_a_max_completion_length_that_its_loss_type_does_not_use(loss_type):
    """Only dr_grpo divides by max_completion_length; given with another loss type it was
    accepted and dropped, whatever its value (policy_loss checks it against the rollouts)."""
    per_token, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}' takes max_completion_length"):
        ft.rl.reduce_loss(per_token, mask, loss_type=loss_type, max_completion_length=0)
    with pytest.raises(ValueError, match="completions are 3 tokens wide, more than"):
        ft.rl.reduce_loss(per_token, mask, loss_type=loss_type, max_completion_length=2)
    # A value that fits changes nothing: these loss types do not divide by it.
    got = ft.rl.reduce_loss(per_token, mask, loss_type=loss_type, max_completion_length=3)
    want = ft.rl.reduce_loss(per_token, mask, loss_type=loss_type)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
