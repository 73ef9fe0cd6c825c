"""Train 16 small MLPs on scikit-learn's digits at once, and as 16 separate ftrain loops.

The members differ in seed, learning rate and weight decay (a small sweep). The vectorized run
stacks them into one `ft.func.Ensemble`: one `vmap`ped forward/backward per micro-batch, and
`ft.func.sweep` updates each member with its own AdamW. Prints one line:

    max_diff_vs_separate=<max abs parameter difference> speedup=<separate time / vectorized time>

Run: python examples/ensemble.py [--members 16] [--epochs 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import ftrain as ft


def digits() -> list[dict[str, torch.Tensor]]:
    x, y = load_digits(return_X_y=True)
    xs = torch.tensor(x, dtype=torch.float32) / 16.0
    return [{"x": xs[i], "y": torch.tensor(int(y[i]))} for i in range(len(y))]


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum"), len(batch["y"])


def hyper(k: int) -> tuple[list[float], list[float]]:
    """A small sweep: learning rates and weight decays, one per member."""
    lrs = [1e-3 * (1 + i % 4) for i in range(k)]
    wds = [0.01 * (i // 4) for i in range(k)]
    return lrs, wds


def train(state: ft.TrainState, data: list, loss, *, epochs: int, lr: float) -> ft.TrainState:
    """The README loop, for `epochs` epochs at a constant learning rate."""
    while state.epoch < epochs:
        for micro in ft.make_batches(data, state, batch_size=64):
            grads, stats = ft.accumulate_grads(state, micro, loss)
            state, _ = ft.clip_and_step(state, grads, lr=lr, stats=stats)
        state = ft.next_epoch(state)
    return state


def separate(data: list, k: int, epochs: int) -> list[ft.TrainState]:
    lrs, wds = hyper(k)
    states = []
    for i in range(k):
        # seed=0 as the ensemble's: make_batches takes the data order from the state's seed
        state = ft.TrainState.create(mlp(i), ft.optim.adamw(weight_decay=wds[i]), seed=0)
        states.append(train(state, data, loss_fn, epochs=epochs, lr=lrs[i]))
    return states


def vectorized(data: list, k: int, epochs: int) -> ft.TrainState:
    lrs, wds = hyper(k)
    ensemble = ft.func.Ensemble([mlp(i) for i in range(k)])
    opt = ft.func.sweep([ft.optim.adamw(weight_decay=wd) for wd in wds], lr_factors=lrs)
    state = ft.TrainState.create(ensemble, opt, seed=0)
    return train(state, data, ft.func.ensemble_loss(loss_fn), epochs=epochs, lr=1.0)


def max_diff(ens: ft.TrainState, states: list[ft.TrainState]) -> float:
    worst = 0.0
    for name, stacked in ens.params.items():
        own = name.removeprefix("stacked.")
        for i, s in enumerate(states):
            worst = max(worst, (stacked[i] - s.params[own]).abs().max().item())
    return worst


def main(argv: list[str] | None = None) -> tuple[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; the median")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # both ways on one core: the comparison is of work, not threads
    data = digits()
    times: dict[str, list[float]] = {"separate": [], "vectorized": []}
    for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
        t0 = time.perf_counter()
        states = separate(data, args.members, args.epochs)
        t1 = time.perf_counter()
        ens = vectorized(data, args.members, args.epochs)
        t2 = time.perf_counter()
        times["separate"].append(t1 - t0)
        times["vectorized"].append(t2 - t1)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    speedup = med["separate"] / med["vectorized"]
    diff = max_diff(ens, states)
    print(f"max_diff_vs_separate={diff:.3g} speedup={speedup:.2f}")
    return diff, speedup


if __name__ == "__main__":
    main()
