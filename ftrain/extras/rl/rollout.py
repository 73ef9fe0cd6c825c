"""Rollouts: `G` sampled completions per prompt with a KV cache, and per-token log-probs.

`sample` decodes with the model's own KV cache, one token per forward for the whole batch
(left-padded prompts, each prompt's cache copied `G` times after one prefill). Each completion
draws its tokens by inverse-CDF sampling from uniforms of its own `torch.Generator`, seeded by
`sample_seed(seed, step, completion number)`: what a completion samples depends neither on
the batch it is in nor on the rank that samples it, so a resumed run and a data-parallel run
sample what one uninterrupted process samples.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ftrain.data import MicroBatches, ZeroWeight
from ftrain.eval import eval_mode
from ftrain.extras.generation import left_pad
from ftrain.losses import upcast
from ftrain.precision import Precision
from ftrain.rng import dropout_seed
from ftrain.state import TrainState
from ftrain.strategies import Strategy

__all__ = ["Rollout", "rollout_batches", "sample", "sample_seed", "token_logps", "warp_logits"]

_SALT = 0x5A3C_91E7  # keeps sampling seeds apart from dropout seeds of the same numbers


@dataclass(frozen=True)
class Rollout:
    """Completions of a batch of prompts, `N = prompts x G` rows, generation g of prompt i in
    row `i * G + g`.

    `prompt_ids`/`prompt_mask`: each prompt left-padded, repeated `G` times. `completion_ids`:
    the sampled tokens, `pad_token_id` after a row's stop token; `completion_mask`: 1 up to and
    including the first stop token (TRL's `completion_mask`); `logps`: the sampling policy's
    log-prob of each sampled token, `log_softmax(logits / temperature)` before top-k/top-p (the
    convention of TRL's `old_per_token_logps`), 0 where the mask is 0; `truncated`: rows that
    hit `max_new_tokens` before a stop token (mask them for TRL's
    `mask_truncated_completions`); `completion_index`: each row's completion number, which
    seeded it; `temperature`: the one `logps` are at, which `rollout_batches` passes on so
    that `policy_loss` and the reference's log-probs use the same (TRL's one `temperature`);
    `max_new_tokens`: the cap it was sampled with, `dr_grpo`'s default
    `max_completion_length` (TRL's one `max_completion_length`; None: not recorded);
    `precision`: the sampling strategy's, whose autocast `rollout_batches` runs the reference
    under so that old, reference and new log-probs are computed alike (None: full precision).
    Rollouts made before these two fields existed load with None (what they were used with).
    `seed`, `step`: the state's when it was sampled, which with `completion_index` seeded each
    row, so that `rollout_batches` refuses two rollouts that drew the same random numbers
    (None: not recorded, for a rollout built by hand or made before these fields).
    `trained`: the ids of the parameters the sampling state trains (`state.params`, objects of
    this process), so that `rollout_batches` refuses a reference that shares one; empty for a
    rollout built by hand or pickled (ids mean nothing elsewhere), for which a reference must
    be frozen instead.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logps: torch.Tensor
    truncated: torch.Tensor
    completion_index: torch.Tensor
    temperature: float = 1.0
    max_new_tokens: int | None = None
    precision: Precision | None = None
    seed: int | None = None
    step: int | None = None
    trained: frozenset[int] = field(default=frozenset(), repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # Object ids mean nothing in another process (or after a copy): a pickled rollout
        # records no policy, and its reference must be frozen.
        return {k: v for k, v in self.__dict__.items() if k != "trained"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def sample_seed(seed: int, step: int, completion: int) -> int:
    """The seed of one completion's generator: a pure function of its position in the run.

    Example:
        >>> import ftrain as ft
        >>> ft.rl.sample_seed(0, 3, 7) == ft.rl.sample_seed(0, 3, 7) != ft.rl.sample_seed(0, 4, 7)
        True
    """
    return dropout_seed(seed ^ _SALT, step, completion, 0)


def warp_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """Logits divided by `temperature`, then top-k and top-p (nucleus) filtered to -inf, in the
    order and with the tie rules of HF's `TemperatureLogitsWarper`, `TopKLogitsWarper` and
    `TopPLogitsWarper` (at least one token kept).

    Raises:
        ValueError: for a `temperature` that is not a finite number > 0, a `top_k` that is not
            an int >= 1 or None, a `top_p` outside (0, 1].
    """
    _check_warp(temperature, top_k, top_p)
    scores = logits / temperature if temperature != 1.0 else logits
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return scores


def _is_int(x: Any) -> bool:
    """An integer that is not a bool (True would pass `isinstance(x, int)`)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    """A finite real number that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_warp(temperature: float, top_k: int | None, top_p: float) -> None:
    if not (_is_finite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be a finite number > 0 (top_k=1 samples greedily), "
            f"got {temperature!r}"
        )
    if top_k is not None and not (_is_int(top_k) and top_k >= 1):
        raise ValueError(f"top_k must be an int >= 1 or None (no top-k), got {top_k!r}")
    if not (_is_finite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


def _check_sampling(temperature: float, top_k: int | None, top_p: float, max_new: int) -> None:
    _check_warp(temperature, top_k, top_p)
    if not (_is_int(max_new) and max_new >= 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new!r}")


def _check_index(index: Sequence[int] | torch.Tensor, prompts: int) -> list[int]:
    """The prompts' numbers as distinct non-negative Python ints, or a ValueError naming index."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.dtype == torch.bool or index.is_floating_point():
            raise ValueError(
                f"index must be a 1-D integer tensor or a sequence of ints, got a tensor of "
                f"dtype {index.dtype} and shape {tuple(index.shape)}"
            )
        values: list[Any] = index.tolist()
    else:
        values = list(index)
        if not all(_is_int(i) for i in values):
            bad = next(i for i in values if not _is_int(i))
            raise ValueError(f"index must hold ints, got {bad!r} in {values!r}")
    idx = [int(i) for i in values]
    if len(idx) != prompts:
        raise ValueError(f"index has {len(idx)} numbers for {prompts} prompts")
    if any(i < 0 for i in idx):
        raise ValueError(f"index must hold numbers >= 0, got {idx!r}")
    if len(set(idx)) != len(idx):
        dup = sorted({i for i in idx if idx.count(i) > 1})
        raise ValueError(
            f"index must hold distinct numbers (equal numbers sample equal completions), "
            f"got {dup} more than once"
        )
    return idx


def _check_prompts(ids: Any, mask: Any) -> None:
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"prompts['input_ids'] must be a 2-D tensor, got {shape}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"prompts['attention_mask'] must have the shape of input_ids {tuple(ids.shape)}, "
            f"got {shape}"
        )
    if ids.shape[1] == 0:
        raise ValueError(
            f"prompts are zero-length (input_ids of shape {tuple(ids.shape)}): sample needs "
            "at least one prompt token per row"
        )
    if mask is not None:
        empty = (mask.sum(1) == 0).nonzero().view(-1).tolist()
        if empty:
            raise ValueError(
                f"prompt rows {empty} are all padding (attention_mask sums to 0): sample needs "
                "at least one prompt token per row"
            )


# Prompt keys `sample` reads, and the ones a prompt batch may carry that are no model input it
# drops (a row's answer or target for the reward; the teacher-forcing decoder inputs).
_READ = ("input_ids", "attention_mask")
_NOT_INPUTS = ("labels", "decoder_input_ids", "decoder_attention_mask")


def _check_prompt_keys(model: nn.Module, prompts: Mapping[str, Any]) -> None:
    """Refuse prompt keys the model's forward takes besides the ids and mask (images, token
    types, packed rows' position ids): `sample` decodes from `input_ids` and `attention_mask`
    alone and would drop them, sampling completions of other prompts than the ones given."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else model
    inner = getattr(inner, "_orig_mod", inner)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(inner.forward).parameters.values()
    taken = {p.name for p in params if p.kind in kinds}
    left_out = sorted(k for k in prompts if k in taken and k not in (*_READ, *_NOT_INPUTS))
    if left_out:
        raise ValueError(
            f"sample decodes from the prompts' input_ids and attention_mask, but the prompts "
            f"also hold {left_out}, which {type(inner).__name__}'s forward takes and sampling "
            "would leave out (completions of other prompts than these); drop them from the "
            "prompts (sample computes the position ids from the mask)"
        )


def _refuse_encoder_decoder(model: nn.Module, what: str) -> None:
    """Refuse a seq2seq model (T5, BART), looked for through DDP's `module` (PEFT and
    torch.compile pass `config` on): sampling and `token_logps` continue the prompt in one
    decoder-only sequence; HF's error for it names the encoder's inputs instead."""
    for m in (model, getattr(model, "module", None)):
        if getattr(getattr(m, "config", None), "is_encoder_decoder", False) is True:
            raise ValueError(
                f"{what} takes a decoder-only causal LM (the completion continues the prompt "
                f"in one sequence); {type(m).__name__} is an encoder-decoder model"
            )


def _uniforms(seed: int, step: int, completions: list[int], n: int) -> torch.Tensor:
    """(rows, n) uniforms in [0, 1), row r from the generator of completion `completions[r]`."""
    out = torch.empty(len(completions), n)
    for r, c in enumerate(completions):
        out[r] = torch.rand(n, generator=torch.Generator().manual_seed(sample_seed(seed, step, c)))
    return out


def _draw(scaled: torch.Tensor, warped: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverse-CDF sampling: the first token whose cumulative probability exceeds u (a token
    of probability 0 owns an empty interval, so is never drawn); and its log-prob."""
    cdf = warped.softmax(-1).cumsum(-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    token = token.clamp(max=scaled.shape[-1] - 1)
    logp = scaled.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    return token, logp


def _stop_ids(model: nn.Module, stop_token_ids: Sequence[int] | int | None) -> list[int]:
    if stop_token_ids is None:
        stop_token_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if stop_token_ids is None:
        return []
    single = _is_int(stop_token_ids) or isinstance(stop_token_ids, bool)
    ids: list[Any] = [stop_token_ids] if single else list(stop_token_ids)  # type: ignore[arg-type]
    if not all(_is_int(i) and i >= 0 for i in ids):
        # True would stop at token 1, -1 never
        raise ValueError(f"stop_token_ids must be ints >= 0, got {ids!r}")
    return [int(i) for i in ids]


def _pad_id(model: nn.Module, pad_token_id: int | None) -> int:
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None:
        raise ValueError(
            "sample needs a pad token id: pass pad_token_id=... or set it in the "
            "model's generation_config"
        )
    if not (_is_int(pad_token_id) and pad_token_id >= 0):
        raise ValueError(f"pad_token_id must be an int >= 0, got {pad_token_id!r}")
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    rows = getattr(embeddings, "num_embeddings", None)
    if isinstance(rows, int) and pad_token_id >= rows:
        raise ValueError(
            f"pad_token_id {pad_token_id} is not a token id of the model's {rows} (its input "
            "embeddings): padded prompts and finished rows would feed it to the model"
        )
    return int(pad_token_id)


def sample(
    state: TrainState,
    prompts: Mapping[str, Any],
    *,
    index: Sequence[int] | torch.Tensor,
    num_generations: int = 1,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | int | None = None,
    pad_token_id: int | None = None,
    strategy: Strategy | None = None,
) -> Rollout:
    """Sample `num_generations` completions of each prompt with the state's model.

    Completion g of prompt i is completion number `index[i] * num_generations + g` and samples
    from the generator seeded by `sample_seed(state.seed, state.step, that number)`: give
    `index` as the prompts' global positions (e.g. their dataset row numbers) and the same
    completions come out whatever batch or rank samples them, and again after a resume.
    Sampling `G` rows of one prompt with `num_generations=1` and `index=[i*G, ..., i*G+G-1]`
    gives the same rows as `num_generations=G, index=[i]`. Decoding stops when every row has
    produced a stop token or after `max_new_tokens`; the model runs unwrapped, in eval mode,
    without gradients, under the strategy's autocast. With several ranks every rank decodes
    until all are done (one all-reduce per token), so FSDP's collective forwards line up.

    Args:
        state: whose model, `seed` and `step` sample (not consumed).
        prompts: `input_ids` and `attention_mask`, padded on either side; the mask may be
            left out only when no row holds the pad id. Other keys (a row's `index`, its
            answer) are not read; ones the model's forward takes raise.
        index: one global number per prompt.
        num_generations: completions per prompt (TRL's `num_generations`).
        max_new_tokens: TRL's `max_completion_length`.
        temperature: divides the logits, as in HF `generate`.
        top_k: keep the k most likely tokens (`top_k=1` is greedy decoding); None keeps all.
        top_p: keep the smallest set of tokens with probability at least `top_p` (nucleus).
        stop_token_ids: ends a completion (kept in it); default the model's eos token(s).
        pad_token_id: fills rows after their stop token; default the model's.
        strategy: overrides `state.strategy`.

    Returns:
        a `Rollout`.

    Raises:
        ValueError: for a bad sampling argument; an `index` of the wrong length, not of
            ints, negative or with repeats; an `attention_mask` of another shape than
            `input_ids`; zero-length prompts or prompt rows that are all padding; no pad id;
            prompts holding the pad id without an `attention_mask`, or ids that are not token
            ids of the model; with several data-parallel
            ranks, completion numbers that another rank samples too or a `max_new_tokens`
            that differs between them (on every rank, after a gather); stop or pad ids that
            are not ints >= 0 or not token ids of the model; logits that are not finite
            (NaN or inf) at a sampled token (on every rank, when one rank's are not);
            prompts holding inputs of the model's forward besides `input_ids` and
            `attention_mask` (`pixel_values`, `position_ids`, ...),
            which sampling would leave out; an encoder-decoder model (T5, BART); a
            `ZeroWeight` stand-in of `make_batches` (use `drop_last=True` for prompts under
            data parallelism). With several data-parallel ranks, each of these is raised on
            every rank, before the first collective (stop ids outside the vocabulary: in the
            first token's): the rank whose arguments or prompts were refused raises its
            error, the others one that names it.
    """
    strategy = state.strategy if strategy is None else strategy
    # The checks of this rank's arguments and prompts run before the first collective, and the
    # ranks agree on their outcome in it: a rank that raised alone (an all-padding prompt, a
    # repeated index) left the others waiting in it until the backend's timeout.
    error: Exception | None = None
    try:
        model, ids, mask, completions, pad_id, stop = _checked_inputs(
            state, prompts, strategy, index=index, num_generations=num_generations,
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            stop_token_ids=stop_token_ids, pad_token_id=pad_token_id,
        )  # fmt: skip
    except Exception as e:
        if strategy.world_size == 1:
            raise
        error = e
    if strategy.world_size > 1:
        _agree_over_ranks(error, max_new_tokens, strategy)
        _check_distinct_over_ranks(completions, strategy, ids.device)
    u = _uniforms(state.seed, state.step, completions, max_new_tokens).to(ids.device)
    with eval_mode(state.model), torch.no_grad(), strategy.autocast():
        tokens, logps = _decode(
            model,
            ids,
            mask,
            u,
            num_generations,
            strategy,
            warp=dict(top_k=top_k, top_p=top_p),
            temperature=temperature,
            stop=stop,
            pad_id=pad_id,
        )
    is_stop = torch.isin(tokens, torch.tensor(stop, device=tokens.device, dtype=tokens.dtype))
    before = is_stop.long().cumsum(1) - is_stop.long()  # stop tokens strictly before t
    completion_mask = (before == 0).long()
    # one check (one host sync) per call: a sampled token's log-prob is finite unless the
    # model's logits held NaN or inf (tokens of probability 0 are never drawn)
    _refuse_nonfinite((~torch.isfinite(logps) & completion_mask.bool()).any(1), strategy)
    return Rollout(
        prompt_ids=ids.repeat_interleave(num_generations, 0),
        prompt_mask=mask.repeat_interleave(num_generations, 0),
        completion_ids=tokens,
        completion_mask=completion_mask,
        logps=logps * completion_mask,
        truncated=~is_stop.any(1),
        completion_index=torch.tensor(completions, device=ids.device),
        temperature=float(temperature),
        max_new_tokens=int(max_new_tokens),
        precision=strategy.precision,
        seed=int(state.seed),
        step=int(state.step),
        trained=frozenset(map(id, state.params.values())),
    )


def _checked_inputs(
    state: TrainState,
    prompts: Mapping[str, Any],
    strategy: Strategy,
    *,
    index: Sequence[int] | torch.Tensor,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float,
    stop_token_ids: Sequence[int] | int | None,
    pad_token_id: int | None,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[int], int, list[int]]:
    """`sample`'s checks of its arguments and this rank's prompts, which run no collective:
    the model, the left-padded prompts on the device, the completion numbers, pad and stop ids."""
    _check_sampling(temperature, top_k, top_p, max_new_tokens)
    if not (_is_int(num_generations) and num_generations >= 1):
        raise ValueError(f"num_generations must be an int >= 1, got {num_generations!r}")
    if isinstance(prompts, ZeroWeight):
        # Another rank's prompt, no dict of prompts: indexing it failed with a TypeError of
        # tuples, and unwrapped its completions would be sampled and trained twice.
        raise ValueError(
            "sample got a ZeroWeight stand-in (make_batches gives one to a rank left without "
            "prompts in the final global micro-batch of an epoch: another rank's prompt, to be "
            "run and counted for nothing), whose completions another rank samples and trains "
            "on. Batch prompts with make_batches(..., drop_last=True) under data parallelism"
        )
    model = strategy.unwrap(state.model)
    _refuse_encoder_decoder(model, "sample")
    ids, mask = prompts["input_ids"], prompts.get("attention_mask")
    _check_prompts(ids, mask)
    _check_prompt_keys(model, prompts)
    idx = _check_index(index, ids.shape[0])
    completions = [i * num_generations + g for i in idx for g in range(num_generations)]
    pad_id, stop = _pad_id(model, pad_token_id), _stop_ids(model, stop_token_ids)
    _check_token_ids(model, ids, mask)
    ids, mask = strategy.to_device(left_pad(ids, mask, pad_id=pad_id))
    return model, ids, mask, completions, pad_id, stop


def _check_token_ids(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Refuse prompt tokens that are not token ids of the model (its input embeddings): the
    embedding lookup failed on this rank alone, on CUDA with a device-side assert that ends
    the process. One host sync."""
    rows = getattr(getattr(model, "get_input_embeddings", lambda: None)(), "num_embeddings", None)
    if not isinstance(rows, int) or ids.is_floating_point():
        return
    bad = (ids < 0) | (ids >= rows)
    if mask is not None:
        bad = bad & mask.bool()
    where = bad.nonzero().tolist()  # host sync
    if where:
        raise ValueError(
            f"prompts['input_ids'] hold ids that are not token ids of the model's {rows} (its "
            f"input embeddings) at (row, position) {[tuple(x) for x in where[:8]]}"
            f"{' ...' if len(where) > 8 else ''}"
        )


def _agree_over_ranks(error: Exception | None, max_new: int, strategy: Strategy) -> None:
    """Raise on every data-parallel rank when one refused its arguments or prompts (`error`:
    raised there, and an error naming the ranks on the others), or when `max_new_tokens`
    differs between them: every rank runs the decode loop's per-token all-reduce up to its
    own cap, so a rank with a smaller one left the loop while the others waited in it (a hang
    until the collective's timeout, or its all-reduce met by another collective). One gather
    of two numbers per rank; every rank raises alike."""
    cap = int(max_new) if error is None and _is_int(max_new) else -1
    mine = torch.tensor([[int(error is not None), cap]], dtype=torch.int64, device=strategy.device)
    every = strategy.gather_rows(mine)  # host sync below
    refused = every[:, 0].nonzero().view(-1).tolist()
    if refused:
        if error is not None:
            raise error
        raise ValueError(
            f"sample: data-parallel rank(s) {refused} refused their inputs (their error is "
            "raised there), so this rank stops too rather than wait for them in sampling's "
            "collectives until the backend's timeout"
        )
    caps = every[:, 1]
    if bool((caps != caps[0]).any()):
        raise ValueError(
            f"max_new_tokens differs between the data-parallel ranks ({caps.tolist()}, in rank "
            "order): every rank decodes in step with the others, one token each, up to "
            "max_new_tokens, so it must be the same on every rank (TRL's one "
            "max_completion_length)"
        )


def _refuse_nonfinite(bad: torch.Tensor, strategy: Strategy) -> None:
    """Raise when a row's sampled log-probs are not finite (`bad`: one flag per row), on every
    rank: with several, one gather of each rank's flag, as NaN logits may come from one rank's
    prompts alone, and a rank raising alone left the others waiting in the next collective."""
    flags = bad.any().view(1)
    if strategy.world_size > 1:
        flags = strategy.gather_rows(flags)
    if bool(flags.any()):
        rows = bad.nonzero().view(-1).tolist()
        where = f"rows {rows}" if rows else "no row of this rank's"
        ranks = flags.nonzero().view(-1).tolist()
        on = f" (on data-parallel rank(s) {ranks})" if strategy.world_size > 1 else ""
        raise ValueError(
            f"the model's output (logits) is not finite (NaN or inf) while sampling {where}"
            f"{on}: check the model's weights and dtype"
        )


def _check_distinct_over_ranks(completions: list[int], strategy: Strategy, device: Any) -> None:
    """Refuse completion numbers that another data-parallel rank samples too: seeds follow the
    numbers, not the rank, so ranks passing their local row numbers as `index` would draw the
    same random numbers. One gather (and host sync); every rank sees every rank's numbers and
    raises alike, so none waits in the decode's collectives."""
    every = strategy.gather_rows(torch.tensor(completions, dtype=torch.int64, device=device))
    values, counts = torch.unique(every, return_counts=True)
    dup = values[counts > 1].tolist()
    if dup:
        raise ValueError(
            f"completion numbers {dup[:8]}{' ...' if len(dup) > 8 else ''} are sampled on more "
            f"than one of the {strategy.world_size} data-parallel ranks (index[i] * "
            "num_generations + g): those ranks would draw the same random numbers. Give index "
            "as the prompts' global positions (e.g. their dataset row numbers, which "
            "make_batches splits among the ranks), not each rank's local row numbers"
        )


def _decode(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    u: torch.Tensor,
    g: int,
    strategy: Strategy,
    *,
    warp: dict[str, Any],
    temperature: float,
    stop: list[int],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode loop: one prefill of the distinct prompts, their cache repeated `g` times,
    then one forward per new token for all rows."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # HF's position ids for left padding
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1
    )
    # transformers 5.24 renamed the KV cache `past_key_values` -> `cache` (output and keyword).
    key = "cache" if "cache" in out else "past_key_values"
    cache, logits = out[key], out.logits[:, -1]
    if g > 1:
        cache.batch_repeat_interleave(g)
        logits, mask, pos = (t.repeat_interleave(g, 0) for t in (logits, mask, pos))
    vocab = logits.shape[-1]
    outside = [i for i in stop if i >= vocab]
    refused = ValueError(
        f"stop_token_ids {outside} are not token ids of the model's {vocab} (its logits): no "
        "completion would ever stop at them"
    )
    if outside and strategy.world_size == 1:
        raise refused
    stop_t = torch.tensor(stop, device=ids.device, dtype=ids.dtype)
    done = torch.zeros(mask.shape[0], dtype=torch.bool, device=ids.device)
    next_pos = pos[:, -1:] + 1
    tokens, logps = [], []
    for t in range(u.shape[1]):
        scaled = upcast(logits) / temperature
        token, logp = _draw(scaled, warp_logits(scaled, **warp), u[:, t])
        token = token.masked_fill(done, pad_id)
        tokens.append(token)
        logps.append(logp)
        done = done | torch.isin(token, stop_t)
        remaining = (~done).sum()
        if strategy.world_size > 1 and t == 0:
            # The first token's all-reduce also carries whether a rank's stop ids are outside
            # the vocabulary (known from the prefill's logits): every rank raises, where one
            # rank raising alone left the others waiting in it.
            both = torch.stack([remaining, remaining.new_tensor(int(bool(outside)))])
            remaining, stops_refused = strategy.all_reduce_sum(both).unbind()
            if int(stops_refused):
                if outside:
                    raise refused
                raise ValueError(
                    f"sample: the stop_token_ids of {int(stops_refused)} data-parallel rank(s) "
                    f"are not token ids of the model's {vocab} (their error is raised there), "
                    "so this rank stops too rather than wait for them in a collective"
                )
        elif strategy.world_size > 1:
            remaining = strategy.all_reduce_sum(remaining)
        if t == u.shape[1] - 1 or int(remaining) == 0:  # host sync per token, as HF's generate
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        out = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{key: cache},
        )
        cache, logits, next_pos = out[key], out.logits[:, -1], next_pos + 1
    return torch.stack(tokens, 1), torch.stack(logps, 1)


def token_logps(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_rows: int = 8,
) -> torch.Tensor:
    """Per-token log-probs of `batch["completion_ids"]` after `batch["prompt_ids"]` under
    `model`: `log_softmax(logits / temperature)` at each completion token, shape `(N, T)`.

    The forward sees the prompt and completion with their masks and HF's position ids for left
    padding (what `sample` decoded with), and computes logits for the completion positions only
    (`logits_to_keep`; of a model that takes it in `**kwargs` and returns every position's,
    the last ones). Log-probs are `logit - logsumexp(logits)` over `chunk_rows` rows at a
    time: without gradients (reference and old log-probs) no full-vocabulary float32
    log-softmax of the batch exists at once.

    Raises:
        ValueError: for a `chunk_rows` that is not an int >= 1, an encoder-decoder model.
    """
    if not (_is_int(chunk_rows) and chunk_rows >= 1):
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    _refuse_encoder_decoder(model, "token_logps")
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    width = batch["completion_ids"].shape[1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=width + 1)
    # the last width + 1 positions: all a model returns that honours logits_to_keep, and the
    # right ones of a model that takes it in **kwargs and returns every position's logits
    logits = getattr(out, "logits", out)[:, -(width + 1) : -1]
    target = batch["completion_ids"]
    parts = []
    for lo in range(0, logits.shape[0], chunk_rows):
        chunk = upcast(logits[lo : lo + chunk_rows]) / temperature
        picked = chunk.gather(-1, target[lo : lo + chunk_rows, :, None]).squeeze(-1)
        parts.append(picked - chunk.logsumexp(-1))
    return torch.cat(parts)


def _check_reference(reference: nn.Module, trained: frozenset[int]) -> None:
    """Refuse a reference whose forward runs parameters the policy trains: its "reference"
    log-probs would be the policy's (a KL to the current policy, always 0), silently.

    `trained` holds the policy's parameters as the rollouts recorded them (`Rollout.trained`);
    without that record (rollouts built by hand) every parameter that requires grad counts.
    `reference=state.model` is the policy; `model.get_base_model()` of a LoRA policy still runs
    the policy's adapters. Adapters switched off (`with model.disable_adapter():`, the
    documented LoRA reference) do not run, so their parameters are not counted. A separate
    model (`from_pretrained` again, a copy) is a reference whether it requires grad or not: it
    runs without gradients and no step touches it."""
    _check_adapters(reference)
    idle = _idle_adapter_params(reference)
    params = [(n, p) for n, p in reference.named_parameters() if id(p) not in idle]
    if trained:
        live = [n for n, p in params if id(p) in trained]
        what = "that the policy trains"
    else:
        live = [n for n, p in params if p.requires_grad]
        what = "that require grad (rollouts built by hand record no policy to compare with)"
    if live:
        raise ValueError(
            f"rollout_batches(reference=...) has {len(live)} parameter(s) {what} (e.g. "
            f"{live[0]!r}): a reference that is (or shares parameters with) the policy computes "
            "the policy's own log-probs, so the KL measures nothing. Pass a frozen copy made "
            "before training (copy.deepcopy(model).eval().requires_grad_(False)), or, with "
            "LoRA, call rollout_batches(..., reference=model) inside `with "
            "model.disable_adapter():`"
        )


def _check_adapters(reference: nn.Module) -> None:
    """The LoRA case by name: a live PEFT adapter layer with trainable weights."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # no PEFT layers unless peft is loaded
    if tuners is None:
        return
    for name, module in reference.named_modules():
        live = isinstance(module, tuners.BaseTunerLayer) and not module.disable_adapters
        if live and any(
            p.requires_grad for n, p in module.named_parameters() if "base_layer" not in n
        ):
            raise ValueError(
                f"rollout_batches(reference=...) runs trainable LoRA adapters (at {name!r}): "
                "the base model of a LoRA policy still runs the policy's adapters, so its "
                "log-probs are the policy's. Call rollout_batches(..., reference=model) inside "
                "`with model.disable_adapter():`, or pass a frozen copy "
                "(copy.deepcopy(model).requires_grad_(False))"
            )


# What a switched-off PEFT module still runs: its wrapped layer (a tuner layer's) or the
# original module (a `modules_to_save` wrapper's); its adapters' own parameters sit idle.
_RUN_WHEN_OFF = ("base_layer", "original_module")


def _idle_adapter_params(reference: nn.Module) -> set[int]:
    """Ids of the parameters of switched-off PEFT adapters (`disable_adapter()`), which the
    forward does not run: tuner layers and `modules_to_save` wrappers report
    `disable_adapters`, a prompt-learning model swaps its forward for the base model's."""
    idle: set[int] = set()
    for module in reference.modules():
        if getattr(module, "disable_adapters", False) is True:
            idle |= {
                id(p)
                for n, p in module.named_parameters()
                if n.split(".", 1)[0] not in _RUN_WHEN_OFF
            }
    encoder = getattr(reference, "prompt_encoder", None)
    if getattr(reference, "_adapters_disabled", False) is True and isinstance(encoder, nn.Module):
        idle |= {id(p) for p in encoder.parameters()}
    return idle


def _check_distinct_draws(rollouts: Sequence[Rollout]) -> None:
    """Refuse two rollouts holding one completion number sampled at the same seed and step:
    they drew the same uniforms (`sample` checks the numbers within one call, and across
    ranks; micro-batches of one step given their local row numbers as `index` repeat them)."""
    seen: dict[tuple[int, int, int], int] = {}
    for k, r in enumerate(rollouts):
        seed, step = getattr(r, "seed", None), getattr(r, "step", None)
        if seed is None or step is None:
            continue
        for c in r.completion_index.tolist():  # a host sync per rollout, outside the step
            first = seen.setdefault((seed, step, c), k)
            if first != k:
                raise ValueError(
                    f"rollouts {first} and {k} both hold completion number {c} (index[i] * "
                    f"num_generations + g) sampled at step {step} with seed {seed}: they drew "
                    "the same random numbers. Give sample's index as the prompts' global "
                    "positions (e.g. their dataset row numbers), not each micro-batch's local "
                    "row numbers"
                )


def _plain(value: Any) -> Any:
    """A copy of an inference tensor (`torch.inference_mode()`) that autograd can use."""
    if isinstance(value, torch.Tensor) and value.is_inference():
        return value.clone()
    return value


def rollout_batches(
    rollouts: Sequence[Rollout],
    advantages: Sequence[torch.Tensor],
    prompts: MicroBatches | None = None,
    *,
    reference: nn.Module | None = None,
    temperature: float | None = None,
    mask_truncated: bool = False,
) -> MicroBatches:
    """One micro-batch per rollout for `accumulate_grads(state, micro, ft.rl.policy_loss(...))`.

    Each holds the rollout's prompt and completion tensors, its `advantages` (one per row),
    `old_logps` (the sampling policy's, `Rollout.logps`) and, with a `reference` model,
    `ref_logps` computed here without gradients under the autocast the rollout was sampled
    with (its `precision`), and `temperature` and `max_new_tokens` (the rollout's) for
    `policy_loss`. `prompts` (the `make_batches` group the rollouts were sampled from, one
    rollout per micro-batch) gives the data position that `clip_and_step` records, so `len`
    and position match the prompts consumed.

    Args:
        reference: a model that shares no trained parameter with the policy, e.g. a frozen
            copy of the policy made before training, or a LoRA policy inside `with
            model.disable_adapter():`.
        advantages: per rollout, shape `(N,)` (one per row) or `(N, T)` (one per completion
            token), finite; used detached (no gradient flows through them).
        temperature: of the reference's log-probs; None (the default) takes each rollout's
            `temperature`, the one it was sampled and its `logps` computed at. Another value
            raises: old, reference and new log-probs at different temperatures make a ratio
            and a KL of two different distributions.
        mask_truncated: zero the mask of truncated completions (TRL's
            `mask_truncated_completions`).

    Raises:
        ValueError: for counts that differ, two rollouts that hold one completion number
            sampled at the same seed and step (they drew the same random numbers: `index` not
            the prompts' global positions), `advantages` of another shape or not finite, a
            `mask_truncated` that is not a bool, a `temperature` other than a rollout's, a
            `reference` that shares a parameter the policy trains (the policy itself, or the
            base of a LoRA policy, which runs its adapters: its log-probs would be the
            policy's; for rollouts built by hand, any parameter that requires grad).
    """
    if temperature is not None:
        _check_warp(temperature, None, 1.0)
    if reference is not None:
        trained: list[frozenset[int]] = [getattr(r, "trained", frozenset()) for r in rollouts]
        _check_reference(reference, frozenset[int]().union(*trained))
    if not isinstance(mask_truncated, bool):
        raise ValueError(f"mask_truncated must be a bool, got {mask_truncated!r}")
    if len(rollouts) != len(advantages) or (prompts is not None and len(prompts) != len(rollouts)):
        raise ValueError(
            f"rollout_batches needs one advantages tensor (and prompt micro-batch) per rollout, "
            f"got {len(rollouts)} rollouts, {len(advantages)} advantages"
            + ("" if prompts is None else f", {len(prompts)} prompt micro-batches")
        )
    _check_distinct_draws(rollouts)
    out = []
    for k, (r, adv) in enumerate(zip(rollouts, advantages, strict=True)):
        n, t = r.completion_ids.shape
        if not isinstance(adv, torch.Tensor) or tuple(adv.shape) not in ((n,), (n, t)):
            shape = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
            raise ValueError(
                f"advantages[{k}] must have shape ({n},) (one per row) or ({n}, {t}) (one per "
                f"completion token) for rollout {k} of {n} rows and {t} tokens, got {shape}"
            )
        if not bool(torch.isfinite(adv).all()):
            raise ValueError(
                f"advantages[{k}] holds NaN or inf (group_advantages gives unscorable "
                "completions 0)"
            )
        if temperature is not None and temperature != r.temperature:
            raise ValueError(
                f"rollout_batches(temperature={temperature!r}) differs from rollout {k}'s "
                f"temperature {r.temperature!r}, the one it was sampled and its logps computed "
                "at: leave temperature=None (the rollout's), or sample at the temperature you "
                "train at"
            )
        keep = r.completion_mask * (~r.truncated)[:, None] if mask_truncated else r.completion_mask
        batch: dict[str, Any] = {
            "prompt_ids": r.prompt_ids,
            "prompt_mask": r.prompt_mask,
            "completion_ids": r.completion_ids,
            "completion_mask": keep,
            "advantages": adv.detach().to(r.logps),  # constants, as _exact's
            "old_logps": r.logps,
            "temperature": r.temperature,  # policy_loss's, unless it is given one (then equal)
            # for Stats' token count: prompt and completion tokens
            "attention_mask": torch.cat([r.prompt_mask, keep], 1),
        }
        # Rollouts sampled or scored under torch.inference_mode() hold inference tensors, which
        # autograd cannot save: the update failed in the embedding's backward. Plain copies.
        batch = {k: _plain(v) for k, v in batch.items()}
        if r.max_new_tokens is not None:
            batch["max_new_tokens"] = r.max_new_tokens  # dr_grpo's max_completion_length
        if reference is not None:
            # under the sampling autocast, as old_logps were (and the loss's forward is): in
            # bf16 a reference equal to the policy then gives a KL of exactly 0
            precision = Precision() if r.precision is None else r.precision
            autocast = precision.autocast(r.logps.device)
            with eval_mode(reference), torch.no_grad(), autocast:
                batch["ref_logps"] = token_logps(reference, batch, temperature=r.temperature)
        out.append(batch)
    return MicroBatches(tuple(out), None if prompts is None else prompts.position)
