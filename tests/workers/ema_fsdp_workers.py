"""The 2-process worker of tests/test_ema_fsdp.py (forked by `launch.run_ranks`).

`probe(strategy)` runs one short sequence and returns the logits of one fixed input after
each event; one process runs it with `SingleDevice` for the reference. Each probe follows a
forward without a backward: FSDP2 keeps the root's gathered (whole) parameters after such a
forward, so a probe reads stale weights unless whatever changed the shards in place dropped
them.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import save_file

import ftrain as ft
from helpers import ragged_rows, rank_env, tiny_llama

ROWS = ragged_rows(16, seed=5, lo=3, hi=20)
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4]])
GLOBAL_BATCH = 4  # rows per step over all ranks


def logits(state: ft.TrainState) -> torch.Tensor:
    with torch.no_grad():  # a forward without a backward: FSDP2's root stays gathered
        return state.model(input_ids=IDS.to(state.strategy.device)).logits.float().cpu()


def _steps(state: ft.TrainState, n: int) -> ft.TrainState:
    per_rank = GLOBAL_BATCH // state.strategy.world_size
    batches = ft.make_batches(ROWS, batch_size=per_rank, shuffle=False, strategy=state.strategy)
    for micro in batches:
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
        if state.step == n:
            break
    return state


def probe(root: str, strategy: ft.strategies.Strategy | None = None) -> dict[str, torch.Tensor]:
    """Logits: `live` after 3 steps of AdamW + EMA; `ema_first`/`ema_second`: two forwards
    inside `swap_ema`; `after`: after the block; `step4`: a forward after a 4th step;
    `loaded`: after loading the step-3 checkpoint into the step-4 state (after that forward);
    `stepped`: after a step whose gradients were followed by an evaluation's forward."""
    kw = {"strategy": strategy} if strategy is not None else {}
    opt = ft.optim.ema(ft.optim.adamw(), decay=0.5)
    state = _steps(ft.TrainState.create(tiny_llama(), opt, seed=0, **kw), 3)
    out = {"live": logits(state)}  # the earlier forward
    with ft.optim.swap_ema(state):
        out["ema_first"] = logits(state)
        out["ema_second"] = logits(state)
    out["after"] = logits(state)
    path = ft.save_checkpoint(state, root)
    state = _steps(state, 4)
    out["step4"] = logits(state)
    state = ft.load_checkpoint(path, state)
    out["loaded"] = logits(state)
    per_rank = GLOBAL_BATCH // state.strategy.world_size
    batches = ft.make_batches(ROWS, batch_size=per_rank, shuffle=False, strategy=state.strategy)
    grads, stats = ft.accumulate_grads(state, next(iter(batches)))
    logits(state)  # an evaluation between the gradients and the step
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
    out["stepped"] = logits(state)
    return out


def fsdp(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    strategy = ft.strategies.from_env("fsdp", timeout=timedelta(seconds=120))
    got = probe(str(Path(out) / "run"), strategy)
    if rank == 0:
        save_file(got, str(Path(out) / "logits.safetensors"))
    del got
    gc.collect()
    strategy.close()
