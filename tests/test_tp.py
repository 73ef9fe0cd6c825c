"""Tensor parallelism (ft.strategies.TP) on CPU with gloo: 2 TP ranks, and FSDP x TP on 4,
equal one process with the same global batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import ftrain as ft
import tp_workers as W
from helpers import tiny_llama
from launch import run_ranks

TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32: the ranks sum in another order


def spawn_within(fn, out, *, world, seconds=240):
    """Run `fn(rank, world, port, out)` in `world` processes; kill them all past `seconds`."""
    run_ranks(fn, str(out), world=world, timeout=seconds)


def reference(steps=W.STEPS):
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3)
    return W.train(state, steps=steps, batch_size=4)


def assert_params_close(got: dict, state, what: str) -> None:
    for n, p in state.params.items():
        torch.testing.assert_close(got[n], p.detach(), **TOL, msg=f"{what}: {n}")


def test_tp_equals_one_process_and_its_checkpoints_reshard(tmp_path):
    """2 TP ranks (HF's base_model_tp_plan) train like one process with clipping active,
    save a sharded checkpoint that one process resumes, and resume one process's checkpoint;
    the export loads with from_pretrained; bad plans raise naming the problem."""
    spawn_within(W.tp_run, tmp_path, world=2)
    got = json.loads((tmp_path / "result.json").read_text())
    single, losses, norms = reference()
    assert got["ranks"] == [0, 1]  # one data-parallel rank: both read the whole batch
    assert got["losses"] == pytest.approx(losses, **{"rel": 1e-5, "abs": 1e-6})
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    assert sum(n > W.MAX_NORM for n in norms) >= 3  # clipping scaled most steps
    assert got["eval"] == pytest.approx(W.evaluate(single), rel=1e-5)  # counted once
    assert_params_close(load_file(str(tmp_path / "params.safetensors")), single, "TP")
    # TP 2 -> one process -> TP 2, both continuing exactly like the uninterrupted run.
    assert_params_close(load_file(str(tmp_path / "resumed.safetensors")), single, "resumed")
    _check_shards(tmp_path / "tp" / f"step-{W.SAVE_AT}")
    _check_export(tmp_path, single)
    errors = got["errors"]
    assert errors["tied"] is True  # tied embeddings and head stay one parameter
    # A plan splitting one of them broke the tie without a word (two parameters, trained apart).
    assert "the plan splits 'model.embed_tokens.weight', which is tied to" in errors["tied_split"]
    assert "'model.layers.*.mlp.nope_proj' matches no module" in errors["pattern"]
    assert "GPT2LMHeadModel has no config.base_model_tp_plan" in errors["no_plan"]
    assert "'replicated_with_grad_allreduce', which TP does not translate" in errors["layout"]
    assert "num_key_value_heads=1 cannot be split over 2" in errors["heads"]
    assert "plan['model.layers.*.mlp.up_proj'] must be a ParallelStyle" in errors["style"]
    assert "shard= chooses FSDP's units, which only exist with dp > 1" in errors["shard"]


def _check_shards(ckpt):
    """One safetensors shard per process, nothing pickled; a damaged shard fails cleanly."""
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    shards = [
        f"{d}/shard-0000{r}-{d.replace('optimizer', 'model')}-00001-of-00001.safetensors"
        for d in ("model", "optimizer")
        for r in (1, 2)
    ]
    assert files == sorted(["COMMITTED", "config.json", "state.json", *shards])
    bad = ckpt.parent / "damaged"
    shutil.copytree(ckpt, bad)
    data = bytearray((bad / shards[1]).read_bytes())
    data[-5] ^= 0xFF
    (bad / shards[1]).write_bytes(bytes(data))
    fresh = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3)
    with pytest.raises(ft.checkpoint.CheckpointError, match=r"sha256|checksum|digest"):
        ft.load_checkpoint(bad, fresh)


def _check_export(root, single):
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(root / "export")
    params = load_file(str(root / "params.safetensors"))
    for n, p in exported.named_parameters():
        assert torch.equal(p, params[n]), n  # the gathered TP parameters, whole
    with torch.no_grad():
        logits = exported(input_ids=W.PROBE).logits
        want = single.model(input_ids=W.PROBE).logits
    torch.testing.assert_close(logits, load_file(str(root / "logits.safetensors"))["logits"])
    torch.testing.assert_close(logits, want, **TOL)


@pytest.mark.slow
def test_fsdp_x_tp_on_a_2d_mesh_equals_one_process(tmp_path):
    """4 processes: 2 data-parallel groups (FSDP over "dp") of 2 TP ranks each."""
    spawn_within(W.fsdp_tp_run, tmp_path, world=4)
    got = json.loads((tmp_path / "result.json").read_text())
    single, losses, norms = reference()
    assert got["mesh"] == ["dp", "tp"] and got["ranks"] == [0, 2]
    assert got["losses"] == pytest.approx(losses, **{"rel": 1e-5, "abs": 1e-6})
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    assert_params_close(load_file(str(tmp_path / "params.safetensors")), single, "FSDP x TP")


def test_tp_needs_a_process_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"TP|RANK"):
        ft.strategies.TP()
    # One process holds the whole model: from_env("tp") is SingleDevice, the plan moot.
    from torch.distributed.tensor.parallel import ColwiseParallel

    plan = {"model.layers.*.mlp.up_proj": ColwiseParallel()}
    assert isinstance(ft.strategies.from_env("tp", plan=plan, dp=1), ft.strategies.SingleDevice)
    with pytest.raises(TypeError, match=r"\['dp'\]"):
        ft.strategies.from_env("tp", dp=2)


def test_tp_implements_the_strategy_protocol():
    """TP is a Strategy; its checkpoints are sharded (every process writes), and the two
    members the checkpoint code uses to pick one writer among all processes are there for
    every strategy."""
    tp = ft.strategies.TP
    seam = ("save_shards", "load_shards", "full_state_dict", "copy_whole", "sum_over_processes")
    for cls in (tp, ft.strategies.SingleDevice, ft.strategies.DDP, ft.strategies.FSDP):
        for name in seam:
            assert callable(getattr(cls, name)), (cls, name)
    assert {"process_rank", "sum_over_processes"} <= set(ft.strategies.Strategy.__dict__)
    assert tp.checkpoint_sharded is True
    one = ft.strategies.SingleDevice("cpu")
    assert one.process_rank == 0 and torch.equal(
        one.sum_over_processes(torch.ones(2)), torch.ones(2)
    )


def test_a_gradient_left_partial_over_tp_is_refused(tmp_path):
    """A SequenceParallel layer's weight gradient is a pending sum over tp: clipping and the
    update would use this rank's part only, so TP's grad_norm raises instead."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from ftrain.strategies._tp import _refuse_partial

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        whole = DTensor.from_local(torch.ones(3), mesh, [Replicate()])
        _refuse_partial([whole])  # replicated: fine
        pending = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        with pytest.raises(ValueError, match=r"shape \(3,\) is Partial over the tensor-parallel"):
            _refuse_partial([whole, pending])
    finally:
        dist.destroy_process_group()
