"""Worker functions for the tensor-parallel tests (spawned; they must live in an importable
module). Each launch checks several things: process start-up is most of a test's time."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch

import ftrain as ft
from dist_workers import ROWS, _save_params
from helpers import rank_env, tiny_gpt2, tiny_llama

STEPS, SAVE_AT, RESUME_AT, MAX_NORM = 5, 3, 4, 0.5
PROBE = torch.tensor([[1, 5, 9, 13, 17, 21, 2, 60]])  # token ids for comparing logits


def train(state, *, steps, batch_size):
    """The README loop (as dist_workers.train), also returning the global grad norms."""
    losses, norms = [], []
    lr = ft.schedules.warmup_cosine(peak_lr=1e-2, warmup_steps=2, total_steps=STEPS)
    while state.step < steps:
        for micro in ft.make_batches(ROWS, state, batch_size=batch_size, accum=2):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro)
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=MAX_NORM
            )
            losses.append(float(stats.loss))
            norms.append(float(info.grad_norm))
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return state, losses, norms


def evaluate(state) -> dict[str, float]:
    rows = ft.make_batches(ROWS, batch_size=8, shuffle=False, strategy=state.strategy)
    return ft.evaluate(state, (b for group in rows for b in group))


def whole(state) -> dict[str, torch.Tensor]:
    """The parameters as whole tensors (a collective for DTensors: call on every rank)."""
    return {n: getattr(p, "full_tensor", p.detach)().detach() for n, p in state.params.items()}


def _tiny_llama(**overrides):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama().config.__class__(**{**_TINY, **overrides}))


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_TINY, head_dim=4))


_TINY = dict(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _tied_llama():
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model


def _errors(out: Path) -> dict[str, str]:
    """The plan errors, raised inside a live group (a TP strategy needs one)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    found = {}
    cases = {
        "pattern": (lambda: {"model.layers.*.mlp.nope_proj": ColwiseParallel()}, tiny_llama),
        "no_plan": (lambda: None, tiny_gpt2),
        "style": (lambda: {"model.layers.*.mlp.up_proj": "colwise"}, tiny_llama),
        "layout": (lambda: None, _tiny_qwen3),
        "heads": (lambda: None, lambda: _tiny_llama(num_key_value_heads=1)),
        # The embedding split, the head tied to it left whole: two parameters from then on.
        "tied_split": (
            lambda: {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())},
            _tied_llama,
        ),
    }
    for key, (plan, build) in cases.items():
        try:
            ft.strategies.TP(plan=plan()).setup(build())
        except (TypeError, ValueError) as e:
            found[key] = str(e)
    try:
        ft.strategies.TP(shard=lambda m: True)  # FSDP units without FSDP (dp=1)
    except ValueError as e:
        found["shard"] = str(e)
    tied = ft.strategies.TP().setup(_tied_llama())
    found["tied"] = tied.lm_head.weight is tied.model.embed_tokens.weight
    return found


def tp_run(rank: int, world: int, port: int, out: str) -> None:
    """TP over 2 ranks: train and save at SAVE_AT, continue to STEPS; rank 0 alone resumes
    that checkpoint in one process to RESUME_AT and saves; both ranks resume that under TP to
    STEPS; export. Rank 0 writes what the test compares."""
    rank_env(rank, world, port)
    root = Path(out)
    strategy = ft.strategies.from_env("tp", timeout=timedelta(seconds=90))
    result = {"errors": _errors(root), "ranks": [strategy.rank, strategy.world_size]}
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3, strategy=strategy)
    state, losses, norms = train(state, steps=SAVE_AT, batch_size=4)
    ft.save_checkpoint(state, root / "tp")
    state, more_losses, more_norms = train(state, steps=STEPS, batch_size=4)
    result.update(losses=losses + more_losses, norms=norms + more_norms, eval=evaluate(state))
    params = whole(state)
    if rank == 0:  # one process (no collective) takes the TP checkpoint on to RESUME_AT
        one = ft.TrainState.create(
            tiny_llama(), ft.optim.adamw(), seed=3, strategy=ft.strategies.SingleDevice()
        )  # the one-process reference, in the group
        one = ft.load_checkpoint(root / "tp" / f"step-{SAVE_AT}", one)
        one, _, _ = train(one, steps=RESUME_AT, batch_size=4)
        ft.save_checkpoint(one, root / "one")
    strategy.barrier()
    again = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3, strategy=strategy)
    again = ft.load_checkpoint(root / "one" / f"step-{RESUME_AT}", again)
    again, _, _ = train(again, steps=STEPS, batch_size=4)
    resumed = whole(again)
    ft.export_pretrained(state, root / "export")
    with torch.no_grad():
        logits = state.model(input_ids=PROBE).logits
    if rank == 0:
        _save_params(params, root / "params.safetensors")
        _save_params(resumed, root / "resumed.safetensors")
        _save_params({"logits": logits}, root / "logits.safetensors")
        (root / "result.json").write_text(json.dumps(result))
    del state, again
    strategy.close()


def fsdp_tp_run(rank: int, world: int, port: int, out: str) -> None:
    """FSDP x TP on a (2, 2) mesh: the global batch of 4 rows is split over the 2 dp groups."""
    rank_env(rank, world, port)
    strategy = ft.strategies.from_env("tp", dp=2, timeout=timedelta(seconds=90))
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3, strategy=strategy)
    state, losses, norms = train(state, steps=STEPS, batch_size=2)
    params = whole(state)
    if rank == 0:
        _save_params(params, Path(out) / "params.safetensors")
        meta = {"losses": losses, "norms": norms, "mesh": strategy.mesh.mesh_dim_names,
                "ranks": [strategy.rank, strategy.world_size]}  # fmt: skip
        (Path(out) / "result.json").write_text(json.dumps(meta))
    del state
    strategy.close()
