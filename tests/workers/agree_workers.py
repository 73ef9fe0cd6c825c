"""The ranks of tests/test_dist_agree.py, two gloo processes on CPU: evaluate, predict, generate,
ft.rl.sample and the advantages given inputs that differ between the ranks (iterators of other
lengths, no batches on one rank, a batch or prompt one rank refuses). Each case records, per
rank, ftrain's message (or what the call returned), how long it took and how many agreement
collectives it ran; a case that hung would wait for the group's collective timeout instead.

`everything` runs every case in one process group (each case leaves the ranks in step, so the
next one runs as if alone); `case` runs one, for a look at a single case by hand."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ftrain as ft
from helpers import rank_env, tiny_llama

ROWS = [{"input_ids": [1 + i, 2, 3, 4, 5], "labels": [1 + i, 2, 3, 4, 5]} for i in range(6)]
PROMPTS = [{"input_ids": [3 + i, 4, 5]} for i in range(6)]


def _batch(k: int) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1 + k, 2, 3, 4, 5]])
    return {"input_ids": ids, "labels": ids.clone()}


def _prompt(k: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[3 + k, 4, 5]])}


def _model() -> torch.nn.Module:
    m = tiny_llama(dtype=torch.float64)
    m.generation_config.pad_token_id, m.generation_config.eos_token_id = 0, 6
    return m


_STRATEGIES: dict[str, ft.strategies.Strategy] = {}


def _state(kind: str) -> ft.TrainState:
    if kind not in _STRATEGIES:
        _STRATEGIES[kind] = ft.strategies.from_env(kind)
    return ft.TrainState.create(_model(), ft.optim.sgd(), seed=3, strategy=_STRATEGIES[kind])


def _outputs(model, batch):
    return {"pred": model(input_ids=batch["input_ids"]).logits.argmax(-1)}


def _evaluate(state, batches, **kw):
    return ft.evaluate(state, batches, **kw)["eval_items"]


def _predict(state, batches, **kw):
    return sum(len(b["pred"]) for b in ft.predict(state, batches, _outputs, **kw))


def _generate(state, batches, **kw):
    return sum(len(b["token_ids"]) for b in ft.generate(state, batches, max_new_tokens=3, **kw))


CALLS = {"evaluate": _evaluate, "predict": _predict, "generate": _generate}


def _batches(call: str, n: int, form: str) -> Any:
    make = _prompt if call == "generate" else _batch
    batches = [make(k) for k in range(n)]
    return iter(batches) if form == "iter" else batches


def uneven(rank: int, call: str, kind: str, form: str, **kw: Any) -> Any:
    """Rank 0 gets 2 batches, rank 1 gets 3, as an iterator (or list) of plain batches."""
    return CALLS[call](_state(kind), _batches(call, 2 + rank, form), **kw)


def empty(rank: int, call: str, kind: str, form: str, **kw: Any) -> Any:
    """Rank 0 gets no batches, rank 1 one."""
    return CALLS[call](_state(kind), _batches(call, rank, form), **kw)


def none_at_all(rank: int, call: str, kind: str) -> Any:
    """No rank gets a batch (an empty iterator): ftrain's one-process message, on every rank."""
    return CALLS[call](_state(kind), iter([]))


def even(rank: int, call: str, kind: str, form: str) -> Any:
    """As many batches everywhere: the call's result."""
    return CALLS[call](_state(kind), _batches(call, 3, form))


def fails_on_rank_1(rank: int, call: str, kind: str) -> Any:
    """Rank 1's metrics_fn / output_fn raises on its second batch (after a forward ran)."""
    state = _state(kind)

    def metrics_fn(model, batch):
        if rank == 1 and int(batch["input_ids"][0, 0]) == 2:
            raise RuntimeError("rank 1's metrics_fn failed")
        logits = model(input_ids=batch["input_ids"]).logits
        return {"hits": ((logits.argmax(-1) == batch["labels"]).sum(), batch["labels"].numel())}

    def output_fn(model, batch):
        if rank == 1 and int(batch["input_ids"][0, 0]) == 2:
            raise RuntimeError("rank 1's output_fn failed")
        return _outputs(model, batch)

    batches = iter([_batch(k) for k in range(3)])
    if call == "evaluate":
        return ft.evaluate(state, batches, metrics_fn=metrics_fn)["eval_items"]
    return sum(len(b["pred"]) for b in ft.predict(state, batches, output_fn))


def refused_prompt(rank: int, kind: str, form: str) -> Any:
    """Rank 1's second batch of prompts holds its labels (a training batch): refused there."""
    batches = [_prompt(k) for k in range(3)]
    if rank == 1:
        ids = batches[1]["input_ids"]
        batches[1] = {"input_ids": ids, "labels": ids.clone()}
    return _generate(_state(kind), iter(batches) if form == "iter" else batches)


def sample(rank: int, what: str, kind: str) -> Any:
    """Rank 1's prompts or arguments are refused: an all-padding row, a repeated index, 1-D
    input_ids, a token id outside the vocabulary, stop ids outside it."""
    state = _state(kind)
    ids = torch.tensor([[5, 9, 14], [7, 3, 22]])
    mask = torch.ones_like(ids)
    index = [2 * rank, 2 * rank + 1]
    stop = None
    if rank == 1:
        if what == "padding":
            mask[1] = 0
        elif what == "index":
            index = [2, 2]
        elif what == "shape":
            ids, mask = ids[0], mask[0]
        elif what == "token":
            ids = ids.clone()
            ids[0, 1] = 1000
        elif what == "stop":
            stop = [6, 1000]
    prompts = {"input_ids": ids, "attention_mask": mask}
    rollout = ft.rl.sample(state, prompts, index=index, max_new_tokens=3, stop_token_ids=stop)
    return rollout.completion_ids.shape[0]


def advantages(rank: int, what: str, kind: str) -> Any:
    """Rank 1's rewards are refused (2-D, or of an integer dtype)."""
    strategy = _state(kind).strategy
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    if rank == 1:
        rewards = rewards.view(2, 2) if what == "shape" else rewards.long()
    fn = ft.rl.group_advantages if what == "shape" else ft.rl.rloo_advantages
    return fn(rewards, 2, strategy=strategy).tolist()


def reading_fails(rank: int, call: str) -> Any:
    """Under FSDP, rank 1's iterator raises while reading its second batch (a file gone, a
    broken generator); rank 0 has 3 batches."""

    def batches() -> Any:
        yield _batch(0)
        if rank == 1:
            raise OSError("rank 1's data went away")
        yield from (_batch(k) for k in (1, 2))

    return CALLS[call](_state("fsdp"), batches())


class _Bufferless(torch.nn.Module):
    """A model without buffers: DDP's forwards run no collective (none broadcasts buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb(input_ids)


def alone(rank: int, model: str) -> Any:
    """Rank 0 predicts alone under DDP (`gather=False`, the rank-0 predict of docs/data.md)
    after a training step, with a model without buffers or a Llama (whose rotary buffers DDP
    broadcasts before its first forward after training); rank 1 does not predict."""
    state = _state("ddp")
    if model == "bufferless":
        state = ft.TrainState.create(_Bufferless(), ft.optim.sgd(), strategy=state.strategy)
        outputs = lambda m, b: {"pred": m(b["input_ids"])}  # noqa: E731
    else:
        grads, stats = ft.accumulate_grads(state, [_batch(rank)])
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.0)
        outputs = _outputs
    if rank != 0:
        return 0
    return sum(len(b["pred"]) for b in ft.predict(state, [_batch(k) for k in range(2)], outputs,
                                                  gather=False))  # fmt: skip


def agreements(rank: int, call: str, kind: str, form: str) -> Any:
    """How many agreement collectives (beyond the call's own) an even call runs: `form` is
    "made" (make_batches(..., strategy=...), whose groups every process agreed on), "iter" (a
    plain iterator of 3 batches) or "list" (a list of 3)."""
    state = _state(kind)
    data = PROMPTS if call == "generate" else ROWS
    if form == "made":
        batches: Any = ft.make_batches(data, batch_size=1, shuffle=False, strategy=state.strategy)
    else:
        batches = _batches(call, 3, form)
    calls = {"sum_over_processes": 0, "all_reduce_sum": 0}
    for name in calls:
        real = getattr(state.strategy, name)

        def counting(tensor, real=real, name=name):
            calls[name] += 1
            return real(tensor)

        setattr(state.strategy, name, counting)
    try:
        CALLS[call](state, batches)
    finally:
        for name in calls:
            delattr(state.strategy, name)
    return calls


def first_read_fails(rank: int, call: str) -> Any:
    """Under DDP with a model without buffers (its forwards run no collective, so no
    agreement runs before the first batch), rank 1's iterator raises on its first read; rank 0
    has 2 batches."""
    state = _state("ddp")
    state = ft.TrainState.create(_Bufferless(), ft.optim.sgd(), strategy=state.strategy)

    def batches() -> Any:
        if rank == 1:
            raise OSError("rank 1's data went away")
        yield from (_batch(k) for k in range(2))

    if call == "evaluate":
        loss_fn = lambda m, b: (m(b["input_ids"]).sum(), 1)  # noqa: E731
        return ft.evaluate(state, batches(), loss_fn)["eval_items"]
    outputs = lambda m, b: {"pred": m(b["input_ids"])}  # noqa: E731
    return sum(len(b["pred"]) for b in ft.predict(state, batches(), outputs))


CASES: dict[str, Callable[[int], Any]] = {
    **{
        f"uneven-{call}-{kind}-{form}": (
            lambda r, call=call, kind=kind, form=form: uneven(r, call, kind, form)
        )
        for call in CALLS
        for kind in ("fsdp", "tp")
        for form in ("iter", "list")
    },
    "uneven-predict-ddp-iter": lambda r: uneven(r, "predict", "ddp", "iter"),
    "uneven-predict-ddp-iter-local": lambda r: uneven(r, "predict", "ddp", "iter", gather=False),
    "uneven-generate-ddp-iter": lambda r: uneven(r, "generate", "ddp", "iter"),
    "uneven-evaluate-ddp-iter": lambda r: uneven(r, "evaluate", "ddp", "iter"),
    **{
        f"empty-{call}-{kind}-{form}": (
            lambda r, call=call, kind=kind, form=form: empty(r, call, kind, form)
        )
        for call in CALLS
        for kind in ("ddp", "fsdp")
        for form in ("iter", "list")
    },
    "empty-predict-ddp-iter-local": lambda r: empty(r, "predict", "ddp", "iter", gather=False),
    "alone-predict-ddp": lambda r: alone(r, "bufferless"),
    "alone-predict-ddp-llama": lambda r: alone(r, "llama"),
    "first-read-fails-evaluate-ddp": lambda r: first_read_fails(r, "evaluate"),
    "first-read-fails-predict-ddp": lambda r: first_read_fails(r, "predict"),
    "reading-fails-evaluate-fsdp": lambda r: reading_fails(r, "evaluate"),
    "reading-fails-predict-fsdp": lambda r: reading_fails(r, "predict"),
    **{f"none-{call}-ddp": (lambda r, call=call: none_at_all(r, call, "ddp")) for call in CALLS},
    "none-evaluate-fsdp": lambda r: none_at_all(r, "evaluate", "fsdp"),
    **{
        f"even-{call}-{kind}-iter": (lambda r, call=call, kind=kind: even(r, call, kind, "iter"))
        for call in CALLS
        for kind in ("ddp", "fsdp")
    },
    "fails-evaluate-ddp": lambda r: fails_on_rank_1(r, "evaluate", "ddp"),
    "fails-predict-ddp": lambda r: fails_on_rank_1(r, "predict", "ddp"),
    "refused-generate-ddp-iter": lambda r: refused_prompt(r, "ddp", "iter"),
    "refused-generate-fsdp-list": lambda r: refused_prompt(r, "fsdp", "list"),
    **{
        f"sample-{what}-{kind}": (lambda r, what=what, kind=kind: sample(r, what, kind))
        for what in ("padding", "index", "shape", "token", "stop")
        for kind in ("ddp", "fsdp")
    },
    "sample-none-ddp": lambda r: sample(r, "none", "ddp"),
    "advantages-shape-ddp": lambda r: advantages(r, "shape", "ddp"),
    "advantages-dtype-ddp": lambda r: advantages(r, "dtype", "ddp"),
    **{
        f"agreements-{call}-{kind}-{form}": (
            lambda r, call=call, kind=kind, form=form: agreements(r, call, kind, form)
        )
        for call in CALLS
        for kind in ("ddp", "fsdp")
        for form in ("made", "iter", "list")
    },
}


def _run(rank: int, name: str) -> dict[str, Any]:
    start = time.monotonic()
    try:
        got: dict[str, Any] = {"got": CASES[name](rank)}
    except Exception as e:  # the test asserts on the type and message
        got = {"type": type(e).__name__, "error": str(e)}
    got["seconds"] = time.monotonic() - start
    return got


def everything(rank: int, world: int, port: int, out: str, timeout_s: float) -> None:
    """Every case in one process group; rank r writes `out.<r>`: {case: record}."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    got = {}
    for name in CASES:
        got[name] = _run(rank, name)
        Path(f"{out}.{rank}").write_text(json.dumps(got))  # what there is, should one hang
    for strategy in _STRATEGIES.values():
        strategy.close()
    dist.destroy_process_group()


def case(rank: int, world: int, port: int, out: str, name: str, timeout_s: float) -> None:
    """One case alone; rank r writes `out.<r>`. The ranks stay until every one has written
    (a rank that goes on keeps the group alive), then leave without a teardown."""
    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    Path(f"{out}.{rank}").write_text(json.dumps(_run(rank, name)))
    deadline = time.monotonic() + timeout_s + 10
    while time.monotonic() < deadline and not all(
        Path(f"{out}.{r}").exists() for r in range(world)
    ):
        time.sleep(0.05)
    os._exit(0)
