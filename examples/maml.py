"""MAML on sinusoid regression (Finn et al. 2017): meta-learn an initialization that adapts.

Each task is y = A sin(x - phase) with A in [0.1, 5], phase in [0, pi], x in [-5, 5]; a model
sees 10 support points, takes a few SGD steps, and is scored on 10 query points. The meta-loop
is the README loop: `ft.func.maml_loss` makes each task a "batch" whose loss is the query loss
after differentiable inner steps, so `accumulate_grads` returns the meta-gradient. Prints:

    maml_init_loss=<query MSE after adaptation> random_init_loss=<same from a random init>

Run: python examples/maml.py [--steps 1000]
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

import ftrain as ft


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def mse(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(), len(batch["y"])


def task(gen: torch.Generator, shots: int = 10) -> dict[str, dict[str, torch.Tensor]]:
    amp = 0.1 + 4.9 * torch.rand((), generator=gen)
    phase = math.pi * torch.rand((), generator=gen)

    def points() -> dict[str, torch.Tensor]:
        x = torch.rand(shots, 1, generator=gen) * 10 - 5
        return {"x": x, "y": amp * torch.sin(x - phase)}

    return {"support": points(), "query": points()}


def meta_train(
    steps: int, *, meta_lr: float = 3e-3, tasks_per_step: int = 4, inner_lr: float = 0.01
) -> nn.Module:
    state = ft.TrainState.create(mlp(0), ft.optim.adam(), seed=0)
    loss = ft.func.maml_loss(mse, inner_steps=1, inner_lr=inner_lr)
    while state.step < steps:
        # Tasks are a pure function of the step, so a resumed run sees the same ones.
        gen = torch.Generator().manual_seed(state.step)
        micro = [task(gen) for _ in range(tasks_per_step)]
        grads, stats = ft.accumulate_grads(state, micro, loss)
        state, _ = ft.clip_and_step(state, grads, lr=meta_lr, stats=stats)
    return state.model


def adapted_loss(model: nn.Module, *, tasks: int = 100, steps: int = 5, lr: float = 0.01) -> float:
    """Mean query MSE on new tasks after `steps` SGD steps on each support set."""
    gen = torch.Generator().manual_seed(10**6)  # tasks never seen in meta-training
    total = 0.0
    for _ in range(tasks):
        t = task(gen)
        params = {n: p.detach().requires_grad_() for n, p in model.named_parameters()}
        adapted = ft.func.inner_loop(
            model, params, [t["support"]] * steps, mse, optimizer=ft.func.inner_sgd(), lr=lr,
            first_order=True,
        )  # fmt: skip
        loss, n = ft.func.functional_loss(model, adapted, t["query"], mse)
        total += float(loss.detach() / n)  # host sync: evaluation only
    return total / tasks


def main(argv: list[str] | None = None) -> tuple[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="meta-training steps")
    parser.add_argument("--meta-lr", type=float, default=3e-3)
    parser.add_argument("--eval-tasks", type=int, default=100)
    args = parser.parse_args(argv)
    learned = adapted_loss(meta_train(args.steps, meta_lr=args.meta_lr), tasks=args.eval_tasks)
    scratch = adapted_loss(mlp(0), tasks=args.eval_tasks)
    print(f"maml_init_loss={learned:.4f} random_init_loss={scratch:.4f}")
    return learned, scratch


if __name__ == "__main__":
    main()
