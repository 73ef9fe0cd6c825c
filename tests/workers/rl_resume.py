"""The GRPO example's loop, SIGKILLed mid-run and resumed (tests/test_rl.py).

Usage: python tests/workers/rl_resume.py ROOT [--kill sample:K | --kill update:K], or `ranked`
in a process forked by tests/workers/launch.py (test_rl does). Trains
examples/grpo_addition.py's task for `STEPS` updates, checkpointing every rollout batch into
ROOT/ckpt and resuming from it; appends each rollout's step, completions and rewards to
ROOT/trace.jsonl and writes the final parameters and optimizer state to ROOT/final.safetensors.
`--kill sample:K` kills this process in its K-th forward while sampling (eval mode),
`update:K` in its K-th forward of an update (training mode).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

import ftrain as ft
from helpers import opt_state_tensors

REPO = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "grpo_addition", REPO / "examples" / "grpo_addition.py"
)
assert _SPEC is not None and _SPEC.loader is not None
example = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(example)

STEPS, ITERATIONS = 8, 2
ARGS = SimpleNamespace(
    steps=STEPS,
    prompts=4,
    generations=4,
    iterations=ITERATIONS,
    loss_type="dapo",
    beta=0.04,
    lr=3e-3,
    save_every=1,
)


def kill_hook(kill: str):
    """A forward pre-hook that SIGKILLs this process at the K-th forward of a phase."""
    phase, k = kill.split(":")
    seen = {"sample": 0, "update": 0}

    def hook(module, args, kwargs):
        now = "update" if module.training else "sample"
        seen[now] += 1
        if now == phase and seen[now] == int(k):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root", type=Path)
    p.add_argument("--kill", default=None)
    a = p.parse_args()
    run(a.root, a.kill)


def ranked(rank: int, world: int, port: int, root: str, kill: str | None) -> None:
    """`run` in a process forked by tests/workers/launch.py (world 1)."""
    run(Path(root), kill)


def run(root: Path, kill: str | None) -> None:
    torch.set_num_threads(1)
    model = example.build_model(0)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    if kill:
        model.register_forward_pre_hook(kill_hook(kill), with_kwargs=True)
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.0), seed=0)
    if (ckpt := ft.latest_checkpoint(root / "ckpt")) is not None:
        state = ft.load_checkpoint(ckpt, state)
    trace = open(root / "trace.jsonl", "a")  # noqa: SIM115 (open until the process ends)

    def record(state, rollouts, rewards):
        ids = [r.completion_ids.tolist() for r in rollouts]
        trace.write(
            json.dumps({"step": state.step, "ids": ids, "rewards": [r.tolist() for r in rewards]})
            + "\n"
        )
        trace.flush()

    args = SimpleNamespace(**vars(ARGS), root=str(root / "ckpt"))
    state = example.train(
        state, example.make_prompts(64, 0), reference=reference, args=args, on_rollout=record
    )
    tensors = {f"param/{k}": v.detach() for k, v in state.params.items()}
    tensors |= {f"opt/{k}": v for k, v in opt_state_tensors(state.opt_state).items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "final.safetensors"))
    print("done", state.step, file=sys.stderr)


if __name__ == "__main__":
    main()
