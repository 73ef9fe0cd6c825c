"""Worker functions for the 2-process tests (spawned; they must live in an importable module)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import ftrain as ft
from helpers import ragged_rows, rank_env, tiny_llama

# Ragged (token counts differ between ranks); 29 rows in global micro-batches of 4 leave one row
# for the last, so rank 1 runs a ZeroWeight stand-in there.
ROWS = ragged_rows(29, seed=11, lo=3, hi=20)


def train(state, *, steps, batch_size, accum=2, hook=None, loss_fn=None):
    """The README loop for `steps` steps; returns the state and the logged losses."""
    losses = []
    lr = ft.schedules.warmup_cosine(peak_lr=1e-2, warmup_steps=2, total_steps=steps)
    while state.step < steps:
        for micro in ft.make_batches(ROWS, state, batch_size=batch_size, accum=accum):  # fmt: skip
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step), max_norm=0.5)
            losses.append(float(stats.loss))
            if state.step >= steps:
                break
        else:
            state = ft.next_epoch(state)
    return state, losses


def equivalence(
    rank: int, world: int, port: int, out: str, kind: str, steps: int, accum: int
) -> None:
    """Train with `kind` ("ddp"/"fsdp"/"hsdp") at batch 2 per rank; rank 0 writes the
    (gathered) parameters, the logged losses and the counters. A "+count" suffix makes the
    tiny model take the large models' path: items counted (and all-reduced) before the
    forward, each loss divided before backward; the result records how often it counted.
    "+counted" does the same with the causal loss as a loss of one's own, `ft.losses.counted`,
    whose items are host ints (summed on the host, then all-reduced)."""
    rank_env(rank, world, port)
    counted, loss_fn = [], None
    if kind.endswith("+counted"):
        causal = ft.losses.causal_lm_loss()
        loss_fn = ft.losses.counted(
            lambda m, b: causal(m, b)[0],
            items=lambda b: int((ft.losses.causal_targets(b) != -100).sum()),
        )
        kind = kind.removesuffix("ed")
    if kind.endswith("+count"):
        import ftrain.grads as grads_module

        kind, count = kind.removesuffix("+count"), grads_module._items_before_forward
        grads_module.COUNT_FIRST_NUMEL = 1
        grads_module._items_before_forward = lambda fn, b, m: counted.append(1) or count(fn, b, m)
    if kind == "hsdp":  # 2 replicas of a 1-rank shard group: a 2-D mesh
        strategy = ft.strategies.from_env("fsdp", replicate=2)
        assert strategy._kwargs["mesh"].mesh_dim_names == ("replicate", "shard")
    else:
        strategy = ft.strategies.from_env(kind)
    state = ft.TrainState.create(
        tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3, strategy=strategy
    )
    state, losses = train(state, steps=steps, batch_size=2, accum=accum, loss_fn=loss_fn)
    # FSDP parameters are sharded DTensors: gather them (a collective, so on every rank).
    full = {n: getattr(p, "full_tensor", p.detach)().detach() for n, p in state.params.items()}
    if rank == 0:
        _save_params(full, Path(out) / "params.safetensors")
        meta = {"losses": losses, "tokens": int(state.data.tokens_seen), "epoch": state.epoch,
                "cursor": state.data.cursor, "counted": len(counted)}  # fmt: skip
        (Path(out) / "result.json").write_text(json.dumps(meta))
    state.strategy.close()  # leaves the group together, the model released first


def _save_params(params: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({n: p.detach().contiguous() for n, p in params.items()}, str(path))


def ddp_traffic(rank: int, world: int, port: int, out: str) -> None:
    """Count DDP's gradient all-reduces (one per bucket) over 2 steps of 4 micro-batches, with
    and without `sync_every_micro`: two strategies, one after the other, in one process group
    (joined here, so each strategy's `close()` leaves it for the next: one launch, not two)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rank_env(rank, world, port)
    dist.init_process_group("gloo")
    for sync_every_micro in (False, True):
        strategy = ft.strategies.from_env(sync_every_micro=sync_every_micro)
        state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), seed=3, strategy=strategy)
        calls = []

        def counting(group, bucket, calls=calls):
            calls.append(1)
            return allreduce_hook(group, bucket)

        state.model.register_comm_hook(None, counting)
        state, _ = train(state, steps=2, batch_size=1, accum=4)
        if rank == 0:
            (Path(out) / f"calls-{sync_every_micro}.json").write_text(json.dumps(len(calls)))
        state.strategy.close()  # the model released first; the group stays (not its own)
        del state
    dist.destroy_process_group()


def resume(rank: int, world: int, port: int, roots: list[str], save_at: int, steps: int,
           kind: str) -> None:  # fmt: skip
    """For each folder of `roots`, with `kind` (DDP or FSDP): resume from it if it holds a
    checkpoint, else train and save at `save_at`; then continue to `steps`. Rank 0 writes the
    final (gathered) params. One process group for all the folders (one launch)."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo")
    for root in roots:
        state = ft.TrainState.create(
            tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3, strategy=ft.strategies.from_env(kind)
        )
        if (ckpt := ft.latest_checkpoint(root)) is not None:
            state = ft.load_checkpoint(ckpt, state)
        else:
            state, _ = train(state, steps=save_at, batch_size=2)
            ft.save_checkpoint(state, root)
        state, _ = train(state, steps=steps, batch_size=2)
        full = {n: getattr(p, "full_tensor", p.detach)().detach() for n, p in state.params.items()}
        if rank == 0:
            _save_params(full, Path(root) / f"final-{world}.safetensors")
        state.strategy.close()  # the model released first; the group stays (not its own)
        del state
    dist.destroy_process_group()


def fsdp_traffic(rank: int, world: int, port: int, out: str) -> None:
    """Count FSDP2's gradient reduce-scatters over 2 steps of 4 micro-batches, with and without
    `sync_every_micro` (two strategies in one process group, as in `ddp_traffic`)."""
    rank_env(rank, world, port)
    calls = []

    def counting(real):
        def wrapper(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        return wrapper

    # FSDP2 calls reduce_scatter_single in torch 2.13 (reduce_scatter_tensor in older ones).
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(torch.distributed, name):
            setattr(torch.distributed, name, counting(getattr(torch.distributed, name)))
    dist.init_process_group("gloo")
    for sync_every_micro in (False, True):
        calls.clear()
        strategy = ft.strategies.from_env("fsdp", sync_every_micro=sync_every_micro)
        state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), seed=3, strategy=strategy)
        state, _ = train(state, steps=2, batch_size=1, accum=4)
        if rank == 0:
            (Path(out) / f"fsdp-calls-{sync_every_micro}.json").write_text(json.dumps(len(calls)))
        state.strategy.close()
        del state
    dist.destroy_process_group()


def fsdp_save_failures(rank: int, world: int, port: int, out: str) -> None:
    """A sharded save that fails on one rank fails on every rank and commits nothing: first
    rank 1 cannot write its shard, then rank 0 cannot seal the directory. A later save works
    and leaves no temporary directory behind."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from ftrain.checkpoint import _save

    rank_env(rank, world, port)
    state = ft.TrainState.create(
        tiny_llama(), ft.optim.adamw(), strategy=ft.strategies.from_env("fsdp")
    )
    real_write, real_json = HuggingFaceStorageWriter.write_data, _save.write_json

    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    outcomes = []
    for who, target in ((1, "write_data"), (0, "write_json")):
        if rank == who and target == "write_data":
            HuggingFaceStorageWriter.write_data = broken
        if rank == who and target == "write_json":
            _save.write_json = broken
        try:
            ft.save_checkpoint(state, out)
            outcomes.append("saved")
        except ft.CheckpointError as e:
            outcomes.append(type(e).__name__)
        HuggingFaceStorageWriter.write_data, _save.write_json = real_write, real_json
        torch.distributed.barrier()
        outcomes.append(ft.latest_checkpoint(out) is None)
    state = state.replace(step=1)
    outcomes.append(ft.save_checkpoint(state, out).name)
    (Path(out) / f"outcome-{rank}.json").write_text(json.dumps(outcomes))
    state.strategy.close()  # leaves the group together, the model released first


def _outputs(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return {
        "labels": batch["labels"],
        "pred": logits.argmax(-1),
        "n": batch["attention_mask"].sum(-1),
    }


def predict_gather(rank: int, world: int, port: int, out: str) -> None:
    """ft.predict over 29 rows at 2 per rank: every rank writes what it saw, gathered and not."""
    import numpy as np

    rank_env(rank, world, port)
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), strategy=ft.strategies.from_env())

    strategy = state.strategy

    def batches():
        return ft.make_batches(ROWS, batch_size=2, shuffle=False, strategy=strategy)

    gathered = list(ft.predict(state, batches(), _outputs))
    local = list(ft.predict(state, batches(), _outputs, gather=False))
    np.savez(
        Path(out) / f"predict-{rank}.npz",
        **{f"g{i}_{k}": v for i, b in enumerate(gathered) for k, v in b.items()},
        local_rows=np.array(sum(len(b["n"]) for b in local)),
    )
    state.strategy.close()  # leaves the group together, the model released first


def fsdp_fp16(rank: int, world: int, port: int, out: str) -> None:
    """FSDP with float16 autocast and loss scaling: train, save a sharded checkpoint (with the
    scale), and write what one process must find when it loads it."""
    rank_env(rank, world, port)
    strategy = ft.strategies.from_env("fsdp", precision="fp16")
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3, strategy=strategy)
    # overflows at first: backs off
    state = state.replace(scaler=state.scaler.replace(scale=torch.tensor(2.0**30)))
    state, losses = train(state, steps=5, batch_size=2)
    path = ft.save_checkpoint(state, Path(out) / "ckpt")
    full = {n: p.full_tensor().detach() for n, p in state.params.items()}
    dtypes = sorted({str(p.dtype) for p in state.params.values()})
    meta = {"scale": float(state.scaler.scale), "tracker": int(state.scaler.growth_tracker),
            "losses": losses, "dtypes": dtypes}  # fmt: skip
    if rank == 0:
        _save_params(full, Path(out) / "params.safetensors")
        (Path(out) / "result.json").write_text(json.dumps({**meta, "path": str(path)}))
    state.strategy.close()  # leaves the group together, the model released first


def names_differ(rank: int, world: int, port: int, out: str) -> None:
    """evaluate's metrics_fn and predict's output_fn returning other names on each rank: every
    rank writes what it got (a record, or ftrain's error)."""
    rank_env(rank, world, port)
    torch.manual_seed(0)
    strategy = ft.strategies.from_env("ddp")
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(), strategy=strategy)

    def loss_fn(model, b):
        return ((model(b[0]) - b[1]) ** 2).sum(), torch.tensor(float(len(b[0])))

    def same(model, b):  # every rank returns every name
        return {"acc_cat": (torch.tensor(float(rank)), torch.tensor(1.0 + rank)),
                "acc_dog": (torch.tensor(1.0), torch.tensor(2.0))}  # fmt: skip

    mine = ("acc_cat", "acc_dog")[rank]

    def per_rank(model, b):  # a name only this rank saw rows of
        return {mine: (torch.tensor(float(rank + 1)), torch.tensor(1.0))}

    def outputs(model, b):  # predict: an output only this rank returns
        return {mine: model(b[0]).squeeze(-1)}

    batch = (torch.ones(2 + rank, 2), torch.zeros(2 + rank, 1))
    result: dict = {"same": ft.evaluate(state, [batch], loss_fn, metrics_fn=same)}
    for key, run in (
        ("per_rank", lambda: ft.evaluate(state, [batch], loss_fn, metrics_fn=per_rank)),
        ("predict", lambda: list(ft.predict(state, [batch], outputs))),
    ):
        try:
            result[key] = repr(run())
        except ValueError as e:
            result[key] = str(e)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    strategy.close()
