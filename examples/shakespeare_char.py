"""Train a character-level GPT on Tiny Shakespeare with an explicit ftrain loop.

nanoGPT's CPU configuration of `shakespeare_char` (4 layers, 4 heads, 128-dim embeddings, block
64, batch 12, lr 1e-3 with 100 warmup steps and cosine decay to 1e-4 at 2000 iterations, AdamW
betas (0.9, 0.99), weight decay 0.1, clip 1.0, dropout 0), on an HF GPT-2 built from a config.
The text ships in the repo (examples/data/tinyshakespeare.txt); nothing is downloaded.

    python examples/shakespeare_char.py                 # full run, prints val_loss=... at the end
    python examples/shakespeare_char.py --max-iters 50  # a quick look
    torchrun --nproc_per_node 2 examples/shakespeare_char.py --strategy ddp   # 2 processes
    torchrun --nproc_per_node 2 examples/shakespeare_char.py --strategy fsdp  # sharded
    python examples/shakespeare_char.py --precision bf16 --compile            # faster kernels

The loop is the same for every strategy, precision and compilation: only the objects handed to
`TrainState.create` change.

Checkpoints go to `--out` (default runs/shakespeare_char) at every evaluation, written in the
background; the newest and the best by eval_loss are kept. Run the command again after an
interruption and it resumes exactly where the last checkpoint left off. The final model is
exported to `<out>/final`, loadable with `GPT2LMHeadModel.from_pretrained`. Logs go to a progress
bar in a terminal (printed lines otherwise) and to `<out>/metrics.jsonl`; draw them with
`python -m ftrain plot runs/shakespeare_char/metrics.jsonl -o curves.png`.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import ftrain as ft

DATA = Path(__file__).parent / "data" / "tinyshakespeare.txt"


class CharWindows(torch.utils.data.Dataset):
    """Every window of `block` characters, with the next character of each position as target."""

    def __init__(self, ids: np.ndarray, block: int) -> None:
        self.ids, self.block = torch.from_numpy(ids), block

    def __len__(self) -> int:
        return len(self.ids) - self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i : i + self.block], self.ids[i + 1 : i + 1 + self.block]


def next_char_loss(model: torch.nn.Module, batch: list[torch.Tensor]):
    """Sum of next-character cross-entropies and their count (targets are already shifted)."""
    x, y = batch
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"), y.new_tensor(
        y.numel()
    )


def load(path: Path, block: int) -> tuple[CharWindows, CharWindows, int]:
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    lookup = np.zeros(max(map(ord, chars)) + 1, dtype=np.int64)
    lookup[[ord(c) for c in chars]] = np.arange(len(chars))
    ids = lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    split = int(0.9 * len(ids))  # nanoGPT's 90/10 split
    return CharWindows(ids[:split], block), CharWindows(ids[split:], block), len(chars)


def train_and_export(args, model, optimizer, strategy, train, val) -> float:
    """Train (resuming from the newest checkpoint), evaluate, export; return the val loss."""
    state = ft.TrainState.create(model, optimizer, seed=args.seed, strategy=strategy)
    main_rank, world = state.strategy.rank == 0, state.strategy.world_size
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by {world} ranks")
    batch_size = args.batch_size // world  # per rank: the global batch stays the same
    lr = ft.schedules.cosine_with_min_lr(1e-3, 100, args.max_iters, min_lr=1e-4)
    if args.out and (ckpt := ft.latest_checkpoint(args.out)) is not None:
        state = ft.load_checkpoint(ckpt, state)
        if main_rank:
            print(f"resumed from {ckpt} (step {state.step})", flush=True)

    def val_loss(iters: int) -> float:
        batches = ft.make_batches(  # a fixed random subset, split over the ranks
            val, batch_size=batch_size, seed=0, strategy=state.strategy
        )
        subset = (b for _, b in zip(range(iters), batches, strict=False))
        return ft.evaluate(state, subset, next_char_loss)["eval_loss"]

    # A progress bar in a terminal, printed lines otherwise (rank 0 only); JSONL on rank 0.
    jsonl = (
        ft.logging.JSONLSink(Path(args.out) / "metrics.jsonl") if args.out and main_rank else None
    )
    logger = ft.logging.Logger(
        state, every=args.log_interval, total_steps=args.max_iters, sinks=[jsonl] if jsonl else [],
        epoch_size=ft.data.num_micro_batches(len(train), batch_size, world_size=world),
    )  # fmt: skip
    start = time.perf_counter()
    while state.step < args.max_iters:
        for micro in ft.make_batches(
            train,
            batch_size=batch_size,
            seed=args.seed,
            epoch=state.epoch,
            start=state.cursor,
            strategy=state.strategy,
        ):
            grads, stats = ft.accumulate_grads(state, micro, next_char_loss)
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=1.0
            )
            logger.step(state, stats, info)  # reads the device back on log steps only
            if ft.should_eval(state, every=args.eval_interval, total_steps=args.max_iters):
                metrics = {"eval_loss": val_loss(args.eval_iters)}
                logger.log({"step": state.step, **metrics})
                if args.out:  # in the background, except the last save of the run
                    ft.save_checkpoint(
                        state, args.out, metrics=metrics, keep_last=args.keep_last,
                        best_metric="eval_loss", blocking=state.step >= args.max_iters,
                    )  # fmt: skip
            if state.step >= args.max_iters:
                break
        else:
            state = ft.next_epoch(state)
    logger.close()
    final = val_loss(args.final_eval_iters)
    if args.out:  # on every rank: FSDP gathers the shards, rank 0 writes
        ft.export_pretrained(state, Path(args.out) / "final", overwrite=True)
    if main_rank:
        print(f"train_time={time.perf_counter() - start:.1f}s")
        print(f"val_loss={final:.4f}")
    return final


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=20, help="batches per periodic evaluation")
    p.add_argument(
        "--final-eval-iters", type=int, default=200, help="batches for the final val_loss"
    )
    p.add_argument("--log-interval", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=12, help="global: split over the ranks")
    p.add_argument(
        "--strategy",
        choices=["single", "ddp", "fsdp"],
        default="single",
        help="ddp/fsdp: data parallel (fsdp: sharded) across the processes torchrun starts",
    )
    p.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="autocast dtype"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", default="runs/shakespeare_char", help="checkpoints; '' for none")
    p.add_argument("--keep-last", type=int, default=1, help="newest checkpoints kept (+ the best)")
    args = p.parse_args(argv)

    train, val, vocab = load(args.data, args.block_size)
    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=args.block_size,
        n_embd=128,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    optimizer = ft.optim.adamw(betas=(0.9, 0.99), weight_decay=0.1, mask=ft.optim.decay_mask(model))
    if args.strategy == "single":
        strategy = ft.strategies.SingleDevice(precision=args.precision)
    else:
        strategy = ft.strategies.from_env(args.strategy, precision=args.precision)
    if args.compile:
        model = torch.compile(model)  # parameter names stay the model's own
    with strategy:  # leaves the process group in order on every rank, also after an error
        final = train_and_export(args, model, optimizer, strategy, train, val)
    return final if math.isfinite(final) else float("nan")


if __name__ == "__main__":
    main()
