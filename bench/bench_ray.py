"""What reporting checkpoints to Ray Train costs a training step: async upload vs no Ray.

    python bench/bench_ray.py [--rounds 7] [--steps 400] [--every 20]

The README loop on one CPU process (one intra-op thread), a ~1.3M-parameter MLP, batch 64:
`--steps` steps, a checkpoint every `--every` steps. Each round runs, in an order that
alternates between rounds:

  plain   the loop in this process (no Ray), `ft.save_checkpoint(state, root)` (blocking);
  ray     in a 1-worker `TorchTrainer` (Ray's worker process, its training thread), twice, in
          alternating order: `save`: the same `ft.save_checkpoint`, nothing reported; and
          `report`: `ft.extras.ray.save_and_report(state, staging)`, the same blocking save,
          then `ray.train.report` with `checkpoint_upload_mode=ASYNC` (Ray copies it to its
          storage in a background thread, then deletes the staged copy).

All use `SingleDevice` (one worker needs no process group). Timed inside the loop, around all
steps including the saves (not Ray's start-up, nor building the model). Reported: medians over
rounds of the time per step, and medians of the per-round ratios: report / plain (all of
Ray's cost) and report / save (the reporting alone, in the same worker).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ftrain as ft


def build() -> ft.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                          nn.Linear(1024, 16))  # fmt: skip
    return ft.TrainState.create(model, ft.optim.adamw(), strategy=ft.strategies.SingleDevice())


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 256, generator=g)
    return [{"x": x[i], "y": torch.tensor(i % 16)} for i in range(len(x))]


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")
    return loss, torch.tensor(len(batch["y"]))


def timed_loop(steps: int, every: int, save: Any) -> float:
    """Seconds per step of the README loop, saves included."""
    torch.set_num_threads(1)
    state, data = build(), rows()
    start = time.perf_counter()
    while state.step < steps:
        for micro in ft.make_batches(data, state, batch_size=32, accum=2):
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3, max_norm=1.0)
            if ft.should_save(state, every=every, total_steps=steps):
                save(state)
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return (time.perf_counter() - start) / steps


def ray_loop(config: dict[str, Any]) -> None:
    from ftrain.extras import ray as ray_ft

    def report(state: ft.TrainState) -> None:
        ray_ft.save_and_report(state, config["staging"], upload="async")

    def save(state: ft.TrainState) -> None:
        ft.save_checkpoint(state, config["root"])

    kinds = {"report": report, "save": save}
    order = ("report", "save") if config["round"] % 2 == 0 else ("save", "report")
    seconds = {k: timed_loop(config["steps"], config["every"], kinds[k]) for k in order}
    Path(config["out"]).write_text(json.dumps(seconds))  # read by the driver


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # as the tests
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from ftrain.extras import ray as ray_ft

    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join([here, str(Path(here).parent), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})  # fmt: skip
    plain: list[float] = []
    with_ray: list[dict[str, float]] = []
    try:
        for r in range(args.rounds):
            order = ("plain", "ray") if r % 2 == 0 else ("ray", "plain")
            for kind in order:
                if kind == "plain":
                    root = tmp / f"plain-{r}"
                    save = functools.partial(ft.save_checkpoint, root=root)
                    plain.append(timed_loop(args.steps, args.every, save))
                    continue
                trainer = TorchTrainer(
                    ray_loop,
                    train_loop_config={
                        "steps": args.steps,
                        "every": args.every,
                        "staging": str(tmp / f"staging-{r}"),
                        "out": str(tmp / f"seconds-{r}"),
                        "root": str(tmp / f"worker-{r}"),
                        "round": r,
                    },
                    scaling_config=ray.train.ScalingConfig(num_workers=1),
                    run_config=ray.train.RunConfig(
                        storage_path=str(tmp / "storage"),
                        name=f"round-{r}",
                        checkpoint_config=ray_ft.checkpoint_config(keep_last=2),
                    ),
                )
                trainer.fit()
                with_ray.append(json.loads((tmp / f"seconds-{r}").read_text()))
            ray_r = with_ray[-1]
            print(f"round {r}: plain {plain[-1] * 1e3:.1f} ms/step, ray: save "
                  f"{ray_r['save'] * 1e3:.1f}, report {ray_r['report'] * 1e3:.1f} ms/step",
                  flush=True)  # fmt: skip
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    report = [x["report"] for x in with_ray]
    save = [x["save"] for x in with_ray]
    print(f"plain (no Ray):          median {statistics.median(plain) * 1e3:.2f} ms/step")
    print(f"ray, save only:          median {statistics.median(save) * 1e3:.2f} ms/step")
    print(f"ray, save_and_report:    median {statistics.median(report) * 1e3:.2f} ms/step "
          f"(async upload every {args.every} steps)")  # fmt: skip
    for name, num, den in (("report / plain", report, plain), ("report / save", report, save)):
        ratios = [b / a for a, b in zip(den, num, strict=True)]
        print(f"ratio {name}: median {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
