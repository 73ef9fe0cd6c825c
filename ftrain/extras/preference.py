"""Preference losses (DPO, IPO, SimPO, ORPO, KTO) as plain functions of per-sequence log-probs.

Each function takes the policy's (and, where the method has one, the reference model's)
per-sequence log-probabilities and returns one loss per example, shape `(batch,)`.
`preference_loss` turns a pairwise loss into an ftrain `loss_fn(model, batch) -> (loss_sum,
num_pairs)`, so `accumulate_grads` averages over the global number of pairs across
micro-batches and ranks: data-parallel training equals one process on the whole batch.

Formulas follow the papers and TRL 1.16 (`DPOTrainer._compute_loss`, `CPOTrainer.cpo_loss`,
`ORPOTrainer.odds_ratio_loss`, `KTOTrainer._compute_loss`); each docstring gives its formula.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ftrain.data import pad_collate
from ftrain.eval import eval_mode
from ftrain.extras.sft import neftune_sites
from ftrain.losses import IGNORE_INDEX, LossFn, causal_targets, model_logits, upcast
from ftrain.rng import dropout_sites

__all__ = [
    "dpo_loss",
    "ipo_loss",
    "kto_loss",
    "orpo_loss",
    "pair_collate",
    "preference_loss",
    "sequence_logps",
    "simpo_loss",
]


def _real(value: Any) -> bool:
    # True is not 1, and inf or NaN is no hyperparameter (beta=inf makes every loss NaN).
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _positive(name: str, value: float) -> None:
    if not (_real(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _nonnegative(name: str, value: float) -> None:
    if not (_real(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _smoothing(label_smoothing: float) -> None:
    if not (_real(label_smoothing) and 0 <= label_smoothing < 0.5):
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")


def _same_shape(**logps: torch.Tensor) -> None:
    """Refuse log-probs of different shapes: broadcasting (batch,) against (batch, 1) would
    silently give a (batch, batch) loss of every chosen against every rejected answer."""
    shapes = {name: tuple(t.shape) for name, t in logps.items()}
    if len(set(shapes.values())) > 1:  # equal shapes of any rank are element-wise pairs
        raise ValueError(
            f"per-sequence log-probs must all have the same shape (batch,), got {shapes}"
        )


def _bce(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    # -log sigma(z) with probability 1 - eps that the label is right (cDPO, Mitchell 2023).
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7), with cDPO label smoothing eps.

    `z = beta * ((pc - pr) - (rc - rr))`; loss `= -(1 - eps) log sigma(z) - eps log sigma(-z)`.
    Log-probs are per-sequence sums over the response tokens.

    Example:
        >>> import torch, ftrain as ft
        >>> z = torch.zeros(1)
        >>> round(ft.preference.dpo_loss(z, z, z, z).item(), 4)   # log 2 at the start
        0.6931
    """
    _positive("beta", beta)
    _smoothing(label_smoothing)
    _same_shape(
        policy_chosen=policy_chosen, policy_rejected=policy_rejected,
        reference_chosen=reference_chosen, reference_rejected=reference_rejected,
    )  # fmt: skip
    margin = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    return _bce(beta * margin, label_smoothing)


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17): `((pc - pr) - (rc - rr) - 1 / (2 beta)) ** 2`.

    TRL and the IPO authors use log-probs averaged over response tokens, which
    `preference_loss(ipo_loss)` computes by default (`average=False` for the sums).
    """
    _positive("beta", beta)
    _same_shape(
        policy_chosen=policy_chosen, policy_rejected=policy_rejected,
        reference_chosen=reference_chosen, reference_rejected=reference_rejected,
    )  # fmt: skip
    margin = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    return (margin - 1 / (2 * beta)) ** 2


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """SimPO (Meng et al. 2024, eq. 6): reference-free, on length-averaged log-probs.

    `z = beta * (pc - pr) - gamma`; loss `= -(1 - eps) log sigma(z) - eps log sigma(-z)`
    (TRL's CPOTrainer with `loss_type="simpo"`, `simpo_gamma=gamma`). `preference_loss(simpo_loss)`
    averages the log-probs by default.
    """
    _positive("beta", beta)
    _smoothing(label_smoothing)
    if not _real(gamma):
        raise ValueError(f"gamma must be a finite number, got {gamma!r}")
    _same_shape(policy_chosen=policy_chosen, policy_rejected=policy_rejected)
    return _bce(beta * (policy_chosen - policy_rejected) - gamma, label_smoothing)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012).

    Each branch is evaluated at a point of its own domain only (-1 stands in elsewhere): the
    branch `torch.where` does not pick still has a gradient, and `log1p(-exp(x))` at an `x`
    whose `exp` rounds to 1 (above about -6e-8 in float32) has an infinite one, which times the
    0 that `where` sends it made every gradient NaN (0 * inf)."""
    near = x > -0.6931
    return torch.where(
        near,
        torch.log(-torch.expm1(torch.where(near, x, -1.0))),
        torch.log1p(-torch.exp(torch.where(near, -1.0, x))),
    )


def _below_zero(logp: torch.Tensor) -> torch.Tensor:
    """`logp` with values above `-eps` of its dtype taken as `-eps`, gradient passed through.

    The odds of a log-prob of 0 (a probability of 1 in floating point: an answer the model is
    sure of, to which ORPO's SFT term drives the chosen one) are infinite: the loss was inf or
    its gradient NaN (inf * 0), as in TRL's `odds_ratio_loss`, and `clip_and_step` skipped
    every step holding that pair. At `-eps` both are finite; the gradient is the formula's
    there, so a rejected answer held certain is still pushed down (the exact one is infinite).
    Every log-prob below `-eps` is used as it is, bit for bit."""
    if not logp.is_floating_point():
        return logp
    eps = torch.finfo(logp.dtype).eps
    return logp + (logp.clamp(max=-eps) - logp).detach()


def orpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
) -> torch.Tensor:
    """ORPO (Hong et al. 2024, eqs. 4-7): SFT loss on the chosen answer plus an odds-ratio term.

    With length-averaged log-probs `pc`, `pr` (< 0): `log_odds = (pc - pr) - (log(1 - e^pc) -
    log(1 - e^pr))`; loss `= -pc - beta * log sigma(log_odds)`. The first term is the chosen
    answer's mean token NLL per pair (TRL averages it over all chosen tokens of the batch
    instead); the second is TRL's `odds_ratio_loss`. `preference_loss(orpo_loss)` averages
    the log-probs by default. In the odds term a log-prob above `-eps` of its dtype (a
    certain answer, whose odds are infinite: TRL's loss is inf or its gradient NaN there)
    counts as `-eps`, its gradient passed through; every other value is used as it is.
    """
    _positive("beta", beta)
    _same_shape(policy_chosen=policy_chosen, policy_rejected=policy_rejected)
    pc, pr = _below_zero(policy_chosen), _below_zero(policy_rejected)
    log_odds = (pc - pr) - (_log1mexp(pc) - _log1mexp(pr))
    return -policy_chosen - beta * F.logsigmoid(log_odds)


def kto_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    *,
    kl: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 7) on unpaired examples.

    With `r = policy - reference` per sequence: a desirable example costs
    `desirable_weight * (1 - sigma(beta * (r - kl)))`, an undesirable one
    `undesirable_weight * (1 - sigma(beta * (kl - r)))`. `kl` is the reference point, a
    detached estimate of KL(policy || reference) clamped at 0; TRL takes the batch mean of
    `policy - reference` on mismatched (prompt, completion) pairs, averaged over ranks (use
    `strategy.all_reduce_sum(x) / world_size` so that every rank uses the same value).
    An example whose completion has no label tokens has log-prob 0 in both models (a
    `sequence_logps` of nothing): leave it out of `policy`, `reference` and your count.

    Args:
        policy: per-sequence log-probs of the policy, shape (batch,).
        reference: per-sequence log-probs of the reference model, shape (batch,).
        desirable: bool, shape (batch,): which examples are desirable.
        kl: the reference point (a number or 0-dim tensor; detached here).
    """
    _positive("beta", beta)
    _nonnegative("desirable_weight", desirable_weight)
    _nonnegative("undesirable_weight", undesirable_weight)
    if desirable_weight == 0 and undesirable_weight == 0:
        raise ValueError(
            "desirable_weight and undesirable_weight are both 0: every KTO loss would be 0"
        )
    if not isinstance(desirable, torch.Tensor) or desirable.dtype != torch.bool:
        raise TypeError(
            f"desirable must be a bool tensor, got {getattr(desirable, 'dtype', desirable)!r}"
        )
    _same_shape(policy=policy, reference=reference, desirable=desirable)
    kl_t = torch.as_tensor(kl, dtype=policy.dtype, device=policy.device).detach().clamp(min=0)
    r = policy - reference
    good = desirable_weight * (1 - torch.sigmoid(beta * (r - kl_t)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl_t - r)))
    return torch.where(desirable, good, bad)


def sequence_logps(
    model: nn.Module, batch: Mapping[str, Any], *, average: bool = False
) -> torch.Tensor:
    """Per-sequence sum (or mean) of the log-probs of the label tokens (not -100), after the
    causal shift: shape (batch,). A padding position (`attention_mask` 0) predicts nothing, as
    in the core's loss (`ft.losses.causal_targets`): with left padding the pads' targets would
    otherwise count, and a row's log-prob would depend on the rows padded with it. Nor is it
    predicted: a label there is padding (a collate of your own may pad labels with a token id,
    not -100). Left-padded rows are moved to the left first (padding after the tokens), so
    that their positions start at 0 as the unpadded row's do.

    A row without label tokens (every label -100, or its only one on the first position, which
    no logit predicts: a completion truncated away by a `max_length`) gets 0, the log-prob of
    no tokens, as if its completion were certain. `preference_loss` leaves a pair with such a
    side out of its loss and its count; where you use the log-probs yourself (`kto_loss`),
    leave such rows out too.

    Raises:
        ValueError: for an encoder-decoder model (T5, BART): its decoder's logits at position
            t score `labels[t]`, unshifted, and its forward needs the decoder's inputs.
    """
    return _logps_and_counts(model, batch, average)[0]


def _logps_and_counts(
    model: nn.Module, batch: Mapping[str, Any], average: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` and each row's number of label tokens, shape (batch,) both."""
    _refuse_encoder_decoder(model)
    batch = _flush_left(batch)
    logits = upcast(model_logits(model, batch))[:, :-1]
    labels = causal_targets(batch)[:, :-1]
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == batch["labels"].shape:
        # the last real token would otherwise be scored against the first pad's label
        labels = labels.masked_fill(mask[:, 1:].logical_not(), IGNORE_INDEX)
    keep = labels != IGNORE_INDEX
    token = torch.gather(
        logits.log_softmax(-1), 2, torch.where(keep, labels, 0).unsqueeze(-1)
    ).squeeze(-1)
    total = (token * keep).sum(-1)
    count = keep.sum(-1)
    return (total / count.clamp(min=1) if average else total), count


def _flush_left(batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """The batch with each row's tokens (`attention_mask` 1) moved to its start, in order, and
    its padding after them (TRL's `flush_left`); every tensor of the mask's shape moves along.

    Without position ids the model numbers positions from 0 at the first column: a left-padded
    row's tokens sat at positions shifted by its padding, and a model of absolute position
    embeddings (GPT-2) scored them differently from the same row padded on the right or not at
    all. A right-padded batch is unchanged. On the device, no host sync."""
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return batch
    order = torch.argsort(mask.eq(0).to(torch.int8), dim=1, stable=True)
    return {
        k: v.gather(1, order) if isinstance(v, torch.Tensor) and v.shape == mask.shape else v
        for k, v in batch.items()
    }


def _refuse_encoder_decoder(model: nn.Module) -> None:
    """Refuse a seq2seq model (looked for through DDP's `module`; PEFT and torch.compile
    wrappers pass `config` on): the causal shift would score each decoder position against the
    label after its own, silently (and without `decoder_input_ids` HF's error names the
    encoder's inputs)."""
    for m in (model, getattr(model, "module", None)):
        if getattr(getattr(m, "config", None), "is_encoder_decoder", False) is True:
            raise ValueError(
                f"sequence_logps scores a causal LM (logits at t predict labels[t + 1]); "
                f"{type(m).__name__} is an encoder-decoder model, whose decoder logits at t "
                "score labels[t]: ftrain's preference losses take decoder-only models. Compute "
                "the per-sequence log-probs of the decoder yourself and pass them to "
                "ft.preference.dpo_loss (or another loss) directly"
            )


def _side(batch: Mapping[str, Any], side: str) -> dict[str, Any]:
    prefix = f"{side}_"
    return {k.removeprefix(prefix): v for k, v in batch.items() if k.startswith(prefix)}


def pair_collate(pad_id: int, *, pad_to_multiple_of: int | None = None) -> Callable[..., Any]:
    """Collate preference rows (`chosen_input_ids`, `chosen_labels`, the same for `rejected_`,
    lists or tensors): each side padded as `ft.pad_collate` pads `input_ids` and `labels`
    (labels with -100), with its own `chosen_attention_mask` / `rejected_attention_mask`.
    Other fields are collated as `ft.pad_collate` collates them: scalars (precomputed
    `reference_chosen` / `reference_rejected`) stacked, sequences (`prompt_input_ids`) padded;
    a field that row 0 lacks is refused, naming it.

    `make_batches`' default collate (`ft.data.pad_collate`) pads the sides alike; this one
    pads each side on its own and checks it as `pad_collate` checks `input_ids` (a mask of
    another length than its tokens). A collate that makes no masks (torch's
    `default_collate`) leaves padding that `preference_loss` cannot tell from labels: refused.

    Example:
        >>> import ftrain as ft
        >>> rows = [{"chosen_input_ids": [5, 6], "chosen_labels": [-100, 6],
        ...          "rejected_input_ids": [5], "rejected_labels": [5]},
        ...         {"chosen_input_ids": [7], "chosen_labels": [7],
        ...          "rejected_input_ids": [8, 9], "rejected_labels": [-100, 9]}]
        >>> b = ft.preference.pair_collate(pad_id=0)(rows)
        >>> b["chosen_labels"].tolist(), b["chosen_attention_mask"].tolist()
        ([[-100, 6], [7, -100]], [[1, 1], [1, 0]])
    """
    pad = pad_collate(pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
    sides = ("chosen_", "rejected_")

    def collate(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        for i, row in enumerate(rows):  # a field row 0 lacks would be dropped unseen
            extra = [k for k in row if k not in rows[0]]
            if extra:
                raise KeyError(
                    f"pair_collate: row {i} of the batch has field {extra[0]!r}, which row 0 "
                    f"has not (row 0 has {', '.join(map(repr, rows[0]))}); every row needs the "
                    "same fields"
                )
        out: dict[str, Any] = {}
        for prefix in sides:
            part = pad([{k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix)}
                        for r in rows])  # fmt: skip
            out.update({prefix + k: v for k, v in part.items()})
        # Other fields as pad_collate takes them: ragged ones (prompt_input_ids) padded
        rest = [{k: v for k, v in r.items() if not k.startswith(sides)} for r in rows]
        if rest[0]:
            out.update(pad(rest))
        return out

    return collate


def _check_masks(chosen: Mapping[str, Any], rejected: Mapping[str, Any]) -> None:
    """Refuse a side without its attention mask: padding cannot be told from label tokens.

    A batch built by hand, or by a collate that makes no masks (torch's `default_collate`, a
    collator of your own padding `chosen_labels` with a token id), marks padding nowhere: every
    padding position would count as a label token in the row's log-prob, which would then
    depend on the rows padded with it. ftrain's collates make the masks."""
    for side, part in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(part.get("attention_mask"), torch.Tensor):
            raise ValueError(
                f"preference batches need {side}_attention_mask (1 on tokens, 0 on padding): "
                f"without it padding cannot be told from label tokens (a collate that makes "
                f"no masks may pad {side}_labels with a token, not -100). Collate with "
                "make_batches' default (ft.data.pad_collate(pad_id=tokenizer.pad_token_id)) or "
                "ft.preference.pair_collate(pad_id=...), or give each row its masks"
            )


def preference_loss(
    loss: Callable[..., torch.Tensor],
    *,
    reference: nn.Module | None = None,
    average: bool | None = None,
) -> LossFn:
    """A `loss_fn(model, batch) -> (loss_sum, num_pairs)` from a pairwise preference loss.

    The batch holds `chosen_input_ids`, `chosen_labels` and `chosen_attention_mask`, the same
    for `rejected_` (`pair_collate` pads rows so), and, for losses with a reference,
    either precomputed `reference_chosen` / `reference_rejected` log-probs (shape (batch,),
    computed with the same `average`) or a frozen `reference` model run here without
    gradients. Reference-free losses (`simpo_loss`, `orpo_loss`) get the policy log-probs only.

    A pair one of whose sides has no label tokens (every label -100, e.g. a completion
    truncated away by a `max_length`) compares nothing: its log-prob would be 0, a certain
    answer. It is left out of `loss_sum` and `num_pairs` (and its reference log-probs unread),
    on the device without a host sync, so the mean over the other pairs is exact, across
    micro-batches and ranks; `Stats.num_items` below the number of pairs says how many were
    left out, and a step whose pairs all were counts no item (its loss NaN, its update
    skipped, as for a causal-LM batch whose labels are all -100). Filter such rows out of the
    data to train on every pair.

    Args:
        loss: e.g. `functools.partial(ft.preference.dpo_loss, beta=0.1)`.
        reference: a frozen copy of the starting model (used when the batch has no
            precomputed reference log-probs).
        average: use length-averaged log-probs instead of sums. None (default): the loss's own
            convention, averages for `ipo_loss`, `simpo_loss` and `orpo_loss` (TRL's, and
            the SimPO and ORPO papers'), sums for `dpo_loss` and any other loss.

    Raises:
        TypeError: for a `loss` that is not a function, a `reference` that is not a module or
            an `average` that is not a bool or None.
        ValueError: when `reference` is given to a reference-free loss (it would be ignored);
            from the loss_fn, when a side has no attention mask (padding could not be told
            from label tokens: a batch built by hand or by a collate that makes no masks),
            when a loss with a reference gets neither `reference` nor precomputed log-probs,
            when a reference-free loss gets precomputed ones, when those are not of shape
            (batch,), when `loss` does not return one value per
            pair, when `reference` shares a trained parameter with the policy (e.g. the
            base of a PEFT policy, whose adapters still run: it is not a fixed reference), or
            when a loss with reference log-probs gets a policy that runs dropout (a dropout
            module of p > 0 or a config's `attention_dropout` > 0, in training mode) or
            NEFTune noise (`ft.sft.neftune`, whose hook stays until its handle is removed).
    """
    if not callable(loss):
        raise TypeError(f"loss must be a function such as ft.preference.dpo_loss, got {loss!r}")
    if reference is not None and not isinstance(reference, nn.Module):
        raise TypeError(f"reference must be a torch.nn.Module or None, got {reference!r}")
    if average is not None and not isinstance(average, bool):
        raise TypeError(
            f"average must be True or False (None: the loss's convention), got {average!r}"
        )
    if average is None:
        # Summed log-probs in SimPO or ORPO make another loss than the paper's, and in IPO
        # another than TRL's: the default follows each loss's convention.
        average = _innermost(loss) in (ipo_loss, simpo_loss, orpo_loss)
    needs = _needs_reference(loss)
    if reference is not None and needs is False:
        raise ValueError(
            f"preference_loss got reference= for {_name(loss)}, a reference-free loss that "
            "takes the policy's log-probs only: the reference would be ignored; drop it"
        )

    # policies checked against `reference` (once each: a walk of both), held weakly as below
    apart: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    # models checked for dropout, once each (a walk of the modules); held weakly, as an
    # id could be reused by a later model
    clean: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = _side(batch, "chosen"), _side(batch, "rejected")
        if "labels" not in chosen or "labels" not in rejected:
            raise KeyError("preference batches need chosen_labels and rejected_labels")
        _check_masks(chosen, rejected)
        pc, chosen_tokens = _logps_and_counts(model, chosen, average)
        pr, rejected_tokens = _logps_and_counts(model, rejected, average)
        # A side without label tokens (its completion truncated away by a max_length) has the
        # log-prob 0 of no tokens: it entered the loss as a certain answer (DPO and IPO
        # trained on half a pair, SimPO's margin was huge, ORPO's loss inf). The pair compares
        # nothing: it is left out of the loss and the count (on the device, no host sync), so
        # the mean over the pairs that compare something stays exact; Stats.num_items < the
        # pairs shows how many were left out, and a step of none counts no item (skipped).
        kept = (chosen_tokens > 0) & (rejected_tokens > 0)
        refs = _references(batch, pc, needs)
        if refs and reference is not None:
            raise ValueError(
                "preference_loss(reference=...) got a batch that holds reference_chosen and "
                "reference_rejected too: one of the two references would be ignored. Drop the "
                "precomputed columns, or build the loss without reference="
            )
        if not refs and reference is not None and needs is not False:
            if model not in apart:
                _check_apart(model, reference)
                apart.add(model)
            # The reference is fixed: dropout in it would make every log-prob noisy. (Its
            # label tokens are the policy's: the same pairs are left out.)
            with eval_mode(reference):
                refs = (
                    sequence_logps(reference, chosen, average=average),
                    sequence_logps(reference, rejected, average=average),
                )
        if refs and model not in clean:
            _check_no_dropout(model)
            if model.training:  # an eval-mode pass says nothing of training
                clean.add(model)
        if not refs and needs:
            raise ValueError(
                f"{_name(loss)} needs reference log-probs: pass preference_loss(..., "
                "reference=frozen_model) or put reference_chosen and reference_rejected in "
                "the batch"
            )
        # A left-out pair's log-probs (policy's and reference's alike) are replaced by -1
        # before the loss, not only its loss after it: the loss's gradient at a log-prob of 0
        # can be inf (ORPO's odds), and the 0 that `where` sends back times inf is NaN.
        per_pair = loss(*(torch.where(kept, x, -1.0) for x in (pc, pr, *refs)))
        if per_pair.shape != pc.shape:
            raise ValueError(
                f"loss must return one value per pair, shape {tuple(pc.shape)}; "
                f"{_name(loss)} returned shape {tuple(per_pair.shape)}"
            )
        return torch.where(kept, per_pair, 0.0).sum(), kept.sum()

    return loss_fn


def _check_no_dropout(model: nn.Module) -> None:
    """Refuse a policy that drops out in its training-mode forward when its log-probs are
    compared with a reference's (run in eval mode, or precomputed): with policy == reference
    the margin would not be 0 nor the DPO loss log 2, and every margin carries dropout noise
    (the DPO authors and TRL's `disable_dropout=True` turn dropout off; `ft.rng.dropout_sites`)."""
    sites = dropout_sites(model)
    if sites:
        shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
        raise ValueError(
            f"preference_loss: the policy runs dropout in its training-mode forward "
            f"({shown}), while its reference log-probs have none: the margins compare a "
            "dropped-out forward with a clean one (not 0 with policy == reference). Call "
            "ft.rng.disable_dropout(model) before training (TRL's disable_dropout)"
        )
    noisy = neftune_sites(model)
    if noisy:
        raise ValueError(
            f"preference_loss: the policy adds NEFTune noise to its input embeddings in its "
            f"training-mode forward ({', '.join(noisy)}), while its reference log-probs have "
            "none: the margins compare a noisy forward with a clean one. Remove the hook "
            "before preference training (handle.remove() on what ft.sft.neftune returned; the "
            "Trainer turns NEFTune off at the end of train())"
        )


def _check_apart(model: nn.Module, reference: nn.Module) -> None:
    """Refuse a reference that holds parameters the policy trains (host-side ids, no sync).

    `reference=peft_model.get_base_model()` (or the policy itself) still runs the policy's
    LoRA adapters: its log-probs are the policy's, every DPO margin is 0 and the "reference"
    moves with each update, silently."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    shared = [n for n, p in reference.named_parameters() if id(p) in trained]
    if shared:
        raise ValueError(
            f"preference_loss(reference=...) shares {len(shared)} trained parameter(s) with the "
            f"policy (e.g. {shared[0]!r}): it would compute the policy's own log-probs, not a "
            "fixed reference's (a PEFT model's base still runs its adapters). Pass a frozen "
            "copy (copy.deepcopy(model).requires_grad_(False)) or precompute reference_chosen "
            "and reference_rejected with the adapters off (with model.disable_adapter(): "
            "ft.preference.sequence_logps(...))"
        )


def _references(
    batch: Mapping[str, Any], pc: torch.Tensor, needs: bool | None
) -> tuple[torch.Tensor, ...]:
    """The batch's precomputed reference log-probs, checked, or () when it has none."""
    given = [k for k in ("reference_chosen", "reference_rejected") if k in batch]
    if not given:
        return ()
    if len(given) == 1:
        raise KeyError(f"the batch has {given[0]} but not its pair: pass both or neither")
    if needs is False:
        raise ValueError(
            "the batch holds reference_chosen and reference_rejected, but the loss is "
            "reference-free and would ignore them: drop them from the batch"
        )
    refs = (batch["reference_chosen"], batch["reference_rejected"])
    for key, ref in zip(given, refs, strict=True):
        if not isinstance(ref, torch.Tensor) or ref.shape != pc.shape:
            raise ValueError(
                f"{key} must be a tensor of shape {tuple(pc.shape)} (one log-prob per pair), "
                f"got {tuple(ref.shape) if isinstance(ref, torch.Tensor) else type(ref).__name__}"
            )
    return refs


def _needs_reference(loss: Callable[..., Any]) -> bool | None:
    """True for a loss of 4 required positional log-probs (DPO, IPO), False for 2 (SimPO,
    ORPO), None when its signature says neither."""
    try:
        params = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [q for q in params if q.kind in kinds]
    if any(q.kind is inspect.Parameter.VAR_POSITIONAL for q in params):
        return None
    required = [q for q in positional if q.default is inspect.Parameter.empty]
    if len(required) == 4:
        return True
    return False if len(positional) == 2 else None


def _innermost(loss: Callable[..., Any]) -> Any:
    while isinstance(loss, functools.partial):  # partials of partials too
        loss = loss.func
    return loss


def _name(loss: Callable[..., Any]) -> str:
    fn = getattr(loss, "func", loss)  # a functools.partial names its function
    return getattr(fn, "__name__", repr(fn))
