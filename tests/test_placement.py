"""Placement only in strategies/ (issue 25): the seam's placement members, the functions for code
without a strategy at hand, and a scan showing that nothing else asks what kind of tensor it
holds."""

from pathlib import Path

import pytest
import torch

import ftrain as ft

SRC = Path(ft.__file__).parent

# What a placement (or backend) question looks like in source. `torch.cuda` is not here: the
# core's CUDA calls (dropout generators, pinned memory, memory statistics) ask about the device,
# not about how a tensor is laid out over processes.
PLACEMENT = (
    "device_mesh",
    "DeviceMesh",
    "DTensor",
    "is_cuda",
    "to_local",
    "from_local",
    "full_tensor",
    "distribute_tensor",
    "placements",
    "torch.distributed.tensor",
    "fully_shard",
    "DistributedDataParallel",
)
MEMBERS = ("local_view", "is_distributed")
STRATEGIES = (ft.strategies.SingleDevice, ft.strategies.DDP, ft.strategies.FSDP, ft.strategies.TP)


def test_no_placement_question_outside_strategies():
    """Every .py file under ftrain/ but strategies/, comments and docstrings included."""
    hits = []
    for f in sorted(SRC.rglob("*.py")):
        if (SRC / "strategies") in f.parents:
            continue
        for number, line in enumerate(f.read_text().splitlines(), 1):
            found = [word for word in PLACEMENT if word in line]
            if found:
                hits.append(f"{f.relative_to(SRC.parent)}:{number}: {found} {line.strip()}")
    assert not hits, "placement questions belong to ft.strategies:\n" + "\n".join(hits)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_every_strategy_implements_the_placement_seam(cls):
    for name in MEMBERS:
        assert callable(getattr(cls, name)), (cls, name)
        assert name in ft.strategies.Strategy.__dict__  # part of the documented protocol


def test_plain_tensors_are_whole_for_the_strategy_and_the_functions():
    s, t = ft.strategies.SingleDevice("cpu"), torch.arange(6.0).reshape(2, 3)
    assert s.local_view(t) is t and not s.is_distributed(t)
    assert ft.strategies.local_view(t) is t and not ft.strategies.is_distributed(t)
    assert ft.strategies.gather_whole(t, like=t) is t
    assert ft.strategies.local_part(t, like=t) is t
    assert not ft.strategies.is_distributed(torch.nn.Linear(2, 2))  # any object may be asked


def test_distributed_tensors_give_their_local_part_and_gather_back(tmp_path):
    """A DTensor on a one-process mesh: the local view shares storage (the fused optimizers
    update through it), gather_whole and local_part are inverse (Muon's round trip), and the
    strategy's members answer as the functions do."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        s = ft.strategies.SingleDevice("cpu")
        for placement in (Shard(0), Replicate()):
            whole = torch.arange(6.0).reshape(3, 2)
            dt = DTensor.from_local(whole.clone(), mesh, [placement])
            assert ft.strategies.is_distributed(dt) and s.is_distributed(dt)
            local = ft.strategies.local_view(dt)
            assert type(local) is torch.Tensor and torch.equal(s.local_view(dt), local)
            local.add_(1)  # in place, through the view
            assert torch.equal(dt.full_tensor(), whole + 1)
            gathered = ft.strategies.gather_whole(local, like=dt)
            assert type(gathered) is torch.Tensor and torch.equal(gathered, whole + 1)
            part = ft.strategies.local_part(gathered, like=dt)
            assert type(part) is torch.Tensor and torch.equal(part, local)
    finally:
        dist.destroy_process_group()
