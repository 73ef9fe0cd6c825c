"""Supervised fine-tuning data: prompt/response formatting, qlora.py's collator, and packing.

A row is `{"input": prompt text, "output": response text}` (qlora.py's layout); formatters turn
the usual dataset layouts into it. `SFTCollator` tokenizes and pads a batch of such rows the way
qlora.py's `DataCollatorForCausalLM` does: BOS + prompt truncated to `source_max_len`, response +
EOS truncated to `target_max_len`, prompt tokens labelled -100 unless `train_on_source`.
`ft.data.pack_examples` concatenates tokenized rows into rows of at most `max_length` tokens
whose `position_ids` restart at every example; HF models whose attention mask reads them then
attend within each example only (the built-in losses call the model with `use_cache=False`;
see `packed_collate` for the models that do not).

    >>> import ftrain as ft
    >>> ft.sft.alpaca({"instruction": "Add 2 and 3.", "output": "5"})["output"]
    '5'
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from ftrain.data import pad_collate
from ftrain.losses import IGNORE_INDEX

__all__ = [
    "ALPACA_PROMPT_DICT",
    "SFTCollator",
    "TruncationCounts",
    "TruncationWarning",
    "alpaca",
    "chat",
    "input_output",
    "neftune",
    "neftune_noise",
    "neftune_sites",
    "packed_collate",
    "train_tokenizer",
]

Row = dict[str, str]

# qlora.py's alpaca prompts, word for word.
ALPACA_PROMPT_DICT: Mapping[str, str] = MappingProxyType(
    {
        "prompt_input": (
            "Below is an instruction that describes a task, paired with an input that provides "
            "further context. Write a response that appropriately completes the request.\n\n"
            "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response: "
        ),
        "prompt_no_input": (
            "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n"
            "### Instruction:\n{instruction}\n\n### Response: "
        ),
    }
)


def alpaca(example: Mapping[str, Any]) -> Row:
    """An alpaca-style `{instruction, input?, output}` example as `{input, output}`.

    The prompt is qlora.py's: with the "input" variant when `example["input"]` is non-empty.

    Raises:
        KeyError: without `instruction` or `output`.
        ValueError: if `instruction` or `output` is None (it would become the text "None").
    """
    for key in ("instruction", "output"):
        if key in example and example[key] is None:  # str(None) would train the text "None"
            raise ValueError(
                f"alpaca: the example's {key!r} is None (a missing value): it would become the "
                "text 'None'; drop such rows (dataset.filter) or fill them"
            )
    has_input = bool(example.get("input", ""))
    template = ALPACA_PROMPT_DICT["prompt_input" if has_input else "prompt_no_input"]
    prompt = template.format(instruction=example["instruction"], input=example.get("input", ""))
    return {"input": prompt, "output": str(example["output"])}


def input_output(example: Mapping[str, Any]) -> Row:
    """An `{input, output}` example as is (checked): the layout qlora.py's collator reads."""
    if not isinstance(example.get("input"), str) or not isinstance(example.get("output"), str):
        raise KeyError(f"expected string 'input' and 'output', got keys {sorted(example)}")
    return {"input": example["input"], "output": example["output"]}


def chat(tokenizer: Any) -> Callable[[Mapping[str, Any]], Row]:
    """A formatter for `{"messages": [{"role", "content"}, ...]}` chat examples.

    The prompt is every message before the last, rendered by the tokenizer's chat template with
    the generation prompt; the response is the last message, which must be the assistant's.
    Use `SFTCollator(add_bos=False)` when the template writes BOS itself.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat_template")

    def format_chat(example: Mapping[str, Any]) -> Row:
        messages = list(example["messages"])
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("the last message of a chat example must be the assistant's")
        prompt = tokenizer.apply_chat_template(
            messages[:-1], tokenize=False, add_generation_prompt=True
        )
        return {"input": prompt, "output": messages[-1]["content"]}

    return format_chat


class TruncationWarning(UserWarning):
    """Issued once per `SFTCollator` when it first cuts a prompt or a response."""


class TruncationCounts(NamedTuple):
    """How many rows an `SFTCollator` encoded, and how many it cut at each limit."""

    rows: int = 0
    prompts: int = 0  # `[BOS] + prompt` longer than `source_max_len`
    responses: int = 0  # `response + [EOS]` longer than `target_max_len`


@dataclasses.dataclass
class _Tally:  # the collator's running counts (a frozen dataclass can hold a mutable field)
    counts: TruncationCounts = dataclasses.field(default_factory=TruncationCounts)
    warned: bool = False


@dataclasses.dataclass(frozen=True)
class SFTCollator:
    """Tokenize and pad `{input, output}` rows for causal-LM fine-tuning (qlora.py's collator).

    `encode` makes one row: `[BOS] + prompt` truncated to `source_max_len` tokens, then
    `response + [EOS]` truncated to `target_max_len` (a truncated response loses its EOS, as in
    qlora.py), each cut at its end; with the tokenizer's `truncation_side="left"` the prompt is
    cut at its start instead (it keeps its BOS and the end next to the response), and the
    response still at its end: the loss trains the response from its first token, as TRL's
    `DPOTrainer` keeps a prompt's last `max_prompt_length` tokens and a completion's first
    `max_completion_length` (cutting the response's start would train the model to begin its
    answer mid-sentence). Labels are the
    response tokens, with -100 over the prompt unless `train_on_source`. Calling the collator on
    a list of rows (raw, or already encoded) pads them: `input_ids` with the tokenizer's pad
    token, `labels` with -100, and an `attention_mask` from the real lengths (qlora.py compares
    ids with the pad id, which is wrong when pad and EOS share an id). Packed rows
    (`ft.data.pack_examples`, which carry `position_ids`) are padded as `packed_collate` pads
    them, without an attention mask, so that HF models keep their examples apart.

    Truncation is counted, never silent: `truncated` holds the running counts of rows encoded
    and of prompts and responses cut, and the first call that cuts anything issues a
    `TruncationWarning` saying how many of how many and at which limit (once per collator;
    `warnings.simplefilter("error", ft.sft.TruncationWarning)` makes it an error). The counts
    are this process's: a collator run by `make_batches(num_workers=N)` counts in the worker
    processes, so encode the dataset upfront (`encode_batch`) to count it all in one place.

    Args:
        tokenizer: an HF tokenizer with a pad token.
        source_max_len: most prompt tokens kept (BOS included).
        target_max_len: most response tokens kept (EOS included).
        train_on_source: also train on the prompt tokens.
        add_bos: start with the tokenizer's BOS (when it has one); a prompt that already
            starts with it (a chat template's) raises: pass False then.
        add_eos: end the response with EOS (a tokenizer without one raises: pass False); a
            response that already ends with it raises: pass False then.
        pad_to_multiple_of: round padded lengths up to a multiple of this.
    """

    tokenizer: Any
    source_max_len: int = 1024
    target_max_len: int = 256
    train_on_source: bool = False
    add_bos: bool = True
    add_eos: bool = True
    pad_to_multiple_of: int | None = None
    _tally: _Tally = dataclasses.field(
        default_factory=_Tally, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # A string is not a flag ("no" is truthy) and True is not a length: refuse, never guess.
        for name in ("source_max_len", "target_max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        multiple = self.pad_to_multiple_of
        if multiple is not None and (
            isinstance(multiple, bool) or not isinstance(multiple, numbers.Integral) or multiple < 1
        ):
            raise ValueError(f"pad_to_multiple_of must be None or an int >= 1, got {multiple!r}")
        for name in ("train_on_source", "add_bos", "add_eos"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (e.g. tokenizer.pad_token = ...)")
        if self.add_eos and self.tokenizer.eos_token_id is None:
            raise ValueError(
                "add_eos=True, but the tokenizer has no EOS token: the model would never learn "
                "to stop; set tokenizer.eos_token, or pass add_eos=False"
            )

    @property
    def truncated(self) -> TruncationCounts:
        """Rows encoded so far, and how many prompts and responses were cut (`TruncationCounts`)."""
        return self._tally.counts

    def encode(self, row: Mapping[str, str]) -> dict[str, list[int]]:
        """One `{input, output}` row as unpadded `{input_ids, labels}`."""
        return self.encode_batch([row])[0]

    def encode_batch(self, rows: Sequence[Mapping[str, str]]) -> list[dict[str, list[int]]]:
        """`encode` for many rows, tokenizing them in one call each for prompts and responses."""
        tok = self.tokenizer
        for r in rows:
            if not isinstance(r.get("input"), str) or not isinstance(r.get("output"), str):
                raise KeyError(f"rows need string 'input' and 'output', got keys {sorted(r)}")
        prompts = tok([r["input"] for r in rows], add_special_tokens=False)["input_ids"]
        answers = tok([r["output"] for r in rows], add_special_tokens=False)["input_ids"]
        bos = [tok.bos_token_id] if self.add_bos and tok.bos_token_id is not None else []
        eos = [tok.eos_token_id] if self.add_eos and tok.eos_token_id is not None else []
        out, cut_prompts, cut_responses = [], 0, 0
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            if bos and p[:1] == bos:
                raise ValueError(
                    f"row {i}: the prompt already starts with BOS (a chat template writes it): "
                    "pass add_bos=False, or the row would start with two"
                )
            if eos and a[-1:] == eos:
                raise ValueError(
                    f"row {i}: the response already ends with EOS (its text holds the EOS "
                    "token): pass add_eos=False, or strip it from the rows, or the row would "
                    "end with two (trained to emit EOS after EOS)"
                )
            source, target = bos + list(p), list(a) + eos
            cut_prompts += len(source) > self.source_max_len
            cut_responses += len(target) > self.target_max_len
            source, target = self._cut(bos, list(p), target)
            labels = source if self.train_on_source else [IGNORE_INDEX] * len(source)
            out.append({"input_ids": source + target, "labels": labels + target})
        self._count(len(out), cut_prompts, cut_responses)
        return out

    def _cut(self, bos: list[int], prompt: list[int], target: list[int]) -> tuple[list, list]:
        """`[BOS] + prompt` and `target` cut to their limits. The prompt on the tokenizer's
        `truncation_side`: "right" (qlora.py's) keeps its start, "left" its end (after its BOS,
        which stays). The response always keeps its start: the labels begin where the prompt
        ends, so a response cut at its start would train an answer that starts mid-way."""
        if _left(self.tokenizer):
            keep = self.source_max_len - len(bos)
            source = bos[: self.source_max_len] + (prompt[-keep:] if keep > 0 else [])
        else:
            source = (bos + prompt)[: self.source_max_len]
        return source, target[: self.target_max_len]

    def _count(self, rows: int, prompts: int, responses: int) -> None:
        tally, old = self._tally, self._tally.counts
        tally.counts = TruncationCounts(
            old.rows + rows, old.prompts + prompts, old.responses + responses
        )
        if (prompts or responses) and not tally.warned:
            tally.warned = True
            side = "starts" if _left(self.tokenizer) else "ends"
            warnings.warn(
                f"SFTCollator cut the {side} of {prompts} of {rows} prompts ([BOS] + input) to "
                f"source_max_len={self.source_max_len} and the ends of {responses} of {rows} "
                f"responses (output + [EOS]) to target_max_len={self.target_max_len}; raise the "
                "limits or shorten the rows. collator.truncated keeps the running counts; this "
                "warning is issued once per collator",
                TruncationWarning,
                stacklevel=3,
            )

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        raw = [r for r in rows if "input_ids" not in r]
        encoded = iter(self.encode_batch(raw)) if raw else iter(())
        rows = [r if "input_ids" in r else next(encoded) for r in rows]
        # Packed rows (`pack_examples`: position_ids restarting per example) get no attention
        # mask, as `packed_collate` does: with one, HF models attend across the examples.
        packed = all("position_ids" in r for r in rows)
        return pad_collate(
            pad_id=self.tokenizer.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            attention_mask=not packed,
        )(rows)


def _left(tokenizer: Any) -> bool:
    """Whether the tokenizer truncates on the left (`truncation_side="left"`)."""
    return getattr(tokenizer, "truncation_side", "right") == "left"


def packed_collate(pad_id: int, pad_to_multiple_of: int | None = None) -> Callable[..., Any]:
    """Collate packed rows: pad `input_ids` with `pad_id`, `labels` with -100 and `position_ids`
    with 0, and pass no `attention_mask`, so that HF models find the example boundaries in
    `position_ids` and attend within each example only (padding tokens attend to themselves).

    HF looks for packed sequences only when no KV cache is in use. ftrain's built-in losses
    (`ft.losses`, the default loss, `evaluate`) call the model with `use_cache=False`; a
    `loss_fn` of your own that calls the model itself must pass it too (or set
    `model.config.use_cache = False`, as qlora.py does): with the cache on, the examples of a
    packed row attend to each other.

    The model must build its attention mask from `position_ids`, as HF's Llama, Mistral, Qwen,
    Gemma, Phi, GPT-2 and GPT-NeoX families do (transformers 5.24). For a model whose forward
    takes no `position_ids` (Bloom, MPT) the built-in losses raise, and so they do for the HF
    model types measured to ignore the boundaries (OPT, BioGPT, XGLM and the BERT-style
    decoders take `position_ids` for their position embeddings only; recurrent hybrids such as
    Jamba and Qwen3-Next carry state across examples): pad rows for those instead. A model
    of your own is not checked: compare a packed row's loss with its examples run alone.
    """

    return pad_collate(pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, attention_mask=False)


def _check_alpha(alpha: Any) -> None:
    ok = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
    if not (ok and math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")


def neftune_noise(embeddings: torch.Tensor, alpha: float) -> torch.Tensor:
    """NEFTune: `embeddings` plus uniform noise of magnitude `alpha / sqrt(L * d)`.

    `L` is the (padded) sequence length and `d` the embedding size, as in HF's
    `neftune_post_forward_hook`; the noise is drawn from the default generator, which
    `accumulate_grads` seeds per micro-batch, so a resumed run draws the same noise.
    """
    _check_alpha(alpha)
    # HF's arithmetic (float32 on the host: shapes are host ints, so no device sync).
    magnitude = float(alpha / torch.sqrt(torch.tensor(embeddings.size(1) * embeddings.size(2))))
    return embeddings + torch.zeros_like(embeddings).uniform_(-magnitude, magnitude)


def neftune(model: Any, alpha: float = 5.0) -> Any:
    """Add NEFTune noise to `model`'s input embeddings while it is in training mode.

    `TrainingArguments(neftune_noise_alpha=alpha)`. Registers a forward hook on
    `model.get_input_embeddings()` (no noise in eval mode, so evaluation and generation are
    unaffected) and returns its handle: `handle.remove()` turns NEFTune off.

    Raises:
        ValueError: if `alpha` is not a finite number >= 0, or the embeddings already have
            NEFTune noise (a second call would add it twice).
    """
    _check_alpha(alpha)
    embeddings = model.get_input_embeddings()
    # A second hook would draw noise twice (sqrt(2) times the alpha asked for).
    if any(getattr(h, "_ftrain_neftune", False) for h in embeddings._forward_hooks.values()):
        raise ValueError(
            f"neftune: {type(model).__name__}'s input embeddings already has NEFTune noise (a "
            "second hook would add noise twice); call .remove() on the first handle before "
            "adding it again"
        )

    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return neftune_noise(output, alpha) if module.training else output

    hook._ftrain_neftune = True  # type: ignore[attr-defined]
    hook._ftrain_neftune_alpha = alpha  # type: ignore[attr-defined]
    return embeddings.register_forward_hook(hook)


def neftune_sites(model: torch.nn.Module) -> list[str]:
    """The modules of `model` (names) that add `neftune` noise in its forward now: those in
    training mode with a NEFTune hook of `alpha` > 0. Empty when no noise is added (eval mode,
    the hook's handle removed, or `alpha=0`, a config's `neftune_alpha: 0`).

    Post-training that compares the policy's log-probs with ones computed without noise (the
    old log-probs of `ft.rl.sample`, a reference's) refuses such a policy, as it refuses
    dropout: unlike the Trainer, which turns NEFTune off at the end of `train()`, the hook
    stays until its handle is removed, so an SFT stage's noise would reach the next stage.

    Example:
        >>> import torch, ftrain as ft
        >>> class Lm(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = torch.nn.Embedding(4, 2)
        ...     def get_input_embeddings(self):
        ...         return self.embed
        >>> model = Lm()
        >>> handle = ft.sft.neftune(model, alpha=5.0)
        >>> ft.sft.neftune_sites(model)
        ['embed']
        >>> handle.remove()
        >>> ft.sft.neftune_sites(model)
        []
    """
    return [
        name
        for name, module in model.named_modules()
        if module.training
        and any(getattr(h, "_ftrain_neftune_alpha", 0) > 0 for h in module._forward_hooks.values())
    ]


_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> Any:
    """A small byte-level BPE tokenizer trained on `texts`, offline, in a second or two.

    For tests and examples that need a real tokenizer without downloading one: `<pad>`, `<s>`
    (BOS) and `</s>` (EOS) are special tokens, and a minimal chat template renders
    `<|role|>content` lines. Returns a `transformers.PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=_CHAT_TEMPLATE,
    )
