"""Resume conformance: every piece of resumable state, SIGKILLed at a point of a step, of a
blocking save, of a background save or of an evaluation, then resumed, ends bit-equal to the
uninterrupted run: parameters, buffers, optimizer state, counters, the rows each step trained on
(in order), every evaluation, the tracker's run and its metrics.

`CASES` is the table (docs/guarantees.md shows the same one; a test keeps them equal). Each test
runs tests/workers/conformance_loop.py to the end once per case (the reference), then with
`--kill PHASE:STEP:K` (the worker kills itself there, deterministically) and once more with the
same arguments less the kill, and compares what the two runs wrote.

The whole matrix (`len(CASES) x len(PHASES)` kills) takes minutes: `python
bench/conformance_matrix.py` runs it and prints a table, and `FTRAIN_CONFORMANCE=all` makes this
file run it too. By default the tests run a seeded sample (`SAMPLE` kills of different cases,
every phase among them); the seed is the day's number, so the sample rotates from day to day
and stays the same within one, and `FTRAIN_CONFORMANCE_SEED=<n>` picks another.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import re
import signal
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file

import conformance_loop
import launch
from conformance_loop import ACCUM, TOTAL

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 180  # seconds per worker process; a run takes 3-10 s on a busy 2-core machine


class Case(NamedTuple):
    """One piece of resumable state, trained by the worker's README loop."""

    name: str
    optimizer: str = "adamw"  # adamw, sgd, muon, partition, from_torch
    data: str = "map"  # map: 30 rows, 2.25 epochs; stream: 2 sharded streams mixed and packed
    workers: int = 0  # make_batches(num_workers=...)
    features: tuple[str, ...] = ()  # ema, save-in-swap, fp16, guard, dp, mlflow
    known: tuple[tuple[str, str], ...] = ()  # (phase, diagnosis) of a known resume bug

    def xfail(self, phase: str) -> str | None:
        return dict(self.known).get(phase)

    def args(self) -> list[str]:
        out = ["--optimizer", self.optimizer, "--data", self.data, "--workers", str(self.workers)]
        return out + [a for f in self.features for a in ("--feature", f)]


# fmt: off
CASES = (
    Case("adamw"),
    Case("sgd", optimizer="sgd"),                      # Nesterov momentum buffers
    Case("muon", optimizer="muon"),                    # Muon on matrices, AdamW on biases
    Case("partition", optimizer="partition"),          # AdamW + SGD groups, an lr factor
    Case("from_torch", optimizer="from_torch"),        # torch.optim.RMSprop, centered, momentum
    Case("ema", features=("ema",)),                    # ema(adamw); evaluations in swap_ema
    Case("ema-save-in-swap", features=("ema", "save-in-swap")),  # saves in swap_ema too
    Case("fp16", features=("fp16",)),                  # loss scale that backs off and grows
    Case("map-2-workers", workers=2),                  # background loading, dropout
    Case("stream", data="stream"),                     # shards, shuffle buffer, mix, pack
    Case("stream-2-workers", data="stream", workers=2),
    Case("guard", features=("guard",)),                # a spike rolls back to a checkpoint
    Case("guard-stream", data="stream", features=("guard",)),
    Case("dp-sgd", optimizer="sgd", features=("dp",)),  # private_grads noise (its key)
    Case("mlflow", features=("mlflow",)),              # MLflowSink's run id and metrics
)
# fmt: on
PHASES = ("step", "save", "bgsave", "eval")
SAMPLE = 4  # kills per default run, one per phase: about 60 s on a busy 2-core machine


def matrix() -> list[tuple[Case, str]]:
    return [(case, phase) for case in CASES for phase in PHASES]


def sample(seed: int, n: int = SAMPLE) -> list[tuple[Case, str]]:
    """`n` kills of different cases, every phase among them (`n >= len(PHASES)`), chosen by
    `seed`."""
    rng = random.Random(seed)
    cases = rng.sample(CASES, n)
    phases = [*PHASES, *(rng.choice(PHASES) for _ in range(n - len(PHASES)))]
    rng.shuffle(phases)
    return list(zip(cases, phases, strict=True))


def _seed() -> int:
    given = os.environ.get("FTRAIN_CONFORMANCE_SEED")
    return int(given) if given else datetime.date.today().toordinal()


SEED = _seed()
SELECTED = matrix() if os.environ.get("FTRAIN_CONFORMANCE") == "all" else sample(SEED)


# --- running the worker -----------------------------------------------------------------------


def run_worker(root: Path, case: Case, *, kill: str | None = None, saves: str = "blocking"):
    """Run the worker to its end or its kill; return its exit status and output. The worker is
    forked from the suite's server (torch and ftrain imported once, not per run)."""
    argv = [str(root), *case.args(), "--saves", saves, *(["--kill", kill] if kill else [])]
    root.mkdir(parents=True, exist_ok=True)
    log = root / "worker.log"
    # Output to a file: a killed run's orphaned loader workers would hold a pipe open. The
    # worker starts a session of its own, so that whatever it leaves is ended with it.
    ctx = launch.start_ranks(conformance_loop.ranked, argv, str(log), world=1)
    (proc,) = ctx.processes
    try:
        proc.join(TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        launch.kill(ctx)
    return proc.exitcode, log.read_text(errors="replace")[-4000:] if log.exists() else ""


def trace(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "trace.jsonl").read_text().splitlines()]


def effective(lines: list[dict]) -> tuple[list[tuple[int, list]], dict[int, float]]:
    """The steps that made the final state and the evaluations of those steps: a step (or an
    evaluation) recorded again after a restart or a rollback replaces the earlier record of
    that step and of every later one."""
    steps: list[tuple[int, list]] = []
    evals: dict[int, float] = {}
    for r in lines:
        if r["kind"] == "step":
            steps = [s for s in steps if s[0] < r["step"]] + [(r["step"], r["ids"])]
            evals = {k: v for k, v in evals.items() if k < r["step"]}
        elif r["kind"] == "eval":
            evals[r["step"]] = r["loss"]
    return steps, evals


def kill_point(case: Case, phase: str, ref: list[dict], rng: random.Random) -> str:
    """A kill point of `phase` that the reference run reaches, chosen by `rng`."""
    if phase == "step":
        step, ids = rng.choice([(r["step"], r["ids"]) for r in ref if r["kind"] == "step"])
        k = rng.choice([*range(len(ids)), ACCUM, ACCUM + 1])  # a forward, the update, after
        return f"step:{step}:{k}"
    if phase == "eval":
        step, n = rng.choice([(r["step"], r["batches"]) for r in ref if r["kind"] == "eval"])
        return f"eval:{step}:{rng.randrange(n + 1)}"
    saves = [(r["step"], r["ops"]) for r in ref if r["kind"] == "save" and r["step"] < TOTAL]
    step, ops = rng.choice(saves)
    return f"{phase}:{step}:{rng.randrange(ops + 1)}"  # before op k (1..ops), or after (0)


_REFERENCES: dict[tuple[str, str], Path] = {}


def reference(case: Case, tmp_path_factory: Any, saves: str = "blocking") -> Path:
    """The uninterrupted run of `case`, once per session (`tmp_path_factory`: pytest's)."""
    key = (case.name, saves)
    if key not in _REFERENCES:
        root = tmp_path_factory.mktemp(f"ref-{case.name}-{saves}")
        rc, out = run_worker(root, case, saves=saves)
        assert rc == 0, f"the uninterrupted run of {case.name} ({saves} saves) failed:\n{out}"
        _REFERENCES[key] = root
    return _REFERENCES[key]


# --- the comparison ---------------------------------------------------------------------------


def assert_same_run(ref: Path, got: Path) -> None:
    """Bit-equal tensors, equal plain values, the same steps on the same rows, equal evals."""
    a, b = load_file(ref / "final.safetensors"), load_file(got / "final.safetensors")
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, f"{got.name}: tensors that differ from the uninterrupted run: {differ}"
    plain_a = json.loads((ref / "final.json").read_text())
    plain_b = json.loads((got / "final.json").read_text())
    assert plain_b == plain_a
    steps_a, evals_a = effective(trace(ref))
    steps_b, evals_b = effective(trace(got))
    assert [s for s, _ in steps_b] == [s for s, _ in steps_a]
    for (step, ids_a), (_, ids_b) in zip(steps_a, steps_b, strict=True):
        assert ids_b == ids_a, f"step {step} trained on other rows"
    assert evals_b == evals_a


def choose_kill(case: Case, phase: str, seed: int, ref: Path) -> str:
    """The kill point of `case` in `phase` for `seed`."""
    return kill_point(case, phase, trace(ref), random.Random(f"{seed}/{case.name}/{phase}"))


def check_conformance(case: Case, kill: str, tmp_path: Path, tmp_path_factory: Any) -> None:
    """Kill `case` at `kill`, restart it, compare with the uninterrupted run.

    With background saves, the uninterrupted run with background saves must equal the one
    with blocking saves first: a save in flight while the loop trains on changes nothing.
    """
    ref = reference(case, tmp_path_factory)
    saves = "background" if kill.startswith("bgsave") else "blocking"
    if saves == "background":
        assert_same_run(ref, reference(case, tmp_path_factory, saves))
    root = tmp_path / "killed"
    rc, out = run_worker(root, case, kill=kill, saves=saves)
    assert rc == -signal.SIGKILL, f"the run was to die at {kill}, but it ended with {rc}:\n{out}"
    last = trace(root)[-1]
    assert (last["kind"], last["at"]) == ("kill", kill), last
    rc, out = run_worker(root, case, saves=saves)
    assert rc == 0, f"the restart after a kill at {kill} failed:\n{out}"
    assert not [p.name for p in (root / "ckpt").iterdir() if p.name.startswith(".tmp")]
    assert_same_run(ref, root)
    if "mlflow" in case.features:  # every process logged to the run the first one created
        ids = {r["run_id"] for r in trace(root) if r["kind"] == "tracker"}
        assert len(ids) == 1, ids


SLOW = {"from_torch", "dp-sgd", "mlflow"}  # the slowest cases: twice the others' time


def _param(case: Case, phase: str):
    reason = case.xfail(phase)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    marks += [pytest.mark.slow] if case.name in SLOW else []
    return pytest.param(case, phase, id=f"{case.name}-{phase}", marks=marks)


@pytest.mark.parametrize(("case", "phase"), [_param(c, p) for c, p in SELECTED])
def test_a_run_killed_and_resumed_equals_the_uninterrupted_run(
    case, phase, tmp_path, tmp_path_factory
):
    kill = choose_kill(case, phase, SEED, reference(case, tmp_path_factory))
    print(f"kill point {kill} (seed {SEED}: FTRAIN_CONFORMANCE_SEED={SEED} reruns it)")
    check_conformance(case, kill, tmp_path, tmp_path_factory)


# --- the table and the sample -----------------------------------------------------------------


def test_the_guarantees_page_shows_this_table():
    page = (REPO / "docs" / "guarantees.md").read_text(encoding="utf-8")
    section = page.split("## The resume conformance suite", 1)[1].split("\n## ", 1)[0]
    first = re.findall(r"^\| `([\w-]+)` \|", section, flags=re.MULTILINE)
    assert first == [c.name for c in CASES] + list(PHASES)  # the cases' table, the phases'
    for case in CASES:
        for phase, _ in case.known:
            assert f"`{case.name}` with `{phase}`" in section, "say which cases are known to fail"


def test_the_sample_covers_every_phase_with_different_cases():
    for seed in range(50):
        chosen = sample(seed)
        assert sample(seed) == chosen
        assert {p for _, p in chosen} == set(PHASES)
        assert len({c.name for c, _ in chosen}) == SAMPLE
    assert len(matrix()) == len(CASES) * len(PHASES)


def test_effective_history_keeps_the_last_record_of_each_step():
    lines = [
        {"kind": "step", "step": 1, "ids": [1]},
        {"kind": "step", "step": 2, "ids": [2]},
        {"kind": "eval", "step": 2, "loss": 0.5},
        {"kind": "step", "step": 3, "ids": [3]},
        {"kind": "kill", "at": "step:4:0"},
        {"kind": "start", "step": 1, "checkpoint": "step-1"},
        {"kind": "step", "step": 2, "ids": [2]},
        {"kind": "step", "step": 3, "ids": [4]},
    ]
    assert effective(lines) == ([(1, [1]), (2, [2]), (3, [4])], {})
