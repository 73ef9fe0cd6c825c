"""SFT, then DPO on generated preference pairs: the preferred answers' likelihood margin grows.

The tiny Llama of examples/sft_lora.py (same config, trained from scratch here so that the run
is self-contained) first learns the three short-answer tasks of that example by supervised
fine-tuning. Preference pairs are then generated from the same tasks: the right answer is
preferred, a wrong one (e.g. "yes" for "no", "two" for "three") rejected. DPO trains the SFT
model against a frozen copy of itself (the reference), with `ft.preference.preference_loss`
as the loss of an ordinary ftrain loop. Reported: the mean log-likelihood margin
`log p(chosen) - log p(rejected)` on held-out pairs before and after DPO.

    python examples/dpo.py                          # minutes on CPU
    python examples/dpo.py --sft-steps 40 --dpo-steps 20   # margin 2.1 -> 9.7
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import random
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ftrain as ft
from ftrain.extras.cli import at_least

_SPEC = importlib.util.spec_from_file_location("sft_lora", Path(__file__).parent / "sft_lora.py")
assert _SPEC is not None and _SPEC.loader is not None
sft_lora = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sft_lora)  # instructions(): the tasks of the SFT example

WRONG = {"yes": ["no"], "no": ["yes"], "one": ["two", "three"], "two": ["one", "three"],
         "three": ["one", "two"]}  # fmt: skip


def pairs(rows: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """One (prompt, chosen, rejected) triple per row: the right answer and a wrong one."""
    rng = random.Random(seed)
    return [{**r, "rejected": rng.choice(WRONG[r["output"]])} for r in rows]


def encode_pairs(collate: Any, rows: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    """Rows of `chosen_*` and `rejected_*` token ids, prompts masked with -100."""
    prompts = [ft.sft.alpaca(r) for r in rows]
    chosen = collate.encode_batch(prompts)
    rejected = collate.encode_batch(
        [{**p, "output": r["rejected"]} for p, r in zip(prompts, rows, strict=True)]
    )
    return [
        {
            "chosen_input_ids": c["input_ids"],
            "chosen_labels": c["labels"],
            "rejected_input_ids": r["input_ids"],
            "rejected_labels": r["labels"],
        }
        for c, r in zip(chosen, rejected, strict=True)
    ]


def pair_collate(pad_id: int) -> Any:
    """Pad the chosen and rejected sides separately (each with its own attention mask)."""
    pad = ft.pad_collate(pad_id=pad_id)

    def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for side in ("chosen", "rejected"):
            batch = pad([{k.removeprefix(f"{side}_"): v for k, v in r.items() if k.startswith(side)}
                         for r in rows])  # fmt: skip
            out.update({f"{side}_{k}": v for k, v in batch.items()})
        return out

    return collate


def _side(batch: dict[str, torch.Tensor], side: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(f"{side}_"): v for k, v in batch.items() if k.startswith(side)}


def margin(state: ft.TrainState, batches: Any) -> float:
    """Mean over pairs of log p(chosen answer) - log p(rejected answer) under the model."""
    total, n = 0.0, 0
    model = state.model
    model.eval()
    with torch.no_grad():
        for batch in batches:
            for b in batch:
                chosen = ft.preference.sequence_logps(model, _side(b, "chosen"))
                diff = chosen - ft.preference.sequence_logps(model, _side(b, "rejected"))
                total, n = total + float(diff.sum()), n + len(diff)
    model.train()
    return total / n


def train(state: ft.TrainState, data: Any, *, steps: int, lr: float, collate: Any,
          loss_fn: Any = None) -> ft.TrainState:  # fmt: skip
    """The README loop for `steps` steps at a warmup-constant lr."""
    schedule = ft.schedules.warmup_constant(lr, warmup_steps=max(1, steps // 10))
    start = state.step
    while state.step < start + steps:
        for micro in ft.make_batches(data, state, batch_size=16, collate_fn=collate):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=schedule(state.step - start),
                                        max_norm=1.0)  # fmt: skip
            if state.step >= start + steps:
                break
        else:
            state = ft.next_epoch(state)
    return state.replace(epoch=0, data=state.data.replace(cursor=0, position=None))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sft-steps", type=at_least(0), default=150)
    p.add_argument("--dpo-steps", type=at_least(0), default=60)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--dpo-lr", type=float, default=5e-4)
    p.add_argument("--rows", type=at_least(1), default=800, help="training rows (and pairs)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (sft_lora.py: 128)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    train_rows, eval_rows = (
        sft_lora.instructions(args.rows, args.seed),
        sft_lora.instructions(64, args.seed + 1),
    )
    texts = [ft.sft.alpaca(r)["input"] + r["output"] for r in train_rows] + ["yes no one two three"]
    tok = ft.sft.train_tokenizer(texts, vocab_size=512)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    collate = ft.sft.SFTCollator(tok, source_max_len=96, target_max_len=8)

    # 1. SFT on the right answers.
    sft_data = collate.encode_batch([ft.sft.alpaca(r) for r in train_rows])
    state = ft.TrainState.create(
        LlamaForCausalLM(config), ft.optim.adamw(weight_decay=0.0), seed=args.seed
    )
    state = train(state, sft_data, steps=args.sft_steps, lr=3e-3, collate=collate)

    # 2. DPO against a frozen copy of the SFT model.
    to_pairs = pair_collate(tok.pad_token_id)
    dpo_data = encode_pairs(collate, pairs(train_rows, args.seed))
    held_out = encode_pairs(collate, pairs(eval_rows, args.seed + 1))
    evals = lambda: ft.make_batches(held_out, batch_size=32, shuffle=False, collate_fn=to_pairs)  # noqa: E731
    before = margin(state, evals())
    reference = copy.deepcopy(state.model).eval().requires_grad_(False)
    loss_fn = ft.preference.preference_loss(
        functools.partial(ft.preference.dpo_loss, beta=args.beta), reference=reference
    )
    state = ft.TrainState.create(state.model, ft.optim.adamw(weight_decay=0.0), seed=args.seed)
    state = train(state, dpo_data, steps=args.dpo_steps, lr=args.dpo_lr, collate=to_pairs,
                  loss_fn=loss_fn)  # fmt: skip
    after = margin(state, evals())
    print(f"held-out log-likelihood margin chosen - rejected: {before:.3f} after SFT -> "
          f"{after:.3f} after DPO ({args.dpo_steps} steps, beta {args.beta})")  # fmt: skip
    return {"margin_sft": before, "margin_dpo": after}


if __name__ == "__main__":
    main()
