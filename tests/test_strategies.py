import contextlib

import torch

import ftrain as ft
from ftrain.strategies._base import local_grad_norm
from helpers import ragged_rows, tiny_llama


def test_single_device_is_a_strategy_and_moves_nested_batches():
    s = ft.strategies.SingleDevice("cpu")
    assert isinstance(s, ft.strategies.Strategy)
    batch = s.to_device({"a": torch.ones(2), "b": [torch.zeros(1), 3]})
    assert batch["a"].device.type == "cpu" and batch["b"][1] == 3
    assert (s.rank, s.world_size, s.grad_reduce_factor) == (0, 1, 1.0)


class Recording(ft.strategies.SingleDevice):
    """Records every call the core makes through the seam."""

    def __init__(self):
        super().__init__("cpu")
        self.calls = []

    def setup(self, model):
        self.calls.append("setup")
        return super().setup(model)

    def to_device(self, batch):
        self.calls.append("to_device")
        return super().to_device(batch)

    def grad_sync(self, model, *, final):
        self.calls.append(f"grad_sync(final={final})")
        return contextlib.nullcontext()

    def all_reduce_sum(self, tensor):
        self.calls.append("all_reduce_sum")
        return tensor

    def grad_norm(self, grads):
        self.calls.append("grad_norm")
        return local_grad_norm(grads)


def test_core_functions_go_through_the_strategy_seam():
    strategy = Recording()
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), strategy=strategy)
    micro = next(iter(ft.make_batches(ragged_rows(9), batch_size=3, accum=3)))
    grads, stats = ft.accumulate_grads(state, micro)
    state, _ = ft.clip_and_step(state, grads, lr=1e-3, stats=stats, max_norm=1.0)
    ft.evaluate(state, [micro[0]])
    assert strategy.calls == [
        "setup",
        "to_device",
        "grad_sync(final=False)",
        "to_device",
        "grad_sync(final=False)",
        "to_device",
        "grad_sync(final=True)",
        "all_reduce_sum",  # one collective for loss and counts
        "grad_norm",
        "to_device",
        "all_reduce_sum",
    ]


def test_local_grad_norm_equals_torch_over_mixed_dtypes():
    gs = [torch.randn(5), torch.randn(3, dtype=torch.float64), torch.randn(4)]
    ref = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in gs]))
    torch.testing.assert_close(local_grad_norm(gs).double(), ref, rtol=1e-6, atol=0)
