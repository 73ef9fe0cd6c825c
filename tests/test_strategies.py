import contextlib

import pytest
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


# --- from_env in one process, and the strategy's lifetime ---------------------------------------


def test_from_env_in_one_process_passes_device_and_precision(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    s = ft.strategies.from_env("ddp", precision="bf16", device="cpu")
    assert isinstance(s, ft.strategies.SingleDevice)  # issue 19: bf16 was dropped silently
    assert s.precision == ft.precision.Precision.of("bf16") and s.device == torch.device("cpu")
    # What one process satisfies as it is (nothing to sync) is accepted ...
    assert ft.strategies.from_env("fsdp", sync_every_micro=True, replicate=1).precision == (
        ft.precision.Precision()
    )
    # ... and what it cannot honour raises, naming it.
    with pytest.raises(TypeError, match=r"from_env\('ddp'\).*\['plan'\]"):
        ft.strategies.from_env("ddp", plan={})  # TP's keyword, dropped under DDP: refused
    with pytest.raises(TypeError, match="plan must be a non-empty"):
        ft.strategies.from_env("tp", plan={})  # validated even where one process ignores it
    with pytest.raises(TypeError, match=r"from_env\('fsdp'\).*\['replicate', 'shard'\]"):
        ft.strategies.from_env("fsdp", shard=lambda m: True, replicate=2)
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        ft.strategies.from_env(bucket_cap_mb=10)


def test_from_env_takes_accelerate_launchs_mixed_precision_or_refuses_another(monkeypatch):
    """`accelerate launch --mixed_precision bf16` (or its config file) says so only in
    ACCELERATE_MIXED_PRECISION: from_env returned a float32 strategy without a word."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    # Set in this process (transformers 4's TrainingArguments(bf16=True) does so), not by a
    # launch: accelerate launch always sets ACCELERATE_DYNAMO_BACKEND beside it.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    assert ft.strategies.from_env(precision="fp32").precision == ft.precision.Precision.of("fp32")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # accelerate's default: nothing said
    assert ft.strategies.from_env(precision="bf16").precision == ft.precision.Precision.of("bf16")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "BF16")
    assert ft.strategies.from_env().precision == ft.precision.Precision.of("bf16")
    for launched in ("bf16", "fp16"):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
        expected = ft.precision.Precision.of(launched)
        assert ft.strategies.from_env().precision == expected
        assert ft.strategies.from_env("fsdp", precision=expected).precision == expected
        differs = f"differs from accelerate launch's --mixed_precision {launched}"
        with pytest.raises(ValueError, match=differs):
            ft.strategies.from_env(precision="fp32")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="--mixed_precision fp8"):
        ft.strategies.from_env()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match=r"told to use FSDP.*from_env\('ddp'\) would not shard"):
        ft.strategies.from_env("ddp")
    assert isinstance(ft.strategies.from_env("fsdp"), ft.strategies.SingleDevice)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="told to use DeepSpeed"):
        ft.strategies.from_env("fsdp")


def test_single_device_lifetime_is_a_no_op():
    with ft.strategies.from_env() as s:
        state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd(), strategy=s)
    s.close()
    s.abort()
    assert state.model(torch.ones(1, 2)).shape == (1, 1)  # nothing was torn down
    with pytest.raises(KeyError), ft.strategies.SingleDevice("cpu"):
        raise KeyError("the loop's error passes through")


def _launch(kind: str, mode: str, timeout: float = 150.0):
    """Two ranks as torchrun starts them (environment variables), each running
    tests/workers/dist_lifetime.py as `python SCRIPT` would, its end included: the
    interpreter's exit (threads joined, objects collected, exit handlers) is what these tests
    check. `launch.start_python` forks them from a process that imported what the script
    imports (torch, ftrain; DDP's torch._dynamo) once, instead of an interpreter start-up a
    rank, and lets each exit as a fresh interpreter does."""
    import os
    from pathlib import Path

    from launch import DDP_PRELOAD, free_port, start_python

    port = free_port()
    script = Path(__file__).parent / "workers" / "dist_lifetime.py"
    procs = []
    try:
        for rank in (0, 1):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))  # fmt: skip
            preload = DDP_PRELOAD if kind == "ddp" else ("torch", "ftrain")
            procs.append(start_python(script, kind, mode, env=env, preload=preload))
        # a hang fails the test here instead of blocking CI
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


@pytest.mark.slow
def test_with_from_env_leaves_the_group_when_a_rank_raises_in_the_loop():
    """Rank 1 raises inside `with from_env() as strategy:`; the collective timeout is the
    default 10 minutes, so both exiting within the test's timeout shows that nothing waits for
    it: rank 1 leaves without a barrier, and rank 0's next collective fails at once."""
    codes, (out0, out1) = _launch("ddp", "raise")
    assert codes[1] != 0 and "rank 1 fails on purpose" in out1, out1
    assert "left:" not in out1
    assert codes[0] != 0 and "left:" not in out0, out0  # rank 0's collective failed


@pytest.mark.slow
def test_with_from_env_closes_in_order_with_the_model_still_alive():
    # (The 2-process tests in test_distributed.py end with close() too, DDP and FSDP.)
    codes, outs = _launch("ddp", "clean")
    assert codes == [0, 0], outs
    assert all(f"rank {r} left: initialized=False" in o for r, o in enumerate(outs)), outs


@pytest.mark.parametrize(
    ("kind", "argument", "mode"),
    [
        ("fsdp", "replicate", "refuse"),
        ("tp", "dp", "refuse"),
        ("fsdp", "replicate", "refuse-direct"),
        ("tp", "dp", "refuse-direct"),
    ],
)
def test_a_strategy_that_refuses_its_arguments_leaves_the_group_it_joined(kind, argument, mode):
    """The check needs the world size, so it runs after joining; the strategy is never returned
    to be closed, so it must leave by itself (else the process hangs or aborts at exit)."""
    codes, outs = _launch(kind, mode, timeout=60)
    assert codes == [0, 0], outs
    for out in outs:
        assert f"refused: {argument} must be an int dividing the world size 2" in out or (
            f"refused: {argument} must divide the world size 2" in out
        ), out
        assert "initialized=False" in out, out


@pytest.mark.parametrize("cls", [ft.strategies.DDP, ft.strategies.FSDP, ft.strategies.TP])
def test_arguments_that_need_no_group_are_refused_before_joining_one(cls, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)  # joining would raise "launch with torchrun"
    with pytest.raises(ValueError, match="precision"):
        cls(precision="fp8")
    assert not torch.distributed.is_initialized()


def test_fsdp_refuses_a_float16_mixed_precision_policy_without_loss_scaling(monkeypatch):
    """docs/strategies.md points to `mp_policy=` for FSDP's own mixed precision; float16
    compute or reduction with precision fp32 or bf16 has no loss scale: small gradients became
    zero without an error. Refused before joining a group; with precision="fp16" it is taken."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)  # joining would raise "launch with torchrun"
    for policy, named in (
        (MixedPrecisionPolicy(param_dtype=torch.float16), "param_dtype=torch.float16"),
        (MixedPrecisionPolicy(reduce_dtype=torch.float16), "reduce_dtype=torch.float16"),
    ):
        for precision in (None, "bf16"):
            with pytest.raises(ValueError, match=f"{named}.*without loss scaling"):
                ft.strategies.FSDP(mp_policy=policy, precision=precision)
    with pytest.raises(RuntimeError, match="needs a process group"):  # past the checks
        ft.strategies.FSDP(mp_policy=MixedPrecisionPolicy(torch.float16), precision="fp16")
    with pytest.raises(RuntimeError, match="needs a process group"):
        ft.strategies.FSDP(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert not torch.distributed.is_initialized()


def test_close_waits_for_the_strategys_own_background_shard_write(tmp_path):
    """close() must not destroy the groups a background save still talks over. The strategy
    knows of that save because it started it (`save_shards_async`), so `ft.strategies` needs
    nothing from `ft.checkpoint` (the core's import graph has no cycle, tests/test_layout.py).
    One rank of a real gloo group, in a fresh process; the shard write is a slow stand-in."""
    import os
    import socket
    import subprocess
    import sys

    script = """
import threading, time
from pathlib import Path
import ftrain as ft
from ftrain.strategies import _dcp

events = []

def slow_save(parts, commit, *, groups, rank):
    def write():
        time.sleep(1.0)
        events.append("written")
    return write

_dcp.save_shards_async = slow_save
strategy = ft.strategies.DDP(device="cpu")
write = strategy.save_shards_async({Path("m"): {}}, commit=lambda: None)
threading.Thread(target=write).start()  # as ft.checkpoint runs it
time.sleep(0.1)
strategy.close()
events.append("closed")
print(events)
"""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "['written', 'closed']", out.stderr[-3000:]


def test_close_returns_after_a_background_shard_save_whose_thread_could_not_start(tmp_path):
    """save_checkpoint(blocking=False) raised and forgot a save whose thread could not start,
    but the strategy still waited for that write: close() hung forever (no timeout). One rank
    of a real gloo group, FSDP (a sharded save), in a fresh process bounded by a timeout."""
    import os
    import subprocess
    import sys

    from cluster_launch import free_port

    script = f"""
import threading, torch
import ftrain as ft

strategy = ft.strategies.FSDP(device="cpu")
state = ft.TrainState.create(torch.nn.Linear(4, 2), ft.optim.sgd(), strategy=strategy)
start = threading.Thread.start

def refuse(thread):
    if thread.name == "ftrain-checkpoint":
        raise RuntimeError("can't start new thread")
    start(thread)

threading.Thread.start = refuse
try:
    ft.save_checkpoint(state, {str(tmp_path)!r}, blocking=False)
except ft.CheckpointError as e:
    print("raised:", e)
threading.Thread.start = start
strategy.close()
print("closed")
"""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    try:
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"close() hung: {e.stdout!r}") from None
    assert "raised: starting the background save of step 0 failed" in out.stdout, out.stderr
    assert out.stdout.strip().endswith("closed"), out.stderr[-3000:]
