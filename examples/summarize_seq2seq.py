"""Seq2seq with the README loop: a tiny T5 (built from a config) learns to reverse digit strings.

What `Seq2SeqTrainer` does for summarization or translation, offline: the default loss sees an
encoder-decoder model and uses its own label alignment (no shift; decoder inputs built from the
labels), and `ft.generate` completes held-out inputs greedily, as `predict_with_generate=True`.

python examples/summarize_seq2seq.py [--steps 300]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import T5Config, T5ForConditionalGeneration

import ftrain as ft
from ftrain.extras.cli import at_least

PAD, EOS, DIGIT0 = 0, 1, 3  # ids 3..12 are the digits 0..9


def make_data(n: int, seed: int) -> list[dict[str, list[int]]]:
    """A digit string and its reverse (then end-of-sequence) as the target."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [DIGIT0 + rng.randrange(10) for _ in range(rng.randrange(3, 9))]
        rows.append({"input_ids": ids, "labels": [*ids[::-1], EOS]})
    return rows


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = argparse.ArgumentParser()
    args.add_argument("--steps", type=at_least(1), default=300)
    steps = args.parse_args(argv).steps
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=16, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config)
    train_ds, val_ds = make_data(2048, seed=0), make_data(64, seed=1)
    losses: list[float] = []

    # --- the loop ---------------------------------------------------------------------------
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.0), seed=0)
    lr = ft.schedules.from_name("linear", peak_lr=3e-3, warmup_steps=10, total_steps=steps)
    while state.step < steps:
        for micro in ft.make_batches(train_ds, state, batch_size=16, accum=2):
            grads, stats = ft.accumulate_grads(state, micro)  # seq2seq: labels not shifted
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=1.0
            )
            if ft.should_log(state, every=20):
                losses.append(float(stats.loss))  # host sync, on log steps only
                print(f"step {state.step}  loss {losses[-1]:.4f}  norm {float(info.grad_norm):.3f}")
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    # ----------------------------------------------------------------------------------------
    val = ft.evaluate(state, ft.make_batches(val_ds, batch_size=32, shuffle=False))
    prompts = ft.make_batches(val_ds, batch_size=32, shuffle=False)
    outputs = [
        ids for b in ft.generate(state, prompts, max_new_tokens=10) for ids in b["token_ids"]
    ]
    exact = sum(out == row["labels"] for out, row in zip(outputs, val_ds, strict=True))
    print(f"eval_loss {val['eval_loss']:.4f}  reversed exactly {exact}/{len(val_ds)}")
    return {"losses": losses, "eval_loss": val["eval_loss"], "exact": exact / len(val_ds)}


if __name__ == "__main__":
    main()
