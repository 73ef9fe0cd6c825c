"""Pretrain a small Llama on a streamed, sharded corpus: the README loop with a stream.

The shipped Tiny Shakespeare text is written as sharded local parquet (or jsonl) files, read
back through `datasets` streaming, tokenized per character on the fly, packed into blocks of
`--block-size` tokens and loaded by background workers. Checkpoints carry the stream position
(JSON inside state.json), so a run killed at any step and started again continues exactly:

python examples/pretrain_stream.py --out runs/stream --steps 200
python examples/pretrain_stream.py --out runs/stream --steps 200   # resumes, if stopped
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ftrain as ft

TEXT = Path(__file__).parent / "data" / "tinyshakespeare.txt"


def write_shards(directory: Path, *, shards: int, fmt: str, max_chars: int | None) -> list[str]:
    """Split the text into speeches (blank-line separated) and write them round-robin."""
    speeches = TEXT.read_text(encoding="utf-8")[:max_chars].split("\n\n")
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(shards):
        rows = [{"text": s + "\n\n"} for s in speeches[k::shards]]
        path = directory / f"part-{k:03d}.{fmt}"
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths.append(str(path))
    return paths


def shards_for(directory: Path, *, shards: int, fmt: str, max_chars: int | None) -> list[str]:
    """The shards `--shards/--format/--max-chars` describe: written once, then reused; shards
    written with other flags (a reused --out) raise instead of being read as these."""
    flags = {"shards": shards, "format": fmt, "max_chars": max_chars}
    manifest = directory / "shards.json"
    found = sorted(directory.glob("part-*.*"))
    if not found:
        paths = write_shards(directory, shards=shards, fmt=fmt, max_chars=max_chars)
        manifest.write_text(json.dumps(flags), encoding="utf-8")
        return paths
    made = (  # a folder from before the manifest: its count and format tell that much
        json.loads(manifest.read_text(encoding="utf-8")) if manifest.exists()
        else {"shards": len(found), "format": found[0].suffix[1:], "max_chars": max_chars}
    )  # fmt: skip
    if diff := [k for k in flags if made.get(k) != flags[k]]:
        said = ", ".join(f"--{k.replace('_', '-')} {made.get(k)}" for k in diff)
        asked = ", ".join(f"--{k.replace('_', '-')} {flags[k]}" for k in diff)
        raise ValueError(
            f"{directory} holds shards written with {said}, not {asked}: a resumed run reads "
            "the data it started on; pass those flags, or another --out"
        )
    return [str(p) for p in found]


def load_stream(paths: list[str], fmt: str, vocab: dict[str, int]) -> Any:
    """A `datasets` streaming dataset of token ids (one shard per parquet row group)."""
    import datasets

    fmt_name = "parquet" if fmt == "parquet" else "json"
    ds = datasets.load_dataset(fmt_name, data_files=paths, streaming=True, split="train")
    if fmt == "parquet":
        ds = ds.reshard()  # shards are row groups: resuming re-reads at most one of them

    def tokenize(row: dict[str, str]) -> dict[str, list[int]]:
        return {"input_ids": [vocab[c] for c in row["text"]]}

    return ds.map(tokenize, remove_columns=["text"])


def build_model(vocab_size: int, block_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=block_size,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="run folder: data shards and checkpoints")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--max-chars", type=int, default=None, help="use the text's start only")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--stop-at", type=int, default=None, help="exit at this step (a kill)")
    args = p.parse_args(argv)
    if args.stop_at is not None and not 0 < args.stop_at < args.steps:  # it would never stop
        p.error(f"--stop-at {args.stop_at} is not a step before --steps {args.steps}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    out = Path(args.out)
    vocab = {c: i + 1 for i, c in enumerate(sorted(set(TEXT.read_text(encoding="utf-8"))))}
    paths = shards_for(out / "data", shards=args.shards, fmt=args.format, max_chars=args.max_chars)
    train_ds = ft.data.pack(load_stream(paths, args.format, vocab), block_size=args.block_size)
    model = build_model(len(vocab) + 1, args.block_size)
    steps, losses = args.steps, []

    # --- the loop (the README loop; only the dataset line differs) -----------------------------
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.1), seed=0)
    lr = ft.schedules.warmup_cosine(peak_lr=3e-3, warmup_steps=10, total_steps=steps)
    if (ckpt := ft.latest_checkpoint(out)) is not None:
        state = ft.load_checkpoint(ckpt, state)
        print(f"resumed from {ckpt} (epoch {state.epoch}, micro-batch {state.data.cursor})")
        if args.stop_at is not None and args.stop_at <= state.step:  # passed: it would not stop
            raise ValueError(f"--stop-at {args.stop_at}, but {ckpt} is at step {state.step}")
    while state.step < steps:
        for micro in ft.make_batches(
            train_ds, state, batch_size=args.batch_size, accum=args.accum, num_workers=args.workers,
        ):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro)
            state, info = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step), max_norm=1)
            if ft.should_log(state, every=args.log_every):
                losses.append(float(stats.loss))  # host sync, on log steps only
                print(f"step {state.step}  loss {losses[-1]:.4f}  norm {float(info.grad_norm):.3f}")
            if ft.should_save(state, every=args.save_every, total_steps=steps):
                ft.save_checkpoint(state, out, keep_last=2)
            if state.step in (steps, args.stop_at):
                break
        else:
            state = ft.next_epoch(state)
        if state.step == args.stop_at:
            return {"stopped": state.step}
    # -------------------------------------------------------------------------------------------
    params = {n: p.detach().clone() for n, p in state.params.items()}
    cursor = int(state.data.cursor)
    return {"losses": losses, "params": params, "epoch": state.epoch, "cursor": cursor}


if __name__ == "__main__":
    main()
