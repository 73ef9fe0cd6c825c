"""A checkpointed loop that builds `ft.strategies.DDP()` directly under torchrun (test_elastic).

Usage: torchrun ... tests/workers/elastic_loop.py ROOT TOTAL KILLS [PREEMPTIONS]
Every step is saved to ROOT. With KILLS > 0, attempt r < KILLS (torchrun's
TORCHELASTIC_RESTART_COUNT) has one rank SIGKILL itself at a step drawn from a generator seeded
by r, at a random instant of that step's save, so the job only ends through KILLS restarts that
resume from `latest_checkpoint` (VICTIM_SIGNAL=SIGSTOP freezes the rank instead). Rank 0
prints "attempt R: steps A..B" per attempt.

With PREEMPTIONS = P > 0 the run is instead cut by SIGTERM P times (`preemptible`): segment
i < P sends it to one rank at a random instant of a random step; every rank saves the same step
and leaves the loop; the next segment resumes from the checkpoint, in the same processes.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

import torch
from torch import nn

import ftrain as ft

GLOBAL_BATCH = 4


def build(strategy: ft.strategies.Strategy | None = None) -> ft.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    return ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.1), seed=3, strategy=strategy)


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g)
    return [{"x": x[i], "y": torch.tensor(i % 4)} for i in range(40)]


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")
    return loss, torch.tensor(len(batch["y"]))


def train(
    state: ft.TrainState, root: str | None, total: int, kill_at: int | None = None
) -> ft.TrainState:
    """The README loop, saving every step to `root` (if any); SIGKILL this process during the
    save of step `kill_at`."""
    data, strategy = rows(), state.strategy
    while state.step < total:
        for micro in ft.make_batches(
            data, state, batch_size=GLOBAL_BATCH // strategy.world_size, accum=2,
        ):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2, max_norm=1.0)
            if state.step == kill_at:  # somewhere inside the save (it takes milliseconds)
                delay = random.Random(kill_at).uniform(0.0, 0.03)
                how = signal.Signals[os.environ.get("VICTIM_SIGNAL", "SIGKILL")]  # or SIGSTOP
                threading.Timer(delay, os.kill, (os.getpid(), how)).start()
            if root is not None:
                ft.save_checkpoint(state, root, keep_last=2)
            if state.step == kill_at:
                # The signal lands within 30 ms, inside or right after this save: never train
                # on past it, or on a fast machine an attempt would get further than planned
                # and the job would run out of steps before its last planned kill.
                time.sleep(120)
            if state.step >= total:
                break
        else:
            state = ft.next_epoch(state)
    return state


def preemptible(
    state: ft.TrainState, root: str, total: int, signal_at: int | None = None, delay: float = 0.0
) -> ft.TrainState:
    """The README loop under `on_preemption`; SIGTERM to this process `delay` seconds into
    step `signal_at`."""
    data, strategy, timer = rows(), state.strategy, None
    with ft.strategies.on_preemption() as preempt:
        while state.step < total and not preempt.requested:
            for micro in ft.make_batches(
                data, state, batch_size=GLOBAL_BATCH // strategy.world_size, accum=2,
            ):  # fmt: skip
                if state.step == signal_at and not delay:
                    os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line
                elif state.step == signal_at:
                    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM))
                    timer.start()
                grads, stats = ft.accumulate_grads(state, micro, loss_fn)
                state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2, max_norm=1.0)
                if ft.should_save(state, every=8, total_steps=total):  # and when preempted
                    ft.save_checkpoint(state, root, keep_last=2)
                if state.step >= total or preempt.requested:
                    break
            else:
                state = ft.next_epoch(state)
        if timer is not None:
            timer.join()  # never let the signal outlive the handler
    return state


def resume(root: str, strategy: ft.strategies.Strategy | None = None) -> ft.TrainState:
    state = build(strategy)
    if (ckpt := ft.latest_checkpoint(root)) is not None:
        state = ft.load_checkpoint(ckpt, state)
    return state


def main_preempted(root: str, total: int, preemptions: int) -> None:
    with ft.strategies.DDP() as strategy:
        for segment in range(preemptions + 1):
            state = resume(root, strategy)
            start, rng = state.step, random.Random(segment)
            victim, at, delay = rng.randrange(2), start + rng.randrange(1, 4), rng.uniform(0, 0.01)
            signal_at = at if segment < preemptions and strategy.rank == victim else None
            state = preemptible(state, root, total, signal_at, delay)
            line = f"rank {strategy.rank} segment {segment}: steps {start}..{state.step}\n"
            sys.stdout.write(line)  # one write: the ranks' lines cannot interleave
            sys.stdout.flush()


def plan(attempt: int, world_size: int, start: int) -> tuple[int, int]:
    """Which rank dies in this attempt, and at which step."""
    rng = random.Random(attempt)
    return rng.randrange(world_size), start + rng.randrange(1, 4)


def main(root: str, total: int, kills: int) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with ft.strategies.DDP() as strategy:  # joins the group torchrun describes
        state = resume(root, strategy)
        start, kill_at = state.step, None
        if attempt < kills:
            victim, kill_at = plan(attempt, strategy.world_size, state.step)
            kill_at = kill_at if strategy.rank == victim else None
        try:
            state = train(state, root, total, kill_at)
        except Exception as e:  # a peer died or froze (test_elastic checks this line)
            print(f"rank {strategy.rank}: the step raised {type(e).__name__}", flush=True)
            raise
        if strategy.rank == 0:
            print(f"attempt {attempt}: steps {start}..{state.step}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) > 4 and int(sys.argv[4]) > 0:
        main_preempted(sys.argv[1], int(sys.argv[2]), int(sys.argv[4]))
    else:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
