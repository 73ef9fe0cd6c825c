"""GPU: the README loop vs a raw loop at bf16 on a ~110M-parameter Llama; MFU; checkpoint stall.

    python bench/bench_gpu.py [--rounds 5] [--peak-tflops 989]

Needs CUDA (exits with a message otherwise). Both loops train their own copy of one Llama
(768 hidden, 12 layers, 12 heads, tied 32k embedding: ~110M parameters) on the same data with
bf16 autocast, AdamW (fused, wd 0.1), accumulation 2, clip 1.0: the raw loop with
`torch.autocast` and `torch.optim.AdamW(fused=True)`, ftrain with
`SingleDevice(precision="bf16")` and the README loop (`grads` bound across iterations).
Step times are medians of interleaved blocks; peak memory is `max_memory_allocated` growth
over the set-up baseline, each loop alone in a fresh subprocess. MFU uses HF's 6 * N FLOPs per
token over the peak given (989 TFLOP/s: H100/H200 dense bf16). The checkpoint stall is how long
`save_checkpoint(blocking=False)` holds the loop up, against a step's time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_loop import ACCUM, CLIP, WD, _block

import ftrain as ft

BS, SEQ, VOCAB, STEPS = 8, 1024, 32_000, 6


def build() -> tuple[torch.nn.Module, list[list[dict[str, torch.Tensor]]]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).cuda()
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS):
        micro = []
        for _ in range(ACCUM):
            ids = torch.randint(0, VOCAB, (BS, SEQ), generator=g).cuda()
            micro.append({"input_ids": ids, "labels": ids})
        data.append(micro)
    return model, data


def raw_loop(model: torch.nn.Module) -> Callable[[list[Any], int], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=WD, fused=True)

    def step(micro: list[Any], k: int) -> None:
        opt.zero_grad(set_to_none=True)
        for batch in micro:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()

    return step


def ftrain_loop(model: torch.nn.Module) -> tuple[Callable[[list[Any], int], None], dict]:
    strategy = ft.strategies.SingleDevice("cuda", precision="bf16")
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=WD), strategy=strategy)
    loop: dict[str, Any] = {"state": state, "grads": None}

    def step(micro: list[Any], k: int) -> None:
        state = loop["state"]
        loop["grads"], stats = ft.accumulate_grads(state, micro)
        loop["state"], _ = ft.clip_and_step(state, loop["grads"], stats=stats, lr=3e-4,
                                            max_norm=CLIP)  # fmt: skip

    return step, loop


def memory_child(loop: str) -> None:
    model, data = build()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step = raw_loop(model) if loop == "raw" else ftrain_loop(model)[0]
    _block(step, data, 0)
    _block(step, data, STEPS)
    print(json.dumps({"peak_mb": (torch.cuda.max_memory_allocated() - base) / 2**20}))


def memory(rounds: int) -> dict[str, float]:
    peaks: dict[str, list[float]] = {"raw": [], "ftrain": []}
    for r in range(rounds):
        for loop in ["raw", "ftrain"] if r % 2 == 0 else ["ftrain", "raw"]:
            out = subprocess.run([sys.executable, __file__, "--memory-child", loop], check=True,
                                 capture_output=True, text=True, timeout=900).stdout  # fmt: skip
            peaks[loop].append(json.loads(out.strip().splitlines()[-1])["peak_mb"])
    return {k: statistics.median(v) for k, v in peaks.items()}


def checkpoint_stall(loop: dict, data: list[Any], step_s: float, saves: int = 3) -> dict:
    """Time `save_checkpoint(blocking=False)` holds the loop, then the wait for the write.

    The first save also pins its host buffers (torch's caching host allocator keeps them for
    the next); later saves show the steady-state stall.
    """
    stalls, writes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(saves):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ft.save_checkpoint(loop["state"], tmp, blocking=False, keep_last=1)
            stalls.append(time.perf_counter() - t0)
            ft.wait_for_checkpoint()
            writes.append(time.perf_counter() - t0)
            loop["state"] = loop["state"].replace(step=loop["state"].step + 1)
    steady = statistics.median(stalls[1:]) if saves > 1 else stalls[0]
    return {
        "first_stall_ms": round(stalls[0] * 1e3, 1),
        "stall_ms": round(steady * 1e3, 1),
        "write_ms": round(statistics.median(writes) * 1e3, 1),
        "stall_in_steps": round(steady / step_s, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--memory-rounds", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--memory-child", choices=["raw", "ftrain"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    if args.memory_child:
        memory_child(args.memory_child)
        return
    model, data = build()
    ft_step, ft_loop = ftrain_loop(copy.deepcopy(model))
    loops = {"raw": raw_loop(copy.deepcopy(model)), "ftrain": ft_step}
    del model
    for step in loops.values():
        _block(step, data, 0)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in loops}
    for r in range(args.rounds):
        for name in list(loops) if r % 2 == 0 else list(reversed(loops)):
            times[name] += _block(loops[name], data, STEPS * (r + 1))
    med = {k: statistics.median(v) for k, v in times.items()}
    inner = ft_loop["state"].strategy.unwrap(ft_loop["state"].model)
    flops = ft.logging.flops_per_token(inner) * BS * SEQ * ACCUM
    n = sum(p.numel() for p in inner.parameters()) / 1e6
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Llama {n:.1f}M params, "
          f"bf16, batch {BS}x{SEQ} x accum {ACCUM}")  # fmt: skip
    print("| loop | ms/step | ratio | MFU |\n|---|---|---|---|")
    for k in loops:
        mfu = flops / med[k] / (args.peak_tflops * 1e12)
        print(f"| {k} | {med[k] * 1e3:.1f} | {med[k] / med['raw']:.3f} | {mfu:.3f} |")
    mem = memory(args.memory_rounds)
    print(f"peak memory growth MiB: raw {mem['raw']:.0f}, ftrain {mem['ftrain']:.0f}, "
          f"ratio {mem['ftrain'] / mem['raw']:.3f}")  # fmt: skip
    print("background checkpoint:", checkpoint_stall(ft_loop, data, med["ftrain"]))


if __name__ == "__main__":
    main()
