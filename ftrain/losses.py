"""Losses as `loss_fn(model, batch) -> (loss_sum, num_items)`.

A loss is a *sum* over items together with the item count, so that `accumulate_grads` can divide
by the global count over all micro-batches and ranks: that is what makes gradient accumulation
exact with ragged padding (the 2024 HF gradient-accumulation bug came from averaging means).
"""

from __future__ import annotations

import functools
import inspect
import numbers
import typing
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ftrain.process_state import STATE

__all__ = [
    "IGNORE_INDEX",
    "LossFn",
    "causal_lm_loss",
    "causal_targets",
    "Counted",
    "classification_loss",
    "counted",
    "decoder_input_ids",
    "default_loss",
    "loss_for",
    "loss_logits",
    "loss_name",
    "model_inputs",
    "model_logits",
    "padded_as_model",
    "seq2seq_loss",
    "token_classification_loss",
    "upcast",
]

IGNORE_INDEX = -100
_SUM = 2  # the `reduction` code of aten's losses for "sum"


class LossFn(Protocol):
    """`loss_fn(model, batch) -> (loss_sum, num_items)`, both device tensors."""

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


def upcast(t: torch.Tensor) -> torch.Tensor:
    """Return `t` in float32 when it is float16 or bfloat16, else unchanged.

    Half-precision logits lose too much in log-softmax; every loss here upcasts them first, and
    a loss of your own should too.

    Example:
        >>> import torch, ftrain as ft
        >>> ft.losses.upcast(torch.zeros(2, dtype=torch.bfloat16)).dtype
        torch.float32
        >>> ft.losses.upcast(torch.zeros(2, dtype=torch.float64)).dtype
        torch.float64
    """
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def model_inputs(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments `model` gets from a dict batch: all but `labels` and the keys its
    `forward` does not take.

    What the Trainer's `remove_unused_columns=True` does: dataset columns the model does not
    take (a raw `text`, an `id`) stay out of the call, and a `UserWarning` names them (once per
    place and set of keys, Python's default warning filter). The batch itself keeps them, so a
    `loss_fn` of your own can read them; call this to run the model from it. The names come from
    the innermost model's `forward` (through PEFT, `torch.compile`, DDP and Opacus wrappers, as
    `loss_for`). A `forward` with `**kwargs` takes every key; an HF model's (`PreTrainedModel`)
    takes the arguments it names and the keys its `**kwargs` annotation declares
    (`TransformersKwargs`: `cu_seq_lens_q`, `seq_idx`, `output_hidden_states`, ...), as HF
    models pass any keyword on to their layers.

    Raises:
        TypeError: when the batch lacks an argument the forward requires.
        ValueError: for packed rows (`position_ids` and no `attention_mask`, as
            `ft.sft.packed_collate` gives them) and a forward that takes no `position_ids`
            (Bloom, MPT), or an HF model whose outputs ignore the example boundaries in them
            (OPT, BioGPT, XGLM, the BERT-style decoders, the recurrent hybrids such as
            Jamba and Qwen3-Next): the examples of a row would attend to each other. Also
            for rows whose boundaries only `cu_seq_lens_q` / `cu_seq_lens_k` hold
            (`DataCollatorWithFlattening(return_position_ids=False)`), which only
            flash-attention kernels read, for a model not set to flash attention.

    Example:
        >>> import torch, ftrain as ft
        >>> class Lm(torch.nn.Module):
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return input_ids
        >>> batch = {"input_ids": torch.tensor([[1]]), "labels": torch.tensor([[1]]), "id": ["a"]}
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     sorted(ft.losses.model_inputs(Lm(), batch))
        ['input_ids']
        >>> str(seen[0].message)  # doctest: +ELLIPSIS
        "the model's forward (Lm) takes no 'id': left out of its inputs..."
    """
    names, required, through = _forward_names(model)
    inputs = {
        k: v
        for k, v in batch.items()
        if k != "labels" and (names is None or k in names or (through and torch.is_tensor(v)))
    }
    if not required <= inputs.keys():
        missing = ", ".join(repr(k) for k in sorted(required - inputs.keys()))
        raise TypeError(
            f"the model's forward ({type(_base_model(model)).__name__}) needs {missing}, which "
            f"the batch does not hold (it has {', '.join(map(repr, batch))}); name the batch's "
            "keys after the forward's arguments, or pass loss_fn=... that calls the model"
        )
    if "position_ids" in batch and "position_ids" not in inputs and not _masked(batch):
        raise ValueError(
            "the batch holds position_ids and no attention_mask (packed rows, as "
            "ft.sft.packed_collate gives them), but the model's forward "
            f"({type(_base_model(model)).__name__}) takes no position_ids: without them its "
            "examples would attend to each other. Pad the examples instead of packing them, "
            "or drop position_ids from the batch"
        )
    if "position_ids" in inputs and not _masked(batch):
        base = _base_model(model)
        kind = _packing_leak(getattr(base, "config", None))
        if kind is not None:
            raise ValueError(
                "the batch holds position_ids and no attention_mask (packed rows, as "
                f"ft.sft.packed_collate gives them), but {type(base).__name__} (model_type "
                f"{kind!r}) does not keep them apart (its attention mask ignores position_ids, "
                "or recurrent layers carry state from one example into the next). Pad the "
                "examples instead of packing them "
                "(ft.sft.SFTCollator, ft.pad_collate), or pass an attention_mask for unpacked rows"
            )
    if not _masked(batch) and "position_ids" not in inputs:
        _refuse_flash_only_boundaries(model, inputs)
    if len(inputs) + ("labels" in batch) != len(batch):
        dropped = ", ".join(repr(k) for k in batch if k != "labels" and k not in inputs)
        base = _base_model(model)
        params = inspect.signature(base.forward).parameters.values()
        note = ""
        if any(p.kind is p.VAR_KEYWORD for p in params):
            note = (
                "; its **kwargs get the other keys holding tensors only"
                if through
                else "; an HF model's **kwargs get only the keys they declare, as HF models "
                "pass any keyword on to their layers"
            )
        warnings.warn(
            f"the model's forward ({type(base).__name__}) takes no {dropped}: left out of its "
            "inputs, as the Trainer's remove_unused_columns does (the batch keeps them for a "
            f"loss_fn of your own; drop them from the data to silence this{note})",
            UserWarning,
            stacklevel=3,
        )
    return inputs


# The keys of HF's `TransformersKwargs` that mark the examples of a packed row for
# flash-attention kernels only; HF's other attention implementations find the boundaries in
# `position_ids`.
_FLASH_BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k")


def _refuse_flash_only_boundaries(model: nn.Module, inputs: Mapping[str, Any]) -> None:
    """Raise for packed rows whose boundaries only `cu_seq_lens_*` hold (no position_ids, no
    attention_mask) when the model is not set to flash attention: SDPA and eager attention
    ignore them, so the examples would attend to each other."""
    held = [k for k in _FLASH_BOUNDARIES if inputs.get(k) is not None]
    if not held:
        return
    impl = getattr(_config(model), "_attn_implementation", None)
    if isinstance(impl, str) and "flash" in impl:
        return
    raise ValueError(
        f"the batch marks its packed examples with {', '.join(held)} only (no position_ids, "
        f"no attention_mask), which only flash-attention kernels read; "
        f"{type(_base_model(model)).__name__} runs {impl!r} attention, so the examples would "
        "attend to each other. Put position_ids in the batch too "
        "(DataCollatorWithFlattening's default return_position_ids=True), or pad the examples"
    )


# HF model types (`config.model_type`) whose forward takes `position_ids` but whose outputs for
# a packed row (position_ids restarting per example, no attention mask) differ from the
# examples run alone: their mask ignores the boundaries (OPT, BioGPT, XGLM, the BERT-style
# decoders, GPT-1), or their recurrent / linear-attention layers carry state across them (the
# hybrids). Measured with transformers 5.24 on tiny models of each type that builds from its
# default config (`python tests/workers/packing_scan.py` re-runs the measurement;
# tests/test_task_losses.py re-measures a sample); a type not listed is not checked.
_PACKING_LEAKS = frozenset({
    "afmoe", "bailing_hybrid", "bert", "bert-generation", "big_bird", "biogpt", "camembert",
    "data2vec-text", "electra", "ernie", "falcon_h1", "gpt_oss", "inkling2_loop_text",
    "inkling2_text", "inkling_text", "jamba", "kimi_linear", "lara_mini", "lfm3",
    "megatron-bert", "minimax", "nemotron_h", "olmo_hybrid", "openai-gpt", "opt",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "qwen4_exp_text", "recurrent_gemma",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "xglm", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "zaya",
})  # fmt: skip


def _packing_leak(config: Any) -> str | None:
    """The model type (the model's, or its text model's in a composite such as a VLM) that
    `_PACKING_LEAKS` lists, if any."""
    kinds = [getattr(config, "model_type", None)]
    text_config = getattr(config, "get_text_config", None)
    if callable(text_config):
        kinds.append(getattr(text_config(), "model_type", None))
    return next((k for k in kinds if k in _PACKING_LEAKS), None)


def _masked(batch: Mapping[str, Any]) -> bool:
    """Whether `batch` holds an attention mask (packed rows hold none: see `packed_collate`)."""
    return batch.get("attention_mask") is not None


_Params = tuple[frozenset[str] | None, frozenset[str], bool]


def _forward_names(model: nn.Module) -> _Params:
    """The batch keys the innermost model's `forward` takes (None: every key), those of its
    named parameters without a default, and whether other keys holding tensors go through its
    `**kwargs` too.

    A forward with `**kwargs` only takes every key; one of your own that names parameters too
    takes them and any other key holding a tensor (`token_type_ids` passed on to an inner
    BERT), not a raw `text` or `id` column (which `model(**batch)` would pass on, failing in
    the layer it reaches: the Trainer's remove_unused_columns leaves them out). An HF model's
    (`PreTrainedModel`) takes only the parameters it names and the keys its
    `**kwargs: Unpack[...]` annotation declares
    (`TransformersKwargs`: the packed-sequence `cu_seq_lens_q`, `seq_idx`, ...), less
    `position_ids`, which counts only where the forward names it (Bloom takes it through
    `**kwargs` and ignores it): HF models pass any keyword on, so a raw `text` column stays
    out, as the Trainer's remove_unused_columns leaves it out."""
    memo = STATE.forward_inputs
    seen = memo.get(model)
    if seen is not None:
        base_ref, forward, found = seen
        base = base_ref()
        # The same forward as when it was read: a forward patched since (on the instance, or
        # on its class) is read again, or its new arguments were dropped from every call.
        if base is not None and _forward_of(base) is forward:
            return found
    base = _base_model(model)
    params = inspect.signature(base.forward).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p for p in params if p.kind in kinds]
    required = frozenset(p.name for p in named if p.default is inspect.Parameter.empty)
    var = next((p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    names: frozenset[str] | None = frozenset(p.name for p in named) or None
    through = var is not None and names is not None  # other keys may go through **kwargs
    if through and _is_hf(base):
        assert var is not None and names is not None
        names |= _declared_kwargs(var.annotation) - {"position_ids"}
        through = False  # an HF model's: only the keys it declares
    found = (names, required - {"labels"}, through)
    # A weak reference: the base is often the model itself, the memo's (weak) key.
    memo[model] = (weakref.ref(base), _forward_of(base), found)
    return found


def _is_hf(module: nn.Module) -> bool:
    """Whether `module` is a transformers `PreTrainedModel` (by its classes: no import)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )


def _declared_kwargs(annotation: Any) -> frozenset[str]:
    """The keys of the TypedDict in a `**kwargs: Unpack[TypedDict]` annotation (HF's
    `TransformersKwargs`); none for any other annotation."""
    args = typing.get_args(annotation)
    kind = args[0] if len(args) == 1 else None
    # By its attributes: a typing_extensions TypedDict (Python 3.10) is one too.
    required = getattr(kind, "__required_keys__", None)
    optional = getattr(kind, "__optional_keys__", None)
    if not isinstance(required, frozenset) or not isinstance(optional, frozenset):
        return frozenset()
    return required | optional


def _forward_of(module: nn.Module) -> Any:
    """What `module.forward` resolves to, without binding: an instance's own `forward`, else
    its class's (two dictionary lookups)."""
    return vars(module).get("forward") or type(module).forward


def model_logits(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Run `model` on a dict batch and return the logits.

    The keyword arguments are `model_inputs(model, batch)`: the batch without its `labels` (so
    that an HF model does not compute a mean loss of its own) and without keys the model's
    `forward` does not name, plus `use_cache=False` where the forward takes `use_cache` and the
    batch does not set it (no key/value cache; packed rows stay apart), and for HF models whose
    learned positions ignore the attention mask (GPT-2, BERT, ...) `position_ids` counted from
    the mask when the batch has none (a left-padded row is read as alone), and for those that
    read the pad id (RoBERTa's family, MobileBERT) `input_ids` holding it where the mask says
    padding. The output's `.logits` (HF models), else its first element when it is a tuple,
    else the output itself.

    Example:
        >>> import torch, ftrain as ft
        >>> class Lm(torch.nn.Module):
        ...     def forward(self, input_ids):
        ...         return torch.zeros(*input_ids.shape, 5)
        >>> batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
        >>> ft.losses.model_logits(Lm(), batch).shape
        torch.Size([1, 3, 5])
    """
    return _logits_of(_call(model, _with_mask_positions(model, batch)))


def _call(model: nn.Module, batch: Mapping[str, Any]) -> Any:
    """`model(**model_inputs(model, batch))`, with `use_cache=False` where the forward takes
    `use_cache` and the batch does not set it: a loss needs no key/value cache, and HF models
    given one build a plain causal mask, so packed rows (`position_ids` restarting, no attention
    mask) attended across their examples."""
    plain = type(batch) is dict
    if plain:  # the keys this model took from a batch of these keys before (issue 30)
        plans = STATE.model_calls.get(model)
        plan = None if plans is None else plans.get(tuple(batch))
        if plan is not None:
            keep, no_cache = plan
            inputs = dict(zip(keep, map(batch.__getitem__, keep), strict=True))
            if no_cache:
                inputs["use_cache"] = False
            return model(**inputs)
    inputs = model_inputs(model, batch)
    if "position_ids" not in inputs:  # (the models `_refuse_left_padding` asks about take none)
        _refuse_left_padding(model, batch)
    names = _forward_names(model)[0]
    no_cache = names is not None and "use_cache" in names and "use_cache" not in inputs
    keep = tuple(inputs)
    if no_cache:
        inputs["use_cache"] = False
    # The same keys give the same inputs, unless the batch's values were read (packed rows'
    # position_ids) or a key was dropped (model_inputs warns each time).
    if (
        plain
        and "position_ids" not in batch
        and len(keep) + ("labels" in batch) == len(batch)
        and not _left_padding_pending(model)  # (checked on each call until it is done)
    ):
        plans = STATE.model_calls.setdefault(model, {})
        if len(plans) < _PLANS:
            plans[tuple(batch)] = (keep, no_cache)
    return model(**inputs)


_PLANS = 64  # batch key sets remembered per model (a dataset of ever new keys stops there)

# HF model types whose causal LM reads a left-padded row differently from the row alone and
# cannot be given positions: the decoders of BART's family (they count positions from the row's
# first slot and take no position_ids) and RWKV (its recurrence ignores the attention mask, so
# the padding flows into its state). Right padding only follows a row's tokens. Measured with
# transformers 5.24 over every causal-LM type that builds a tiny model from its default config
# (a row left- and right-padded vs alone); their encoder-decoder models are not refused here.
_LEFT_PAD_BLIND = frozenset({
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
    "pegasus", "plbart", "rwkv", "trocr", "whisper",
})  # fmt: skip


def _left_padding_pending(model: nn.Module) -> bool:
    """Whether `_refuse_left_padding` still checks `model`'s batches (no call plan is kept for
    it until then, so that each call comes by the check)."""
    return STATE.left_padding_checked.get(model, _PADDING_CHECKS) < _PADDING_CHECKS


def _refuse_left_padding(model: nn.Module, batch: Mapping[str, Any]) -> None:
    """Raise for a left-padded batch (a row whose `attention_mask` starts with 0) to a causal
    LM of `_LEFT_PAD_BLIND`: its outputs would change with the padding in front of a row.

    A host sync, for those models only, on each micro-batch until one with padding has passed
    (on the right: a tokenizer pads all its batches on one side), `_PADDING_CHECKS` at most:
    an unpadded first batch (rows of one length, grouped by length) no longer ends the check.
    """
    checked = STATE.left_padding_checked
    done = checked.get(model)
    if done is not None and done >= _PADDING_CHECKS:
        return
    cfg = _config(model)
    kind = getattr(cfg, "model_type", None)
    if kind not in _LEFT_PAD_BLIND or getattr(cfg, "is_encoder_decoder", False):
        return
    checked[model] = (done or 0) + 1
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] == 0:
        return
    left = (mask[:, 0] == 0) & (mask != 0).any(1)
    padded, rows = bool((mask == 0).any()), left.nonzero().flatten().tolist()  # host sync
    if padded and not rows:
        checked[model] = _PADDING_CHECKS  # padding seen, on the right: checked
    if rows:
        why = (
            "its recurrence ignores the attention mask, so the padding flows into its state"
            if kind == "rwkv"
            else "it counts positions from the row's first slot and takes no position_ids"
        )
        raise ValueError(
            f"a left-padded batch (row {rows[0]}'s attention_mask starts with 0) to "
            f"{type(_base_model(model)).__name__} (model_type {kind!r}): {why}, so its "
            "outputs would change with the padding in front of each row. Pad on the right "
            "(tokenizer.padding_side = 'right'; ft.pad_collate's default padding_side)"
        )


def _logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


# The router losses HF's mixture-of-experts models add to their `.loss` when
# `config.output_router_logits` is set (Mixtral, Qwen-MoE, ...; Switch Transformers).
_AUX = ("aux_loss", "encoder_aux_loss", "decoder_aux_loss", "encoder_z_loss", "decoder_z_loss")
# Router logits from which a seq2seq MoE's loss computes its router loss only when it is given
# labels (NLLB-MoE), so that without labels no `_AUX` field is set.
_ROUTERS = ("encoder_router_logits", "decoder_router_logits")
_ROUTER_FIELDS = _AUX + _ROUTERS  # read in one pass: every micro-batch asks
_ROUTER_NAMES = frozenset(_ROUTER_FIELDS)


def _router_outputs(out: Any) -> list[str]:
    """The router fields `out` holds (not None). A dataclass output (HF's `ModelOutput`) is
    read only when its type declares one; a tensor or a plain tuple holds none; any other
    object is asked for each. (Seven failed attribute lookups a micro-batch were ~2% of a
    small model's step, issue 30.)"""
    fields = getattr(type(out), "__dataclass_fields__", None)
    if fields is not None:
        if _ROUTER_NAMES.isdisjoint(fields):
            return []
    elif isinstance(out, torch.Tensor) or type(out) is tuple:
        return []
    return [a for a in _ROUTER_FIELDS if getattr(out, a, None) is not None]


def loss_logits(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """`model_logits` for a loss of logits and labels: raises where the model also returned a
    router loss that its own `.loss` would add, which such a loss would silently leave out.

    Every built-in loss (and `ft.chunked_causal_lm_loss`) runs the model through this; a loss
    of your own that computes cross-entropy from the logits can too. Mixture-of-experts models
    (Mixtral, Qwen-MoE, Switch Transformers, ...) return `aux_loss` and the like when their
    config (or the batch) sets `output_router_logits`.

    Raises:
        ValueError: when the output holds a router loss, naming it.

    Example:
        >>> import torch, ftrain as ft
        >>> class Lm(torch.nn.Module):
        ...     def forward(self, input_ids):
        ...         return torch.zeros(*input_ids.shape, 5)
        >>> ft.losses.loss_logits(Lm(), {"input_ids": torch.tensor([[1, 2]])}).shape
        torch.Size([1, 2, 5])
    """
    out = _call(model, _with_mask_positions(model, batch))
    aux = _router_outputs(out)
    if aux:
        why = (
            "the batch asks for output_router_logits"
            if batch.get("output_router_logits")
            else "its config sets output_router_logits"
        )
        raise ValueError(
            f"{type(_base_model(model)).__name__} returned {', '.join(aux)} ({why}): its own "
            "loss adds router_aux_loss_coef times its router loss, which ftrain's built-in "
            "losses do not; turn output_router_logits off to train without it, or pass "
            "loss_fn=... that adds it to the sum"
        )
    return _logits_of(out)


def causal_lm_loss(*, label_smoothing: float = 0.0) -> LossFn:
    """Next-token cross-entropy summed over label tokens that are not -100, after the shift.

    Logits at position t predict `labels[t + 1]`, as in HF causal LMs. With `label_smoothing`
    eps the per-token loss is `(1 - eps) * nll + eps * mean_v(-log p_v)`, HF's `LabelSmoother`.
    A model whose learned positions do not follow the attention mask (GPT-2, GPT-Neo,
    StarCoder's GPTBigCode, ...) gets `position_ids` counted from the mask, as `generate` gives
    them, so that a left-padded row scores what it scores alone.

    Args:
        label_smoothing: eps in [0, 1).

    Example:
        >>> import torch, ftrain as ft
        >>> class Uniform(torch.nn.Module):
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return torch.zeros(*input_ids.shape, 4)
        >>> batch = {"input_ids": torch.tensor([[0, 1, 2]]), "labels": torch.tensor([[0, 1, -100]])}
        >>> loss, n = ft.losses.causal_lm_loss()(Uniform(), batch)
        >>> round(loss.item(), 4), int(n)    # one counted token: log(4)
        (1.3863, 1)
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")

    def loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _aligned_ce(*_causal_pair(model, batch), label_smoothing)

    return loss_fn


def _causal_pair(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) of a causal LM batch: `causal_targets(batch)`."""
    if "labels" not in batch:
        raise _no_labels(
            batch, "causal_lm_loss needs 'labels' in the batch (use input_ids as labels)"
        )
    logits, targets = loss_logits(model, batch), causal_targets(batch)
    if logits.shape[1] != targets.shape[-1]:  # ([-1]: 1-D labels of a model of your own)
        # The last virtual token predicts the first label, as in PEFT's own loss: the label of
        # the row's first token, not of a pad (a left-padded row's first slot)
        labels, mask = batch["labels"], batch.get("attention_mask")
        first = labels[:, :1]
        if isinstance(mask, torch.Tensor) and mask.shape == labels.shape and labels.dim() == 2:
            lead = mask.logical_not().cumprod(1).sum(1, keepdim=True)  # leading padding
            lead = lead.clamp(max=labels.shape[1] - 1)
            first = labels.gather(1, lead).masked_fill(mask.gather(1, lead) == 0, IGNORE_INDEX)
        targets = _behind_virtual_tokens(model, logits, targets, first)
    return logits, targets


def _behind_virtual_tokens(
    model: nn.Module, logits: torch.Tensor, labels: Any, first: torch.Tensor | None = None
) -> Any:
    """`labels` behind -100 for the virtual tokens a PEFT prompt-learning adapter (prompt
    tuning, P-tuning, multitask prompt tuning) puts in front of the inputs, so in front of the
    logits, as PEFT's own loss puts them (`first` for the last virtual token: a causal LM's
    first label); unchanged for other models (the loss then names the shapes that do not
    match). Asked only when the logits and labels differ in length.

    Raises:
        ValueError: for CPT, whose own loss weights the tokens by their type.
    """
    config = getattr(_peft_model(model), "active_peft_config", None)
    n = getattr(config, "num_virtual_tokens", None)
    if not getattr(config, "is_prompt_learning", False) or not isinstance(n, int):
        return labels
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or logits.dim() != 3:
        return labels
    if logits.shape[1] != labels.shape[1] + n:
        return labels
    peft_type = getattr(config, "peft_type", None)
    if str(getattr(peft_type, "value", peft_type)) == "CPT":
        raise ValueError(
            "a PEFT CPT adapter: its own loss weights the prompt's tokens by their type "
            "(cpt_tokens_type_mask), which ftrain's built-in losses do not; pass loss_fn=... "
            "that computes it, e.g. from the model's own .loss"
        )
    out = F.pad(labels, (n, 0), value=IGNORE_INDEX)
    if first is not None:
        out[:, n - 1 : n] = first
    return out


def _prepends_virtual_tokens(model: nn.Module) -> bool:
    """Whether `model` holds a PEFT prompt-learning adapter that puts virtual tokens in front of
    the logits (prompt tuning, P-tuning, ...; prefix tuning puts them in the key/value cache)."""
    config = getattr(_peft_model(model), "active_peft_config", None)
    kind = str(getattr(getattr(config, "peft_type", None), "value", None))
    return bool(getattr(config, "is_prompt_learning", False)) and kind not in _PREFIXES


_PREFIXES = ("PREFIX_TUNING", "CARTRIDGE")  # PEFT's prompt learning in the key/value cache


def _prompt_learning(model: nn.Module) -> bool:
    """Whether `model` is under a PEFT prompt-learning adapter (prompt tuning, P-tuning, ...)."""
    config = getattr(_peft_model(model), "active_peft_config", None)
    return bool(getattr(config, "is_prompt_learning", False))


def _peft_model(model: nn.Module) -> nn.Module | None:
    """The PEFT model (one with `active_peft_config`) in `model`'s wrappers, if any."""
    for _ in range(8):  # wrappers nest a few levels at most
        if hasattr(type(model), "active_peft_config"):
            return model
        inner = next((model._modules[a] for a in _WRAPPED if a in model._modules), None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return None


# HF model types with learned absolute positions that they do not count from the attention
# mask: a left-padded row was read from position k (its padding), not 0, so its loss changed
# with the rows padded beside it. Measured with transformers 5.24 over every causal-LM type that
# builds a tiny model from its default config (a row left-padded vs alone, then with these
# positions); the others are invariant already (rotary or ALiBi positions, or positions counted
# from the mask or the pad id), or take no position_ids (BART's family, RWKV). The backbone is
# the same under their token and sequence classifiers (BERT's [CLS] moved to position k). The
# encoders without a causal LM (ALBERT, DeBERTa, DistilBERT, ...) were measured the same way over
# every token-classification type (their right-padded logits bit-for-bit unchanged); MPNet, MRA
# and Nyströmformer count their positions from an offset, so not from 0, and are left out.
_MASK_BLIND_POSITIONS = frozenset({
    "albert", "bert", "bert-generation", "big_bird", "biogpt", "ctrl", "deberta", "deberta-v2",
    "distilbert", "electra", "ernie", "flaubert", "git", "gpt-sw3", "gpt2", "gpt_bigcode",
    "gpt_neo", "layoutlm", "megatron-bert", "mobilebert", "openai-gpt", "recurrent_gemma",
    "rembert", "roc_bert", "squeezebert", "xglm", "xlm",
})  # fmt: skip


# HF model types that read the pad id where the mask says padding: RoBERTa's family counts
# positions from the tokens that are not its pad id, MobileBERT's trigram embeddings take in the
# token before a row's first (the pad id's embedding is zero). Padded in another id
# (make_batches' default 0), a left-padded row was read differently from the row alone.
# Measured with transformers 5.24 over every token-classification type that builds a tiny model
# from its default config (a row left-padded in 0 and in the pad id vs alone).
_PAD_ID_READERS = frozenset({
    "camembert", "data2vec-text", "esm", "ibert", "longformer", "luke", "markuplm",
    "mobilebert", "mpnet", "roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl",
})  # fmt: skip
_MASK_READERS = _MASK_BLIND_POSITIONS | _PAD_ID_READERS


def _with_mask_positions(model: nn.Module, batch: Any) -> Any:
    """`batch` with `position_ids` counted from its `attention_mask` (as HF's `generate` counts
    them) for the model types in `_MASK_BLIND_POSITIONS`, so that a left-padded row is read
    from position 0, as alone; at a right-padded row's tokens they are its usual positions.
    For the types in `_PAD_ID_READERS`, `input_ids` hold the model's pad id where the mask says
    padding. Unchanged for other models and for a batch without a 2-D mask of the ids' shape;
    position_ids the batch holds are kept."""
    # The model first: one memo lookup for every other model (on each micro-batch's path).
    kind = getattr(_config(model), "model_type", None)
    if kind not in _MASK_READERS:
        return batch
    if not isinstance(batch, Mapping):
        return batch
    mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    if not isinstance(mask, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return batch
    if mask.dim() != 2 or mask.shape != ids.shape:
        return batch
    if kind in _PAD_ID_READERS:
        pad = getattr(_config(model), "pad_token_id", None)
        if isinstance(pad, int) and not isinstance(pad, bool):
            batch = {**batch, "input_ids": ids.masked_fill(mask == 0, pad)}
        if kind not in _MASK_BLIND_POSITIONS:
            return batch
    if "position_ids" in batch or _prompt_learning(model):
        return batch  # (PEFT's prompt learning drops position_ids, warning on every call)
    # `!= 0`: a mask of segment ids (1, 1, 2, 2, ...: packed rows, some libraries' form) counts
    # its tokens once each, as a 0/1 mask does, not by its values
    return {**batch, "position_ids": ((mask != 0).cumsum(-1) - 1).clamp(min=0)}


def causal_targets(batch: Mapping[str, Any]) -> torch.Tensor:
    """The targets a causal LM's logits are scored against: `labels` shifted left (position t
    predicts `labels[t + 1]`), -100 at the end, and -100 where position t is padding.

    A padding position (`attention_mask` 0) predicts nothing. With left padding the last pad
    would otherwise be trained to predict the row's first token (HF's `ForCausalLMLoss` counts
    that target), which the same row never has unpadded or right-padded: the loss and its item
    count would depend on which rows share the batch. Only a 2-D mask of the labels' shape is
    read (packed rows carry none).

    Example:
        >>> import torch, ftrain as ft
        >>> batch = {"labels": torch.tensor([[-100, 5, 6]]),
        ...          "attention_mask": torch.tensor([[0, 1, 1]])}    # left-padded
        >>> ft.losses.causal_targets(batch).tolist()    # 5 is not predicted from the pad
        [[-100, 6, -100]]
    """
    labels = batch["labels"]
    if labels.shape[-1] == 0:  # nothing to shift (and pad cannot drop from nothing)
        return labels
    # Shift the labels, not the logits (as HF's ForCausalLMLoss does): a slice of the logits
    # is copied for the loss, and its gradient again in the backward; the last position's
    # target is -100 and its gradient exactly 0. (One pad op: the negative pad drops the first
    # label, the positive one appends -100.)
    targets = F.pad(labels, (-1, 1), value=IGNORE_INDEX)
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
        # In place (the pad made a new tensor); `logical_not` is `mask == 0` for any dtype,
        # in one cheaper kernel (issue 30).
        targets.masked_fill_(mask.logical_not(), IGNORE_INDEX)
    return targets


def classification_loss(*, label_smoothing: float = 0.0) -> LossFn:
    """The loss of a sequence classifier by HF's `problem_type`, summed, with its item count.

    As `*ForSequenceClassification` decides (`config.problem_type`, else inferred the same way):
    squared error for regression (one output, or `problem_type="regression"`), counted per
    target value; binary cross-entropy with logits for `"multi_label_classification"` (float or
    bool multi-hot labels with several outputs), counted per label; cross-entropy over integer
    class labels otherwise, -100 ignored, counted per labelled row. Each equals the model's own
    `.loss` on one batch (a mean) as sum / count. A problem type inferred so is recorded in
    `config.problem_type`, as HF's own loss records it: the exported `config.json` keeps it, and
    HF's text-classification pipeline reads it (sigmoid or softmax or neither).

    Args:
        label_smoothing: eps in [0, 1), as in `causal_lm_loss`; single-label classification
            only (a regression or multi-label batch with it raises).

    Raises:
        ValueError: float labels for a single-label head, labels whose shape does not match the
            outputs for regression or multi-label, or `label_smoothing` on those.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")

    def loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if "labels" not in batch:
            raise _no_labels(batch, "classification_loss needs 'labels' in the batch")
        logits = loss_logits(model, padded_as_model(model, batch))
        labels = batch["labels"]
        kind = _problem_type(model, logits, labels)
        cfg = _config(model)
        if cfg is not None and getattr(cfg, "problem_type", kind) is None:
            # Recorded as HF's own loss records it: the exported config.json and HF's
            # text-classification pipeline read it (without it, sigmoid on a regression
            # score and softmax over multi-label outputs).
            cfg.problem_type = kind
        if kind == "single_label_classification":
            if labels.is_floating_point():
                raise ValueError(
                    f"float labels {labels.dtype} for a single-label classifier: class indices "
                    "are integers; for multi-hot labels set config.problem_type = "
                    "'multi_label_classification', for targets 'regression'"
                )
            loss = F.cross_entropy(
                upcast(logits).reshape(-1, logits.shape[-1]),
                labels.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
                label_smoothing=label_smoothing,
            )
            return loss, (labels != IGNORE_INDEX).sum()
        if label_smoothing:
            raise ValueError(
                f"label_smoothing={label_smoothing} applies to single-label classification; "
                f"this batch is {kind} (config.problem_type, or one output: regression)"
            )
        pred = upcast(logits)
        squeeze = logits.shape[-1] == 1 and kind == "regression"  # HF squeezes both
        if labels.numel() != pred.numel() if squeeze else labels.shape != pred.shape:
            raise ValueError(
                f"{kind}: labels of shape {tuple(labels.shape)} do not match the model's "
                f"outputs {tuple(pred.shape)}"
            )
        if squeeze:
            pred, labels = pred.reshape(-1), labels.reshape(-1)
        target = labels.to(pred.dtype)
        if kind == "regression":
            loss = F.mse_loss(pred, target, reduction="sum")
        else:
            loss = F.binary_cross_entropy_with_logits(pred, target, reduction="sum")
        return loss, torch.tensor(target.numel(), device=target.device)

    return loss_fn


def padded_as_model(model: nn.Module, batch: Any) -> Any:
    """`batch` with its padding (`attention_mask` 0) in `input_ids` set to the model's pad id.

    A decoder's `*ForSequenceClassification` (Llama, GPT-2, Qwen, ...) reads the row's last
    token that is not `config.pad_token_id`, not the attention mask: rows padded with another
    id (`pad_collate()`'s default 0, `make_batches`' default collate) were classified from a
    padding position, silently. `classification_loss`, `ft.classification_metrics` and
    `ft.predict` (for sequence classifiers) run the model on this batch, so the padding the
    mask declares is padding to the model too. Unchanged without a pad id, an `input_ids` and
    2-D `attention_mask` of one shape, or padding.

    For a sequence classifier (`loss_for(model)` is `classification_loss`) left-padded rows are
    also right-aligned: each row's leading padding moves to its end, in every tensor of the
    mask's shape but `labels` (on the device, no host sync). An encoder's classifier (BERT,
    RoBERTa, DistilBERT, DeBERTa, ALBERT, ELECTRA, ...) pools its first token, [CLS], which a
    left-padded row has moved right: it classified the row from a pad, as HF's own loss does.
    A right-padded batch keeps its values.

    Example:
        >>> import torch, ftrain as ft
        >>> from transformers import LlamaConfig, LlamaForSequenceClassification
        >>> m = LlamaForSequenceClassification(LlamaConfig(
        ...     vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        ...     num_attention_heads=2, pad_token_id=2))
        >>> b = {"input_ids": torch.tensor([[5, 6, 0]]),
        ...      "attention_mask": torch.tensor([[1, 1, 0]])}
        >>> ft.losses.padded_as_model(m, b)["input_ids"].tolist()
        [[5, 6, 2]]
    """
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    mask = batch.get("attention_mask") if ids is not None else None
    if not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor):
        return batch
    if ids.dim() != 2 or mask.shape != ids.shape:
        return batch
    cfg = _config(model)
    text = getattr(cfg, "get_text_config", None)
    pad = getattr(text() if callable(text) else cfg, "pad_token_id", None)
    if isinstance(pad, int) and not isinstance(pad, bool):
        batch = {**batch, "input_ids": ids.masked_fill(mask == 0, pad)}
    return _right_aligned(model, batch, mask) if _sequence_classifier(model) else batch


def _sequence_classifier(model: nn.Module) -> bool:
    """Whether `model` is a sequence classifier that reads a left-padded row from its padding
    and a right-aligned one right (`_FIRST_SLOT_CLASSIFIERS`), PEFT prompt-tuned too. Not a
    decoder's (Llama, GPT-2, ...: HF reads the last token that is not the pad id, or the last
    position without one) nor XLNet's (the last position: its tokenizer pads on the left)."""
    if getattr(_config(model), "model_type", None) not in _FIRST_SLOT_CLASSIFIERS:
        return False
    try:
        fn, _ = _defaults(model)
    except TypeError:  # a module of your own, or a decoder the default loss refuses
        return False
    # (prompt-tuned too: PEFT puts its virtual tokens in front of the row's embeddings, which
    # right-aligned rows then follow directly, as the row alone)
    return fn is _CLASSIFY


# HF model types whose sequence classifier reads a left-padded row other than the row alone and
# a right-aligned one as the row alone: encoders pooling their first token ([CLS]) or counting
# positions from the row's first slot, and BART's family (the encoder's positions). Measured
# with transformers 5.24 (a row left-padded vs alone; the types that do not build from a default
# config added by their pooling: DeBERTa, Funnel, LayoutLMv2/v3, LiLT, SqueezeBERT, X-MOD, and
# BART's family as its seq2seq loss measured). Others keep their rows where they are.
_FIRST_SLOT_CLASSIFIERS = frozenset({
    "albert", "bart", "bert", "big_bird", "bigbird_pegasus", "camembert", "canine", "convbert",
    "data2vec-text", "deberta", "deberta-v2", "distilbert", "electra", "ernie", "esm", "esmc",
    "flaubert", "funnel", "gte", "ibert", "jina_embeddings_v3", "layoutlm", "layoutlmv2",
    "layoutlmv3", "led", "lilt", "longformer", "luke", "markuplm", "mbart", "megatron-bert",
    "mobilebert", "modernbert", "modernvbert", "mpnet", "mra", "mvp", "nomic_bert",
    "nystromformer", "perceiver", "plbart", "rembert", "roberta", "roberta-prelayernorm",
    "roc_bert", "roformer", "squeezebert", "tapas", "ultrabert", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "xmod",
})  # fmt: skip

# HF encoder-decoder types whose encoder reads a left-padded input other than the input alone
# (positions from the first slot) and a right-aligned one as alone; T5's family, M2M-100,
# NLLB-MoE, FSMT and SeamlessM4T read either alike (measured as above).
_FIRST_SLOT_ENCODERS = frozenset({
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "encoder-decoder", "led",
    "marian", "mbart", "mvp", "pegasus", "pegasus_x", "plbart",
})  # fmt: skip


def _right_aligned(model: nn.Module, batch: Mapping[str, Any], mask: torch.Tensor) -> Any:
    """`batch` with each row's leading padding (`mask` 0) moved to its end: every input of the
    model's forward whose first two dimensions are the mask's (`input_ids`, `attention_mask`,
    `token_type_ids`, `inputs_embeds`, LayoutLM's `bbox`, ...) but `labels` and the `decoder_*`
    inputs, rolled left by the row's leading padding; unchanged unless `input_ids` or
    `inputs_embeds` is laid out as the mask (Whisper's mask is over audio frames). On the
    device, no host sync; a right-padded batch is gathered in its own order (the same values).
    An encoder's classifier pools its first token ([CLS]: BERT, RoBERTa, DistilBERT, DeBERTa,
    ...), a pad in a left-padded row, and HF reads it so; an encoder-decoder's encoder may
    count positions from the first slot too."""
    tokens = batch.get("input_ids")
    tokens = batch.get("inputs_embeds") if tokens is None else tokens
    if not isinstance(tokens, torch.Tensor) or tokens.shape[:2] != mask.shape:
        return batch
    names = _forward_names(model)[0]  # (None: the forward takes any keyword)
    n = mask.shape[1]
    lead = mask.logical_not().cumprod(1).sum(1, keepdim=True)  # each row's leading padding
    index = (torch.arange(n, device=mask.device) + lead).remainder(n)
    out = dict(batch)
    for key, value in batch.items():
        if key == "labels" or key.startswith("decoder_") or (names and key not in names):
            continue  # per row, the decoder's (an encoder-decoder's), or not the model's
        # (not images: `pixel_values` of 3 channels beside 3 tokens)
        if isinstance(value, torch.Tensor) and value.dim() <= 3 and value.shape[:2] == mask.shape:
            at = index.view(*index.shape, *(1,) * (value.dim() - 2)).expand_as(value)
            out[key] = value.gather(1, at)
    return out


_PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def _config(model: nn.Module) -> Any:
    """The innermost model's `config` (None without one), looked up once per model: looking
    through the wrappers is several failed attribute lookups, microseconds a micro-batch."""
    memo = STATE.model_configs
    try:
        return memo[model]
    except KeyError:
        found = memo[model] = getattr(_base_model(model), "config", None)
        return found


def _problem_type(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> str:
    """`config.problem_type`, else what `*ForSequenceClassification.forward` infers: one
    output is regression, integer labels single-label, anything else multi-label."""
    kind = getattr(_config(model), "problem_type", None)
    if kind is not None:
        if kind not in _PROBLEM_TYPES:
            raise ValueError(f"config.problem_type {kind!r} is none of {_PROBLEM_TYPES}")
        return str(kind)
    if logits.shape[-1] == 1:
        return "regression"
    if labels.is_floating_point() or labels.dtype == torch.bool:
        return "multi_label_classification"
    return "single_label_classification"


def _aligned_ce(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over label tokens that are not -100, logits aligned with labels;
    the count as int64."""
    loss, count = _ce_sum(logits, labels, label_smoothing)
    return loss, count.long()


def _ce_sum(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_aligned_ce` with the count in the loss's dtype where it is exact (no cast op)."""
    flat, target = upcast(logits.reshape(-1, logits.shape[-1])), labels.reshape(-1)
    if label_smoothing == 0.0 and target.numel() < 2**24:
        # F.cross_entropy's own kernels (log_softmax, nll_loss); nll_loss's total weight is the
        # count of targets that are not -100: no separate count (issue 30). Exact below 2**24.
        log_p = F.log_softmax(flat, 1)
        loss, count = torch.ops.aten.nll_loss_forward(log_p, target, None, _SUM, IGNORE_INDEX)
        return loss, count
    loss = F.cross_entropy(
        flat, target, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=label_smoothing
    )
    return loss, (labels != IGNORE_INDEX).sum()


def token_classification_loss(*, label_smoothing: float = 0.0) -> LossFn:
    """Per-token cross-entropy summed over labels that are not -100, without a shift.

    For `*ForTokenClassification` (NER, POS) and masked LMs: the logits at position t score
    `labels[t]`, labels of shape (batch, seq).

    Args:
        label_smoothing: eps in [0, 1), as in `causal_lm_loss`.

    Example:
        >>> import torch, ftrain as ft
        >>> class Tagger(torch.nn.Module):
        ...     def forward(self, input_ids):
        ...         return torch.zeros(*input_ids.shape, 3)
        >>> batch = {"input_ids": torch.tensor([[4, 5, 6]]), "labels": torch.tensor([[0, 2, -100]])}
        >>> loss, n = ft.losses.token_classification_loss()(Tagger(), batch)
        >>> round(loss.item(), 4), int(n)    # two counted tokens: 2 * log(3)
        (2.1972, 2)
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")

    def loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _aligned_ce(*_token_pair(model, batch), label_smoothing)

    return loss_fn


def _token_pair(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if "labels" not in batch:
        raise _no_labels(batch, "token_classification_loss needs 'labels' in the batch")
    if "position_ids" in batch and not _masked(batch):
        # ft.data.pack_examples makes every example's first label -100 (nothing predicts it
        # under a causal shift): a tagger would lose one label per example.
        raise ValueError(
            "token_classification_loss got packed rows (position_ids and no attention_mask): "
            "packing marks each example's first label -100 for a causal LM's shift, so a "
            "token classifier would lose one label per example; pad its rows instead "
            "(make_batches' default collate)"
        )
    logits, labels = loss_logits(model, batch), batch["labels"]
    if logits.shape[1] != labels.shape[-1]:  # ([-1]: one label a row, a model of your own's)
        labels = _behind_virtual_tokens(model, logits, labels)
    return logits, labels


def _decoder_inputs(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The decoder inputs an encoder-decoder model builds from `labels` (teacher forcing).

    The model's own `prepare_decoder_input_ids_from_labels` where it has one (T5, BART, ...),
    else labels shifted right behind `config.decoder_start_token_id`, -100 replaced by the pad
    id: what HF models do when called with `labels` and no `decoder_input_ids`.

    Raises:
        ValueError: if the model has neither that method nor a decoder start token id.
    """
    base = _base_model(model)
    prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return prepare(labels=labels)
    cfg = getattr(base, "config", None)
    start = getattr(cfg, "decoder_start_token_id", None)
    if start is None:
        raise ValueError(
            f"cannot build decoder_input_ids for {type(base).__name__}: it has no "
            "decoder_start_token_id; put decoder_input_ids in the batch"
        )
    pad = getattr(cfg, "pad_token_id", None)
    shifted = torch.cat([labels.new_full((labels.shape[0], 1), start), labels[:, :-1]], dim=1)
    return shifted.masked_fill(shifted == IGNORE_INDEX, 0 if pad is None else pad)


def decoder_input_ids(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The decoder inputs `seq2seq_loss` builds from `labels` when the batch has none: the
    model's `prepare_decoder_input_ids_from_labels` (T5, BART, mBART, ...), else the labels
    shifted right behind `config.decoder_start_token_id` (Whisper), -100 replaced by the pad id.

    To leave leading label tokens out of the loss (mBART-50's target language code, Whisper's
    language and task tokens, which generation is given), build the decoder inputs from the
    labels first, put them in the batch, then mask the labels: built from masked labels, the
    decoder would read the pad id where the tokens were (the default loss refuses such labels).

    Raises:
        ValueError: if the model has neither that method nor a decoder start token id.

    Example:
        >>> import torch, ftrain as ft
        >>> from transformers import T5Config, T5ForConditionalGeneration
        >>> model = T5ForConditionalGeneration(T5Config(
        ...     vocab_size=16, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2,
        ...     decoder_start_token_id=0, pad_token_id=0))
        >>> labels = torch.tensor([[7, 5, 6, 1]])    # 7: a forced token, not to be trained
        >>> batch = {"input_ids": torch.tensor([[5, 6, 1]]),
        ...          "decoder_input_ids": ft.losses.decoder_input_ids(model, labels),
        ...          "labels": labels.masked_fill(torch.arange(4) < 1, -100)}
        >>> batch["decoder_input_ids"].tolist(), batch["labels"].tolist()
        ([[0, 7, 5, 6]], [[-100, 5, 6, 1]])
        >>> int(ft.losses.default_loss(model, batch)[1])    # three tokens counted
        3
    """
    return _decoder_inputs(model, labels)


def seq2seq_loss(*, label_smoothing: float = 0.0) -> LossFn:
    """Cross-entropy of an encoder-decoder model summed over label tokens that are not -100.

    No shift: the decoder's logits at position t score `labels[t]`, as in T5 and BART. The
    batch's `decoder_input_ids` are used when present (`DataCollatorForSeq2Seq(model=...)` puts
    them there); otherwise they are built from the labels as the model does
    (`decoder_input_ids(model, labels)`): its `prepare_decoder_input_ids_from_labels`, else the
    labels shifted right behind `config.decoder_start_token_id` with -100 replaced by the pad
    id. Built so, the decoder would read the pad id wherever -100 comes before a counted label,
    so the first batches are checked and such labels raise: left padding (pad labels on the
    right) and masked leading tokens (mBART's language code, Whisper's task tokens: put
    `decoder_input_ids(model, labels)` of the unmasked labels in the batch, then mask them).

    Args:
        label_smoothing: eps in [0, 1), as in `causal_lm_loss`.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")

    def loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _aligned_ce(*_seq2seq_pair(model, batch), label_smoothing)

    return loss_fn


def _seq2seq_pair(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if "labels" not in batch:
        raise _no_labels(batch, "seq2seq_loss needs 'labels' in the batch")
    labels = batch["labels"]
    batch = _encoder_right_aligned(model, batch)
    if batch.get("decoder_input_ids") is None and batch.get("decoder_inputs_embeds") is None:
        if STATE.seq2seq_labels_checked.get(model, 0) < _PADDING_CHECKS:
            _check_label_padding(model, labels)
        batch = {**batch, "decoder_input_ids": _decoder_inputs(model, labels)}
    return loss_logits(model, batch), labels


_PADDING_CHECKS = 8  # batches checked for left-padded seq2seq labels while none held -100


def _encoder_right_aligned(model: nn.Module, batch: Mapping[str, Any]) -> Any:
    """`batch` with a left-padded encoder input right-aligned, for the encoder-decoders of
    `_FIRST_SLOT_ENCODERS`: BART's family, LED, Pegasus-X, BERT2BERT count the encoder's
    positions from its first slot, not the mask, so a left-padded input was read from its
    padding on (the decoder's logits do not line up with the encoder's positions, so moving
    them changes nothing else). `seq2seq_loss` and `predict` read it so."""
    mask = batch.get("attention_mask")
    kind = getattr(_config(model), "model_type", None)
    if kind in _FIRST_SLOT_ENCODERS and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return _right_aligned(model, batch, mask)
    return batch


def _check_label_padding(model: nn.Module, labels: Any) -> None:
    """Refuse labels with -100 before a counted label. A host sync: done on a model's first
    batches only, until one holding -100 has passed (`_PADDING_CHECKS` at most).

    The decoder inputs built from the labels put the pad id where they hold -100, so the
    decoder read the pad id in place of every -100 that comes before a counted label:
    left-padded rows had it read padding (unmasked) before their target, so the loss and
    gradient changed with the rows padded beside them, silently; a masked leading token
    (mBART-50's target language code, Whisper's language and task tokens, masked so that they
    are not trained) had the decoder read the pad id in its place, so it never saw the token it
    is given when generating (mBART's `prepare_decoder_input_ids_from_labels` also moved a
    content token into the start position). Right padding only follows the target, which a
    causal decoder never reads. Decoder inputs in the batch are not checked: built from the
    unmasked labels, they are the way to mask a leading token.
    """
    checked = STATE.seq2seq_labels_checked
    checked[model] = checked.get(model, 0) + 1
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.shape[1] < 2:
        return
    ignored = labels == IGNORE_INDEX
    after = ignored[:, :-1] & ~ignored[:, 1:]
    padded, rows = ignored.any().item(), after.any(1).nonzero().flatten().tolist()  # host sync
    if padded and not rows:
        checked[model] = _PADDING_CHECKS  # padding seen, on the right: checked
    if rows:
        raise ValueError(_masked_labels_message(labels, ignored, rows[0]))


def _masked_labels_message(labels: torch.Tensor, ignored: torch.Tensor, row: int) -> str:
    """Why seq2seq labels with -100 before a counted label are refused, and what to do, by
    what the -100 look like: the same leading run in every row is a masked prefix (mBART's
    language code, Whisper's task tokens), leading runs of other lengths are left padding, and
    -100 only after a counted label is a masked span."""
    built = (
        "the decoder inputs are built from the labels with -100 replaced by the pad id (as "
        "the model's own loss does), so the decoder would read "
    )
    lead = ignored.long().cumprod(1).sum(1)  # each row's leading run of -100
    first = int(lead[row])
    shown = labels[row].tolist()
    if first and bool((lead == first).all()):
        return (
            f"seq2seq labels hold -100 before a counted label (row {row}: {shown}; "
            f"the first {first} label(s) of every row masked: a forced language or task "
            f"token, as for mBART-50 or Whisper?): {built}the pad id in place of the masked "
            "token(s), never the token(s) it is given when generating (mBART's "
            "prepare_decoder_input_ids_from_labels also moves a content token into the start "
            "position). Build decoder_input_ids from the labels before masking them and put "
            "them in the batch: e.g. DataCollatorForSeq2Seq(tokenizer, model=model), or "
            "batch['decoder_input_ids'] = model.prepare_decoder_input_ids_from_labels("
            "labels=labels) for models that have it; then set the masked labels to -100"
        )
    where = "left padding?" if first else "a masked span?"
    return (
        f"seq2seq labels hold -100 before a counted label (row {row}: {shown}; {where}): "
        f"{built}padding (or the pad id in place of a masked token) before the target, and "
        "the loss would change with it. Pad labels on the right (DataCollatorForSeq2Seq, a "
        "tokenizer with padding_side='right'), or put decoder_input_ids (and "
        "decoder_attention_mask) in the batch, built from the labels before masking them"
    )


_CAUSAL = causal_lm_loss()
_CLASSIFY = classification_loss()
_TOKENS = token_classification_loss()
_SEQ2SEQ = seq2seq_loss()

# Wrappers around a model, looked through to find the HF model: PEFT, torch.compile, DDP,
# Opacus' GradSampleModule.
_WRAPPED = ("_orig_mod", "module", "_module")


def _base_model(model: nn.Module) -> nn.Module:
    """The model inside PEFT / torch.compile / DDP / Opacus wrappers (itself when unwrapped)."""
    for _ in range(8):  # wrappers nest a few levels at most
        get_base = getattr(model, "get_base_model", None)
        inner = get_base() if callable(get_base) else None
        for attr in _WRAPPED:
            inner = inner if isinstance(inner, nn.Module) else getattr(model, attr, None)
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner
    return model


_UNSHIFTED = ("ForTokenClassification", "ForMaskedLM", "WithLMHeadModel", "XLNetLMHeadModel")

# The decoders of encoder-decoder families offered as causal LMs: their own loss scores
# labels[t] at position t, the labels shifted by the caller (HF: "The labels are **not shifted**
# inside the model"), where every other `*ForCausalLM` shifts them itself (transformers 5.24).
_PRESHIFTED = frozenset(
    f"{family}ForCausalLM"
    for family in (
        "Bart", "BigBirdPegasus", "Blenderbot", "BlenderbotSmall", "CpmAnt", "Marian", "MBart",
        "Mvp", "Pegasus", "PLBart", "TrOCR", "Whisper",
    )
)  # fmt: skip


def _by_class(model: nn.Module) -> LossFn | None:
    """HF's task heads by class name (what HF's own `loss_type` reads), the config for seq2seq."""
    names = [c.__name__ for c in type(model).__mro__]
    # XLM's and Flaubert's masked-LM heads (`*WithLMHeadModel`) and XLNet's permutation LM
    # score labels[t] at position t, unshifted, like `*ForMaskedLM`.
    if any(n.endswith(_UNSHIFTED) for n in names):
        return _TOKENS
    if any(n.endswith("ForSequenceClassification") for n in names):
        return _CLASSIFY
    if any(n.endswith("ForQuestionAnswering") for n in names):
        return None  # span starts and ends: not a token loss
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        # With an LM head (T5, BART, Marian's MTModel, Whisper, EncoderDecoderModel); a bare
        # BartModel or T5Model has none.
        heads = getattr(model, "get_output_embeddings", None)
        return _SEQ2SEQ if callable(heads) and heads() is not None else None
    # Decoder-only *ForConditionalGeneration (Llava, Gemma 3, ...) shift as causal LMs do.
    causal = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    return _CAUSAL if any(n.endswith(causal) for n in names) else None


def _refuse_preshifted(model: nn.Module) -> None:
    """Raise for the decoders in `_PRESHIFTED` (and subclasses): shifting would disagree with
    the model's own loss, not shifting with labels equal to input_ids (a causal LM's usual
    batch, which would train it to copy its input); only the user knows which the batch is."""
    name = next((c.__name__ for c in type(model).__mro__ if c.__name__ in _PRESHIFTED), None)
    if name is not None:
        raise TypeError(
            f"the default loss cannot tell how {type(model).__name__}'s labels line up: "
            f"{name}'s own loss scores labels[t] at position t (labels shifted before the "
            "batch, unlike other causal LMs). Pass loss_fn=ft.losses."
            "token_classification_loss() for labels already shifted left, or loss_fn=ft."
            "losses.causal_lm_loss() for labels equal to input_ids"
        )


def loss_for(model: nn.Module) -> LossFn:
    """The loss `default_loss` uses for `model`, by its task head, never by the labels' shape.

    | model | loss |
    |---|---|
    | causal LMs (`*ForCausalLM`, `*LMHeadModel`, decoder-only `*ForConditionalGeneration`) | `causal_lm_loss()`: labels shifted |
    | encoder-decoder LM heads (`config.is_encoder_decoder` with output embeddings: T5, BART, Marian, ...) | `seq2seq_loss()`: no shift |
    | `*ForTokenClassification`, `*ForMaskedLM`, `*WithLMHeadModel` (XLM, Flaubert), `XLNetLMHeadModel` | `token_classification_loss()`: no shift |
    | `*ForSequenceClassification` | `classification_loss()`, by `config.problem_type` |

    Wrappers are looked through: PEFT (`get_base_model()`), `torch.compile` (`_orig_mod`),
    DDP (`module`), Opacus (`_module`).

    The decoders of encoder-decoder families offered as causal LMs (`BartForCausalLM`,
    `MarianForCausalLM`, `TrOCRForCausalLM`, `WhisperForCausalLM`, ...) score `labels[t]` at
    position t in their own loss, the labels shifted beforehand: which of the two a batch means
    cannot be told from it, so they raise too, saying which loss to pass.

    Raises:
        TypeError: for any other model (question answering, a bare `BartModel`, your own
            module, those decoders), naming its class and saying to pass `loss_fn=`.

    Example:
        >>> import torch, ftrain as ft
        >>> ft.losses.loss_for(torch.nn.Linear(2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: the default loss does not know Linear: ...
    """  # noqa: E501
    fn = _by_class(model)
    base = model if fn is not None else _base_model(model)
    fn = fn if fn is not None else _by_class(base)
    _refuse_preshifted(_base_model(model))  # PEFT's PeftModelForCausalLM ends like a causal LM
    if fn is None:
        raise TypeError(
            f"the default loss does not know {type(base).__name__}: it recognises HF causal "
            "LMs, encoder-decoder, token- and sequence-classification models. Pass "
            "loss_fn=... (e.g. ft.losses.causal_lm_loss(), or your own (model, batch) -> "
            "(loss_sum, num_items)) to accumulate_grads / evaluate"
        )
    return fn


def _label_items(batch: Any, *, shift: bool) -> torch.Tensor | None:
    """The label tokens a token loss counts in `batch` (after the shift when `shift`), read
    from the labels alone; None when `batch` is not a dict with 2-D `labels`."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        return None
    if shift:  # as `causal_targets` counts them: no target predicted from a padding position
        return (causal_targets(batch) != IGNORE_INDEX).sum()
    return (labels != IGNORE_INDEX).sum()


def _causal_sum(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _ce_sum(*_causal_pair(model, batch))


def _token_sum(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _ce_sum(*_token_pair(model, batch))


def _seq2seq_sum(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _ce_sum(*_seq2seq_pair(model, batch))


def _defaults(model: nn.Module) -> tuple[LossFn, LossFn]:
    """(`loss_for(model)`, the loss `accumulate_grads` runs under the default loss), looked up
    once per model (`loss_for` scans the class hierarchy's names: microseconds that a small
    step notices, issue 30).

    The second is `loss_for(model)` for dict batches with labels, its item count left in the
    loss's dtype for the token losses (the sums `accumulate_grads` keeps need no cast then);
    any other batch goes through `default_loss` and its errors.

    Raises:
        TypeError: as `loss_for`.
    """
    memo = STATE.default_losses
    found: tuple[LossFn, LossFn] | None = memo.get(model)
    if found is not None:
        return found
    fn = loss_for(model)
    if fn is _CAUSAL and _prepends_virtual_tokens(model):
        memo[model] = (fn, _prompted_step_loss)
        return fn, _prompted_step_loss
    counted = (
        _causal_sum if fn is _CAUSAL
        else _token_sum if fn is _TOKENS
        else _seq2seq_sum if fn is _SEQ2SEQ
        else fn
    )  # fmt: skip

    def step_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if type(batch) is dict and "labels" in batch:
            return counted(model, batch)
        return default_loss(model, batch)

    if fn is not _CAUSAL:
        memo[model] = (fn, step_loss)
        return fn, step_loss

    def first_step_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # The micro-batches of a model's first step (accumulate_grads looks the loss up once
        # a step) are checked; later steps run `step_loss` itself, no check.
        memo[model] = (fn, step_loss)
        _refuse_preshifted_labels(batch)
        return step_loss(model, batch)

    memo[model] = (fn, first_step_loss)
    return fn, first_step_loss


def _prompted_step_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The default loss's step for a causal LM under PEFT prompt tuning (`_defaults`). Its
    count holds a target more a row than the labels alone give (the first label, predicted by
    the last virtual token), so `_items_before_forward` does not count it ahead: it knows such
    a model by this function."""
    if type(batch) is dict and "labels" in batch:
        return _causal_sum(model, batch)
    return default_loss(model, batch)


def _refuse_preshifted_labels(batch: Any) -> None:
    """Raise for causal-LM labels that are already the next tokens (`labels[t] ==
    input_ids[t + 1]` at every counted position, not `input_ids[t]` at some): nanoGPT's
    `(x, y)` windows as `input_ids` and `labels`. The causal loss shifts them again, so the
    model was trained to predict the token after the next, silently. A host sync, on a
    model's first step only."""
    ids, labels = (batch.get(k) if isinstance(batch, Mapping) else None for k in _IDS_LABELS)
    if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor)):
        return
    if ids.dim() != 2 or labels.shape != ids.shape or ids.shape[1] < 2:
        return
    counted = labels[:, :-1] != IGNORE_INDEX
    ahead = (labels[:, :-1] == ids[:, 1:]) | ~counted
    moved = (labels[:, :-1] != ids[:, :-1]) & counted
    if bool(ahead.all() & moved.any()):  # host sync (first step only)
        raise ValueError(
            "the labels are input_ids shifted left already (labels[t] == input_ids[t + 1]: "
            "nanoGPT-style (x, y) windows?), and a causal LM's loss shifts them itself (position "
            "t predicts labels[t + 1], as in HF): the model would learn to predict the token "
            "after the next. Pass labels equal to input_ids (-100 where nothing is learned), or "
            "loss_fn=ft.losses.token_classification_loss() for labels you shifted"
        )


_IDS_LABELS = ("input_ids", "labels")


class Counted:
    """A loss of your own whose item count is read from the batch alone: `counted(sum_fn,
    items)`. Called as a `LossFn`, it returns `(sum_fn(model, batch), items(batch))`.

    `accumulate_grads` can then count a step's items before any forward and divide each
    micro-batch's loss by the global count before backward (as it does for its own token
    losses, from `COUNT_FIRST_NUMEL` parameters on), instead of dividing the gradients by it
    after the last backward: one pass over every gradient less a step, the same result to float
    rounding. The count it divides by and the count it reports are the same function of the
    same batch, so they cannot disagree.
    """

    __slots__ = ("items", "sum_fn")

    def __init__(self, sum_fn: Callable[[nn.Module, Any], torch.Tensor], items: Any) -> None:
        for name, fn in (("sum_fn", sum_fn), ("items", items)):
            if not callable(fn):
                raise TypeError(f"counted: {name} must be callable, got {fn!r}")
        self.sum_fn, self.items = sum_fn, items

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        total = self.sum_fn(model, batch)
        if not isinstance(total, torch.Tensor) or total.numel() != 1:
            raise TypeError(
                f"counted: {loss_name(self)} must return the loss *sum* as a one-element "
                f"tensor (the count comes from items(batch)), got {_described(total)}"
            )
        return total, self.count(batch)

    def count(self, batch: Any) -> Any:
        """`items(batch)`, checked: a non-negative number, or a one-element tensor (whose sign
        is not read: a host sync, where the count-first path runs none)."""
        n = self.items(batch)
        if isinstance(n, torch.Tensor):
            if n.numel() != 1 or n.dtype == torch.bool or n.is_complex():
                raise TypeError(
                    f"counted: items(batch) must be one number (the batch's item count), "
                    f"got {_described(n)}"
                )
            return n
        # numpy's numbers too (np.prod of a shape); a bool is a number to Python, never a count
        count = float(n) if isinstance(n, numbers.Real) and not isinstance(n, bool) else -1.0
        if not count >= 0:  # NaN too
            raise TypeError(
                f"counted: items(batch) must be a number >= 0 (the batch's item count), got {n!r}"
            )
        return int(n) if isinstance(n, numbers.Integral) else count

    def __repr__(self) -> str:
        return f"counted({self.sum_fn!r}, items={self.items!r})"


def counted(sum_fn: Callable[[nn.Module, Any], torch.Tensor], items: Any) -> Counted:
    """A `LossFn` from a loss *sum* and its item count read from the batch alone.

    For a loss of your own whose count does not depend on the model's output (the targets'
    size, the label tokens), this lets `accumulate_grads` count the step's items before the
    forward and divide each loss before backward, as a raw loop does, saving one pass over the
    gradients a step on models of `COUNT_FIRST_NUMEL` parameters and more (docs/api.md). Below
    that size, and in `evaluate`, it is a plain `LossFn`.

    Args:
        sum_fn: `(model, batch) -> loss_sum`, a one-element tensor (the *sum* over items).
        items: `batch -> count`, an int, a float (a weighted count) or a one-element tensor.

    Raises:
        TypeError: when either is not callable; on a call, when `sum_fn` returns anything but
            a one-element tensor (e.g. a `(sum, count)` pair) or `items` anything but one
            non-negative number (a tensor count's sign is not read: that is a host sync).

    Example:
        >>> import torch, torch.nn.functional as F, ftrain as ft
        >>> def ce_sum(model, batch):
        ...     x, y = batch
        ...     return F.cross_entropy(model(x), y, reduction="sum")
        >>> loss_fn = ft.losses.counted(ce_sum, items=lambda batch: batch[1].numel())
        >>> model = torch.nn.Linear(3, 2)
        >>> loss, n = loss_fn(model, [torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)])
        >>> n
        4
    """
    return Counted(sum_fn, items)


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"[:200]


def _items_before_forward(loss_fn: LossFn, batch: Any, model: nn.Module | None = None) -> Any:
    """The item count `loss_fn` will report for `batch`, known without running the model
    (token losses, issue 12; the default loss once `model` says which; a `counted` loss);
    None when it is not known in advance."""
    if type(loss_fn) is Counted:
        return loss_fn.count(batch)
    if loss_fn is default_loss:
        if model is None:
            return None
        loss_fn, step_loss = _defaults(model)
        if step_loss is _prompted_step_loss:
            return None
    if loss_fn is _CAUSAL:
        return _label_items(batch, shift=True)
    if loss_fn is _TOKENS or loss_fn is _SEQ2SEQ:
        return _label_items(batch, shift=False)
    return None


def default_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss `accumulate_grads` and `evaluate` use when none is given: `loss_for(model)`.

    Decided by the model's task head, never by the labels' shape: a causal LM shifts its
    labels, an encoder-decoder (T5, BART) and a token classifier do not, a sequence classifier
    takes one label per row. A model `loss_for` does not recognise (any module that is not such
    an HF model) raises a TypeError saying to pass `loss_fn=`.

    Raises:
        KeyError: when the batch has no `labels`.
        TypeError: when the model is not one `loss_for` recognises.
    """
    fn = loss_for(model)
    if not isinstance(batch, Mapping) or "labels" not in batch:
        raise _no_labels(
            batch,
            "the default loss needs a dict batch with 'labels'; pass loss_fn=... for other data",
        )
    return fn(model, batch)


def _no_labels(batch: Any, message: str) -> KeyError:
    """The KeyError for a batch without `labels`: `message`, and where the batch has a column
    that a Trainer collator would have renamed to `labels` (`label`, `label_ids`: GLUE's and
    many datasets' name), how to rename it."""
    other = [k for k in ("label", "label_ids") if isinstance(batch, Mapping) and k in batch]
    if other:
        message += (
            f". The batch has {other[0]!r}, which HF's DataCollatorWithPadding renames to "
            f"'labels' (ftrain's collators do not): rename the column first, e.g. "
            f"dataset.rename_column({other[0]!r}, 'labels')"
        )
    return KeyError(message)


def loss_name(fn: Callable[..., Any] | None) -> str:
    """The name `evaluate` records as `eval_loss_fn`: `module.qualname` of a loss function.

    None is the default loss. A `functools.partial` is named by the function it wraps, and a
    callable object by its class. A `counted` loss is named by its sum function, followed by
    `[items=...]` naming its items function where that has a name of its own (not a lambda):
    two counts of one sum (per token, per row) give means that `save_checkpoint(best_metric=
    "eval_loss")` must not rank together, so give each its items function by name (`def`).

    Example:
        >>> import torch, ftrain as ft
        >>> from ftrain.losses import loss_name
        >>> loss_name(None)
        'ftrain.losses.default_loss'
        >>> def rows(batch):
        ...     return len(batch[1])
        >>> loss_name(ft.losses.counted(torch.nn.functional.mse_loss, rows))  # doctest: +ELLIPSIS
        'torch.nn.functional.mse_loss[items=...rows]'
    """
    fn = default_loss if fn is None else fn
    items = None
    while isinstance(fn, functools.partial | Counted):
        if isinstance(fn, Counted):
            items = fn.items if items is None else items
        fn = fn.func if isinstance(fn, functools.partial) else fn.sum_fn
    name = _qualified(fn)
    if items is None or "<lambda>" in _qualified(items):
        return name  # a lambda has no name of its own: the sum's (stable, as before)
    return f"{name}[items={_qualified(items)}]"


def _qualified(fn: Any) -> str:
    """`module.qualname` of a function (through partials), else of its class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{named.__module__}.{named.__qualname__}"
