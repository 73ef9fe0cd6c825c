"""One run of the resume conformance suite (tests/test_resume_conformance.py): the README loop
over one piece of resumable state, which can SIGKILL itself at a chosen point.

Usage:

    python tests/workers/conformance_loop.py ROOT --optimizer adamw --data map --workers 0 \\
        [--feature ema|save-in-swap|fp16|guard|dp|mlflow ...] [--saves blocking|background] \\
        [--kill PHASE:STEP:K]

Run it once to the end for the reference, and again after a kill with the same arguments less
`--kill`: it resumes from `ft.latest_checkpoint(ROOT/ckpt)`. Kill points, all deterministic:

- `step:S:K`: in training step S: K < accum kills in the forward of micro-batch K (inside
  `accumulate_grads`), K == accum inside the optimizer update (the parameters are half
  updated in place), K == accum + 1 after `clip_and_step` returned.
- `save:S:K` (blocking saves) and `bgsave:S:K` (`blocking=False`): in the save of step S, just
  before its K-th file-system operation (an fsync, rename or tree removal: before each file is
  durable, before the commit rename, inside rotation); K == 0 right after `save_checkpoint`
  returned (a background save has then only copied the tensors). A background save runs in its
  thread while the loop trains on, on a slow disk (`SLOW_DISK` seconds per operation, so it
  spans steps); if it ends before its K-th operation, the kill comes when the loop next looks.
- `eval:S:K`: in the evaluation after step S, in the forward of evaluation batch K, or right
  after `evaluate` returned when K is the number of batches.

Output under ROOT: `trace.jsonl` (one line per step trained, with the ids of the rows it
trained on, per evaluation, per save with the number of file-system operations it made, per
(re)start), `final.safetensors` (parameters, buffers and every optimizer-state tensor) and
`final.json` (the state's plain values, the tracker's run and metrics) once the run is done.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ftrain as ft

TOTAL, SAVE_EVERY, EVAL_EVERY = 9, 3, 4  # saves at 3, 6, 9; evaluations at 4, 8, 9
BATCH, ACCUM = 2, 2
SEED = 11
VOCAB = 256
NOISE_KEY = bytes(range(32))  # a fixed DP-SGD key held by the test, never written by the run
POISON = 14  # the guard case: row 14 (map) or token 255 (stream) gives a 100x loss from step 4
MARK = 255  # one stream row holds it
# Seconds each file-system operation of a background save takes: a save spans several steps,
# as on a cluster's shared disk, so the loop runs on while it is in flight.
SLOW_DISK = 0.08


class Kill:
    """Where this run kills itself (`--kill PHASE:STEP:K`), and the counters that find it."""

    def __init__(self, spec: str | None) -> None:
        self.phase, self.step, self.k = None, -1, -1
        if spec:
            phase, step, k = spec.split(":")
            self.phase, self.step, self.k = phase, int(step), int(k)
        self.where: tuple[str, int] | None = None  # the phase and step running now
        self.count = 0  # forwards (step, eval) or file-system operations (save) seen in it
        self.bg_armed = False  # the background save of the kill step was started
        self.bg_thread: threading.Thread | None = None  # the thread writing it
        self.bg_count = 0  # file-system operations that thread made

    def enter(self, phase: str, step: int) -> None:
        self.where, self.count = (phase, step), 0

    def at(self, phase: str, step: int, k: int) -> None:
        if (phase, step, k) == (self.phase, self.step, self.k):
            die(f"{phase}:{step}:{k}")

    def tick(self) -> None:
        """One more forward in the current phase (main thread); in a step, K >= accum are the
        update's and the step end's points, not forwards."""
        if self.where is not None:
            if self.where[0] != "step" or self.count < ACCUM:
                self.at(self.where[0], self.where[1], self.count)
            self.count += 1


KILL = Kill(None)
TRACE: Path | None = None


def record(**fields: Any) -> None:
    # One write(2) per line on an O_APPEND file: a SIGKILL leaves whole lines only.
    assert TRACE is not None
    fd = os.open(TRACE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(fields) + "\n").encode())
    finally:
        os.close(fd)


def die(point: str, *, late: bool = False) -> None:
    record(kind="kill", at=point, **({"late": True} if late else {}))
    os.kill(os.getpid(), signal.SIGKILL)


# --- the file-system operations a save makes, counted (and killed at) -------------------------


def _counting(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        me = threading.current_thread()
        if me.name == "ftrain-checkpoint":  # a background save, on a slow disk
            time.sleep(SLOW_DISK)
            if KILL.bg_armed and KILL.bg_thread in (None, me):  # the first one after arming
                KILL.bg_thread = me
                KILL.bg_count += 1
                if KILL.bg_count == KILL.k:
                    die(f"bgsave:{KILL.step}:{KILL.k}")
        elif KILL.where is not None and KILL.where[0] == "save":
            KILL.count += 1
            KILL.at("save", KILL.where[1], KILL.count)
        return fn(*args, **kwargs)

    return wrapper


def install_hooks() -> None:
    """Count (and kill at) the file-system operations of saves, in this process only."""
    os.fsync = _counting(os.fsync)
    os.rename = _counting(os.rename)
    os.replace = _counting(os.replace)
    shutil.rmtree = _counting(shutil.rmtree)


# --- data -------------------------------------------------------------------------------------


def map_rows(n: int, seed: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return [{"x": x[i], "y": i % 4, "idx": i} for i in range(n)]


class Shards(torch.utils.data.IterableDataset):
    """A sharded torch IterableDataset of token rows (datasets' shard protocol); the tokens
    of row i of source `base` identify it, so the trained tokens show the data order."""

    def __init__(self, base: int, shards: int, rows: int, index: int | None = None) -> None:
        self.base, self.num_shards, self.rows, self.index = base, shards, rows, index

    def shard(self, num_shards: int, index: int, contiguous: bool = True) -> Shards:
        return Shards(self.base, num_shards, self.rows, index)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for k in range(self.num_shards) if self.index is None else [self.index]:
            for i in range(self.rows):
                row = k * self.rows + i
                ids = [self.base + (row * 3 + j) % 100 + 1 for j in range(1 + row % 5)]
                if (self.base, k, i) == (0, 1, 5):
                    ids[0] = MARK  # the guard case's spike
                yield {"input_ids": ids}


def stream_source() -> Any:
    a = ft.data.stream(Shards(0, 3, 12), shuffle_buffer=4)
    b = ft.data.stream(Shards(120, 2, 10), shuffle_buffer=3)
    return ft.data.pack(ft.data.mix([a, b], weights=[0.7, 0.3]), block_size=8)


def lm_rows(n: int) -> list[dict[str, Any]]:
    return [{"input_ids": [(i * 5 + j) % 200 + 1 for j in range(8)], "idx": i} for i in range(n)]


def ids_of(micro: Any) -> list[Any]:
    out = []
    for b in micro:
        b = b.batch if isinstance(b, ft.data.ZeroWeight) else b
        if "idx" in b:
            out.append(b["idx"].tolist())
        else:  # packed token blocks: the tokens themselves
            out.append([[t for t in row if t] for row in b["input_ids"].tolist()])
    return out


# --- models and losses ------------------------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 4))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.drop, self.head = (
            nn.Embedding(VOCAB, 8),
            nn.Dropout(0.1),
            nn.Linear(8, VOCAB),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.emb(ids)))


def mlp_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    KILL.tick()
    logits = model(batch["x"]).float()
    loss = nn.functional.cross_entropy(logits, batch["y"], reduction="none")
    if GUARD_ON[0]:
        loss = torch.where(batch["idx"] == POISON, loss * 100, loss)
    return loss.sum(), batch["y"].shape[0]


def lm_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    KILL.tick()
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)[:, 1:]
    logits = model(ids[:, :-1]).float()
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(labels.shape)
    if GUARD_ON[0]:
        loss = torch.where((ids == MARK).any(dim=1, keepdim=True), loss * 100, loss)
    return loss.sum(), (labels != -100).sum()


GUARD_ON = [False]  # poison active (set after warm-up, in the guard case only)


# --- the state --------------------------------------------------------------------------------


def optimizer(name: str, ema: bool) -> ft.optim.Optimizer:
    weights = lambda n: "w" if n.endswith("weight") else "b"  # noqa: E731
    opts = {
        "adamw": lambda: ft.optim.adamw(weight_decay=0.1),
        "sgd": lambda: ft.optim.sgd(momentum=0.9, nesterov=True, weight_decay=0.01),
        "muon": lambda: ft.optim.partition({"w": ft.optim.muon(), "b": ft.optim.adamw()}, weights),
        "partition": lambda: ft.optim.partition(
            {"w": ft.optim.adamw(weight_decay=0.1), "b": ft.optim.sgd(momentum=0.9)},
            weights,
            lr_factors={"b": 0.5},
        ),
        "from_torch": lambda: ft.optim.from_torch(torch.optim.RMSprop, momentum=0.9, centered=True),
    }
    opt = opts[name]()
    opt = ft.optim.ema(opt, decay=0.9) if ema else opt
    return _killable(opt)


def _killable(opt: ft.optim.Optimizer) -> ft.optim.Optimizer:
    """The optimizer, with a kill point after its in-place update and before it returns."""

    def update(grads: Any, state: Any, params: Any, **kw: Any) -> Any:
        new = opt.update(grads, state, params, **kw)
        KILL.at("step", kw["step"] + 1, ACCUM)
        return new

    return ft.optim.Optimizer(opt.init, update)


def build(args: argparse.Namespace) -> ft.TrainState:
    model = mlp() if args.data == "map" else TinyLM()
    strategy = None
    if "fp16" in args.feature:  # a scale that overflows, backs off and grows within the run
        rule = ft.precision.LossScaling(init_scale=2.0**18, growth_interval=2)
        precision = ft.precision.Precision(torch.float16, rule)
        strategy = ft.strategies.SingleDevice("cpu", precision=precision)
    cls = ft.guard.GuardedState if "guard" in args.feature else ft.TrainState
    opt = optimizer(args.optimizer, "ema" in args.feature)
    return cls.create(model, opt, seed=SEED, strategy=strategy)


def grads_of(state: ft.TrainState, micro: Any, loss_fn: Any, dp: bool) -> Any:
    if not dp:
        return ft.accumulate_grads(state, micro, loss_fn)
    kw: dict[str, Any] = {}
    # DP-SGD noise is keyed by a secret where private_grads takes `noise_key` (issue 27, item
    # 10): the test holds the key, so the resumed run draws the same noise. Before that
    # change the noise is a function of (seed, step) and needs no key.
    if "noise_key" in inspect.signature(ft.func.private_grads).parameters:
        kw["noise_key"] = NOISE_KEY
    return ft.func.private_grads(
        state, micro, loss_fn, max_norm=1.0, noise_multiplier=0.5, chunk_size=2, **kw
    )


# --- the loop ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    global KILL, TRACE
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--data", choices=["map", "stream"], default="map")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--feature", action="append", default=[])
    p.add_argument("--saves", choices=["blocking", "background"], default="blocking")
    p.add_argument("--kill", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    install_hooks()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    KILL, TRACE = Kill(args.kill), root / "trace.jsonl"
    ckpts = root / "ckpt"

    state = build(args)
    if (ckpt := ft.latest_checkpoint(ckpts)) is not None:
        state = ft.load_checkpoint(ckpt, state)
    record(kind="start", step=state.step, checkpoint=ckpt.name if ckpt else None)
    train = map_rows(30, 1) if args.data == "map" else stream_source()
    val = map_rows(10, 2) if args.data == "map" else lm_rows(6)
    loss_fn = mlp_loss if args.data == "map" else lm_loss
    lr = ft.schedules.warmup_cosine(peak_lr=1e-2, warmup_steps=2, total_steps=TOTAL)
    guard = ft.guard.SpikeGuard(factor=3.0, warmup=3, beta=0.9) if "guard" in args.feature else None
    logger, sink = tracker(args, root, state)

    while state.step < TOTAL:
        batches = ft.make_batches(
            train, state, batch_size=BATCH, accum=ACCUM, num_workers=args.workers
        )
        for micro in batches:
            step = state.step + 1
            bg_ended()
            GUARD_ON[0] = guard is not None and step >= 4
            KILL.enter("step", step)
            grads, stats = grads_of(state, micro, loss_fn, "dp" in args.feature)
            KILL.where = None
            if guard is not None:
                state, verdict = guard.observe(state, stats)
                if verdict.rollback:
                    record(kind="rollback", step=step, reason=verdict.reason)
                    del grads
                    state = guard.rollback(state, ckpts, skip=micro)
                    break
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=1.0
            )
            record(kind="step", step=state.step, ids=ids_of(micro))
            KILL.at("step", state.step, ACCUM + 1)
            if logger is not None:
                logger.step(state, stats, info)
            if ft.should_eval(state, every=EVAL_EVERY, total_steps=TOTAL):
                evaluate(state, val, loss_fn, args, logger)
            if ft.should_save(state, every=SAVE_EVERY, total_steps=TOTAL):
                with swapped(state, args):  # the average in the model while it saves
                    save(state, ckpts, args)
            if state.step >= TOTAL:
                break
        else:
            state = ft.next_epoch(state)
    ft.wait_for_checkpoint()
    if sink is not None:
        sink.close()
    dump(state, root, args)


def swapped(state: ft.TrainState, args: argparse.Namespace) -> Any:
    if "save-in-swap" in args.feature:
        return ft.optim.swap_ema(state)
    return contextlib.nullcontext()


def evaluate(state: ft.TrainState, val: Any, loss_fn: Any, args: Any, logger: Any) -> None:
    KILL.enter("eval", state.step)
    batches = ft.make_batches(val, batch_size=4, shuffle=False)
    if "ema" in args.feature:
        with ft.optim.swap_ema(state):
            out = ft.evaluate(state, batches, loss_fn)
    else:
        out = ft.evaluate(state, batches, loss_fn)
    KILL.tick()  # K == number of batches: after evaluate returned
    KILL.where = None
    record(kind="eval", step=state.step, loss=out["eval_loss"], batches=KILL.count - 1)
    if logger is not None:
        logger.log({"step": state.step, **out})


def save(state: ft.TrainState, ckpts: Path, args: argparse.Namespace) -> None:
    background = args.saves == "background" and state.step < TOTAL  # the last save blocks
    bg_ended()
    if not background:
        KILL.enter("save", state.step)
        ft.save_checkpoint(state, ckpts, keep_last=2)
        record(kind="save", step=state.step, ops=KILL.count)
        KILL.where = None
        bg_ended()
        KILL.at("save", state.step, 0)
        return
    ft.wait_for_checkpoint()  # as save_checkpoint does first: then only this save's ops count
    bg_ended()
    KILL.bg_armed |= KILL.phase == "bgsave" and state.step == KILL.step
    ft.save_checkpoint(state, ckpts, keep_last=2, blocking=False)
    record(kind="save", step=state.step, ops=None)
    KILL.at("bgsave", state.step, 0)
    bg_ended()


def bg_ended() -> None:
    """Kill now if the background save to kill in ended before its K-th operation (the loop
    trains on meanwhile: a save spans steps on a slow disk)."""
    t = KILL.bg_thread
    if KILL.bg_armed and t is not None and not t.is_alive():
        die(f"bgsave:{KILL.step}:{KILL.k}", late=True)


def tracker(args: argparse.Namespace, root: Path, state: ft.TrainState) -> tuple[Any, Any]:
    if "mlflow" not in args.feature:
        return None, None
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    uri = (root / "mlruns").as_uri()
    # rank= given: this worker is forked from the suite's zygote (a Python child), where a
    # sink without it would open its run at the first step, after the record below.
    sink = ft.logging.MLflowSink(
        root / "ckpt", tracking_uri=uri, experiment="conformance", params={"seed": SEED},
        rank=state.strategy.process_rank,
    )  # fmt: skip
    record(kind="tracker", run_id=sink.run_id, resumed=sink.resumed)
    logger = ft.logging.Logger(state, every=1, sinks=[sink], progress=False)
    return logger, sink


def dump(state: ft.TrainState, root: Path, args: argparse.Namespace) -> None:
    """The run's end state: every tensor, and the plain values, for a bitwise comparison."""
    from safetensors.torch import save_file

    model = state.strategy.unwrap(state.model)
    tensors = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for path, v in ft.checkpoint.flatten_tree(state.opt_state).items():
        if torch.is_tensor(v):
            tensors[f"opt/{path}"] = v.detach().clone().contiguous()
    save_file(tensors, root / "final.safetensors")
    plain = {
        "step": state.step,
        "epoch": state.epoch,
        "cursor": state.data.cursor,
        "position": state.data.position,
        "tokens_seen": int(state.data.tokens_seen),
        "samples_seen": int(state.data.samples_seen),
        "scale": None if state.scaler.scale is None else float(state.scaler.scale),
        "growth": None if state.scaler.growth_tracker is None else int(state.scaler.growth_tracker),
        "opt_plain": {
            k: v for k, v in ft.checkpoint.flatten_tree(state.opt_state).items()
            if not torch.is_tensor(v)
        },
    }  # fmt: skip
    if isinstance(state, ft.guard.GuardedState):
        plain["guard"] = [state.loss_avg, state.loss_count, state.nonfinite_run, state.rollbacks]
    if "mlflow" in args.feature:
        plain["mlflow"] = mlflow_summary(root)
    (root / "final.json").write_text(json.dumps(plain, indent=1, default=repr))


def mlflow_summary(root: Path) -> dict[str, Any]:
    """The experiment's runs and each metric's values by step (a set: a resumed run logs the
    steps after its checkpoint again, with equal values)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient((root / "mlruns").as_uri())
    exp = client.get_experiment_by_name("conformance")
    runs = client.search_runs([exp.experiment_id])
    out: dict[str, Any] = {"runs": len(runs), "status": [r.info.status for r in runs]}
    for key in ("loss", "grad_norm", "eval_loss"):
        by_step: dict[int, set[float]] = {}
        for m in client.get_metric_history(runs[0].info.run_id, key):
            by_step.setdefault(m.step, set()).add(m.value)
        out[key] = {s: sorted(v) for s, v in sorted(by_step.items())}
    out["params"] = dict(runs[0].data.params)
    return out


def ranked(rank: int, world: int, port: int, argv: list[str], log: str) -> None:
    """`main(argv)` in a process forked by tests/workers/launch.py (world 1): in a session of
    its own (the test ends whatever a killed run leaves, its loader workers), its output
    appended to `log`, and loader workers started as a fresh interpreter here starts them
    (a process forked by the server defaults to the server's method)."""
    multiprocessing.set_start_method("fork", force=True)
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    main(argv)


if __name__ == "__main__":
    main()
