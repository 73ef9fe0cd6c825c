"""The README loop: a tiny Llama (built from a config) learns a small synthetic language.

python examples/minimal_loop.py [--steps 60]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ftrain as ft


def make_data(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Counting sequences of random length and start: easy to learn, ragged to batch."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, length = rng.randrange(1, 40), rng.randrange(4, 17)
        ids = [(start + i) % 60 + 1 for i in range(length)]
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def main(argv: list[str] | None = None) -> list[float]:
    args = argparse.ArgumentParser()
    args.add_argument("--steps", type=int, default=60)
    steps = args.parse_args(argv).steps
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )
    train_ds, val_ds = make_data(256, seed=0), make_data(64, seed=1)
    losses: list[float] = []

    # --- the loop ---------------------------------------------------------------------------
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.1), seed=0)
    lr = ft.schedules.warmup_cosine(peak_lr=3e-3, warmup_steps=5, total_steps=steps)
    while state.step < steps:
        for micro in ft.make_batches(train_ds, state, batch_size=8, accum=2):
            grads, stats = ft.accumulate_grads(state, micro)
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=1.0
            )
            if ft.should_log(state, every=10):
                losses.append(float(stats.loss))  # host sync, on log steps only
                print(f"step {state.step}  loss {losses[-1]:.4f}  norm {float(info.grad_norm):.3f}")
            if ft.should_eval(state, every=30, total_steps=steps):
                val = ft.evaluate(state, ft.make_batches(val_ds, batch_size=16, shuffle=False))
                print(f"step {state.step}  eval_loss {val['eval_loss']:.4f}")
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    # ----------------------------------------------------------------------------------------
    return losses


if __name__ == "__main__":
    main()
