"""Advantages and the clipped policy loss of GRPO and its family, as TRL 1.16 computes them.

Sources: `GRPOTrainer._generate_and_score_completions` (advantages, `scale_rewards`),
`GRPOTrainer._compute_loss` (ratio, clipping, k3 KL, `loss_type` normalisations),
`RLOOTrainer._generate_and_score_completions` (leave-one-out baseline). Every function here is
checked against TRL's own code in tests/test_rl.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ftrain.extras.rl.rollout import _is_finite, _is_int, token_logps
from ftrain.extras.sft import neftune_sites
from ftrain.losses import LossFn
from ftrain.rng import dropout_sites
from ftrain.strategies import Strategy

__all__ = [
    "clipped_objective",
    "group_advantages",
    "kl_k3",
    "policy_loss",
    "reduce_loss",
    "rloo_advantages",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (TRL's `nanstd`); NaN below 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.nan)
    return var.sqrt().squeeze(dim) if dim is not None else var.sqrt().squeeze()


def _check_rewards(rewards: torch.Tensor, num_generations: int) -> None:
    """The arguments and this rank's rewards' type, before any collective."""
    if not (_is_int(num_generations) and num_generations >= 2):
        raise ValueError(
            f"num_generations must be an int >= 2 (with one completion per prompt every "
            f"advantage is 0 and nothing is learned), got {num_generations!r}"
        )
    if not (isinstance(rewards, torch.Tensor) and rewards.is_floating_point()):
        what = rewards.dtype if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a floating-point tensor, got {what}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")


def _check_finite(rewards: torch.Tensor) -> None:
    """After the gather: every rank sees every rank's rewards and raises alike (a check of this
    rank's rows alone would leave the others waiting in the collective)."""
    inf = torch.isinf(rewards).nonzero().view(-1)
    if inf.numel():
        raise ValueError(
            f"rewards hold inf at rows {inf.tolist()} of the global batch: mark an unscorable "
            "completion with NaN"
        )


def _exact(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """The rewards in float64, and the dtype to return advantages in (float32 at least).

    Means in the rewards' own dtype round: 1000.1 three times has a float32 mean one ulp off,
    and `(r - mean) / (std + 1e-4)` turns that ulp into advantages of +-0.35 for a group whose
    rewards are all equal. In float64 the sum of n equal float32 (or half) values is n times
    the value exactly (for any group size below 2**29), so its mean is the value itself and
    equal rewards give 0 exactly; unequal ones round far below float32's precision.

    Detached: advantages are constants of the policy gradient (TRL scores without gradients).
    Rewards of a model run with autograd on (a reward model, the policy judging itself) would
    carry its graph into the loss: the policy's gradient would flow through its own rewards,
    and a second update on the same rollouts would backward through a freed graph."""
    out = torch.promote_types(rewards.dtype, torch.float32)
    return rewards.detach().to(torch.float64), out


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.shape[0] % num_generations:
        raise ValueError(
            f"rewards must be 1-D with a multiple of num_generations={num_generations} rows "
            f"(all completions of each prompt, over all ranks), got shape {tuple(rewards.shape)}"
        )
    return rewards.view(-1, num_generations)


def _global(
    rewards: torch.Tensor, strategy: Strategy | None, check: Callable[[], None]
) -> tuple[torch.Tensor, slice]:
    """Every rank's rewards in rank order, and where this rank's lie in them (host sync), after
    `check()` (of the arguments and this rank's rewards) on every rank: with several ranks its
    outcome travels in the first gather, so that a rank refused alone (rewards of another
    dtype or shape) does not leave the others waiting in it; every rank raises (that rank its
    error, the others one that names it)."""
    if strategy is None or strategy.world_size == 1:
        check()
        if strategy is None:
            _check_one_process()
        return rewards, slice(0, rewards.shape[0])
    error: Exception | None = None
    try:
        check()
    except Exception as e:
        error = e
    n = rewards.shape[0] if error is None else 0
    mine = torch.tensor([[n, int(error is not None)]], dtype=torch.int64, device=strategy.device)
    counts = strategy.gather_rows(mine)
    refused = counts[:, 1].nonzero().view(-1).tolist()  # host sync
    if refused:
        if error is not None:
            raise error
        raise ValueError(
            f"data-parallel rank(s) {refused} refused their rewards or arguments (their error "
            "is raised there), so this rank stops too rather than wait for them in the "
            "gather of the rewards until the backend's timeout"
        )
    start = int(counts[: strategy.rank, 0].sum())
    return strategy.gather_rows(rewards), slice(start, start + n)


def _check_one_process() -> None:
    """Refuse `strategy=None` under a process group of several ranks (as `make_batches` does):
    each rank would form groups of its own rows only, splitting a prompt's group that lies on
    several ranks, and `scale="batch"` (or RLOO's `normalize`) would divide by this rank's
    std, not the global batch's as TRL does, silently."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"strategy is None under an initialised process group of {dist.get_world_size()} "
            "ranks: the advantages would be computed from this rank's rewards alone (groups "
            "split over ranks broken, batch statistics per rank). Pass strategy=state.strategy "
            "(rewards gathered over the ranks), or strategy=ft.strategies.SingleDevice() for "
            "this rank's rewards alone on purpose"
        )


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale: str = "group",
    strategy: Strategy | None = None,
) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, divided by the std plus 1e-4.

    `A_i = (r_i - mean_group(r)) / (std + 1e-4)` where std is the group's (`scale="group"`,
    GRPO), the whole batch's (`"batch"`: the rewards of this call, so give it every rollout's
    of a step at once, as TRL takes the generation batch's), or absent (`"none"`: Dr. GRPO,
    `A_i = r_i - mean_group(r)`); std is Bessel-corrected. Rows `k*G .. k*G+G-1` form a
    group. NaN rewards (unscorable completions) stay out of the means and get advantage 0.
    With a `strategy` of several ranks, `rewards` are this rank's rows, in rank order of the
    global batch: they are gathered, groups formed over all of them (a prompt's completions
    may lie on different ranks) and this rank's advantages returned.
    Computed in float64, so a group of equal rewards gets advantages of exactly 0 (in the
    rewards' dtype its mean can round by an ulp, which the division by `std + 1e-4` would blow
    up); returned in the rewards' dtype, float32 at least, and detached from any graph the
    rewards carry (a reward model run with gradients on): advantages are constants.

    Raises:
        ValueError: for `num_generations < 2` (every advantage would be 0), rewards that are
            not a 1-D floating tensor of a multiple of `num_generations` rows, an inf reward
            (NaN marks an unscorable completion), an unknown `scale`, `strategy=None` under an
            initialised process group of several ranks (pass `state.strategy`, or
            `ft.strategies.SingleDevice()` for this rank's rewards alone). With a `strategy`
            of several ranks, on every rank: where one rank's rewards or arguments are
            refused, that rank raises its error and the others one that names it.

    Example:
        >>> import torch, ftrain as ft
        >>> ft.rl.group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, scale="none").tolist()
        [0.5, -0.5, 0.0, 0.0]
    """

    def check() -> None:
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
        _check_rewards(rewards, num_generations)

    rewards, mine = _global(rewards, strategy, check)
    _check_finite(rewards)
    rewards, dtype = _exact(rewards)
    grouped = _grouped(rewards, num_generations)
    adv = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
    if scale == "group":
        adv = adv / (_nanstd(grouped, 1).repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        adv = adv / (_nanstd(rewards) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)[mine].to(dtype)


def rloo_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    normalize: bool = False,
    strategy: Strategy | None = None,
) -> torch.Tensor:
    """RLOO's advantages: each reward minus the mean of the other rewards of its group.

    `A_i = r_i - (sum_group(r) - r_i) / (n - 1)` with n the group's scorable (non-NaN) count;
    `normalize` then standardises over the batch (`(A - mean) / (std + 1e-4)`, TRL's
    `normalize_advantages`). Groups, NaN rewards and `strategy` as in `group_advantages`. TRL's
    RLOO subtracts `beta * sum_t (old_logp - ref_logp)` from the rewards first: do that on
    `rewards` before calling.
    Computed in float64 and returned as `group_advantages` returns them.

    Raises:
        ValueError: as `group_advantages`, and for a `normalize` that is not a bool.

    Example:
        >>> import torch, ftrain as ft
        >>> ft.rl.rloo_advantages(torch.tensor([3.0, 0.0, 0.0]), 3)
        tensor([ 3.0000, -1.5000, -1.5000])
    """

    def check() -> None:
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize must be a bool, got {normalize!r}")
        _check_rewards(rewards, num_generations)

    rewards, mine = _global(rewards, strategy, check)
    _check_finite(rewards)
    rewards, dtype = _exact(rewards)
    grouped = _grouped(rewards, num_generations)
    n = (~torch.isnan(grouped)).sum(1, keepdim=True)
    baseline = (torch.nansum(grouped, 1, keepdim=True) - grouped) / (n - 1)
    adv = (grouped - baseline).view(-1)
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (_nanstd(adv) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)[mine].to(dtype)


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token, always >= 0:
    `exp(ref - logp) - (ref - logp) - 1`.

    Example:
        >>> import torch, ftrain as ft
        >>> ft.rl.kl_k3(torch.tensor([-1.0]), torch.tensor([-1.0]))
        tensor([0.])
    """
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def _check_clip(epsilon: float, epsilon_high: float | None, delta: float | None) -> None:
    if not (_is_finite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    if epsilon_high is not None and not (_is_finite(epsilon_high) and epsilon_high >= 0):
        raise ValueError(f"epsilon_high must be a finite number >= 0 or None, got {epsilon_high!r}")
    if delta is not None and not (_is_finite(delta) and delta > 1):
        raise ValueError(
            f"delta must be a finite number > 1 or None (it caps the ratio; at <= 1 it "
            f"clips even an unchanged policy), got {delta!r}"
        )


def clipped_objective(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate per token, negated to a loss, with asymmetric clipping (DAPO).

    `rho = exp(logp - old_logp)`; loss `= -min(rho' * A, clip(rho, 1 - eps_low, 1 + eps_high)
    * A)` with `rho' = min(rho, delta)` when `delta` is given (TRL's two-sided clipping),
    `eps_high = epsilon_high or epsilon`. `advantages` has one value per row (or per token).

    Raises:
        ValueError: for an `epsilon` or `epsilon_high` that is not a finite number >= 0, a
            `delta` that is not a finite number > 1 (TRL recommends `delta > 1 + epsilon`).

    Example:
        >>> import torch, ftrain as ft
        >>> lp, old = torch.log(torch.tensor([[1.5]])), torch.zeros(1, 1)
        >>> ft.rl.clipped_objective(lp, old, torch.tensor([1.0]))   # clipped at 1.2
        tensor([[-1.2000]])
    """
    _check_clip(epsilon, epsilon_high, delta)
    high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    coef = torch.exp(logps - old_logps)
    clipped = torch.clamp(coef, 1 - epsilon, 1 + high)
    if delta is not None:
        coef = torch.clamp(coef, max=delta)
    return -torch.min(coef * adv, clipped * adv)


def _check_max_len(max_completion_length: int | None, loss_type: str = "dr_grpo") -> None:
    if not (_is_int(max_completion_length) and max_completion_length >= 1):  # type: ignore[operator]
        need = "needs" if loss_type == "dr_grpo" else "takes"
        raise ValueError(
            f"loss_type={loss_type!r} {need} max_completion_length= (an int >= 1), "
            f"got {max_completion_length!r}"
        )


def _check_width(width: int, max_completion_length: int) -> None:
    if width > max_completion_length:
        raise ValueError(
            f"completions are {width} tokens wide, more than max_completion_length="
            f"{max_completion_length} (dr_grpo's divisor; the longest completion otherwise); "
            "pass the max_new_tokens the rollouts were sampled with"
        )


def _max_len(batch: Mapping[str, Any], given: int | None, width: int) -> int:
    """`dr_grpo`'s divisor: the batch's `max_new_tokens` (its rollout's, which
    `rollout_batches` puts there), which a `max_completion_length` given to `policy_loss` must
    equal: another value rescales the loss and its gradient by `max_new_tokens / given`."""
    own = batch.get("max_new_tokens")
    if own is not None and not (_is_int(own) and own >= 1):
        raise ValueError(f"the batch's max_new_tokens must be an int >= 1, got {own!r}")
    if given is None:
        if own is None:
            raise ValueError(
                "loss_type='dr_grpo' needs max_completion_length=... (the max_new_tokens the "
                "rollouts were sampled with): this batch does not record it (rollout_batches "
                "puts a Rollout's there)"
            )
        return int(own)
    _check_width(width, given)
    if own is not None and own != given:
        raise ValueError(
            f"policy_loss(max_completion_length={given!r}) differs from the batch's "
            f"max_new_tokens {own!r}, the cap its rollout was sampled with (with dr_grpo the "
            f"loss and its gradient would be scaled by {own}/{given}); leave "
            "max_completion_length=None (the batch's), or sample with max_new_tokens equal to it"
        )
    return given


def reduce_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(loss_sum, num_items)` of one micro-batch for `accumulate_grads`, which divides the
    summed losses by the summed items over all micro-batches and ranks:

    - `grpo`: sum over rows of each row's token mean; items = rows (mean of sequence means);
    - `bnpo`: the micro-batch's token mean; items = 1 (mean over micro-batches and ranks);
    - `dr_grpo`: token sum / `max_completion_length`; items = rows;
    - `dapo`: token sum; items = tokens (the step's global token mean).

    Each equals TRL's loss of the same name over the micro-batches of one optimizer step
    (`dapo`: when one generation batch makes one optimizer step, see docs/post_training.md).

    A row whose mask is all 0 (a completion masked by `rollout_batches(mask_truncated=True)`)
    has no log-prob standing in for it: it adds exactly 0 to the loss and nothing to any
    gradient. `grpo` and `dr_grpo` still count it as a row, as TRL does (its mean over rows,
    Dr. GRPO's constant normaliser), so it weighs the others' mean down; `bnpo` and `dapo`
    count its 0 tokens. A `dapo` step whose rows are all empty counts no item: its loss is
    NaN and `clip_and_step` skips it; the other types apply a step of zero gradients (TRL's
    too: weight decay and momentum still act).

    Raises:
        ValueError: for an unknown `loss_type`; with `dr_grpo` (or given with another loss
            type, which does not divide by it), a `max_completion_length` that is not an int
            >= 1 or is less than the completions' width.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "dr_grpo" or max_completion_length is not None:
        # Only dr_grpo divides by it; a value given with another loss type is still checked
        # (accepted and dropped, a wrong one would go unnoticed), as policy_loss checks it.
        _check_max_len(max_completion_length, loss_type)
        assert max_completion_length is not None
        _check_width(per_token.shape[-1], max_completion_length)
    m = mask.to(per_token.dtype)
    # selected, not multiplied: a NaN or inf outside the mask would survive `* 0`
    kept = torch.where(mask.bool(), per_token * m, 0.0)  # a fractional mask still weighs
    total = kept.sum()
    rows = torch.tensor(per_token.shape[0], device=per_token.device)
    if loss_type == "grpo":
        return (kept.sum(-1) / m.sum(-1).clamp(min=1.0)).sum(), rows
    if loss_type == "bnpo":
        return total / m.sum().clamp(min=1.0), torch.ones((), device=per_token.device)
    if loss_type == "dr_grpo":
        assert max_completion_length is not None
        return total / max_completion_length, rows
    return total, m.sum()  # dapo


def policy_loss(
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    temperature: float | None = None,
    max_completion_length: int | None = None,
    bias_correction_kl: bool = True,
) -> LossFn:
    """GRPO's loss as an ftrain `loss_fn(model, batch) -> (loss_sum, num_items)`.

    Per token: `clipped_objective(logp, old_logp, A) + beta * kl_k3(logp, ref_logp)`, the KL
    multiplied by `rho = exp(logp - old_logp)` with `bias_correction_kl` (TRL's
    `use_bias_correction_kl`, on by default); reduced by `reduce_loss(loss_type)`. `logp` is
    `token_logps(model, batch, temperature=...)` at the batch's `temperature` (the rollout's,
    which `rollout_batches` puts there; 1.0 in a batch without one); a `temperature` given here
    must equal the batch's. The batch is what `rollout_batches`
    builds: prompt and completion ids and masks, `advantages`, `old_logps` (absent: the
    current log-probs detached, ratio 1, as TRL when `num_iterations=1`) and, with `beta > 0`,
    `ref_logps` (which `beta=0` refuses to ignore); both are used detached (constants). The
    policy must not drop out (its old and reference log-probs were computed in eval mode).
    `dr_grpo` divides by
    `max_completion_length`, by default the batch's `max_new_tokens` (its rollout's, as TRL
    uses one `max_completion_length` for sampling and the loss); a value given here must equal
    it, with any loss type (the others do not divide by it). Defaults are `GRPOConfig`'s.

    Raises:
        ValueError: for an unknown `loss_type`; a `max_completion_length` that is not None
            or an int >= 1 (or, when the loss runs, is smaller than the completions' width or
            differs from the batch's `max_new_tokens`; with `dr_grpo`, is None in a batch
            without one); a `beta`, `epsilon` or
            `epsilon_high` that is not a finite number >= 0, a `delta` that is not a finite
            number > 1, a `temperature` that is not a finite number > 0 (or, when the loss
            runs, differs from the batch's), a `bias_correction_kl` that is not a bool; when
            the loss runs, `beta=0` with `ref_logps` in the batch (the KL would be dropped),
            and a policy that runs dropout (a dropout module of p > 0 or a config's
            `attention_dropout` > 0, in training mode) or NEFTune noise (`ft.sft.neftune`)
            while the batch holds `old_logps` or `beta > 0`.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "dr_grpo" and max_completion_length is not None:
        _check_max_len(max_completion_length)
    elif max_completion_length is not None and not (
        _is_int(max_completion_length) and max_completion_length >= 1
    ):
        raise ValueError(
            f"max_completion_length must be an int >= 1 or None, got {max_completion_length!r}"
        )
    if not (_is_finite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    _check_clip(epsilon, epsilon_high, delta)
    if temperature is not None and not (_is_finite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(bias_correction_kl, bool):
        raise ValueError(f"bias_correction_kl must be a bool, got {bias_correction_kl!r}")

    # models checked for dropout, once each (a walk of the modules); held weakly, as an
    # id could be reused by a later model
    clean: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def loss_fn(model: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if beta == 0.0 and "ref_logps" in batch:
            raise ValueError(
                f"policy_loss(beta={beta!r}) would ignore the batch's ref_logps, which "
                "rollout_batches(reference=...) computed for a KL penalty: pass beta > 0 for "
                "the KL to the reference, or drop reference= (no KL, no reference forward)"
            )
        if model not in clean and ("old_logps" in batch or beta != 0.0):
            _check_no_dropout(model)
            if model.training:  # an eval-mode pass says nothing of training
                clean.add(model)
        # Positions outside the mask are made inert before any arithmetic: a token there (the
        # pad after a stop) may have log-prob -inf, and a masked NaN is still NaN (NaN * 0),
        # in the loss and in every gradient.
        inside = batch["completion_mask"].bool()
        logps = token_logps(model, batch, temperature=_temperature(batch, temperature))
        logps = torch.where(inside, logps, 0.0)
        # Old and reference log-probs are constants of the update, as TRL's (computed without
        # gradients): old ones recomputed by hand with autograd on (token_logps of the policy)
        # held the policy's graph, and the ratio exp(logp - old) had a gradient of 0.
        old = batch.get("old_logps")
        old = logps.detach() if old is None else torch.where(inside, old.detach(), 0.0)
        per_token = clipped_objective(
            logps, old, batch["advantages"], epsilon=epsilon, epsilon_high=epsilon_high, delta=delta
        )
        if beta != 0.0:
            if "ref_logps" not in batch:
                raise KeyError(
                    "policy_loss with beta > 0 needs ref_logps in the batch: "
                    "rollout_batches(..., reference=ref_model)"
                )
            kl = kl_k3(logps, torch.where(inside, batch["ref_logps"].detach(), 0.0))
            per_token = per_token + beta * (
                kl * torch.exp(logps - old) if bias_correction_kl else kl
            )
        length = max_completion_length
        if loss_type == "dr_grpo" or max_completion_length is not None:
            # the other loss types do not divide by it, but a value given is still checked
            # against the rollouts' (never accepted and dropped)
            length = _max_len(batch, max_completion_length, per_token.shape[-1])
        return reduce_loss(
            per_token, batch["completion_mask"], loss_type=loss_type, max_completion_length=length
        )

    return loss_fn


def _check_no_dropout(model: nn.Module) -> None:
    """Refuse a policy that drops out in its training-mode forward: `sample` computed the old
    log-probs and `rollout_batches` the reference's in eval mode, so the ratio would not be 1
    before any update (clipping acting on dropout noise) and the KL would compare a
    dropped-out forward with a clean one (`ft.rng.dropout_sites`)."""
    sites = dropout_sites(model)
    if sites:
        raise ValueError(
            f"policy_loss: the policy runs dropout in its training-mode forward "
            f"({_listed(sites)}), while its old_logps (sampled in eval mode) and ref_logps "
            "(computed in eval mode) have none: the ratio is not 1 before any update and "
            "clipping acts on dropout noise. Call ft.rng.disable_dropout(model) before "
            "training (TRL's disable_dropout)"
        )
    noisy = neftune_sites(model)
    if noisy:
        raise ValueError(
            f"policy_loss: the policy adds NEFTune noise to its input embeddings in its "
            f"training-mode forward ({_listed(noisy)}), while its old_logps (sampled in eval "
            "mode) and ref_logps have none: the ratio is not 1 before any update. Remove the "
            "hook before post-training (handle.remove() on what ft.sft.neftune returned; the "
            "Trainer turns NEFTune off at the end of train())"
        )


def _listed(sites: list[str]) -> str:
    return ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")


def _temperature(batch: Mapping[str, Any], given: float | None) -> float:
    """The temperature of a batch's log-probs: the batch's (its rollout's), which one given to
    `policy_loss` must equal; 1.0 when neither says."""
    own = batch.get("temperature")
    if own is not None and not (_is_finite(own) and own > 0):
        raise ValueError(f"the batch's temperature must be a finite number > 0, got {own!r}")
    if given is None:
        return 1.0 if own is None else float(own)
    if own is not None and float(own) != given:
        raise ValueError(
            f"policy_loss(temperature={given!r}) differs from the batch's temperature {own!r}, "
            "the one its rollout was sampled and its old_logps computed at: the ratio would "
            "compare two distributions; leave temperature=None (the batch's)"
        )
    return given
