"""ftrain loop vs a raw PyTorch loop (fused AdamW), interleaved in one run, three regimes.

    python bench/bench_loop.py                 # all regimes, writes nothing, prints a table
    python bench/bench_loop.py --regime tiny --rounds 3

The ftrain loop is the README loop (`grads` stays bound across iterations, every 10th step logs
`float(stats.loss)` and `float(info.grad_norm)`); the raw loop logs the same two numbers.
Step time: both loops train their own copy of the same model on the same pre-collated data with
the same hyper-parameters (accumulation 2, clip 1.0, warmup-cosine lr, AdamW wd 0.1). The loops
take turns step by step (order alternating) so that machine noise hits both; the ratio is of
per-step medians over the rounds.
Peak memory: each loop runs alone in a fresh subprocess and reports its peak RSS growth over the
set-up baseline (CUDA: max allocated), interleaved the same way.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import ftrain as ft

ACCUM, CLIP, WD, LOG_EVERY = 2, 1.0, 0.1, 10
LOGGED: list[tuple[float, float]] = []  # what the loops log, so that the reads happen


def build(regime: str) -> tuple[torch.nn.Module, list[list[dict[str, torch.Tensor]]], int]:
    """(model, step batches, steps per block) for one regime; deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if regime == "tiny":  # per-step overhead dominates
        model: torch.nn.Module = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=128,
                n_positions=32,
                n_embd=32,
                n_layer=1,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
        bs, seq, vocab, steps = 4, 16, 128, 100
    elif regime == "embedding":  # ~30M parameters, mostly embeddings: the optimizer dominates
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=50_000,
                n_positions=32,
                n_embd=576,
                n_layer=1,
                n_head=4,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
        bs, seq, vocab, steps = 2, 16, 50_000, 8
    elif regime == "llama":  # compute dominates
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=1024,
                hidden_size=256,
                intermediate_size=688,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                max_position_embeddings=256,
            )
        )
        bs, seq, vocab, steps = 8, 128, 1024, 4
    else:
        raise ValueError(f"unknown regime {regime!r}")
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(steps):
        micro = []
        for _ in range(ACCUM):
            ids = torch.randint(0, vocab, (bs, seq), generator=g)
            micro.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
        data.append(micro)
    return model, data, steps


def raw_loop(
    model: torch.nn.Module, total: int, compiled_step: bool = False
) -> Callable[[list[Any], int], None]:
    """The loop people write by hand, logging every LOG_EVERY steps like the README loop.
    `compiled_step`: torch's compiled-optimizer recipe instead of fused AdamW (a foreach AdamW
    with a tensor lr, its `step` under `torch.compile`; bench_compiled_step.py)."""
    if compiled_step:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.0), weight_decay=WD)
        opt_step = torch.compile(opt.step)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=WD, fused=True)
        opt_step = opt.step
    lr = ft.schedules.warmup_cosine(1e-3, 10, total)

    def step(micro: list[Any], k: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for batch in micro:
            loss = model(**batch).loss / len(micro)
            loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for group in opt.param_groups:
            if compiled_step:
                group["lr"].fill_(lr(k))  # a tensor lr: no recompile when it changes
            else:
                group["lr"] = lr(k)
        opt_step()
        if (k + 1) % LOG_EVERY == 0:
            LOGGED.append((float(loss_sum), float(norm)))

    return step


def ftrain_loop(
    model: torch.nn.Module, total: int, strategy: Any = None, compile: bool = False
) -> Callable[[list[Any], int], None]:
    """The README loop's body. `grads` lives across iterations as in the README, where it stays
    bound until the next `accumulate_grads` returns: held in `loop`, not scoped to one call.
    `compile` is `clip_and_step`'s (bench_compiled_step.py)."""
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=WD), strategy=strategy)
    lr = ft.schedules.warmup_cosine(1e-3, 10, total)
    loop: dict[str, Any] = {"state": state, "grads": None}
    extra = {"compile": True} if compile else {}  # so that trees without it run this bench too

    def step(micro: list[Any], k: int) -> None:
        state = loop["state"]
        loop["grads"], stats = ft.accumulate_grads(state, micro)
        state, info = ft.clip_and_step(
            state, loop["grads"], stats=stats, lr=lr(state.step), max_norm=CLIP, **extra
        )
        loop["state"] = state
        if ft.should_log(state, every=LOG_EVERY):
            LOGGED.append((float(stats.loss), float(info.grad_norm)))

    return step


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _to_device(model: torch.nn.Module, data: list[Any]) -> tuple[torch.nn.Module, list[Any]]:
    return model.to(DEVICE), [[{k: v.to(DEVICE) for k, v in b.items()} for b in m] for m in data]


def _block(step: Callable[[list[Any], int], None], data: list[Any], offset: int) -> list[float]:
    times = []
    for i, micro in enumerate(data):
        _sync()
        t0 = time.perf_counter()
        step(micro, offset + i)
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def time_regime(regime: str, rounds: int) -> dict[str, float]:
    import copy

    model, data, steps = build(regime)
    model, data = _to_device(model, data)
    total = steps * (rounds + 1)
    loops = {
        "raw": raw_loop(copy.deepcopy(model), total),
        "ftrain": ftrain_loop(copy.deepcopy(model), total),
    }
    for step in loops.values():  # warm-up block (allocator, first-step state init)
        _block(step, data, 0)
    # The loops take turns step by step, order alternating: on a shared machine the load changes
    # within a block of steps, and block-interleaved medians swung by up to 1.2x.
    per_step: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(rounds):
        for i, micro in enumerate(data):
            order = list(loops) if (r * steps + i) % 2 == 0 else list(reversed(loops))
            for name in order:
                per_step[name] += _block(loops[name], [micro], steps * (r + 1) + i)
    med = {name: statistics.median(ts) for name, ts in per_step.items()}
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "params_m": n_params / 1e6,
        "raw_ms": med["raw"] * 1e3,
        "ftrain_ms": med["ftrain"] * 1e3,
        "time_ratio": med["ftrain"] / med["raw"],
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def memory_child(regime: str, loop: str) -> None:
    model, data, steps = build(regime)
    model, data = _to_device(model, data)
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step = (raw_loop if loop == "raw" else ftrain_loop)(model, steps * 2)
    base = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    _block(step, data, 0)
    _block(step, data, steps)
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    print(json.dumps({"peak_growth_mb": (peak - base) / 2**20}))


def memory_regime(regime: str, rounds: int) -> dict[str, float]:
    growth: dict[str, list[float]] = {"raw": [], "ftrain": []}
    for r in range(rounds):
        for loop in ["raw", "ftrain"] if r % 2 == 0 else ["ftrain", "raw"]:
            out = subprocess.run(
                [sys.executable, __file__, "--memory-child", regime, loop],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            growth[loop].append(json.loads(out.strip().splitlines()[-1])["peak_growth_mb"])
    raw, ours = statistics.median(growth["raw"]), statistics.median(growth["ftrain"])
    return {"raw_peak_mb": raw, "ftrain_peak_mb": ours, "mem_ratio": ours / raw}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--regime", choices=["tiny", "embedding", "llama", "all"], default="all")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--memory-rounds", type=int, default=2)
    p.add_argument("--memory-child", nargs=2, metavar=("REGIME", "LOOP"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    regimes = ["tiny", "embedding", "llama"] if args.regime == "all" else [args.regime]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'}"
    )
    print(
        "| regime | params (M) | raw ms/step | ftrain ms/step | time ratio | raw peak MB | "
        "ftrain peak MB | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for regime in regimes:
        t = time_regime(regime, args.rounds)
        m = memory_regime(regime, args.memory_rounds)
        print(
            f"| {regime} | {t['params_m']:.2f} | {t['raw_ms']:.2f} | {t['ftrain_ms']:.2f} | "
            f"{t['time_ratio']:.3f} | {m['raw_peak_mb']:.1f} | {m['ftrain_peak_mb']:.1f} | "
            f"{m['mem_ratio']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
