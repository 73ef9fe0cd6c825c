"""`chunked_causal_lm_loss`: the causal-LM loss without the `(tokens, vocab)` logits.

An extra (`ft.chunked_causal_lm_loss`): the plain loss lives in the core's `ft.losses`; this one
trades the full logits for chunks, and can hand the work to the optional Liger or CCE GPU kernels
(`pip install 'ftrain[kernels]'`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ftrain.extras import _lce_kernels
from ftrain.losses import (
    IGNORE_INDEX,
    LossFn,
    causal_lm_loss,
    causal_targets,
    loss_for,
    loss_logits,
    loss_name,
    upcast,
)
from ftrain.strategies import is_distributed

__all__ = ["chunked_causal_lm_loss"]


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `h @ weight.T (+ bias)` against `labels`, chunk by chunk.

    Forward walks the tokens in chunks of `chunk` rows; each chunk's logits live only while it
    is processed. When gradients are needed they are computed in the same pass (the softmax is
    at hand: `d loss / d logits = softmax - onehot`) and kept as `(N, H)` + `(V, H)` tensors,
    so backward only scales them: no second pass over the vocabulary, and never more than
    `(chunk, V)` logits at once (the idea of Liger's fused linear cross-entropy).
    """

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk: int,
        grad_enabled: bool = True,
    ) -> torch.Tensor:
        # needs_input_grad stays True under no_grad: the caller says whether grad mode is on.
        # Each gradient only where its input wants one: a frozen head (LoRA) must not cost a
        # (V, H) float32 buffer and a matmul per chunk.
        want_h, want_w, want_b = (grad_enabled and n for n in ctx.needs_input_grad[:3])
        # The logits' dtype (float32 for half weights): sums over chunks in bf16 would drift.
        acc = torch.promote_types(weight.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=h.device)
        gh = torch.empty_like(h) if want_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_w else None
        gb = None
        if bias is not None and want_b:
            gb = torch.zeros(weight.shape[0], dtype=acc, device=h.device)
        for start in range(0, h.shape[0], chunk):
            hc, yc = h[start : start + chunk], labels[start : start + chunk]
            # Ignored tokens are masked, not dropped: selecting rows would be a host sync.
            valid = yc != IGNORE_INDEX
            yc = torch.where(valid, yc, 0)[:, None]
            logits = upcast(F.linear(hc, weight, bias))
            lse = torch.logsumexp(logits, dim=-1)
            total += torch.where(valid, lse - logits.gather(1, yc).squeeze(1), 0.0).sum()
            if gh is not None or gw is not None or gb is not None:
                d = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                d.scatter_add_(1, yc, torch.full_like(yc, -1, dtype=d.dtype))
                d.mul_(valid[:, None])
                if gh is not None:
                    gh[start : start + chunk] = (d.to(weight.dtype) @ weight).to(h.dtype)
                if gw is not None:
                    gw.addmm_(d.T, hc.to(acc))
                if gb is not None:
                    gb += d.sum(0)
        ctx.save_for_backward(gh, gw, gb)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gh, gw, gb = ctx.saved_tensors
        gh = None if gh is None else gh * grad
        gw = None if gw is None else (gw * grad).to(ctx.dtypes[0])
        gb = None if gb is None else (gb * grad).to(ctx.dtypes[1])
        return gh, gw, gb, None, None, None


# Config fields with which HF causal LMs change the logits after the head, which the chunks
# would leave out: softcaps (Gemma 2/3, nanochat: final_logit_softcapping; RecurrentGemma:
# logits_soft_cap) and scales (Cohere: logit_scale; Granite, HyperCLOVA X: logits_scaling;
# Falcon-H1: lm_head_multiplier; output multipliers). None or 1.0 is plain logits.
_AFTER_HEAD = (
    "final_logit_softcapping", "logits_soft_cap", "logit_scale", "logits_scaling",
    "lm_head_multiplier", "output_multiplier", "output_multiplier_scale",
)  # fmt: skip


def _head(model: nn.Module, head: nn.Module | None) -> nn.Module:
    """The output projection: `head`, else the HF causal LM's own (DDP and torch.compile
    wrappers looked through); the model is checked either way."""
    inner: Any = model
    while not hasattr(inner, "get_output_embeddings"):
        inner = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        if inner is None:
            if head is not None:
                return head  # a model of your own: its head is yours to vouch for
            raise TypeError(
                f"chunked_causal_lm_loss needs an HF causal LM (get_output_embeddings) or "
                f"head=..., got {type(model).__name__}"
            )
    _check_causal(inner)
    if head is None:
        head = inner.get_output_embeddings()
        _check_linear(head, "the output embeddings")
    _check_config(inner, head)
    return head


def _check_causal(model: nn.Module) -> None:
    """Refuse the models whose labels are not shifted (encoder-decoders, masked LMs): the
    chunks would score each position against the next label, silently."""
    try:
        own = loss_name(loss_for(model))
    except TypeError:
        return  # not an HF task head ftrain knows: a causal LM of your own
    if own != loss_name(causal_lm_loss()):
        raise ValueError(
            f"chunked_causal_lm_loss shifts the labels as a causal LM does, but "
            f"{type(model).__name__}'s loss is {own.split('.')[-3]} (labels not shifted); "
            f"use ft.losses.loss_for(model) for it"
        )


def _check_linear(head: Any, what: str) -> None:
    # The chunks compute `h @ weight.T + bias`: a head whose forward does anything else (a
    # LoRA or quantized layer, a subclass with a scale) would be skipped silently.
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        kind = type(head)
        raise TypeError(
            f"{what} must be a plain nn.Linear (the chunks compute its projection without "
            f"calling it), got {kind.__module__}.{kind.__qualname__}; use causal_lm_loss for "
            "this model (e.g. a LoRA adapter or a quantized layer on the head)"
        )


def _check_config(model: nn.Module, head: Any) -> None:
    cfg: Any = getattr(model, "config", None)
    text = cfg.get_text_config() if callable(getattr(cfg, "get_text_config", None)) else cfg
    for c in (cfg, text):
        for attr in _AFTER_HEAD:
            if getattr(c, attr, None) not in (None, 1.0):
                raise ValueError(
                    f"chunked_causal_lm_loss computes plain logits, but this model's config "
                    f"sets {attr}={getattr(c, attr)!r}; use causal_lm_loss for it"
                )
        cut, size = getattr(c, "unpadded_vocab_size", None), head.weight.shape[0]
        if isinstance(cut, int) and cut < size:
            raise ValueError(
                f"chunked_causal_lm_loss scores all {size} outputs of the head, but "
                f"this model's config sets unpadded_vocab_size={cut} (its logits are cut to it); "
                "use causal_lm_loss for it"
            )


def _hidden(model: nn.Module, head: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Run `model` with `head` fed an empty slice: returns the head's input, no logits built."""
    seen: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(grab)
    try:
        # The head still runs (on 0 tokens), so DDP/FSDP hooks fire; a router loss the model
        # returned beside the logits raises, as in causal_lm_loss.
        loss_logits(model, batch)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise RuntimeError(f"the output head ran {len(seen)} times in one forward, expected 1")
    return seen[0]


def chunked_causal_lm_loss(
    *, chunk_size: int | None = None, head: nn.Module | None = None, kernel: str = "torch"
) -> LossFn:
    """`causal_lm_loss` without the `(tokens, vocab)` logits: cross-entropy through the head in
    chunks of `chunk_size` label tokens.

    The model runs with its output head fed an empty slice (a forward pre-hook), its input
    hidden states are taken, and the loss and its gradients are computed chunk by chunk, so
    the peak holds `chunk_size x vocab` logits instead of `tokens x vocab`. The result (sum
    and count) equals `causal_lm_loss()` up to float rounding, gradients included. Logits are
    float32 as in `causal_lm_loss`. Models that transform logits after the head (softcapping,
    logit scales, a cut vocabulary), models whose labels are not shifted (encoder-decoders,
    masked LMs), mixture-of-experts models that return a router loss (`output_router_logits`:
    their own loss adds it; `causal_lm_loss` refuses them too), heads that are not a plain
    `nn.Linear` (a LoRA adapter or a quantized layer on the head) and labels of another shape
    than the tokens are refused. Sharded (FSDP) head
    weights are refused too: the chunks need the whole matrix outside the head's own forward,
    where FSDP has resharded it.

    `kernel` picks who computes the cross-entropy through the head: "torch" (default) is the
    chunked function above; "liger" (Liger-Kernel's fused linear cross-entropy) and "cce"
    (Apple's Cut Cross-Entropy, no bias) are Triton GPU kernels, optional packages
    (`pip install 'ftrain[kernels]'`) that need the head on CUDA, CCE also half precision
    (`precision="bf16"`); "auto" takes Liger, then CCE, when installed and the head is on
    CUDA, else "torch". Both kernels run with their
    extras off (z-loss, smoothing, softcap, CCE's gradient filtering) and reduction "sum", so
    they compute this same loss; each reads the device once per call (Liger counts the labels
    with `.item()`, CCE selects them with `nonzero`), unlike "torch".

    Args:
        chunk_size: label tokens per chunk of the "torch" path (>= 1; default 1024); also
            the chunk of "auto" when it falls back to "torch". The kernels choose their own
            tiling, so an explicit "liger" or "cce" refuses it.
        head: the output projection (`nn.Linear`); `model.get_output_embeddings()` by default.
        kernel: "torch", "auto", "liger" or "cce".

    Raises:
        ValueError: for a bad `chunk_size` or `kernel`; when called, for an explicit kernel
            whose head is not on CUDA ("cce": with a bias, or outside bf16/fp16), a model
            that is not a causal LM, changes its logits after the head or returns a router
            loss, or labels whose shape is not the tokens'.
        TypeError: for a `head` (given, or the model's) that is not a plain `nn.Linear`.
        ImportError: for an explicit kernel whose package does not import.

    Example:
        >>> import torch, ftrain as ft
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> cfg = GPT2Config(vocab_size=50, n_embd=8, n_layer=1, n_head=2, bos_token_id=0,
        ...                  eos_token_id=0)
        >>> m = GPT2LMHeadModel(cfg).eval()  # eval: no dropout, so both losses see one model
        >>> b = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "labels": torch.tensor([[1, 2, 3, 4]])}
        >>> a, n = ft.chunked_causal_lm_loss(chunk_size=2)(m, b)
        >>> bool(torch.isclose(a, ft.losses.causal_lm_loss()(m, b)[0])), int(n)
        (True, 3)
    """
    if kernel not in ("torch", "auto", *_lce_kernels.KERNELS):
        raise ValueError(f"kernel must be 'torch', 'auto', 'liger' or 'cce', got {kernel!r}")
    if chunk_size is not None and kernel in _lce_kernels.KERNELS:
        raise ValueError(
            f"chunk_size={chunk_size!r} applies to the torch path; kernel={kernel!r} tiles the "
            f"vocabulary itself: drop chunk_size, or use kernel='torch' or 'auto'"
        )
    if kernel in _lce_kernels.KERNELS:
        _lce_kernels.require(kernel)  # fail when built, not at the first step
    chunk = 1024 if chunk_size is None else chunk_size
    if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1):
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if head is not None:
        _check_linear(head, "head")

    def loss_fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if "labels" not in batch:
            raise KeyError("chunked_causal_lm_loss needs 'labels' in the batch")
        out = _head(model, head)
        weight, bias = out.weight, out.bias
        if is_distributed(weight):
            raise ValueError(
                "chunked_causal_lm_loss cannot use a sharded (FSDP) head weight; use "
                "causal_lm_loss under FSDP, or DDP"
            )
        hidden, labels = _hidden(model, out, batch), batch["labels"]
        if hidden.shape[:-1] != labels.shape:  # host ints: no sync
            # The chunks pair hidden row i with label i: other shapes would pair them wrongly.
            raise ValueError(
                f"chunked_causal_lm_loss: the labels' shape {tuple(labels.shape)} differs from "
                f"the head's input {tuple(hidden.shape[:-1])} (batch, tokens); give each token "
                "one label (-100 to ignore it)"
            )
        # The targets of causal_lm_loss (a padding position predicts nothing), whose last
        # column is -100: the last position's hidden state costs one ignored row per sequence.
        labels = causal_targets(batch).reshape(-1)
        h = hidden.reshape(-1, hidden.shape[-1])
        use = _lce_kernels.pick(kernel, h, weight, bias)  # type: ignore[arg-type]
        if use == "torch":
            grad_on = torch.is_grad_enabled()
            loss = _LinearCrossEntropy.apply(h, weight, bias, labels, chunk, grad_on)
        else:
            loss = _lce_kernels.run(use, h, weight, bias, labels)  # type: ignore[arg-type]
        return loss, (labels != IGNORE_INDEX).sum()

    return loss_fn
