"""Token classification (NER) with the README loop: a tiny BERT tagger built from a config.

What the Trainer does with `AutoModelForTokenClassification` and
`DataCollatorForTokenClassification`, offline: the default loss sees a `*ForTokenClassification`
model and scores each token's own tag (no shift), padding labels are -100, and
`ft.classification_metrics` gives per-token accuracy from the same forward pass as the loss
(`compute_metrics` without holding every prediction).

The toy task: sentences of word ids; a "name" is a capitalised id (>= 40) and its tag depends on
its left neighbour (B- after a non-name, I- after a name), so the tagger needs context.

python examples/token_classification.py [--steps 200]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import BertConfig, BertForTokenClassification

import ftrain as ft
from ftrain.extras.cli import at_least

TAGS = ["O", "B-NAME", "I-NAME"]
PAD, NAME0, VOCAB = 0, 40, 61


def make_data(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Rows of word ids and their tags; the first token (a [CLS]-like 1) is tagged -100."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.randrange(NAME0, VOCAB) if rng.random() < 0.3 else rng.randrange(2, NAME0)
                 for _ in range(rng.randrange(4, 12))]  # fmt: skip
        tags = [0 if w < NAME0 else 2 if i and words[i - 1] >= NAME0 else 1
                for i, w in enumerate(words)]  # fmt: skip
        rows.append({"input_ids": [1, *words], "labels": [-100, *tags]})
    return rows


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = argparse.ArgumentParser()
    args.add_argument("--steps", type=at_least(1), default=200)
    steps = args.parse_args(argv).steps
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=len(TAGS), pad_token_id=PAD,
    )  # fmt: skip
    model = BertForTokenClassification(config)
    train_ds, val_ds = make_data(2048, seed=0), make_data(256, seed=1)
    collate = ft.pad_collate(pad_id=PAD)  # labels padded with -100, attention mask built
    losses: list[float] = []

    # --- the loop ---------------------------------------------------------------------------
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.01), seed=0)
    lr = ft.schedules.from_name("linear", peak_lr=3e-3, warmup_steps=10, total_steps=steps)
    while state.step < steps:
        for micro in ft.make_batches(train_ds, state, batch_size=32, collate_fn=collate):
            grads, stats = ft.accumulate_grads(state, micro)  # per-token loss, no shift
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
    val = ft.make_batches(val_ds, batch_size=64, shuffle=False, collate_fn=collate)
    metrics = ft.evaluate(state, val, metrics_fn=ft.classification_metrics)
    print(f"eval_loss {metrics['eval_loss']:.4f}  token accuracy {metrics['eval_accuracy']:.4f}")
    return {"losses": losses, **metrics}


if __name__ == "__main__":
    main()
