"""chunked_causal_lm_loss vs causal_lm_loss at a 32k vocabulary: peak memory and step time.

    python bench/bench_loss.py                    # 3 rounds, prints a table
    python bench/bench_loss.py --rounds 5 --chunk 256

A 1-layer Llama (hidden 256) with a 32,000-token vocabulary on 4 x 512 tokens, so the logits
(and their gradient) dominate: 2,048 x 32,000 float32 logits are 262 MB. Each measurement runs
alone in a fresh subprocess (forward + backward through `ft.accumulate_grads`, the README step
minus the optimizer) and reports its peak RSS growth over the set-up baseline and the median
step time; rounds alternate plain/chunked so machine noise hits both.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

import ftrain as ft

VOCAB, HIDDEN, BATCH, SEQ = 32_000, 256, 4, 512


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(kind: str, chunk: int, steps: int) -> dict[str, float]:
    """One measurement in this process: peak RSS growth (MB) and median step time (s)."""
    torch.set_num_threads(1)
    model = _model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    micro = [{"input_ids": ids, "labels": ids}]
    loss_fn = (
        ft.losses.causal_lm_loss()
        if kind == "plain"
        else ft.chunked_causal_lm_loss(chunk_size=chunk)
    )
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads = None
    base = _rss_mb()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        grads, _ = ft.accumulate_grads(state, micro, loss_fn)
        times.append(time.perf_counter() - t0)
    del grads
    return {"peak_mb": _rss_mb() - base, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.chunk, args.steps)))
        return
    results: dict[str, list[dict[str, float]]] = {"plain": [], "chunked": []}
    for _ in range(args.rounds):
        for kind in ("plain", "chunked"):
            cmd = [sys.executable, __file__, "--worker", kind, "--chunk", str(args.chunk),
                   "--steps", str(args.steps)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
            results[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("peak_mb", "step_s")}
        for k, v in results.items()
    }
    tokens = BATCH * (SEQ - 1)
    ratio = tokens / args.chunk
    print(f"vocab {VOCAB}, {tokens} label tokens, chunk {args.chunk} (chunk ratio {ratio:.1f}), "
          f"{args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print(f"logits alone: {tokens * VOCAB * 4 / 2**20:.0f} MiB float32")
    print("| loss | peak RSS growth (MiB) | step (s, median) |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v['peak_mb']:.0f} | {v['step_s']:.3f} |")
    print(
        f"memory chunked/plain: {med['chunked']['peak_mb'] / med['plain']['peak_mb']:.2f}x; "
        f"time chunked/plain: {med['chunked']['step_s'] / med['plain']['step_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
