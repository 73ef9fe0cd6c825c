"""Preference losses: hand-computed cases from the papers' formulas, TRL's own loss code where it
is callable (ORPO, SimPO), TRL 1.16's formulas transcribed where it is inlined (DPO, IPO, KTO),
and the ftrain loss_fn built from them."""

import functools
import math
import types

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain import preference as P
from helpers import tiny_llama

PC = torch.tensor([-3.0, -10.0, -1.5, -7.0], dtype=torch.float64)
PR = torch.tensor([-4.0, -9.0, -1.5, -12.0], dtype=torch.float64)
RC = torch.tensor([-3.5, -9.5, -2.0, -8.0], dtype=torch.float64)
RR = torch.tensor([-3.5, -9.0, -1.0, -11.0], dtype=torch.float64)


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_dpo_by_hand_and_label_smoothing():
    # pair 0: margin (-3 + 4) - (-3.5 + 3.5) = 1; beta 0.5 -> z = 0.5
    got = P.dpo_loss(PC, PR, RC, RR, beta=0.5)
    assert got[0].item() == pytest.approx(-math.log(_sig(0.5)), rel=1e-12)
    got = P.dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.2)
    want = -0.8 * math.log(_sig(0.5)) - 0.2 * math.log(_sig(-0.5))
    assert got[0].item() == pytest.approx(want, rel=1e-12)
    # TRL 1.16 DPOTrainer._compute_loss, loss_type="sigmoid" (reverse KL):
    # chosen_scores = chosen_logps - ref_chosen_logps; delta_score = chosen - rejected scores;
    # per_sequence_loss = -F.logsigmoid(beta * delta_score)
    delta = (PC - RC) - (PR - RR)
    torch.testing.assert_close(P.dpo_loss(PC, PR, RC, RR, beta=0.1), -F.logsigmoid(0.1 * delta))


def test_ipo_by_hand_and_trl_formula():
    # pair 0: margin 1, beta 0.25 -> (1 - 2) ** 2 = 1
    assert P.ipo_loss(PC, PR, RC, RR, beta=0.25)[0].item() == pytest.approx(1.0)
    # TRL: per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2 on length-averaged scores
    delta = (PC - RC) - (PR - RR)
    torch.testing.assert_close(P.ipo_loss(PC, PR, RC, RR, beta=0.1), (delta - 5.0) ** 2)


def _trl_self(**kw):
    acc = types.SimpleNamespace(device=torch.device("cpu"))
    return types.SimpleNamespace(accelerator=acc, **kw)


def test_simpo_by_hand_and_trl_formula():
    # pair 0: z = 2 * (-3 + 4) - 0.5 = 1.5
    assert P.simpo_loss(PC, PR)[0].item() == pytest.approx(-math.log(_sig(1.5)), rel=1e-12)
    # TRL 1.16 CPOTrainer.cpo_loss, loss_type="simpo": logits = (pc - pr) - simpo_gamma / beta;
    # losses = -logsigmoid(beta * logits) * (1 - ls) - logsigmoid(-beta * logits) * ls
    z = 2.0 * ((PC - PR) - 0.8 / 2.0)
    want = -F.logsigmoid(z) * 0.9 - F.logsigmoid(-z) * 0.1
    torch.testing.assert_close(P.simpo_loss(PC, PR, beta=2.0, gamma=0.8, label_smoothing=0.1), want)


def test_orpo_by_hand():
    pc, pr = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)])
    # odds 0.5/0.5 = 1 and 0.2/0.8 = 0.25: log odds ratio = log 4
    want = -math.log(0.5) - 0.1 * math.log(_sig(math.log(4)))
    assert P.orpo_loss(pc, pr, beta=0.1).item() == pytest.approx(want, rel=1e-6)


@pytest.mark.slow  # importing TRL takes ~10 s of CPU
def test_simpo_and_orpo_against_trl_code():
    cpo = pytest.importorskip("trl.experimental.cpo").CPOTrainer
    orpo = pytest.importorskip("trl.experimental.orpo").ORPOTrainer
    fake = _trl_self(beta=2.0, simpo_gamma=0.8, label_smoothing=0.1, loss_type="simpo", alpha=0.0)
    want, _, _ = cpo.cpo_loss(fake, PC, PR)
    torch.testing.assert_close(P.simpo_loss(PC, PR, beta=2.0, gamma=0.8, label_smoothing=0.1), want)
    avg_c, avg_r = PC / 10, PR / 10  # length-averaged log-probs
    ratio_term, *_ = orpo.odds_ratio_loss(_trl_self(beta=0.3), avg_c, avg_r)
    # TRL: loss = nll - mean(beta * logsigmoid(log_odds)); ours adds the NLL per pair.
    torch.testing.assert_close(P.orpo_loss(avg_c, avg_r, beta=0.3), -avg_c - ratio_term.double())


def test_kto_by_hand_and_trl_formula():
    desirable = torch.tensor([True, False, True, False])
    got = P.kto_loss(PC, RC, desirable, kl=0.2, beta=0.5, undesirable_weight=1.5)
    # example 0 desirable: r = 0.5 -> 1 - sigma(0.5 * (0.5 - 0.2))
    assert got[0].item() == pytest.approx(1 - _sig(0.15), rel=1e-12)
    # example 1 undesirable: r = -0.5 -> 1.5 * (1 - sigma(0.5 * (0.2 + 0.5)))
    assert got[1].item() == pytest.approx(1.5 * (1 - _sig(0.35)), rel=1e-12)
    # a negative KL estimate is clamped at 0 (TRL: .clamp(min=0))
    torch.testing.assert_close(
        P.kto_loss(PC, RC, desirable, kl=-1.0), P.kto_loss(PC, RC, desirable, kl=0.0)
    )
    with pytest.raises(TypeError, match="bool"):
        P.kto_loss(PC, RC, torch.ones(4), kl=0.0)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: P.dpo_loss(PC, PR, RC, RR, beta=0), "beta"),
        (lambda: P.dpo_loss(PC, PR, RC, RR, label_smoothing=0.5), "label_smoothing"),
        (lambda: P.simpo_loss(PC, PR, beta=-1), "beta"),
        (lambda: P.preference_loss("dpo"), "loss must be a function"),
    ],
)
def test_bad_hyperparameters_raise(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bad()


def _pair_batch():
    g = torch.Generator().manual_seed(0)
    ids_c = torch.randint(1, 61, (3, 7), generator=g)
    ids_r = torch.randint(1, 61, (3, 9), generator=g)
    lab_c, lab_r = ids_c.clone(), ids_r.clone()
    lab_c[:, :3] = -100  # the prompt
    lab_r[:, :3] = -100
    lab_r[0, 7:] = -100  # padding
    mask_r = torch.ones_like(ids_r)
    mask_r[0, 7:] = 0
    return {"chosen_input_ids": ids_c, "chosen_labels": lab_c,
            "chosen_attention_mask": torch.ones_like(ids_c),
            "rejected_input_ids": ids_r, "rejected_labels": lab_r,
            "rejected_attention_mask": mask_r}  # fmt: skip


def test_sequence_logps_and_the_loss_fn_with_a_frozen_or_precomputed_reference():
    model, ref = tiny_llama(), tiny_llama(seed=1)
    batch = _pair_batch()
    logits = model(input_ids=batch["chosen_input_ids"]).logits[:, :-1].log_softmax(-1)
    want0 = sum(
        logits[0, t, batch["chosen_labels"][0, t + 1]].item() for t in range(2, 6)
    )  # labels at positions 3..6 are predicted from positions 2..5
    got = P.sequence_logps(
        model, {"input_ids": batch["chosen_input_ids"], "labels": batch["chosen_labels"]}
    )
    assert got[0].item() == pytest.approx(want0, rel=1e-5)
    loss_fn = P.preference_loss(functools.partial(P.dpo_loss, beta=0.1), reference=ref)
    total, n = loss_fn(model, batch)
    pre = dict(batch)
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            pre[f"reference_{side}"] = P.sequence_logps(
                ref, {"input_ids": batch[f"{side}_input_ids"], "labels": batch[f"{side}_labels"]}
            )
    total_pre, _ = P.preference_loss(functools.partial(P.dpo_loss, beta=0.1))(model, pre)
    assert int(n) == 3 and total.item() == pytest.approx(total_pre.item(), rel=1e-6)
    simpo = P.preference_loss(P.simpo_loss, average=True)
    assert simpo(model, batch)[0].requires_grad
    with pytest.raises(KeyError, match="chosen_labels"):
        loss_fn(model, {"chosen_input_ids": batch["chosen_input_ids"]})


def test_accumulated_pairs_equal_one_big_batch():
    batch = _pair_batch()
    loss_fn = P.preference_loss(
        functools.partial(P.dpo_loss, beta=0.5), reference=tiny_llama(seed=1)
    )
    whole = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    g1, _ = ft.accumulate_grads(whole, [batch], loss_fn)
    split = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    parts = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(3)]
    g2, _ = ft.accumulate_grads(split, parts, loss_fn)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-7, msg=n)


_ROWS = [
    {"chosen_input_ids": [5, 6, 7, 8], "chosen_labels": [-100, -100, 7, 8],
     "rejected_input_ids": [5, 6, 9], "rejected_labels": [-100, -100, 9]},
    {"chosen_input_ids": [5, 6, 7, 8, 10, 11], "chosen_labels": [-100, -100, 7, 8, 10, 11],
     "rejected_input_ids": [5, 6, 9, 12, 13], "rejected_labels": [-100, -100, 9, 12, 13]},
]  # fmt: skip


def test_pair_collate_takes_other_fields_as_pad_collate_does():
    """pair_collate dropped a field that row 0 lacks without a word, and failed inside torch's
    default_collate on ragged ones (`prompt_input_ids`): it refuses the first, naming it, and
    pads the others as make_batches' default collate does."""
    rows = [r | {"prompt_input_ids": r["chosen_input_ids"][: 2 + i], "reference_chosen": -1.0 - i}
            for i, r in enumerate(_ROWS)]  # fmt: skip
    collate = P.pair_collate(pad_id=0)
    lacking = [_ROWS[0], _ROWS[1] | {"reference_chosen": -2.0}]
    with pytest.raises(KeyError, match=r"pair_collate: row 1 .* field 'reference_chosen', which"):
        collate(lacking)
    default = next(iter(ft.make_batches(rows, batch_size=2, shuffle=False)))[0]
    batch = collate(rows)
    assert batch.keys() == default.keys()
    for key, value in batch.items():
        assert torch.equal(default[key], value), key
    assert batch["prompt_input_ids"].tolist() == [[5, 6, 0], [5, 6, 7]]
    assert batch["reference_chosen"].tolist() == [-1.0, -2.0]


def test_a_side_without_its_mask_is_refused_and_both_collates_pad_each_side():
    """The default collate padded `chosen_labels` (not a field named `labels`) with 0, a token,
    and made no mask: the short rows' padding counted as label tokens 0 in their log-probs.
    It pads each side as pair_collate does now; a batch without a side's mask is refused."""
    model = tiny_llama()
    loss_fn = P.preference_loss(P.simpo_loss)
    default = next(iter(ft.make_batches(_ROWS, batch_size=2, shuffle=False)))[0]
    unmasked = {k: v for k, v in default.items() if k != "chosen_attention_mask"}
    # The default collate makes the masks now: the message no longer blames it.
    why = r"need chosen_attention_mask.*a collate that makes no masks.*make_batches' default"
    with pytest.raises(ValueError, match=why + r".*pair_collate"):
        loss_fn(model, unmasked)
    collate = P.pair_collate(pad_id=0)
    assert default.keys() == collate(_ROWS).keys()
    for key, value in collate(_ROWS).items():
        assert torch.equal(default[key], value), key
    batch = collate(_ROWS)
    assert batch["chosen_labels"][0].tolist() == [-100, -100, 7, 8, -100, -100]
    assert batch["rejected_attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    alone = sum(loss_fn(model, collate([row]))[0] for row in _ROWS)
    assert loss_fn(model, batch)[0].item() == pytest.approx(alone.item(), rel=1e-5)
    refs = [{**r, "reference_chosen": -1.0, "reference_rejected": -2.0} for r in _ROWS]
    assert collate(refs)["reference_chosen"].tolist() == [-1.0, -1.0]


def test_a_label_at_a_padding_position_is_no_target():
    """Rows that bring their masks pass the mask check, but a collate that pads
    `chosen_labels` with 0 (the default one did) had the last real token scored against the
    first pad's label."""
    model = tiny_llama()
    loss_fn = P.preference_loss(P.simpo_loss)
    rows = [
        {
            **r,
            **{
                f"{s}_attention_mask": [1] * len(r[f"{s}_input_ids"])
                for s in ("chosen", "rejected")
            },
        }
        for r in _ROWS
    ]
    zero = ft.data.pad_collate(label_pad_id=0)  # pads every labels field with a token
    default = next(iter(ft.make_batches(rows, batch_size=2, shuffle=False, collate_fn=zero)))[0]
    assert default["chosen_labels"][0].tolist() == [-100, -100, 7, 8, 0, 0]  # padded with a token
    alone = sum(loss_fn(model, P.pair_collate(pad_id=0)([row]))[0] for row in rows)
    assert loss_fn(model, default)[0].item() == pytest.approx(alone.item(), rel=1e-5)
    side = {k.removeprefix("chosen_"): v for k, v in default.items() if k.startswith("chosen_")}
    want = P.sequence_logps(model, {k: v[:1, :4] for k, v in side.items()})
    assert P.sequence_logps(model, side)[0].item() == pytest.approx(want.item(), rel=1e-5)


def test_sequence_logps_refuses_an_encoder_decoder_model():
    """With the decoder's inputs in the batch, T5's log-probs were scored after the causal shift
    (decoder position t against labels[t + 1]): a number, silently wrong; without them HF's
    error named the encoder's inputs."""
    from helpers import tiny_t5

    side = {
        "input_ids": torch.tensor([[6, 7, 8]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
        "labels": torch.tensor([[3, 4, 5, 1]]),
        "decoder_input_ids": torch.tensor([[0, 3, 4, 5]]),
    }
    names = r"(T5ForConditionalGeneration|PeftModelForSeq2SeqLM) is an encoder-decoder"
    for model in (tiny_t5(), ft.lora.apply(tiny_t5(), r=2)):
        with pytest.raises(ValueError, match=names):
            P.sequence_logps(model, side)
    batch = {f"{s}_{k}": v for s in ("chosen", "rejected") for k, v in side.items()}
    with pytest.raises(ValueError, match="is an encoder-decoder model"):
        P.preference_loss(P.simpo_loss)(tiny_t5(), batch)


# --- a side without label tokens ----------------------------------------------------------------

# Row 1's rejected answer was truncated away (every label -100), row 3's chosen one keeps only a
# label on its first position, which no logit predicts: neither pair compares anything.
_EMPTY_ROWS = [
    {"chosen_input_ids": [5, 6, 7, 8], "chosen_labels": [-100, -100, 7, 8],
     "rejected_input_ids": [5, 6, 9, 12], "rejected_labels": [-100, -100, 9, 12]},
    {"chosen_input_ids": [5, 6, 7, 8, 10], "chosen_labels": [-100, -100, 7, 8, 10],
     "rejected_input_ids": [5, 6, 9], "rejected_labels": [-100, -100, -100]},
    {"chosen_input_ids": [5, 7, 11], "chosen_labels": [-100, 7, 11],
     "rejected_input_ids": [5, 6, 9, 12, 13], "rejected_labels": [-100, -100, 9, 12, 13]},
    {"chosen_input_ids": [5, 6], "chosen_labels": [5, -100],
     "rejected_input_ids": [5, 6, 9], "rejected_labels": [-100, 6, 9]},
]  # fmt: skip
_KEPT = [0, 2]


def _with_references(rows, ref):
    """The rows with `reference_chosen` / `reference_rejected` precomputed by `sequence_logps`
    (0 for a side without label tokens)."""
    batch = P.pair_collate(pad_id=0)(rows)
    out = []
    with torch.no_grad():
        logps = {s: P.sequence_logps(ref, P._side(batch, s)) for s in ("chosen", "rejected")}
    for i, row in enumerate(rows):
        out.append(row | {f"reference_{s}": logps[s][i].item() for s in logps})
    return out


_LOSSES = {
    "dpo-reference-model": (functools.partial(P.dpo_loss, beta=0.5), "model"),
    "dpo-precomputed": (functools.partial(P.dpo_loss, beta=0.5), "batch"),
    "ipo": (P.ipo_loss, "model"),
    "simpo": (P.simpo_loss, None),
    "orpo": (P.orpo_loss, None),
}


@pytest.mark.parametrize("case", _LOSSES, ids=_LOSSES.keys())
def test_a_pair_with_a_side_without_label_tokens_is_left_out_of_the_loss_and_the_count(case):
    """Such a side's log-prob was 0, a certain answer: DPO and IPO trained on half a pair,
    SimPO's margin was huge and ORPO's loss inf (every gradient NaN, the step skipped). The
    pair now counts for nothing: the loss sum and count equal those of the other pairs alone,
    with the reference's log-probs from a model or precomputed, and the gradients too."""
    loss, reference = _LOSSES[case]
    ref = tiny_llama(seed=1)
    rows = _with_references(_EMPTY_ROWS, ref) if reference == "batch" else _EMPTY_ROWS
    loss_fn = P.preference_loss(loss, reference=ref if reference == "model" else None)
    collate = P.pair_collate(pad_id=0)
    model = tiny_llama()
    total, count = loss_fn(model, collate(rows))
    assert int(count) == len(_KEPT) and count.dtype == torch.int64
    total.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want, want_count = loss_fn(model, collate([rows[i] for i in _KEPT]))
    want.backward()
    assert int(want_count) == len(_KEPT)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        assert torch.isfinite(got[n]).all(), n
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)


def test_left_out_pairs_keep_the_step_mean_exact_across_micro_batches_and_stand_ins():
    """accumulate_grads divides by the pairs counted over every micro-batch: a micro-batch of
    left-out pairs only adds nothing, and a ZeroWeight stand-in holding one (a rank without rows
    in the last global micro-batch) no NaN (ORPO's inf loss times 0 made the gradients NaN)."""
    collate = P.pair_collate(pad_id=0)
    loss_fn = P.preference_loss(P.orpo_loss)
    whole = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    g1, s1 = ft.accumulate_grads(whole, [collate([_EMPTY_ROWS[i] for i in _KEPT])], loss_fn)
    split = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    micro = [
        collate(_EMPTY_ROWS[:2]),
        collate([_EMPTY_ROWS[3]]),  # nothing to count
        collate(_EMPTY_ROWS[2:3]),
        ft.data.ZeroWeight(collate(_EMPTY_ROWS[1:2])),
    ]
    g2, s2 = ft.accumulate_grads(split, micro, loss_fn)
    assert s2.num_items.item() == 2 and s2.num_samples.item() == 4  # pairs, rows
    torch.testing.assert_close(s2.loss, s1.loss, rtol=1e-5, atol=0)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-4, atol=1e-7, msg=n)
    _, info = ft.clip_and_step(split, g2, stats=s2, lr=0.1)
    assert not bool(info.skipped)


def test_a_step_whose_pairs_are_all_left_out_counts_no_item_and_is_skipped():
    """As a causal-LM step whose labels are all -100: the mean over no pair is NaN by
    contract and clip_and_step skips the update (the guard does not count it as a spike)."""
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    before = {n: p.clone() for n, p in state.params.items()}
    micro = [P.pair_collate(pad_id=0)([_EMPTY_ROWS[1], _EMPTY_ROWS[3]])]
    grads, stats = ft.accumulate_grads(state, micro, P.preference_loss(P.simpo_loss))
    assert stats.num_items.item() == 0 and math.isnan(stats.loss.item())
    state, info = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    assert bool(info.skipped)
    assert all(torch.equal(state.params[n], p) for n, p in before.items())


def test_leaving_pairs_out_reads_nothing_on_the_host():
    loss_fn = P.preference_loss(
        functools.partial(P.dpo_loss, beta=0.1), reference=tiny_llama(seed=1)
    )
    batch = P.pair_collate(pad_id=0)(_EMPTY_ROWS)
    model = tiny_llama()
    loss_fn(model, batch)  # the first call walks the models for dropout (host work, no sync)
    # (HF's padding mask is read on the host in masking_utils: allowed, as the docs say)
    _, count = ft.testing.assert_no_host_sync(
        loss_fn, model, batch, allow=("transformers.masking_utils",)
    )
    assert int(count) == len(_KEPT)


def test_orpo_at_a_log_prob_of_0_has_a_finite_loss_and_gradient():
    """A chosen answer the model is sure of (a mean log-prob of 0 in float32, or within 6e-8 of
    it: to which ORPO's SFT term drives it) made every gradient NaN (the odds are infinite; and
    `torch.where`'s unpicked branch had an infinite derivative up to -6e-8), a rejected one the
    loss inf: clip_and_step skipped every step holding the pair. The odds term now takes such
    log-probs at -eps, gradient passed through: a certain rejected answer is pushed down."""
    for dtype in (torch.float32, torch.float64):
        eps = torch.finfo(dtype).eps
        pc = torch.tensor([0.0, -1e-9, -1.0, -0.5, -3.0], dtype=dtype, requires_grad=True)
        pr = torch.tensor([-1.0, -1.0, 0.0, -1e-30, -4.0], dtype=dtype, requires_grad=True)
        loss = P.orpo_loss(pc, pr, beta=0.1)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(pc.grad).all()
        assert torch.isfinite(pr.grad).all()
        assert pr.grad[2] > 0  # descending the loss lowers the certain rejected answer
        # the odds term is the formula's at -eps (the SFT term -pc takes pc as it is)
        at_eps = P.orpo_loss(
            torch.full((2,), -eps, dtype=dtype), torch.full((2,), -1.0, dtype=dtype)
        )
        torch.testing.assert_close((loss + pc)[:2].detach(), at_eps - eps)
    # ordinary log-probs: unchanged, bit for bit (TRL's formula, tested above)
    x, y = torch.tensor([-0.3, -2.0]), torch.tensor([-0.9, -0.1])
    odds = (x - y) - (torch.log1p(-torch.exp(x)) - torch.log1p(-torch.exp(y)))
    torch.testing.assert_close(P.orpo_loss(x, y), -x - 0.1 * F.logsigmoid(odds))
