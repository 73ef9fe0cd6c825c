"""Supervised fine-tuning with LoRA, qlora.py's recipe as an explicit ftrain loop.

A tiny Llama (built from a config) learns a small generated instruction dataset in alpaca
format: prompts masked out of the loss, LoRA on every linear layer but the head, constant LR
with warmup, clip 0.3, gradient checkpointing, adapters saved at every checkpoint, then greedy
completions of held-out prompts. qlora.py's length grouping is `--group-by-length`. It is off
by default: HF's order sorts each megabatch of 50 batches by length, and on this small
three-task set that serves one task for dozens of steps in a row. With it on, the adapters
learn the answer format but not the answers (accuracy 0.46 against 0.87; bench/RESULTS.md).
Everything is offline: the tokenizer is a byte-level BPE trained on the spot on Tiny
Shakespeare and the instructions.

LoRA adapts a *pretrained* model, so the example first pretrains its base briefly on Tiny
Shakespeare (a plain ftrain loop, saved to `<out>/base` with the tokenizer and reused by later
runs). Such a tiny, briefly trained base has a small logit range: with its head frozen, LoRA
stalls at an eval loss near 3 on these two-token answers, so the head is trained too
(`modules_to_save=["lm_head"]`, saved with the adapter); real LLMs do not need that.

    python examples/sft_lora.py                     # about 35 s on 2 CPU cores
    python examples/sft_lora.py --qlora             # 4-bit NF4 base (pip install 'ftrain[qlora]')

Run it again and it resumes from its last checkpoint. docs/migrating_from_trainer.md puts this
loop next to qlora.py's `train()`.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import ftrain as ft
from ftrain.extras.cli import at_least

TEXT = Path(__file__).parent / "data" / "tinyshakespeare.txt"


def instructions(n: int, seed: int) -> list[dict[str, str]]:
    """Alpaca-style rows of three tasks with short answers: is a line of Shakespeare a
    question, is it shouted (upper case), and how many words (one to three) are given."""
    rng = random.Random(seed)
    text = TEXT.read_text()
    words = sorted({w.strip(".,;:!?'").lower() for w in text.split()} - {""})
    words = [w for w in words if w.isalpha() and 3 <= len(w) <= 7]
    lines = [ln.strip() for ln in text.splitlines() if 12 < len(ln.strip()) < 60]
    lines = [ln for ln in lines if ln[-1] in ".?" and not ln.isupper()]
    rows = []
    for _ in range(n):
        task, line = rng.randrange(3), rng.choice(lines)
        if task == 0:
            answer = "yes" if line.endswith("?") else "no"
            rows.append({"instruction": "Is it a question?", "input": line, "output": answer})
        elif task == 1:
            shout = rng.random() < 0.5
            rows.append({"instruction": "Is it shouted?", "input": line.upper() if shout else line,
                         "output": "yes" if shout else "no"})  # fmt: skip
        else:
            k = rng.randint(1, 3)
            rows.append({"instruction": "How many words?", "input": " ".join(rng.sample(words, k)),
                         "output": ["one", "two", "three"][k - 1]})  # fmt: skip
    return rows


def pretrain_base(out: Path, rows: list[dict[str, str]], steps: int, seed: int) -> None:
    """A tokenizer and a tiny Llama pretrained on Tiny Shakespeare: the base to adapt."""
    text = TEXT.read_text()[:400_000]
    prompts = [ft.sft.alpaca(r)["input"] for r in rows[:300]]  # the prompts' words get tokens
    tok = ft.sft.train_tokenizer([text, *prompts], vocab_size=1024)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    windows = [{"input_ids": w, "labels": w} for w in ids[: len(ids) // 64 * 64].view(-1, 64)]
    state = ft.TrainState.create(LlamaForCausalLM(config), ft.optim.adamw(), seed=seed)
    lr = ft.schedules.warmup_cosine(3e-3, warmup_steps=20, total_steps=steps)
    for micro in ft.make_batches(windows, batch_size=32, seed=seed):
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step), max_norm=1.0)
        if state.step >= steps:
            break
    print(f"pretrained the base for {steps} steps: loss {float(stats.loss):.3f}")
    state.model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "pretrain_steps.txt").write_text(f"{steps}\n")  # what a later run may compare


def pretrained_steps(base: Path) -> int | None:
    """The steps `base` was pretrained for (None for a base made before this was recorded)."""
    record = base / "pretrain_steps.txt"
    return int(record.read_text()) if record.is_file() else None


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=at_least(1), default=250)
    p.add_argument("--batch-size", type=at_least(1), default=16)  # per_device_train_batch_size
    p.add_argument("--accum", type=at_least(1), default=1)  # gradient_accumulation_steps
    p.add_argument("--lr", type=float, default=2e-3)  # learning_rate (tiny model: higher)
    p.add_argument("--lora-r", type=at_least(1), default=16)
    p.add_argument("--eval-every", type=at_least(1), default=50)
    p.add_argument("--pretrain-steps", type=at_least(1), default=300, help="for the base, once")
    p.add_argument("--qlora", action="store_true", help="4-bit NF4 base weights (bitsandbytes)")
    p.add_argument(
        "--stop-at", type=at_least(1), help="leave after this step, as a job time limit would"
    )
    p.add_argument("--group-by-length", action="store_true", help="HF's length-grouped order")
    p.add_argument("--out", default="runs/sft_lora", help="checkpoints and adapters")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    train_rows, eval_rows = instructions(2000, args.seed), instructions(100, args.seed + 1)
    base = Path(args.out) / "base"
    if not (base / "config.json").is_file():
        pretrain_base(base, train_rows, args.pretrain_steps, args.seed)
    elif (made := pretrained_steps(base)) not in (None, args.pretrain_steps):
        raise ValueError(  # the base is made once and reused: another count would not act
            f"--pretrain-steps {args.pretrain_steps}, but {base} holds a base pretrained for "
            f"{made} steps (made once, reused); pass --pretrain-steps {made}, or delete {base}"
        )
    tok = AutoTokenizer.from_pretrained(base)

    # Data: alpaca rows -> {input, output} -> token ids with the prompt masked (qlora.py).
    collate = ft.sft.SFTCollator(tok, source_max_len=128, target_max_len=32)
    train = collate.encode_batch([ft.sft.alpaca(r) for r in train_rows])
    evals = collate.encode_batch([ft.sft.alpaca(r) for r in eval_rows])

    # Model: the base, in 4 bits for QLoRA; LoRA on every linear layer but the head.
    if args.qlora:
        model = ft.lora.load_4bit(base, compute_dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(base)
        model.config.use_cache = False
        ft.lora.enable_checkpointing(model)  # gradient_checkpointing=True
    torch.manual_seed(args.seed)
    model = ft.lora.apply(model, r=args.lora_r, alpha=2 * args.lora_r, dropout=0.05,
                          modules_to_save=["lm_head"])  # fmt: skip

    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.0), seed=args.seed)
    lr = ft.schedules.warmup_constant(args.lr, warmup_steps=int(0.03 * args.max_steps))
    if (ckpt := ft.latest_checkpoint(args.out)) is not None:
        state = ft.load_checkpoint(ckpt, state)
        if state.seed != args.seed:  # --seed draws the rows: another would train on other data
            raise ValueError(
                f"--seed {args.seed}, but {ckpt} was trained with --seed {state.seed} (it also "
                f"draws the instructions); pass --seed {state.seed}, or another --out"
            )
        print(f"resumed from {ckpt} (step {state.step})")

    def eval_loss() -> float:
        batches = ft.make_batches(evals, batch_size=32, shuffle=False, collate_fn=collate)
        return ft.evaluate(state, batches)["eval_loss"]

    lengths = [len(r["input_ids"]) for r in train]
    first, start = eval_loss(), time.perf_counter()
    print(f"step {state.step:4d}  eval_loss {first:.4f}")
    stop = min(args.max_steps, args.stop_at or args.max_steps)
    while state.step < stop:
        for micro in ft.make_batches(
            train, state, batch_size=args.batch_size, accum=args.accum, collate_fn=collate,
            group_by_length=args.group_by_length,
            lengths=lengths if args.group_by_length else None,
        ):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step), max_norm=0.3)
            if ft.should_eval(state, every=args.eval_every, total_steps=args.max_steps):
                metrics = {"eval_loss": eval_loss()}
                print(
                    f"step {state.step:4d}  loss {float(stats.loss):.4f}  "
                    f"eval_loss {metrics['eval_loss']:.4f}  {time.perf_counter() - start:.0f}s"
                )
                ft.save_checkpoint(state, args.out, metrics=metrics, keep_last=1)  # adapters
            if state.step >= stop:
                break
        else:
            state = ft.next_epoch(state)
    if state.step < args.max_steps:  # stopped early: the checkpoint is where to continue from
        ft.save_checkpoint(state, args.out, keep_last=1)
        return {"first": first, "final": eval_loss(), "accuracy": float("nan")}
    final = eval_loss()
    ft.export_pretrained(state, Path(args.out) / "adapter", tokenizer=tok, overwrite=True)

    # Greedy completions of the held-out prompts (predict_with_generate), batched and, with
    # several ranks, gathered in dataset order.
    prompts = [{"input_ids": [tok.bos_token_id, *tok(ft.sft.alpaca(r)["input"])["input_ids"]]}
               for r in eval_rows]  # fmt: skip
    completions = ft.generate(state, ft.make_batches(prompts, batch_size=32, shuffle=False),
                              tokenizer=tok, max_new_tokens=4, do_sample=False)  # fmt: skip
    answers = [text.strip() for batch in completions for text in batch["text"]]
    right = sum(a == r["output"] for a, r in zip(answers, eval_rows, strict=True))
    for row, answer in list(zip(eval_rows, answers, strict=True))[:4]:
        print(f"{row['instruction']} {row['input']!r} -> {answer!r} (want {row['output']!r})")
    accuracy = right / len(eval_rows)
    print(f"eval_loss={final:.4f} (from {first:.4f}), accuracy={accuracy:.2f} on {len(eval_rows)}")
    return {"first": first, "final": final, "accuracy": accuracy}


if __name__ == "__main__":
    main()
