"""Two processes on CPU with gloo: DDP equals one process with the same global batch."""

from __future__ import annotations

import json
import math
import re
import time

import pytest
import torch
from safetensors.torch import load_file

import dist_fail
import dist_workers as W
import ftrain as ft
from helpers import tiny_llama
from launch import exit_codes, free_port, run_ranks


def spawn(fn, *args, world=2, timeout=240.0):
    """Run `fn` in `world` ranks; a hang fails the test after `timeout` s (CI never hangs), an
    error in a rank raises here."""
    run_ranks(fn, *args, world=world, timeout=timeout)


@pytest.mark.parametrize(
    ("kind", "accum"), [("ddp", 1), ("ddp", 2), ("ddp+count", 2), ("ddp+counted", 2)]
)
def test_ddp_equals_one_process_with_the_same_global_batch(tmp_path, kind, accum):
    """ddp+count: the path of models >= 2^20 parameters (items counted over the ranks before
    the forward, losses divided before backward) equals one process dividing afterwards;
    ddp+counted: the same path for a loss of one's own (`ft.losses.counted`)."""
    steps = 9  # 29 rows, 4 per global micro-batch: crosses an epoch end and a 1-row last batch
    spawn(W.equivalence, str(tmp_path), kind, steps, accum)
    single = ft.TrainState.create(tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3)
    single, losses = W.train(single, steps=steps, batch_size=4, accum=accum)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert (got["tokens"], got["epoch"], got["cursor"]) == (
        int(single.data.tokens_seen), single.epoch, single.data.cursor,
    )  # fmt: skip
    assert got["counted"] == (steps * accum if "+count" in kind else 0)
    params = load_file(str(tmp_path / "params.safetensors"))
    for n, p in single.params.items():
        torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_non_final_micro_batches_do_not_reduce_gradients(tmp_path, kind):
    """DDP all-reduces (counted by a comm hook, one per bucket) and FSDP reduce-scatters
    (counted at torch.distributed.reduce_scatter_single, one per sharded module) run in the
    final micro-batch only."""
    worker, name = (W.ddp_traffic, "calls") if kind == "ddp" else (W.fsdp_traffic, "fsdp-calls")
    spawn(worker, str(tmp_path))  # both settings, one after the other
    per_step = json.loads((tmp_path / f"{name}-False.json").read_text())
    every = json.loads((tmp_path / f"{name}-True.json").read_text())
    assert per_step >= 2 and per_step % 2 == 0  # 2 steps, the same collectives each step
    assert every == 4 * per_step  # syncing every micro-batch: 4 times the traffic


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_checkpoints_move_between_two_ranks_and_one(tmp_path, kind):
    """Saved by 2 DDP or FSDP ranks, resumed by 1 process, and the reverse: both continue
    exactly like one uninterrupted process (same global batch of 4; dropout is off so the
    ranks' dropout streams do not matter). FSDP saves one shard file per rank through
    torch.distributed.checkpoint, and nothing pickled."""
    steps, save_at = 7, 3

    def single(root=None):
        state = ft.TrainState.create(tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3)
        if root is not None and (ckpt := ft.latest_checkpoint(root)) is not None:
            state = ft.load_checkpoint(ckpt, state)
        elif root is not None:
            state, _ = W.train(state, steps=save_at, batch_size=4)
            ft.save_checkpoint(state, root)
        return W.train(state, steps=steps, batch_size=4)[0]

    reference = single()
    two_then_one, one_then_two = tmp_path / "a", tmp_path / "b"
    single(one_then_two)  # one process saves at 3
    # Two ranks train and save at 3 in `a`, then resume `b` at 3 (one launch: the imports
    # and the group's start-up cost more than the training).
    spawn(W.resume, [str(two_then_one), str(one_then_two)], save_at, steps, kind)
    ckpt = two_then_one / "step-3"
    assert ft.checkpoint.read_meta(ckpt)["world_size"] == 2
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    if kind == "fsdp":
        shards = [
            f"{d}/shard-0000{r}-model-00001-of-00001.safetensors"
            for d in ("model", "optimizer")
            for r in (1, 2)
        ]
    else:
        shards = ["model.safetensors", "optimizer.safetensors"]
    assert files == sorted(["COMMITTED", "config.json", "state.json", *shards])
    resumed = single(two_then_one)  # one process resumes it
    if kind == "fsdp":
        _hostile_shards(ckpt, tmp_path / "hostile")
        _cli_on_shards(ckpt, tmp_path / "exported")
    from_two = load_file(str(one_then_two / "final-2.safetensors"))
    for n, p in reference.params.items():
        torch.testing.assert_close(resumed.params[n], p, rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(from_two[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("mode", ["crash", "hang"])
def test_a_failing_rank_ends_the_other_with_a_clear_error(mode, capsys):
    """Rank 1 raises after one step. If its process exits, rank 0's next collective fails at
    once (gloo sees the closed socket; on a loaded machine it may report a send time-out
    instead, at the 5 s timeout); if it stays alive, rank 0 fails when the collective times out
    (`from_env(timeout=5 s)`) instead of hanging. Asserted on the worker's own line, not on
    gloo's wording, which changes with the load. The ranks fork from the suite's server (what
    is tested is the collective's end, not an interpreter's start or exit); rank 1 is killed
    once rank 0 has exited by itself, as the hanging one never does."""
    start = time.monotonic()
    codes = exit_codes(dist_fail.ranked, mode, wait_for=[0], timeout=90)
    elapsed = time.monotonic() - start
    out0 = capsys.readouterr().out  # the ranks' output; only rank 0 prints these lines
    assert codes[0] != 0, out0[-2000:]
    assert re.search(r"rank 0: the step raised \w+Error", out0), out0[-2000:]
    stopped = float(re.search(r"rank 0 stopped after ([\d.]+)s", out0).group(1))
    if mode == "crash":
        assert stopped < 30, out0[-2000:]
    else:  # rank 1's sockets stay open: only the timeout ends the collective
        assert 4 < stopped < 30, out0[-2000:]
    assert elapsed < 90


@pytest.mark.parametrize(
    ("kind", "accum"), [("fsdp", 1), ("fsdp", 2), ("hsdp", 2), ("fsdp+count", 2)]
)
def test_fsdp_equals_one_process_with_the_same_global_batch(tmp_path, kind, accum):
    """FSDP2 shards parameters, gradients and AdamW state; clipping uses the global norm
    (max_norm=0.5 is active here), so the run matches one process. HSDP (a replicate x shard
    mesh) too: its norm counts each shard once, not once per replica. fsdp+count: the large
    models' count-first path (see the DDP test)."""
    steps = 9
    spawn(W.equivalence, str(tmp_path), kind, steps, accum)
    single = ft.TrainState.create(tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3)
    single, losses = W.train(single, steps=steps, batch_size=4, accum=accum)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert got["tokens"] == int(single.data.tokens_seen)
    assert got["counted"] == (steps * accum if "+count" in kind else 0)
    params = load_file(str(tmp_path / "params.safetensors"))
    for n, p in single.params.items():
        torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_a_sharded_save_commits_on_all_ranks_or_none(tmp_path):
    spawn(W.fsdp_save_failures, str(tmp_path))
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"outcome-{rank}.json").read_text())
        # rank 1's shard write fails, then rank 0's commit: both ranks raise, nothing is
        # committed; then a save succeeds.
        assert outcome == ["CheckpointError", True, "CheckpointError", True, "step-1"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-1"]


def _sha256(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hostile_shards(ckpt, work):
    """A damaged sharded checkpoint fails cleanly, before DCP reads anything."""
    import shutil

    from safetensors.torch import load_file, save_file

    def fresh():
        return ft.TrainState.create(tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3)

    shard = "model/shard-00002-model-00001-of-00001.safetensors"

    def flip(d):
        data = bytearray((d / shard).read_bytes())
        data[-5] ^= 0xFF
        (d / shard).write_bytes(bytes(data))

    def drop(d):
        (d / shard).unlink()

    def pickle_metadata(d):  # DCP's default format: a pickled .metadata next to the shards
        (d / "model" / ".metadata").write_bytes(b"\x80\x04K\x01.")

    def forged_offsets(d):  # rank 2's chunks moved onto rank 1's: a gap and an overlap
        f = d / shard
        tensors = load_file(str(f))
        info = {k: {"saved_offsets": [0] * t.dim()} for k, t in tensors.items()}
        save_file(tensors, str(f), metadata={"DCP_SHARDING_INFO": json.dumps(info)})
        # Reseal: record the new size and digest, and the new state.json's digest.
        meta = json.loads((d / "state.json").read_text())
        meta["files"][shard] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        (d / "state.json").write_text(json.dumps(meta))
        (d / "COMMITTED").write_text(json.dumps({"state.json": _sha256(d / "state.json")}))

    for damage, verify, message in [
        (flip, True, "checksum"),
        (drop, True, "missing or not recorded"),
        (pickle_metadata, True, "missing or not recorded"),
        (forged_offsets, True, "do not cover it once"),
    ]:
        d = work / damage.__name__
        shutil.copytree(ckpt, d)
        damage(d)
        with pytest.raises(ft.CheckpointError, match=message):
            ft.load_checkpoint(d, fresh(), verify=verify)


def test_predict_gathers_exact_per_sample_outputs_across_ranks(tmp_path):
    """29 rows over 2 ranks at 2 rows each: every rank sees the same 29 rows, in the order one
    process yields them with batch 4 (no padding sample repeated); each rank's own share is
    disjoint (15 + 14). Sequences padded differently on each rank are padded with -100."""
    import numpy as np

    spawn(W.predict_gather, str(tmp_path))
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    single = list(ft.predict(state, ft.make_batches(W.ROWS, batch_size=4, shuffle=False),
                             W._outputs))  # fmt: skip
    got = [np.load(tmp_path / f"predict-{r}.npz") for r in (0, 1)]
    assert int(got[0]["local_rows"]) + int(got[1]["local_rows"]) == len(W.ROWS) == 29
    assert int(got[0]["local_rows"]) == 15
    for rank in (0, 1):
        assert sum(len(got[rank][f"g{i}_n"]) for i in range(len(single))) == 29
        for i, want in enumerate(single):
            labels, n = got[rank][f"g{i}_labels"], got[rank][f"g{i}_n"]
            np.testing.assert_array_equal(labels, want["labels"])  # -100 padding included
            np.testing.assert_array_equal(n, want["n"])
            pred = got[rank][f"g{i}_pred"]
            for row, length in enumerate(n):
                np.testing.assert_array_equal(pred[row, :length], want["pred"][row, :length])


def test_fsdp_fp16_loss_scaling_is_sharded_and_checkpointed(tmp_path):
    """Under FSDP the loss scale backs off from an overflowing 2**30 on every rank alike,
    master weights stay float32, and one process resumes the sharded checkpoint with the
    scale and the weights."""
    spawn(W.fsdp_fp16, str(tmp_path))
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["dtypes"] == ["torch.float32"]
    assert got["scale"] < 2.0**30 and all(math.isfinite(x) for x in got["losses"])
    strategy = ft.strategies.SingleDevice("cpu", precision="fp16")
    fresh = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=3, strategy=strategy)
    state = ft.load_checkpoint(got["path"], fresh)
    assert (float(state.scaler.scale), int(state.scaler.growth_tracker)) == (
        got["scale"],
        got["tracker"],
    )
    params = load_file(str(tmp_path / "params.safetensors"))
    for n, p in state.params.items():
        assert torch.equal(params[n], p.detach()), n


def _cli_on_shards(ckpt, out):
    """`python -m ftrain inspect/export` read sharded checkpoints too (whole tensors out)."""
    import contextlib
    import io

    from transformers import AutoModelForCausalLM

    from ftrain.extras.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["inspect", str(ckpt)]) == 0
        assert main(["export", str(ckpt), "--to", str(out)]) == 0
    assert "sharded into 4 files" in text.getvalue()
    fresh = ft.TrainState.create(tiny_llama(dropout=0.0), ft.optim.adamw(), seed=3)
    loaded = ft.load_checkpoint(ckpt, fresh)
    exported = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for n, p in loaded.params.items():
        assert torch.equal(exported[n], p), n


def test_from_env_under_accelerate_launch():
    """`accelerate launch` sets the same environment as torchrun; from_env joins it. (On a
    machine without GPUs accelerate's multi-process launcher is `--multi_gpu`; its `--cpu`
    multi-process mode needs MPI.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).parent / "workers" / "accelerate_probe.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(probe)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = sorted(re.findall(r"probe \w+ \d/\d [\d.]+", run.stdout))
    assert lines == ["probe DDP 0/2 3.0", "probe DDP 1/2 3.0"]
