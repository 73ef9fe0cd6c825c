"""Workers for the 2-process GRPO test (spawned; they must live in an importable module).

Three prompts with G = 4 completions each make 12 completions; rank r samples completions
6r .. 6r+5, so prompt 1's group lies on both ranks. Rewards are scored where sampled, the
advantages grouped over both ranks, and two updates (grpo, then dapo with a KL to a frozen
reference) made under DDP. `run(None)` is the same step in one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

import ftrain as ft
from helpers import tiny_llama

G = 4
PROMPTS = torch.tensor([[0, 0, 5, 9, 14], [7, 3, 22, 8, 40], [0, 31, 2, 17, 6]])
MAX_NEW = 6


def model() -> torch.nn.Module:
    m = tiny_llama(dtype=torch.float64)
    m.generation_config.pad_token_id, m.generation_config.eos_token_id = 0, 6
    return m


def reward(completion_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain Python on the host: the share of even tokens in each completion."""
    rows = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, mask, strict=True)]
    return torch.tensor([sum(t % 2 == 0 for t in r) / len(r) for r in rows], dtype=torch.float64)


def run(strategy: ft.strategies.Strategy | None) -> dict:
    """Sample this rank's completions, score, group, update twice; what the step produced."""
    rank, world = (0, 1) if strategy is None else (strategy.rank, strategy.world_size)
    ref = model().eval().requires_grad_(False)
    state = ft.TrainState.create(
        model(), ft.optim.adamw(), seed=3, strategy=strategy or ft.strategies.SingleDevice()
    )
    if world == 1:
        prompts, index, g = PROMPTS, [0, 1, 2], G
    else:  # my completions' numbers, each from its own prompt row
        share = len(PROMPTS) * G // world
        index = list(range(rank * share, (rank + 1) * share))
        prompts, g = PROMPTS[[c // G for c in index]], 1
    batch = {"input_ids": prompts, "attention_mask": (prompts != 0).long()}
    rollout = ft.rl.sample(state, batch, index=index, num_generations=g, max_new_tokens=MAX_NEW)
    rewards = reward(rollout.completion_ids, rollout.completion_mask)
    adv = ft.rl.group_advantages(rewards, G, strategy=state.strategy)
    micro = ft.rl.rollout_batches([rollout], [adv], reference=ref)
    for loss_type in ("grpo", "dapo"):
        loss_fn = ft.rl.policy_loss(loss_type=loss_type, beta=0.04)
        grads, stats = ft.accumulate_grads(state, micro, loss_fn)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2, max_norm=1.0)
    width = rollout.completion_ids.shape[1]
    ids = torch.nn.functional.pad(rollout.completion_ids, (0, MAX_NEW - width), value=-1)
    return {
        "ids": ids.tolist(),
        "rewards": rewards.tolist(),
        "advantages": adv.tolist(),
        "params": {k: v.detach().clone() for k, v in state.params.items()},
    }


def dp(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    strategy = ft.strategies.from_env("ddp")
    got = run(strategy)
    save_file(got.pop("params"), str(Path(out, f"params-{rank}.safetensors")))
    Path(out, f"rl-{rank}.json").write_text(json.dumps(got))
    strategy.close()  # releases the DDP model before the group goes


def inf_on_one_rank(rank: int, world: int, port: int, out: str) -> None:
    """Only rank 1 holds an inf reward: both ranks must raise ftrain's error (none may wait in
    the gather for the other)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    with ft.strategies.from_env("ddp") as strategy:
        rewards = torch.tensor([1.0, 2.0, float("inf") if rank == 1 else 3.0, 0.0])
        for advantages in (ft.rl.group_advantages, ft.rl.rloo_advantages):
            try:
                advantages(rewards, 2, strategy=strategy)
            except ValueError as e:
                Path(out, f"{advantages.__name__}-{rank}.txt").write_text(str(e))
