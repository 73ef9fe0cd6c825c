"""Generation-based evaluation: `generate` over ranks in dataset order, multiple-choice scoring.

`generate` is what `Seq2SeqTrainer(predict_with_generate=True)` gives: completions of every
prompt, gathered from all data-parallel ranks with exact counts. `multiple_choice_metrics` is
qlora.py's MMLU scoring as an `evaluate` metrics_fn: the answer-letter logits at the answer
position, accuracy per subject, and `mean_over_subjects` for the mean of those accuracies.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ftrain.data import weighted
from ftrain.eval import (
    Lockstep,
    MetricsFn,
    check_prediction_args,
    eval_mode,
    forward_collectives,
    prediction_batches,
    several_processes,
)
from ftrain.losses import IGNORE_INDEX, causal_targets, model_logits, upcast
from ftrain.rng import default_generators, dropout_seed, restored
from ftrain.state import TrainState
from ftrain.strategies import Strategy

__all__ = ["generate", "left_pad", "mean_over_subjects", "multiple_choice_metrics"]

_OWN = ("input_ids", "attention_mask")
# Batch keys a model's forward takes that generation has no use for: the targets, and the
# decoder inputs teacher forcing builds from them (DataCollatorForSeq2Seq(model=...)).
_UNUSED = ("labels", "decoder_input_ids", "decoder_attention_mask")
# Settings that count the prompt, padding included, in a decoder-only model's output length,
# and the ones that count new tokens only.
_LENGTHS = MappingProxyType({"max_length": "max_new_tokens", "min_length": "min_new_tokens"})
# Settings that ask model.generate for outputs besides the tokens, which generate drops.
_DROPPED = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# Keeps generation's sampling seeds apart from the dropout seeds of the same numbers.
_GENERATE_SALT = 0x6E4E_7A11


def left_pad(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's tokens (where `attention_mask` is 1) to the right end, as generation
    wants: new tokens then follow every prompt directly. Works on the device, no host sync
    with a mask; without one every token is prompt text, and one check (a host sync) refuses
    `input_ids` that hold `pad_id`.

    Raises:
        ValueError: without `attention_mask`, for `input_ids` holding `pad_id` anywhere: padded
            prompts would be read as prompt text, pad tokens included. It is not inferred
            from `pad_id` (which can be a real token, e.g. an eos inside a chat prompt): pass
            the attention_mask.

    Example:
        >>> import torch
        >>> from ftrain.extras.generation import left_pad
        >>> ids, mask = left_pad(torch.tensor([[5, 6, 0], [7, 0, 0]]),
        ...                      torch.tensor([[1, 1, 0], [1, 0, 0]]), pad_id=0)
        >>> ids.tolist(), mask.tolist()
        ([[0, 5, 6], [0, 0, 7]], [[0, 1, 1], [0, 0, 1]])
    """
    if attention_mask is None:
        _check_unmasked(input_ids, pad_id)
        return input_ids, torch.ones_like(input_ids)
    # A stable sort of the mask puts the padding first and keeps the tokens in order.
    order = torch.argsort(attention_mask.to(torch.int8), dim=1, stable=True)
    mask = attention_mask.gather(1, order)
    ids = torch.where(mask.bool(), input_ids.gather(1, order), pad_id)
    return ids, mask


def _right_pad(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`left_pad`'s mirror: each row's tokens (mask 1) moved to the left end, in order."""
    order = torch.argsort(attention_mask.eq(0).to(torch.int8), dim=1, stable=True)
    mask = attention_mask.gather(1, order)
    return torch.where(mask.bool(), input_ids.gather(1, order), pad_id), mask


def _check_unmasked(input_ids: torch.Tensor, pad_id: int) -> None:
    rows = (input_ids == pad_id).any(1).nonzero().view(-1).tolist()  # host sync, once per batch
    if rows:
        raise ValueError(
            f"the prompts' input_ids hold the pad id {pad_id} (rows {rows}) but no "
            "attention_mask was given, so every pad token would be read as prompt text: pass "
            "the batch's attention_mask (1 on prompt tokens, 0 on padding), all ones where "
            "the pad id is a real token of the prompt"
        )


def _setting(model: nn.Module, kwargs: Mapping[str, Any], name: str) -> Any:
    """A generation setting as HF resolves it: the keyword, else the `generation_config` passed
    (its unset fields fall back to the model's), else the model's `generation_config`."""
    if name in kwargs:
        return kwargs[name]
    value = getattr(kwargs.get("generation_config"), name, None)
    return getattr(model.generation_config, name, None) if value is None else value


def _eos_ids(model: nn.Module, kwargs: Mapping[str, Any]) -> list[int]:
    eos = _setting(model, kwargs, "eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _trim(new: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """Mark everything after each row's first end-of-sequence token with -100 (what HF fills
    with padding once a row is done; one prompt alone stops there)."""
    if not eos:
        return new
    is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
    after = (is_eos.cumsum(1) - is_eos.long()) > 0
    return new.masked_fill(after, IGNORE_INDEX)


class _StopRecorder:
    """The caller's stopping criteria, recording where each row first met one of them.

    HF stops a row there but, without an eos criterion, keeps sampling it (and with one fills it
    with the pad id), so the batch would return tokens the prompt alone never gets."""

    def __init__(self, criteria: Sequence[Any]) -> None:
        self.criteria = list(criteria)
        self.ends: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for criterion in self.criteria:
            done = done | torch.as_tensor(
                criterion(input_ids, scores, **kwargs), device=done.device
            )
        if self.ends is None:
            self.ends = torch.full_like(done, torch.iinfo(torch.int64).max, dtype=torch.int64)
        first = done & (self.ends == torch.iinfo(torch.int64).max)
        self.ends = torch.where(first, input_ids.shape[1], self.ends)
        return done

    def trim(self, new: torch.Tensor, width: int) -> torch.Tensor:
        """Mark the new tokens after each row's stop with -100 (`width`: tokens before them)."""
        if self.ends is None:
            return new
        after = torch.arange(new.shape[1], device=new.device) + width >= self.ends[:, None]
        return new.masked_fill(after, IGNORE_INDEX)


def _stop_criteria(model: nn.Module, kwargs: dict[str, Any], tokenizer: Any) -> list[Any] | None:
    """The caller's `stopping_criteria` and `stop_strings` (moved out of `kwargs`), or None."""
    criteria = list(kwargs.pop("stopping_criteria", None) or [])
    stops = kwargs.pop("stop_strings", None)
    if _setting(model, kwargs, "stop_strings") is not None:
        raise ValueError(
            "generate: the generation_config (passed or the model's) sets stop_strings, whose "
            "rows could not be trimmed where they stop; pass stop_strings=... to ft.generate "
            "with tokenizer=... instead"
        )
    if stops is not None:
        if tokenizer is None:
            raise ValueError("generate: stop_strings=... needs tokenizer=... to find them")
        from transformers import StopStringCriteria

        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stops))
    if criteria and (_setting(model, kwargs, "num_beams") or 1) > 1:
        raise ValueError(
            "generate: stopping_criteria or stop_strings with num_beams > 1 is not supported "
            "(beams are reordered, so where each row stopped is unknown); call model.generate "
            "yourself"
        )
    return criteria or None


def generate(
    state: TrainState,
    batches: Iterable[Any],
    *,
    tokenizer: Any = None,
    gather: bool = True,
    strategy: Strategy | None = None,
    seed: int | None = None,
    **generate_kwargs: Any,
) -> Iterator[dict[str, list[Any]]]:
    """Complete every prompt with `model.generate`; yield the new tokens (and text) per batch.

    Each batch holds prompts: `input_ids` and, when rows are padded, `attention_mask`; `labels`
    and `decoder_input_ids` are ignored, and so are keys the model's forward does not take (a
    raw `text`, an `id`). Other inputs of the model (`pixel_values`, `token_type_ids`,
    `position_ids`, ...) raise rather than be left out, and so, for a decoder-only model, does
    a training batch whose labels mark tokens of its `input_ids`: its prompts hold their
    answers. For encoder-decoder models (T5, BART) the prompt is the encoder's input and the
    new tokens are the decoder's output (without its start token, or without the
    `decoder_input_ids` passed as a keyword: a decoder prompt), as
    `Seq2SeqTrainer(predict_with_generate=True)` gives. Rows are left-padded here for
    decoder-only models and right-padded for encoder-decoders (whose encoder may have absolute
    positions) whatever side they were padded on, so
    `make_batches(prompts, batch_size=..., shuffle=False)` with the default collate works. The
    model runs unwrapped from DDP, in eval mode without gradients, under the strategy's
    autocast. With several data-parallel ranks every rank generates its own share
    and, with `gather`, yields every rank's rows in rank order, which is dataset order
    (`make_batches` gives each prompt to exactly one rank; a stand-in batch adds none). Ranks
    generate in lockstep (`synced_gpus=True`, which FSDP needs: its forward passes are
    collectives), so every rank must iterate as many batches: before each batch the processes
    agree that each has one (one small all-reduce), and every process raises where one has
    none, ran out early, or refused its batch.

    Sampling (`do_sample=True`, from the keywords or the model's `generation_config`) is
    reproducible and leaves torch's global random stream alone: batch `i` on rank `r` draws from
    the default generators (CPU, and the strategy's accelerator) seeded by
    `ftrain.rng.dropout_seed(seed ^ salt, i, 0, r)`, and they get their previous state back
    afterwards. The same call gives the same completions, in this process or a resumed one,
    and whatever the caller draws from the global stream afterwards is what it would draw
    without the call (HF's `model.generate` draws from that stream: each call samples anew, and
    moves every later draw). The same batches on the same ranks give the same samples; another
    batch size samples other ones. Pass another `seed` (e.g. `state.step`) for fresh draws.
    The generators seeded are the CPU one and the accelerator's (CUDA, XPU, MPS, ...:
    `ftrain.rng.default_generators`, as for dropout); a device without a generator ftrain can
    seed is named by a `RuntimeWarning`, and sampling there is not reproducible.

    Args:
        state: the state whose model generates (not consumed).
        batches: batches of prompts, e.g. `make_batches(prompts, batch_size=8, shuffle=False)`.
        tokenizer: decodes the new tokens into `text` (special tokens skipped) when given.
        gather: gather every rank's rows (a collective); False yields this rank's only.
        strategy: overrides `state.strategy`.
        seed: the sampling seed (an int in [0, 2**63), as `TrainState.create` takes);
            None (default): `state.seed`.
        **generate_kwargs: for `model.generate`, e.g. `max_new_tokens=32, do_sample=False`.
            `pad_token_id` defaults to the model's, else the tokenizer's. `stopping_criteria`
            and `stop_strings` (with `tokenizer`) end each row where they first hold, as for
            the prompt alone (HF would go on sampling a stopped row, or pad it). For a decoder-only
            model, `max_length` / `min_length` (which count the left-padded prompt, so the
            longest prompt of a batch would set every row's length) raise unless
            `max_new_tokens` / `min_new_tokens` are set. A `generation_config`
            passed here counts as HF counts it (its `eos_token_id` ends the rows, its
            `pad_token_id` pads them; unset ones fall back to the model's); it is not changed.

    Yields:
        `{"token_ids": [[int, ...], ...]}` per batch, the new tokens of each prompt up to and
        including the first end-of-sequence token (what generating for that prompt alone
        returns), plus `"text"` with a tokenizer.

    Raises:
        TypeError: for an argument of the wrong type (named in the message); if the model
            has no `generate`, `generate_kwargs` sets the prompts or a `generator` (use
            `seed`), `seed` is not an int, or a batch is not a dict with `input_ids`.
        ValueError: for `seed` outside [0, 2**63).
        ValueError: with no batches, or batches `make_batches` shuffled (the completions
            would not line up with the prompts' rows); if no pad token id is known; for
            `output_scores`, `output_logits`, `output_attentions` or `output_hidden_states`
            (outputs it does not yield); for a decoder-only model, for `max_length` or
            `min_length` as above; for `stop_strings` without `tokenizer` or set in a
            `generation_config`, and `stopping_criteria` or `stop_strings` with `num_beams` > 1;
            for a batch holding inputs generation would leave out,
            (decoder-only) prompts that hold their labels, or `input_ids` holding the pad id
            without an `attention_mask` (padding read as prompt text; see `left_pad`). With
            several processes, on every one: when one got no batches or ran out before the
            others (after N batches, named), and when one refused its batch (that process
            raises the error above, the others one that says so).
    """
    check_prediction_args(state, batches, gather=gather, strategy=strategy)
    seed = _check_seed(state.seed if seed is None else seed, generate_kwargs)
    strategy = state.strategy if strategy is None else strategy
    model = strategy.unwrap(state.model)
    generate_fn: Any = getattr(model, "generate", None)
    if not callable(generate_fn):
        raise TypeError(f"generate needs a model with .generate (an HF model), not {type(model)}")
    if taken := sorted(set(_OWN) & set(generate_kwargs)):
        raise TypeError(f"generate takes the prompts from the batches, not from {taken}")
    kwargs = dict(generate_kwargs)
    pad_id = _pad_id(model, kwargs, tokenizer)
    _set_pad(kwargs, pad_id)
    if strategy.world_size > 1:
        kwargs.setdefault("synced_gpus", True)
    _refuse_dropped(model, kwargs)
    eos = _eos_ids(model, kwargs)
    stops = _stop_criteria(model, kwargs, tokenizer)
    enc_dec = getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True
    if not enc_dec:
        _check_lengths(model, kwargs)
    inputs = _forward_names(model)

    def check(item: Any) -> None:  # before the batch's collectives: refused on every process
        batch = weighted(item)[0]
        _check_batch(batch, inputs, model, enc_dec)
        if batch.get("attention_mask") is None:
            _check_unmasked(batch["input_ids"], pad_id)

    # Eval mode across the yields; no_grad and autocast only around each batch's generation
    # (held across a yield they were the caller's too: its loop body ran without gradients
    # and its float32 matmuls in bf16).
    gens = default_generators(strategy.device)
    with eval_mode(state.model, no_grad=False):
        lock = _lockstep(strategy, synced=bool(kwargs.get("synced_gpus")), gather=gather)
        reader = prediction_batches(batches, "generate", state, lock, check=check)
        for i, batch in enumerate(reader):
            batch, weight = weighted(batch)
            batch = strategy.to_device(batch)
            # Eval mode again if the loop body switched to training (a training step does):
            # dropout would otherwise run in the generation.
            again = eval_mode(state.model, no_grad=False) if state.model.training else None
            # Sampling seeded by the batch's position; the caller's random stream put back.
            context = again or contextlib.nullcontext()
            with context, torch.no_grad(), strategy.autocast(), restored(gens):
                for g in gens:
                    g.manual_seed(dropout_seed(seed ^ _GENERATE_SALT, i, 0, strategy.rank))
                new = _new_tokens(generate_fn, batch, pad_id, enc_dec, kwargs, stops)
            new = _trim(new, eos)
            if gather and strategy.world_size > 1:
                new = strategy.gather_rows(new[: None if weight else 0])
            elif not weight:
                continue
            token_ids = [row[row != IGNORE_INDEX].tolist() for row in new.cpu()]
            result: dict[str, list[Any]] = {"token_ids": token_ids}
            if tokenizer is not None:
                result["text"] = tokenizer.batch_decode(token_ids, skip_special_tokens=True)
            yield result


def _lockstep(strategy: Strategy, *, synced: bool, gather: bool) -> Lockstep | None:
    """The processes' agreement before each batch (`ft.eval.Lockstep`), where generating one
    runs collectives: the ranks' synced generation (a collective per new token), the gather of
    the completions, FSDP's and TP's forwards. Every batch, lists and `make_batches` groups
    too: a batch one process refuses (`_check_batch`) is refused on every process. One
    all-reduce of three integers a batch, next to the generation's one per new token; none
    with one process, nor where nothing pairs the ranks (`synced_gpus=False`, `gather=False`,
    DDP)."""
    if not several_processes():
        return None
    if strategy.world_size > 1 and (synced or gather):
        why = (
            "the ranks generate in lockstep (synced_gpus: a collective per new token)"
            if synced
            else "each batch's completions are gathered over the ranks"
        )
    elif forward_collectives(strategy):
        why = f"under {type(strategy).__name__} every batch's forward runs collectives"
    else:
        return None
    return Lockstep(strategy, "generate", why, every=True)


def _check_seed(seed: Any, kwargs: Mapping[str, Any]) -> int:
    """The sampling seed, checked; a `generator` keyword is refused (HF's generate takes none:
    it would reach the model's forward, or be ignored)."""
    # As TrainState.create checks its seed: the wrong type is a TypeError, not a ValueError.
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"generate: seed must be an int, got {seed!r}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"generate: seed must be in [0, 2**63), got {seed}")
    if "generator" in kwargs:
        raise TypeError(
            "generate: model.generate takes no generator; pass seed=... (an int), from which "
            "ft.generate seeds each batch's sampling"
        )
    return seed


def _refuse_dropped(model: nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Refuse settings asking for scores, logits, attentions or hidden states: `model.generate`
    would compute them and `generate` yield the tokens only."""
    for name in _DROPPED:
        # output_attentions / output_hidden_states in the model's own config (HF copies them
        # into its generation_config) serve its training forward: only asked of generate here.
        asked = (
            _setting(model, kwargs, name)
            if name.startswith(("output_scores", "output_logits"))
            else kwargs.get(name, getattr(kwargs.get("generation_config"), name, None))
        )
        if asked:
            raise ValueError(
                f"generate: {name}=True asks for outputs besides the tokens (from the keywords, "
                "the generation_config or the model's), which ft.generate does not yield; call "
                "model.generate yourself for them, or drop the setting"
            )


def _check_lengths(model: nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Refuse `max_length` / `min_length` for a decoder-only model unless the `*_new_tokens`
    setting overrides them: they count the prompt with its left padding, so a prompt's output
    would depend on the longest prompt of its batch."""
    for total, new in _LENGTHS.items():
        if _setting(model, kwargs, total) is not None and _setting(model, kwargs, new) is None:
            raise ValueError(
                f"generate: {total}={_setting(model, kwargs, total)!r} (from the keywords, the "
                "generation_config or the model's) counts a decoder-only model's prompt with "
                "its left padding, so each prompt would get a length that depends on the "
                f"longest prompt of its batch; pass {new}=... instead"
            )


def _forward_names(model: nn.Module) -> frozenset[str]:
    """The keyword arguments the innermost model's `forward` names (through PEFT and
    `torch.compile`); empty when it takes `**kwargs` only."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else model
    inner = getattr(inner, "_orig_mod", inner)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(inner.forward).parameters.values()
    return frozenset(p.name for p in params if p.kind in kinds)


def _check_batch(batch: Any, taken: frozenset[str], model: nn.Module, enc_dec: bool) -> None:
    """Refuse a batch generation would misread: inputs of the model (images, token types,
    positions) it would leave out, and, for a decoder-only model, prompts that hold their
    answers (a training batch, whose labels mark tokens of input_ids)."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError("generate needs dict batches with 'input_ids' (the prompts)")
    left_out = sorted(k for k in batch if k in taken and k not in (*_OWN, *_UNUSED))
    if left_out:
        raise ValueError(
            "generate passes the prompts' input_ids and attention_mask to "
            f"{type(model).__name__}.generate, but the batch also holds {left_out}, which its "
            "forward takes and this generation would leave out; drop them from the batch, or "
            "call model.generate yourself"
        )
    labels, ids = batch.get("labels"), batch["input_ids"]
    if enc_dec or not isinstance(labels, torch.Tensor) or labels.shape != ids.shape:
        return
    scored = labels != IGNORE_INDEX
    if bool(scored.any() & (labels.eq(ids) | ~scored).all()):  # a host sync, outside the steps
        raise ValueError(
            "generate: the batch's labels mark tokens of its input_ids as targets (a training "
            "batch): the prompts hold their answers, and generation would continue after them. "
            "Generate from the prompts alone (input_ids up to the first label)"
        )


def _new_tokens(
    generate_fn: Any,
    batch: Any,
    pad_id: int,
    enc_dec: bool,
    kwargs: dict[str, Any],
    stops: list[Any] | None = None,
) -> torch.Tensor:
    """The generated tokens of a batch of prompts, without the prompt.

    Decoder-only: prompts left-padded, the output continues them. Encoder-decoder (T5, BART):
    the prompt is the encoder's input, right-padded (an encoder with absolute positions reads
    a left-padded prompt from another position), the output is the decoder's, which starts
    with the decoder start token. With `stops`, each row ends where one
    of them first held (-100 after it)."""
    recorder = None
    if stops is not None:
        from transformers import StoppingCriteriaList

        recorder = _StopRecorder(stops)
        kwargs = {**kwargs, "stopping_criteria": StoppingCriteriaList([recorder])}
    if enc_dec:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if mask is None:
            _check_unmasked(ids, pad_id)  # the encoder would attend to the padding
            mask = torch.ones_like(ids)
        else:
            # Right-padded whatever side they came on: an encoder with absolute positions
            # (BART, Marian) read a left-padded prompt from position k, not 0, and completed it
            # otherwise than the prompt alone.
            ids, mask = _right_pad(ids, mask, pad_id)
    else:
        ids, mask = left_pad(batch["input_ids"], batch.get("attention_mask"), pad_id=pad_id)
    result = generate_fn(input_ids=ids, attention_mask=mask, **kwargs)
    out = getattr(result, "sequences", result)
    width = ids.shape[1]
    if enc_dec:
        # The decoder start token, or the decoder prompt the caller passed (forced language or
        # task tokens), which generate returns in front of the new tokens: behind the start
        # token when the prompt did not begin with it (HF puts it there).
        prompt = kwargs.get("decoder_input_ids")
        width = 1
        if isinstance(prompt, torch.Tensor):
            w = prompt.shape[-1]
            width = w if torch.equal(out[:, :w], prompt.to(out.device)) else w + 1
    new = out[:, width:]
    return new if recorder is None else recorder.trim(new, width)


def _set_pad(kwargs: dict[str, Any], pad_id: int) -> None:
    """Give `generate` the pad id: as a keyword, or inside a passed `generation_config` (a copy;
    HF deprecates a keyword beside a config)."""
    config = kwargs.get("generation_config")
    if "pad_token_id" in kwargs or config is None:
        kwargs.setdefault("pad_token_id", pad_id)
    elif config.pad_token_id is None:
        kwargs["generation_config"] = config = copy.deepcopy(config)
        config.pad_token_id = pad_id


def _pad_id(model: nn.Module, kwargs: Mapping[str, Any], tokenizer: Any) -> int:
    pad = _setting(model, kwargs, "pad_token_id")
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError(
            "generate needs a pad token id: pass pad_token_id=..., a tokenizer with one, or set "
            "model.generation_config.pad_token_id"
        )
    return int(pad)


def multiple_choice_metrics(
    *, choice_ids: Sequence[int], subjects: Sequence[str] | None = None
) -> MetricsFn:
    """A metrics_fn scoring multiple-choice questions as qlora.py scores MMLU.

    Each row's answer is its first label that is not -100 (the answer letter's token); the
    prediction is the choice whose token has the highest logit at the position before it (the
    one that predicts it). Returns, from one forward pass, the summed causal-LM `loss` over the
    labels, `accuracy` over all rows and, with `subjects`, `accuracy_<subject>` per subject,
    where the batch holds `subject`: each row's index into `subjects`. Use it as
    `evaluate(state, batches, metrics_fn=...)`; `mean_over_subjects` then gives qlora.py's
    `mmlu_<split>_accuracy`, the mean of the subjects' accuracies.

    Args:
        choice_ids: the token id of each answer letter, e.g. of "A", "B", "C", "D" (qlora.py
            takes `tokenizer(letter, add_special_tokens=False).input_ids[0]`).
        subjects: subject names; the batch's `subject` indexes them.

    Raises:
        ValueError: if `choice_ids` is empty or repeats an id; from the metrics_fn, if a row's
            answer token is not one of `choice_ids`, or `subject` is missing.
    """
    if not choice_ids or len(set(choice_ids)) != len(choice_ids):
        raise ValueError(f"choice_ids must be distinct token ids, got {list(choice_ids)!r}")
    names = list(subjects or [])

    def metrics_fn(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
        inputs = {k: v for k, v in batch.items() if k != "subject"}
        logits, labels = upcast(model_logits(model, inputs)), batch["labels"]
        answered = (labels != IGNORE_INDEX).any(1)
        pos = (labels != IGNORE_INDEX).int().argmax(1)  # the first label: the answer letter
        rows = torch.arange(len(labels), device=labels.device)
        choices = torch.as_tensor(list(choice_ids), device=labels.device)
        ref = labels[rows, pos]
        if not torch.isin(ref[answered], choices).all():  # a host sync, outside the step path
            raise ValueError(f"an answer token is not one of choice_ids={list(choice_ids)}")
        if (answered & (pos == 0)).any():  # a host sync too; index -1 would wrap around
            raise ValueError(
                "an answer token (the row's first label) is at position 0, where no logit "
                "predicts it: put at least one prompt token before the answer"
            )
        pred = choices[logits[rows, pos - 1][:, choices].argmax(-1)]
        correct = (pred == ref) & answered
        targets = causal_targets(batch)  # causal_lm_loss's: a padding position predicts nothing
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        out = {"loss": (loss, (targets != IGNORE_INDEX).sum())}
        out["accuracy"] = (correct.sum(), answered.sum())
        if names:
            if "subject" not in batch:
                raise ValueError("multiple_choice_metrics with subjects needs 'subject' rows")
            subject = batch["subject"]
            if ((subject < 0) | (subject >= len(names))).any():  # a host sync, as above
                raise ValueError(
                    f"multiple_choice_metrics: a row's subject index is outside [0, "
                    f"{len(names)}) (subjects={names}): it would count in eval_accuracy and "
                    "in no subject's"
                )
            for i, name in enumerate(names):  # every name on every rank: evaluate sums by name
                mine = batch["subject"] == i
                out[f"accuracy_{name}"] = ((correct & mine).sum(), (answered & mine).sum())
        return out

    return metrics_fn


def mean_over_subjects(metrics: Mapping[str, float], *, prefix: str = "eval_accuracy_") -> float:
    """The mean of the per-subject accuracies in `evaluate`'s result (subjects without rows,
    whose accuracy is NaN, left out), as qlora.py averages MMLU subjects.

    Example:
        >>> from ftrain.extras.generation import mean_over_subjects
        >>> mean_over_subjects({"eval_accuracy": 0.7, "eval_accuracy_law": 0.5,
        ...                     "eval_accuracy_art": 1.0, "eval_accuracy_x": float("nan")})
        0.75

    Raises:
        ValueError: if no key starts with `prefix`.
    """
    scores = [v for k, v in metrics.items() if k.startswith(prefix) and not math.isnan(v)]
    if not scores:
        raise ValueError(f"no per-subject accuracy (a key starting with {prefix!r}) in metrics")
    return sum(scores) / len(scores)
