"""Prototype (not a feature): pipeline parallelism behind one proposed seam member.

docs/strategies.md explains why `torch.distributed.pipelining` does not fit today's seam: a
schedule owns the micro-batches and the loss. This prototype tries the member proposed there,
`strategy.forward_backward(state, micro, loss_fn) -> totals`, by patching `accumulate_grads`'
private `_forward_backward` to delegate to it, and runs the README loop *unchanged* with a
2-stage GPipe strategy (2 processes, gloo, CPU), against one process running the same loop.
What it leaves out: checkpoints, export, evaluation, a per-architecture stage split beyond this
tiny Llama, and the loss (the stage's loss is hard-wired to the summed causal LM loss).

    python bench/proto_pipeline.py [--steps 4] [--timeout 300]
"""

from __future__ import annotations

import argparse
import os
import random
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from probe_cp_pp import spawn_bounded, tiny_llama  # bench/ is the script's directory

import ftrain as ft
import ftrain.grads as core

SEQ = 12  # fixed length: pipeline stages fix their activation shapes at the first step


def rows(n: int = 24) -> list[dict]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        ids = [rng.randrange(1, 61) for _ in range(SEQ)]
        prompt = rng.randrange(0, 6)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


class Stage(torch.nn.Module):
    """Stage 0: embeddings + layer 0; stage 1: layer 1 + norm + head (of one full model)."""

    def __init__(self, model, index: int) -> None:
        super().__init__()
        m = model.model
        self.index, self.rotary = index, m.rotary_emb
        self.parts = torch.nn.ModuleList(
            [m.embed_tokens, m.layers[0]] if index == 0 else [m.layers[1], m.norm, model.lm_head]
        )

    def forward(self, x):
        h = self.parts[0](x) if self.index == 0 else x
        pos = torch.arange(h.shape[1]).expand(h.shape[0], -1)
        layer = self.parts[1] if self.index == 0 else self.parts[0]
        h = layer(h, position_embeddings=self.rotary(h, pos), attention_mask=None)
        return h if self.index == 0 else self.parts[2](self.parts[1](h))


def lm_sum(logits, labels):  # the stage's loss: a sum, so ftrain can divide by the global count
    y = labels[:, 1:].reshape(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y, reduction="sum")


class GPipe(ft.strategies.SingleDevice):
    """Each rank one stage; data rank 0 of 1 (every stage reads the same batches)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.stage_index, self.stages = dist.get_rank(), dist.get_world_size()
        self.schedule = None

    def setup(self, model):
        # The state keeps the full model, its names; parameters of other stages are frozen, so
        # state.params (and the optimizer) hold this stage's only.
        self.part = Stage(model, self.stage_index)
        mine = {id(p) for p in self.part.parameters()}
        for p in model.parameters():
            p.requires_grad_(id(p) in mine)
        return model

    def grad_norm(self, grads):
        sq = ft.strategies._base.local_grad_norm(grads).square()
        dist.all_reduce(sq)  # the global norm: squares summed over stages
        return sq.sqrt()

    def forward_backward(self, state, micro, loss_fn):
        from torch.distributed import pipelining as P

        if self.schedule is None:
            stage = P.PipelineStage(self.part, self.stage_index, self.stages, self.device)
            self.schedule = P.ScheduleGPipe(
                stage, n_microbatches=len(micro), loss_fn=lm_sum, scale_grads=False
            )
        ids = torch.cat([b["input_ids"] for b in micro])
        labels = torch.cat([b["labels"] for b in micro])
        losses: list[torch.Tensor] = []
        if self.stage_index == 0:
            self.schedule.step(ids)
        else:
            self.schedule.step(target=labels, losses=losses)
        loss = torch.stack(losses).detach().sum() if losses else torch.zeros(())
        items = (labels[:, 1:] != -100).sum()
        totals = torch.stack([loss.double(), items.double()])
        dist.all_reduce(totals[:1])  # the loss lives on the last stage only
        return torch.cat([totals, torch.tensor([ids.numel(), ids.shape[0]], dtype=torch.float64)])


def delegate(original):
    def _forward_backward(state, micro, loss_fn, strategy):
        if hasattr(strategy, "forward_backward"):  # the proposed seam member
            return strategy.forward_backward(state, micro, loss_fn)
        return original(state, micro, loss_fn, strategy)

    return _forward_backward


def readme_loop(state, data, steps):
    losses = []
    lr = ft.schedules.warmup_cosine(peak_lr=1e-2, warmup_steps=2, total_steps=steps)
    while state.step < steps:
        for micro in ft.make_batches(data, state, batch_size=4, accum=2):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro)
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=0.5
            )
            losses.append((float(stats.loss), float(info.grad_norm)))
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return state, losses


def worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    core._forward_backward = delegate(core._forward_backward)
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=0, strategy=GPipe())
    state, losses = readme_loop(state, rows(), steps)
    params = {n: p.detach().clone() for n, p in state.params.items()}
    torch.save({"losses": losses, "params": params}, f"{out}.{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    out = f"/tmp/proto_pipeline_{os.getpid()}"
    spawn_bounded(worker, (args.steps, out), timeout=args.timeout)
    one = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=0)
    one, want = readme_loop(one, rows(), args.steps)
    got = [torch.load(f"{out}.{r}.pt") for r in range(2)]
    worst = 0.0
    for part in got:
        for n, p in part["params"].items():
            worst = max(worst, (p - one.params[n].detach()).abs().max().item())
    fmt = lambda xs: ", ".join(f"({a:.6f}, {b:.6f})" for a, b in xs)  # noqa: E731
    print(f"(loss, pre-clip grad norm) per step, one process: {fmt(want)}")
    print(f"(loss, pre-clip grad norm) per step, 2 stages:    {fmt(got[1]['losses'])}")
    print(f"max |parameter diff| after {args.steps} steps: {worst:.2e}")
    for r in range(2):
        os.remove(f"{out}.{r}.pt")


if __name__ == "__main__":
    main()
