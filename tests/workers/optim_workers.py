"""The 2-process worker of tests/test_optim_distributed.py (spawned; importable module)."""

from __future__ import annotations

import functools
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import save_file

import ftrain as ft
from helpers import ragged_rows, tiny_llama

ROWS = ragged_rows(16, seed=5, lo=3, hi=20)


def pair_rows(n: int = 8) -> list[dict[str, list[int]]]:
    """Preference pairs: chosen and rejected token rows sharing a masked 3-token prompt."""
    out = []
    for i, r in enumerate(ragged_rows(2 * n, seed=9, lo=5, hi=12, mask_prompt=False)):
        labels = [-100] * 3 + r["input_ids"][3:]
        side = "chosen" if i % 2 == 0 else "rejected"
        if side == "chosen":
            out.append({})
        out[-1].update({f"{side}_input_ids": r["input_ids"], f"{side}_labels": labels})
    return out


def pair_collate(rows):
    pad = ft.pad_collate()
    out = {}
    for side in ("chosen", "rejected"):
        batch = pad([{k.removeprefix(f"{side}_"): v for k, v in r.items() if k.startswith(side)}
                     for r in rows])  # fmt: skip
        out.update({f"{side}_{k}": v for k, v in batch.items()})
    return out


def dpo_loss_fn():
    reference = tiny_llama(seed=1).requires_grad_(False)
    loss = functools.partial(ft.preference.dpo_loss, beta=0.5, label_smoothing=0.1)
    return ft.preference.preference_loss(loss, reference=reference)


def run(strategy=None, per_rank: int = 1) -> dict[str, object]:
    """Gradients of the chunked LM loss and of DPO, and an EMA evaluation, with `per_rank`
    times fewer rows per batch than one process would use for the same global batch."""
    out: dict[str, object] = {}
    kw = {"strategy": strategy} if strategy is not None else {}
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), **kw)
    micro = next(iter(ft.make_batches(ROWS, batch_size=8 // per_rank, accum=2, shuffle=False,
                                      strategy=state.strategy)))  # fmt: skip
    loss_fn = ft.chunked_causal_lm_loss(chunk_size=5) if per_rank > 1 else None
    grads, _ = ft.accumulate_grads(state, micro, loss_fn)
    out["lm"] = {n: g.detach().clone() for n, g in grads.items()}
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), **kw)
    micro = next(iter(ft.make_batches(pair_rows(), batch_size=4 // per_rank, accum=2,
                                      shuffle=False, collate_fn=pair_collate,
                                      strategy=state.strategy)))  # fmt: skip
    grads, _ = ft.accumulate_grads(state, micro, dpo_loss_fn())
    out["dpo"] = {n: g.detach().clone() for n, g in grads.items()}
    state = ft.TrainState.create(tiny_llama(), ft.optim.ema(ft.optim.adamw(), decay=0.5), **kw)
    for micro in ft.make_batches(ROWS, batch_size=8 // per_rank, shuffle=False,
                                 strategy=state.strategy):  # fmt: skip
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
    val = ft.make_batches(ROWS, batch_size=8 // per_rank, shuffle=False, strategy=state.strategy)
    live = {n: p.detach().clone() for n, p in state.params.items()}
    with ft.optim.swap_ema(state):
        out["ema_eval"] = ft.evaluate(state, val)["eval_loss"]
    out["restored"] = all(torch.equal(p, live[n]) for n, p in state.params.items())
    return out


def ddp(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    strategy = ft.strategies.from_env("ddp", timeout=timedelta(seconds=120))
    got = run(strategy, per_rank=world)
    if rank == 0:
        tensors = {f"{k}/{n}": g for k in ("lm", "dpo") for n, g in got[k].items()}
        save_file(tensors, str(Path(out) / "grads.safetensors"))
        meta = {"ema_eval": got["ema_eval"], "restored": got["restored"]}
        (Path(out) / "result.json").write_text(json.dumps(meta))
    import gc

    del got, strategy
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def recipe(model):
    """Muon on the hidden matrices, AdamW elsewhere, an EMA of everything."""
    hidden = {n for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n}
    part = ft.optim.partition(
        {"muon": ft.optim.muon(), "adamw": ft.optim.adamw()},
        lambda n: "muon" if n in hidden else "adamw",
        lr_factors={"adamw": 0.2},
    )
    return ft.optim.ema(part, decay=0.5)


def train_recipe(strategy=None, per_rank: int = 1):
    """Three steps of the Muon/AdamW/EMA recipe; the live and EMA weights, gathered."""
    kw = {"strategy": strategy} if strategy is not None else {}
    state = ft.TrainState.create(tiny_llama(), recipe(tiny_llama()), **kw)
    for micro in ft.make_batches(ROWS, batch_size=4 // per_rank, shuffle=False,
                                 strategy=state.strategy):  # fmt: skip
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
        if state.step == 3:
            break
    full = lambda t: getattr(t, "full_tensor", t.detach)().detach().clone()  # noqa: E731
    live = {n: full(p) for n, p in state.params.items()}
    with ft.optim.swap_ema(state):
        average = {n: full(p) for n, p in state.params.items()}
    back = all(torch.equal(full(p), live[n]) for n, p in state.params.items())
    return live, average, back


def fsdp(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    strategy = ft.strategies.from_env("fsdp", timeout=timedelta(seconds=120))
    live, average, back = train_recipe(strategy, per_rank=world)
    if rank == 0:
        tensors = {**{f"live/{n}": t for n, t in live.items()},
                   **{f"ema/{n}": t for n, t in average.items()}}  # fmt: skip
        save_file(tensors, str(Path(out) / "fsdp.safetensors"))
        (Path(out) / "fsdp.json").write_text(json.dumps({"restored": back}))
    import gc

    del strategy
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
