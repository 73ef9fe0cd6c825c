"""Forward+backward time of the main job's model variants against nanoGPT's `GPT`.

HF GPT-2 with the tanh GELU approximation (`gelu_new`), HF GPT-2 with exact GELU, HF
GPTBigCode with one head per key (`multi_query=False`: GPT-2 with `nn.Linear` instead of
`Conv1D`), each also under `torch.compile` (steady state, compile time excluded), and nanoGPT's
own model (bias=False) and the example's `CharGPT` (nanoGPT's model written as an HF
`PreTrainedModel`) at the example's shapes, interleaved; prints median milliseconds.
nanoGPT is not part of ftrain: point --nanogpt at a checkout of it (its `model.py` is imported
from there).

    python bench/bench_arch.py --nanogpt /path/to/nanoGPT [--rounds 60] [--threads 1]
        [--compile] [--others]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, GPTBigCodeConfig, GPTBigCodeForCausalLM

V, B, T = 65, 12, 64
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example() -> torch.nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    from shakespeare_char import CharGPT, CharGPTConfig

    torch.manual_seed(0)
    return CharGPT(CharGPTConfig(vocab_size=V, block_size=T, n_layer=4, n_head=4, n_embd=128))


def _hf(activation: str) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=V, n_positions=T, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        activation_function=activation,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _bigcode() -> GPTBigCodeForCausalLM:
    torch.manual_seed(0)
    cfg = GPTBigCodeConfig(
        vocab_size=V, n_positions=T, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, multi_query=False,
        activation_function="gelu",
    )  # fmt: skip
    return GPTBigCodeForCausalLM(cfg)


def _others() -> dict[str, torch.nn.Module]:
    """Other HF architectures at the same size: OPT without biases, GPT-NeoX, Llama without
    biases (tied embeddings), each with exact GELU and no dropout."""
    import transformers as tr

    torch.manual_seed(0)
    opt = tr.OPTConfig(
        vocab_size=V, hidden_size=128, num_hidden_layers=4, ffn_dim=512, num_attention_heads=4,
        max_position_embeddings=T, do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0,
        activation_function="gelu", enable_bias=False, word_embed_proj_dim=128, pad_token_id=0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    neox = tr.GPTNeoXConfig(
        vocab_size=V, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=T, hidden_act="gelu",
        use_parallel_residual=False, rotary_pct=0.25, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    llama = tr.LlamaConfig(
        vocab_size=V, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=T, hidden_act="gelu",
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return {
        "hf_opt_nobias": tr.OPTForCausalLM(opt), "hf_neox": tr.GPTNeoXForCausalLM(neox),
        "hf_llama_nobias": tr.LlamaForCausalLM(llama),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nanogpt", required=True, help="a checkout of nanoGPT")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="add torch.compile variants")
    parser.add_argument("--others", action="store_true", help="add OPT, GPT-NeoX and Llama")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, args.nanogpt)
    from model import GPT, GPTConfig  # nanoGPT's

    cfg = GPTConfig(block_size=T, vocab_size=V, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    cfg.bias = False
    models = {
        "hf_gelu_new": _hf("gelu_new"), "hf_gelu": _hf("gelu"), "hf_bigcode": _bigcode(),
        "nanogpt": GPT(cfg), "example": _example(),
    }  # fmt: skip
    if args.others:
        models |= _others()
    if args.compile:
        compiled = ("hf_gelu", "hf_bigcode", "nanogpt", "example")
        models |= {f"{k}_compiled": torch.compile(models[k]) for k in compiled}
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            t = time.perf_counter()
            if name.startswith("nanogpt"):
                loss = model(x, y)[1]
            else:
                logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v[10:]) for k, v in times.items()}
    print({k: round(v * 1e3, 2) for k, v in med.items()})
    print("vs nanoGPT:", {k: round(v / med["nanogpt"], 3) for k, v in med.items()})


if __name__ == "__main__":
    main()
