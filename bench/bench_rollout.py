"""ft.rl.sample vs HF generate: new tokens per second on the same prompts.

    python bench/bench_rollout.py                 # 5 rounds, one thread, prints a table
    python bench/bench_rollout.py --rounds 7 --generations 8 --device cuda

A 4-layer Llama (hidden 256, vocabulary 8,000) samples G completions of 64 new tokens for each
of 16 ragged, left-padded prompts (8-40 tokens), at temperature 1.0 and top-p 0.95, with no
stop token, so both decode the same number of tokens: `generate(do_sample=True,
num_return_sequences=G)` and `ft.rl.sample(num_generations=G)`. Rounds alternate which runs
first; the table gives the median time of each and the ratio of their throughputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ftrain as ft
from ftrain.extras.cli import at_least

PROMPTS, NEW, VOCAB = 16, 64, 8000


def _model(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=128, pad_token_id=0, eos_token_id=None)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _prompts(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 41, (PROMPTS,), generator=g)
    ids = torch.zeros(PROMPTS, int(lengths.max()), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):  # left padding, as generate wants
        ids[i, -n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, -n:] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=at_least(1), default=5)
    p.add_argument("--generations", type=at_least(1), default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=at_least(1), default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, prompts, G = _model(a.device), _prompts(a.device), a.generations
    state = ft.TrainState.create(model, ft.optim.sgd(), seed=0,
                                 strategy=ft.strategies.SingleDevice(a.device))  # fmt: skip
    kw = dict(temperature=1.0, top_p=0.95, max_new_tokens=NEW)

    def hf() -> int:
        with torch.no_grad():
            out = model.generate(**prompts, do_sample=True, num_return_sequences=G, top_k=None,
                                 **kw)  # fmt: skip
        return (out.shape[1] - prompts["input_ids"].shape[1]) * out.shape[0]

    def ours() -> int:
        r = ft.rl.sample(state, prompts, index=list(range(PROMPTS)), num_generations=G,
                         stop_token_ids=[], **kw)  # fmt: skip
        return r.completion_ids.numel()

    times: dict[str, list[float]] = {"hf": [], "ft": []}
    tokens = {"hf": hf(), "ft": ours()}  # warm-up, and the token counts
    assert tokens["hf"] == tokens["ft"] == PROMPTS * G * NEW, tokens
    for r in range(a.rounds):
        for name in ("hf", "ft") if r % 2 == 0 else ("ft", "hf"):
            fn = hf if name == "hf" else ours
            _sync(a.device)
            t0 = time.perf_counter()
            fn()
            _sync(a.device)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{PROMPTS} prompts x {G} completions x {NEW} new tokens, {a.device}, "
          f"{a.threads} thread(s), {a.rounds} rounds")  # fmt: skip
    print("| sampler | median s | tokens/s |\n|---|---|---|")
    for k, label in (("hf", "HF generate"), ("ft", "ft.rl.sample")):
        print(f"| {label} | {med[k]:.3f} | {tokens[k] / med[k]:,.0f} |")
    print(f"ft.rl.sample / HF generate throughput: {med['hf'] / med['ft']:.2f}x")


if __name__ == "__main__":
    main()
