"""GRPO in the README loop: a tiny Llama, from scratch, learns to add two small numbers.

Prompts are `a + b =` with a, b in 0..4 (one token per symbol); a completion earns 1 when its
first token is the digit of a + b, and 0.25 more when it is exactly that digit and the end
token (two plain-Python reward functions, summed as TRL sums them). Each step samples
`--generations` completions per prompt (`ft.rl.sample`), scores them, turns the rewards into
group-normalised advantages, and makes `--iterations` clipped-policy updates with the sampling
log-probs kept as the old ones, a k3 KL penalty to the frozen starting model (`--beta`) and
DAPO's asymmetric clipping. It checkpoints into `--root` and resumes from it bit for bit.

    python examples/grpo_addition.py                    # ~1 min on a 2-core CPU
    python examples/grpo_addition.py --log runs/grpo/metrics.jsonl
    python -m ftrain plot runs/grpo/metrics.jsonl --metrics reward -o grpo.png
"""

from __future__ import annotations

import argparse
import copy
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ftrain as ft
from ftrain.extras.cli import at_least

PAD, EOS, PLUS, EQUALS, ZERO = 0, 1, 2, 3, 4  # digits d are token ZERO + d
MAX_NEW_TOKENS = 3


def make_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """`a + b =` prompts with their row number (`index`: what seeds their completions)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(5), rng.randrange(5)
        rows.append({"input_ids": [ZERO + a, PLUS, ZERO + b, EQUALS], "index": i})
    return rows


def correct(prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[float]:
    """1 when the completion starts with the digit of a + b."""
    return [
        float(bool(c) and c[0] == p[0] + p[2] - ZERO)
        for p, c in zip(prompts, completions, strict=True)
    ]


def formatted(prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[float]:
    """0.25 when the completion is exactly one digit and the end token."""
    return [0.25 * (len(c) == 2 and ZERO <= c[0] < ZERO + 10 and c[1] == EOS) for c in completions]


REWARDS: tuple[Callable[..., list[float]], ...] = (correct, formatted)


def score(rollout: ft.rl.Rollout) -> torch.Tensor:
    """The summed rewards of each completion (prompt and completion tokens, padding dropped)."""
    prompts = [
        ids[m.bool()].tolist()
        for ids, m in zip(rollout.prompt_ids, rollout.prompt_mask, strict=True)
    ]
    done = [
        ids[m.bool()].tolist()
        for ids, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
    ]
    per_fn = [fn(prompts, done) for fn in REWARDS]
    return torch.tensor([sum(r) for r in zip(*per_fn, strict=True)])


def build_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    return model


def train(
    state: ft.TrainState,
    prompts: list[dict[str, Any]],
    *,
    reference: Any,
    args: Any,
    on_rollout: Callable[..., None] | None = None,
) -> ft.TrainState:
    """The README loop: sample -> score -> advantages -> accumulate_grads -> clip_and_step."""
    G, steps = args.generations, args.steps
    loss_fn = ft.rl.policy_loss(
        loss_type=args.loss_type,
        beta=args.beta,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=MAX_NEW_TOKENS,
    )
    while state.step < steps:
        for micro in ft.make_batches(prompts, state, batch_size=args.prompts, accum=1):
            rollouts = [
                ft.rl.sample(
                    state,
                    p,
                    index=p["index"],
                    num_generations=G,
                    max_new_tokens=MAX_NEW_TOKENS,
                    temperature=1.0,
                )
                for p in micro
            ]
            rewards = [score(r) for r in rollouts]
            advantages = [ft.rl.group_advantages(r, G) for r in rewards]
            batches = ft.rl.rollout_batches(rollouts, advantages, micro, reference=reference)
            if on_rollout is not None:
                on_rollout(state, rollouts, rewards)
            # later updates reuse the rollouts: the data is counted once
            for i in range(args.iterations):
                grads, stats = ft.accumulate_grads(state, batches, loss_fn)
                state, _ = ft.clip_and_step(
                    state,
                    grads,
                    lr=args.lr,
                    max_norm=1.0,
                    stats=stats if i == args.iterations - 1 else None,
                )
            if args.root and ft.should_save(state, every=args.iterations * args.save_every):
                ft.save_checkpoint(state, args.root, keep_last=2)
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return state


def check_resume(args: Any, state: ft.TrainState, ckpt: Path) -> None:
    """Refuse a resume that would not continue the checkpoint's run (flags it would ignore)."""
    if state.seed != args.seed:  # the prompts, the completions and the reference follow it
        raise ValueError(
            f"--seed {args.seed}, but {ckpt} was trained with --seed {state.seed}; pass "
            f"--seed {state.seed}, or another --root"
        )
    if state.step % args.iterations:  # saves fall on multiples of --iterations: none would
        raise ValueError(
            f"--iterations {args.iterations}, but {ckpt} is at step {state.step}, not a multiple "
            "of it (another --iterations made it): pass the run's --iterations"
        )


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=at_least(1), default=200, help="optimizer updates")
    p.add_argument("--prompts", type=at_least(1), default=32, help="prompts per rollout batch")
    p.add_argument(  # one completion per prompt: every group advantage is 0
        "--generations", type=at_least(2), default=8, help="completions per prompt (G), >= 2"
    )
    p.add_argument("--iterations", type=at_least(1), default=2, help="updates per rollout batch")
    p.add_argument("--loss-type", default="dapo", choices=["grpo", "bnpo", "dr_grpo", "dapo"])
    p.add_argument("--beta", type=float, default=0.04, help="KL penalty to the starting model")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default=None, help="checkpoint folder (resumes from it)")
    p.add_argument(
        "--save-every", type=at_least(1), help="with --root: rollout batches between saves (5)"
    )
    p.add_argument("--log", type=Path, default=None, help="JSONL of the mean reward per step")
    args = p.parse_args(argv)
    if args.steps % args.iterations:  # every rollout batch makes --iterations updates
        p.error(f"--steps {args.steps} is not a multiple of --iterations {args.iterations}")
    if args.save_every is not None and not args.root:
        p.error(f"--save-every {args.save_every} saves into --root: pass --root DIR")
    args.save_every = args.save_every or 5

    model = build_model(args.seed)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if args.beta else None
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.0), seed=args.seed)
    if args.root and (ckpt := ft.latest_checkpoint(args.root)) is not None:
        state = ft.load_checkpoint(ckpt, state)
        check_resume(args, state, ckpt)
    curve: list[float] = []

    def log(state: ft.TrainState, rollouts: Any, rewards: list[torch.Tensor]) -> None:
        mean = float(torch.cat(rewards).mean())  # host sync: rewards are host values anyway
        curve.append(mean)
        print(f"step {state.step:4d}  mean reward {mean:.3f}")
        if args.log is not None:
            args.log.parent.mkdir(parents=True, exist_ok=True)
            with open(args.log, "a") as f:
                f.write(json.dumps({"step": state.step, "reward": mean}) + "\n")

    train(state, make_prompts(512, args.seed), reference=reference, args=args, on_rollout=log)
    return curve


if __name__ == "__main__":
    main()
