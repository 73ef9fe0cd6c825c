"""GPU suite: runs whenever CUDA is present, skipped on CPU-only machines.

The step path (accumulate_grads, clip_and_step, log-window updates between log steps, fp16
loss scaling) must never wait for the device: under `torch.cuda.set_sync_debug_mode("error")`
every synchronizing CUDA call (`.item()`, a blocking device-to-host copy, `nonzero`, ...)
raises. The model is a plain module (embedding, dropout, linear) so that the check is about
ftrain's code, not about a model library's own syncs. Speed and memory against a raw loop are
measured by bench/bench_gpu.py, not asserted here.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import ftrain as ft

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

V, T = 97, 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 64)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(64, V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.emb(input_ids)))


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]):
    logits = model(batch["input_ids"]).float()
    labels = batch["labels"]
    loss = nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss, (labels != -100).sum()


def _micro(device: torch.device, accum: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(accum):
        ids = torch.randint(0, V, (4, T), generator=g)
        labels = ids.clone()
        labels[:, :5] = -100  # a masked prompt, so the item count is data dependent
        out.append({"input_ids": ids.to(device), "labels": labels.to(device)})
    return out


@contextlib.contextmanager
def _no_sync():
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # torch warns that the debug mode is a prototype
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_step_path_never_syncs(precision):
    device = torch.device("cuda")
    torch.manual_seed(0)
    strategy = ft.strategies.SingleDevice(device, precision=precision)
    state = ft.TrainState.create(TinyLM(), ft.optim.adamw(weight_decay=0.1), strategy=strategy)
    micro = _micro(device)
    lr = ft.schedules.warmup_cosine(1e-3, 2, 10)
    # One step outside the check: first calls may initialise CUDA state lazily.
    grads, stats = ft.accumulate_grads(state, micro, _loss)
    state, info = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step), max_norm=1.0)
    window = ft.logging.window(state)
    with _no_sync():
        for _ in range(3):  # README loop between two log steps
            grads, stats = ft.accumulate_grads(state, micro, _loss)
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=1.0
            )
            window = ft.logging.update(window, stats, info)
    record, _ = ft.logging.emit(window, state)  # the log step reads back: outside the check
    assert record["loss"] > 0 and state.step == 4
    if precision == "fp16":
        assert state.scaler.scale is not None and float(state.scaler.scale) > 0


def _loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return _loss(model, batch)[0]


@pytest.mark.parametrize("items", ["host", "device"])
def test_counting_first_never_syncs(monkeypatch, items):
    """The count-first path (models of `COUNT_FIRST_NUMEL` parameters and more; forced here)
    with a loss of one's own (`ft.losses.counted`) whose count is a host int (the targets'
    size: copied to the device without waiting) or a device tensor."""
    import ftrain.grads as grads_module

    monkeypatch.setattr(grads_module, "COUNT_FIRST_NUMEL", 1)
    device = torch.device("cuda")
    strategy = ft.strategies.SingleDevice(device)
    state = ft.TrainState.create(TinyLM(), ft.optim.adamw(), strategy=strategy)
    count = (lambda b: b["labels"].numel()) if items == "host" else (
        lambda b: (b["labels"] != -100).sum())  # fmt: skip
    loss_fn = ft.losses.counted(_loss_sum, items=count)
    micro = _micro(device)
    grads, stats = ft.accumulate_grads(state, micro, loss_fn)
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3, max_norm=1.0)
    with _no_sync():
        for _ in range(3):
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3, max_norm=1.0)
    assert state.step == 4 and float(stats.loss) > 0


def test_fp16_overflow_skips_and_backs_off_without_sync():
    device = torch.device("cuda")
    torch.manual_seed(0)
    strategy = ft.strategies.SingleDevice(device, precision="fp16")
    state = ft.TrainState.create(TinyLM(), ft.optim.adamw(), strategy=strategy)
    micro = _micro(device, accum=1)
    before = {n: p.detach().clone() for n, p in state.params.items()}
    scale = float(state.scaler.scale)
    with _no_sync():
        grads, stats = ft.accumulate_grads(state, micro, _loss)
        next(iter(grads.values())).fill_(float("inf"))  # an overflow, on the device
        state, info = ft.clip_and_step(state, grads, stats=stats, lr=1e-3, max_norm=1.0)
    assert bool(info.skipped) and float(state.scaler.scale) == scale / 2
    for n, p in state.params.items():
        assert torch.equal(p, before[n]), n


def test_gradients_are_released_on_the_device():
    """Donated gradients free their device memory: after the step only parameters and
    optimizer state stay allocated (the README loop's `grads` variable holds nothing)."""
    device = torch.device("cuda")
    model = nn.Linear(1024, 1024, bias=False).to(device)
    state = ft.TrainState.create(model, ft.optim.sgd(), strategy=ft.strategies.SingleDevice(device))

    def loss_fn(m, x):
        return m(x).sum(), torch.tensor(x.shape[0], device=device)

    x = torch.randn(8, 1024, device=device)
    grads, stats = ft.accumulate_grads(state, [x], loss_fn)
    torch.cuda.synchronize()
    with_grads = torch.cuda.memory_allocated()
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    torch.cuda.synchronize()
    released = with_grads - torch.cuda.memory_allocated()
    # The gradient's 4 MiB go; the step's own small tensors (a few hundred bytes) may come.
    assert released >= 1024 * 1024 * 4 - 4096, f"only {released} bytes released"


def test_background_save_stages_without_blocking_the_loop(tmp_path):
    """A background save copies into pinned host memory without a host sync, and what it
    writes is the state at the save even though the next (in-place) steps run meanwhile."""
    device = torch.device("cuda")
    strategy = ft.strategies.SingleDevice(device, precision="bf16")
    state = ft.TrainState.create(TinyLM(), ft.optim.adamw(), strategy=strategy)
    micro = _micro(device)
    grads, stats = ft.accumulate_grads(state, micro, _loss)
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-3)
    saved = {n: p.detach().clone() for n, p in state.params.items()}
    saved_loss = float(stats.loss)
    try:
        with _no_sync():
            ft.save_checkpoint(state, tmp_path, blocking=False, metrics={"loss": stats.loss})
            for _ in range(3):
                grads, stats = ft.accumulate_grads(state, micro, _loss)
                state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-1)
    finally:
        ft.wait_for_checkpoint()
    fresh = ft.TrainState.create(TinyLM(), ft.optim.adamw(), strategy=strategy)
    loaded = ft.load_checkpoint(tmp_path / "step-1", fresh)
    assert loaded.step == 1
    # A device-tensor metric is read back in the writer thread, after the staging copies.
    assert ft.checkpoint.read_meta(tmp_path / "step-1")["metrics"]["loss"] == saved_loss
    for n, p in loaded.params.items():
        assert torch.equal(p, saved[n]), n
    # ... and not the values the later steps wrote into the same (donated) tensors meanwhile.
    assert not torch.equal(state.params["head.weight"], saved["head.weight"])


def test_pinned_groups_are_page_locked_and_equal_the_unpinned_ones():
    """`make_batches(pin_memory=True)` without workers (the example on CUDA): DataLoader pins
    what the in-process path collates; the batches are those of the unpinned call."""
    rows = [{"input_ids": list(range(1, 2 + i % 7))} for i in range(20)]
    plain = list(ft.make_batches(rows, batch_size=3, accum=2, seed=1))
    pinned = list(ft.make_batches(rows, batch_size=3, accum=2, seed=1, pin_memory=True))
    assert [len(g) for g in pinned] == [len(g) for g in plain]
    for g, h in zip(pinned, plain, strict=True):
        for b, c in zip(g, h, strict=True):
            assert b.keys() == c.keys()
            for k in b:
                assert b[k].is_pinned() and torch.equal(b[k], c[k]), k
