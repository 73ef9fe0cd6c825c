"""Hyperparameter search with Optuna: what `Trainer.hyperparameter_search` gives, as an ftrain loop.

Each trial trains a small MLP on scikit-learn's bundled handwritten digits (8x8 images, 10
classes; offline) with the README loop, searching the peak learning rate, the warmup steps and
the weight decay of AdamW with a warmup-cosine schedule. Every evaluation reports the
validation loss to the trial (`trial.report`), and Optuna's `MedianPruner` stops a trial whose
loss is worse than the median of earlier trials at the same step. The study's best validation
loss is compared with the default configuration, HF's `TrainingArguments` defaults (lr 5e-5,
no warmup, no weight decay).

    python examples/search.py                 # 20 trials of 200 steps, about 30 s on 2 cores
    python examples/search.py --trials 50     # pip install 'ftrain[search]' for optuna
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

import ftrain as ft

DEFAULT = {"lr": 5e-5, "warmup_steps": 0, "weight_decay": 0.0}  # HF's TrainingArguments


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def digits(seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """scikit-learn's digits as rows `{"x", "labels"}`: 1,297 to train, 500 to validate."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = [{"x": torch.tensor(x[i] / 16.0, dtype=torch.float32), "labels": int(y[i])}
            for i in order]  # fmt: skip
    return rows[500:], rows[:500]


def train(data, *, lr: float, warmup_steps: int, weight_decay: float, steps: int,
          eval_every: int, trial: Any = None, seed: int = 0) -> float:  # fmt: skip
    """The README loop; returns the final validation loss. With an Optuna `trial`, each
    evaluation is reported to it and a pruned trial stops (`optuna.TrialPruned`)."""
    train_rows, val_rows = data
    torch.manual_seed(seed)
    state = ft.TrainState.create(MLP(), ft.optim.adamw(weight_decay=weight_decay), seed=seed)
    schedule = ft.schedules.warmup_cosine(peak_lr=lr, warmup_steps=warmup_steps, total_steps=steps)
    loss_fn = ft.losses.classification_loss()
    metrics: dict[str, float] = {}
    while state.step < steps:
        for micro in ft.make_batches(train_rows, state, batch_size=32):
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=schedule(state.step),
                                        max_norm=1.0)  # fmt: skip
            if ft.should_eval(state, every=eval_every, total_steps=steps):
                val = ft.make_batches(val_rows, batch_size=250, shuffle=False)
                metrics = ft.evaluate(state, val, metrics_fn=ft.classification_metrics)
                if trial is not None:
                    trial.report(metrics["eval_loss"], state.step)
                    if trial.should_prune():
                        import optuna

                        raise optuna.TrialPruned()
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return metrics["eval_loss"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per trial")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    data = digits(args.seed)
    run = {"data": data, "steps": args.steps, "eval_every": args.eval_every, "seed": args.seed}

    def objective(trial: optuna.Trial) -> float:
        return train(
            lr=trial.suggest_float("lr", 1e-4, 1e-1, log=True),
            warmup_steps=trial.suggest_int("warmup_steps", 0, args.steps // 4),
            weight_decay=trial.suggest_float("weight_decay", 0.0, 0.3),
            trial=trial, **run,
        )  # fmt: skip

    study = optuna.create_study(
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=args.seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=args.eval_every),
    )
    study.optimize(objective, n_trials=args.trials)
    default = train(**DEFAULT, **run)
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    result = {
        "default": default,
        "best": study.best_value,
        "best_params": study.best_params,
        "complete": len(study.trials) - len(pruned),
        "pruned": len(pruned),
        "pruned_at": [max(t.intermediate_values) for t in pruned],  # the last step reached
    }
    print(f"{result['complete']} trials completed, {result['pruned']} pruned early")
    print(f"default configuration {DEFAULT}: eval_loss={default:.4f}")
    print(f"best of the study {study.best_params}: eval_loss={study.best_value:.4f}")
    return result


if __name__ == "__main__":
    main()
