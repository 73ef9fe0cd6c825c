"""The benchmark scripts run (tiny shapes, CPU), so that they cannot rot; they measure, these
tests only check that each loop ran and reported (speed is never asserted in tests).

A script whose run is one `python SCRIPT` process is forked by `launch.start_python` (only the
interpreter's start-up skipped); one that starts processes itself (bench_gpu.py's nanoGPT
comparison, bench_loop.py's `--cache-malloc` restart) runs as a fresh interpreter."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import launch

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "tests" / "workers" / "nanogpt_stub"  # nanoGPT's interface, a bigram model
TINY = [
    "--device=cpu", "--precision=fp32", "--no-compile", "--n-layer=1", "--n-head=2",
    "--n-embd=16", "--block-size=16", "--vocab=64", "--batch-size=2", "--accum=2",
]  # fmt: skip


def _bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )  # fmt: skip


def _forked(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python bench/SCRIPT ARGS` forked by `launch.start_python` from the process that imported
    torch, ftrain and torch._dynamo (these scripts import all three: transformers' models pull
    in torch._dynamo), ~3 s sooner than a fresh interpreter; its stdout and stderr together."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = launch.start_python(ROOT / "bench" / script, *args, env=env,
                               preload=launch.DDP_PRELOAD)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess([script, *args], proc.returncode, out, out)


def _rows(out: str) -> dict[str, list[str]]:
    rows = [ln.strip("|").split("|") for ln in out.splitlines() if ln.startswith("| ")]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}


@pytest.mark.slow
def test_bench_gpu_compares_the_example_model_with_nanogpt_at_tiny_shapes(tmp_path):
    # Through scripts/gpu_check.sh, the one command a session lent a GPU runs (its nanoGPT part).
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(STUB), *TINY, "--iters=5",
         "--warmup=2", "--rounds=1", "--sides=nanogpt,ftrain,ftrain+get_batch,ftrain+divide,raw"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PARTS": "nanogpt", "OUT": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0 and "== 0 part(s) failed" in out.stdout, out.stdout[-3000:]
    assert (tmp_path / "nanogpt.txt").read_text() in out.stdout  # its output kept in $OUT
    rows = _rows(out.stdout)
    sides = ("ftrain", "ftrain+get_batch", "ftrain+divide", "raw", "nanogpt")
    assert set(rows) >= set(sides), out.stdout
    for side in sides:
        ms, tokens_s, mfu, _, last = rows[side]
        assert float(ms) > 0 and float(tokens_s.replace(",", "")) > 0 and float(mfu) >= 0
        assert 0 < float(last) < 2 * math.log(64)  # each trained: not diverged, not empty
    assert rows["nanogpt"][3] == "1.000"
    assert "1 layers x 2 heads x 16, block 16, batch 2 x accum 2" in out.stdout


@pytest.mark.slow
def test_bench_gpu_refuses_a_nanogpt_that_ignores_the_vocabulary_size(tmp_path):
    """nanoGPT sizes its model from data/<dataset>/meta.pkl (else 50304): one that does not
    read it would train another model than ftrain's, so the comparison stops."""
    for f in STUB.glob("*.py"):
        (tmp_path / f.name).write_text(f.read_text())
    train = tmp_path / "train.py"
    train.write_text(train.read_text().replace("if os.path.exists(meta_path):", "if False:"))
    out = _bench("bench_gpu.py", f"--nanogpt={tmp_path}", *TINY, "--iters=3", "--warmup=1",
                 "--rounds=1")  # fmt: skip
    assert out.returncode != 0
    assert "nanoGPT did not size its model to --vocab 64" in out.stderr, out.stderr[-2000:]


def test_bench_counted_runs_both_losses_and_compares_their_training():
    """bench_counted.py at tiny shapes (counted first from 1 parameter): both loops ran and
    reported, and trained alike (the script checks that); below the size it refuses."""
    tiny = ["--n-layer=1", "--n-head=2", "--n-embd=16", "--block=8", "--batch=2", "--steps=1",
            "--rounds=2"]  # fmt: skip
    out = _forked("bench_counted.py", *tiny, "--count-first-numel=1", timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
    rows = _rows(out.stdout)
    assert float(rows["counted: each loss divided before backward"][1]) > 0, out.stdout
    out = _forked("bench_counted.py", *tiny, timeout=120)
    assert out.returncode != 0 and "both loops would divide" in out.stdout, out.stdout[-2000:]


def test_bench_collate_times_both_readers():
    out = _forked("bench_collate.py", "--block=16", "--batch=2", "--stream-batch=4",
                  "--items=5", "--repeats=1", timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    times = re.findall(r"(?:windows|rows) ([0-9.]+) ms", out.stdout)
    assert len(times) == 2 and all(float(t) > 0 for t in times), out.stdout


def test_bench_gpu_refuses_an_unknown_side(tmp_path):
    for name in ("train.py", "configurator.py"):
        (tmp_path / name).write_text("")
    out = _bench("bench_gpu.py", f"--nanogpt={tmp_path}", *TINY, "--sides=nanogpt,ftrian")
    assert out.returncode != 0 and "--sides: unknown ['ftrian']" in out.stderr


def test_bench_gpu_names_what_a_nanogpt_folder_lacks(tmp_path):
    (tmp_path / "train.py").write_text("")
    out = _bench("bench_gpu.py", f"--nanogpt={tmp_path}", *TINY, timeout=120)
    assert out.returncode != 0 and "no configurator.py there" in out.stderr


@pytest.mark.slow
def test_bench_loop_runs_every_loop_and_its_memory_child():
    every = "--loops=raw,exact,ftrain,fabric,hf,ftrain"  # a repeated loop runs a second copy
    # The memory child and --alone's child (forked: one process each, as bench_loop starts
    # them) run next to the main run (a fresh interpreter: --cache-malloc restarts it), which
    # the two cores of a CI machine do in parallel.
    with ThreadPoolExecutor(2) as pool:
        children = pool.submit(
            lambda: [
                _forked("bench_loop.py", "--memory-child", "mlp", "ftrain"),
                _forked("bench_loop.py", "--alone-child", "mlp", "ftrain", "--steps=2"),
            ]
        )
        out = _bench("bench_loop.py", "--regime=mlp", "--rounds=1", "--steps=3",
                     "--memory-rounds=0", "--block=2", "--cache-malloc", every)  # fmt: skip
        child, alone = children.result()
    assert out.returncode == 0, out.stderr[-3000:]
    loops = {r[2] for r in (ln.split(" | ") for ln in out.stdout.splitlines()) if len(r) > 3}
    expected = {"raw", "exact", "ftrain", "hf", "ftrain#2"}
    try:
        import lightning.fabric  # noqa: F401  (the bench extra; CI may not have it)

        expected.add("fabric")
    except ImportError:
        assert "skipping fabric" in out.stderr
    assert loops >= expected, out.stdout
    assert re.search(r"\| mlp \| [0-9.]+ \| raw \| [0-9.]+ \| \*\*1\.000\*\*", out.stdout)
    assert "malloc caching (--cache-malloc)" in out.stdout  # restarted with glibc's tunables
    assert child.returncode == 0, child.stderr[-3000:]
    assert float(re.findall(r'"peak_growth_mb": ([0-9.e+-]+)', child.stdout)[-1]) >= 0
    assert alone.returncode == 0, alone.stderr[-3000:]
    got = json.loads([ln for ln in alone.stdout.splitlines() if ln.startswith("{")][-1])
    assert got["ms"] > 0 and got["faults"] >= 0 and got["sys_ms"] >= 0, got


@pytest.mark.slow
def test_count_step_counts_the_python_opcodes_of_a_step():
    out = _forked("count_step.py", "opcodes", "ftrain", "--steps=2")  # 2 traced steps, not 20
    assert out.returncode == 0, out.stderr[-3000:]
    total = re.search(r"ftrain: (\d+) Python opcodes a step", out.stdout)
    assert total and int(total.group(1)) > 1000, out.stdout
    assert "ftrain/grads.py:" in out.stdout  # the functions are named


@pytest.mark.slow
def test_ab_revision_runs_another_revisions_loop_next_to_this_trees():
    out = _forked("ab_revision.py", "HEAD", "--rounds=1", "--steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"rev's package: .*ftrain_rev", out.stdout), out.stdout  # renamed, imported
    rows = _rows(out.stdout)
    for loop in ("raw", "rev", "ftrain", "raw#2", "rev#2", "ftrain#2"):
        assert float(rows[loop][0]) > 0, out.stdout  # each loop ran and was timed
    assert rows["raw"][2] == "**1.000**", out.stdout


def test_the_guarded_raw_loop_keeps_the_guarantees_it_stands_for(monkeypatch):
    """bench_loop's `guarded` loop is the contract written by hand, against which ftrain's own
    overhead is read: it must train what the README loop trains (to float rounding: it divides
    each loss before backward, ftrain the gradients after), skip a non-finite step, leave the
    caller's random stream as it was, and not predict a row's first token from a left pad."""
    import copy

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_loop

    model, data, _ = bench_loop.build("mlp")
    hand, ours = copy.deepcopy(model), copy.deepcopy(model)
    guarded = bench_loop.guarded_loop(hand, 100)
    readme = bench_loop.make_loop("ftrain", ours, data, 100)
    left = [{**b, "attention_mask": b["attention_mask"].clone()} for b in data[2]]
    left[0]["attention_mask"][:, :3] = 0  # a left-padded micro-batch
    batches = [data[0], data[1], left, data[3]]
    rng = torch.get_rng_state()
    for k, micro in enumerate(batches):
        guarded(micro, k)
        readme(micro, k)
    assert torch.equal(torch.get_rng_state(), rng)
    for a, b in zip(hand.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        hand.fc1.weight[0, 0] = float("nan")  # a non-finite gradient: the step is skipped
    before = [p.detach().clone() for p in hand.parameters()]
    guarded(data[4], 4)
    for a, p in zip(before, hand.parameters(), strict=True):
        assert torch.equal(a.nan_to_num(), p.detach().nan_to_num())
