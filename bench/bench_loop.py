"""The README loop vs raw PyTorch loops and the peers, interleaved in one run, three regimes.

    python bench/bench_loop.py                          # the whole table (~5 min on 2 idle cores)
    python bench/bench_loop.py --regime mlp --rounds 9  # one regime
    python bench/bench_loop.py --profile                # where a small step's time goes
    python bench/bench_loop.py --regime embedding --alone 3   # each loop alone, fresh processes
    python bench/bench_loop.py --cache-malloc           # malloc keeps freed memory (no faults)

Loops, each training its own copy of the same model on the same pre-collated micro-batches
(accumulation 2, clip 1.0, AdamW lr warmup-cosine, weight decay 0.1, fused kernels; every 10th
step reads the loss and the gradient norm on the host):

- `raw`: the loop most people write: `zero_grad(set_to_none=True)`, per micro-batch
  `loss = model(**b).loss / accum; loss.backward()`, `clip_grad_norm_`, `opt.step()` with
  `torch.optim.AdamW(fused=True)` (ftrain runs the same `_fused_adamw_` kernel).
- `exact`: the same with exact token-weighted accumulation, as the HF Trainer does it: count the
  step's label tokens first, `model(**b, num_items_in_batch=n).loss` (a sum divided by n).
- `guarded` (not in the default table): the exact loop plus the other guarantees of the README
  loop, by hand (a padding position predicts nothing, dropout seeded per step and micro-batch
  with the caller's random stream put back, a non-finite step skipped on the device, tokens
  and samples counted): what the contract costs written by hand; the README loop's ratio over
  it is ftrain's own overhead.
- `ftrain`: the README loop as README.md writes it: `grads, stats` bound across iterations,
  `clip_and_step(..., stats=stats, lr=lr(state.step), max_norm=1.0)`, `should_log` (reads
  `float(stats.loss)` and `float(info.grad_norm)`), `should_eval` and `should_save` asked every
  step (with cadences this run never reaches: their work is not the loop's), the `break` test.
- `fabric`: Lightning Fabric (`fabric.setup`, `no_backward_sync`, `fabric.backward`,
  `fabric.clip_gradients`), the same fused AdamW. Needs `pip install -e ".[bench]"`.
- `hf`: the HF Trainer (`optim="adamw_torch_fused"`, the same schedule, accumulation and clip),
  run in a thread that a callback holds after each step, so that it takes its turn like the
  others; its step time runs from the end of its previous turn to the end of this step.

Regimes: `mlp` (a 2-layer MLP language model, ~1 ms a step: per-step overhead dominates; its
`.loss` is transformers' `ForCausalLMLoss`, what every HF causal LM computes), `embedding`
(GPT-2 with a 50k x 576 embedding, 33M parameters: the optimizer dominates), `llama` (4 layers,
256 wide, sequence 128: compute dominates). `tiny` (a 1-layer GPT-2) is kept for the other
bench scripts.

Step time: the loops take turns, `--block` consecutive steps at a time (20, or a whole round where
a round is shorter), in an order that rotates, so that load changes on a shared machine hit all of
them; per loop the median over all steps of all rounds, and the spread of the per-round medians.
The paired ratio is the median over turns of the loop's turn median over the raw loop's in the same
rotation: load that drifts over seconds cancels in each pair, so it moves less from run to run than
the pooled ratio (a second raw loop, `--loops raw,...,raw`, reads 0.99-1.03 paired where it read
0.97-1.08 pooled on the session VM). A loop runs its steps back to back, as in a training process
(the first step of a turn, cold, is one sample in 20). Taking turns after every single step
(`--block 1`) leaves each loop's code and memory cold from the other loops' steps, which penalises
the loop whose code the others share least: ftrain's, next to four loops on torch.optim and HF's
loss (`--loops raw,ftrain,ftrain` penalises the raw loop instead), and it mixes five allocators'
states (+10-35% on ftrain's 33M-parameter steps, which run within 2% of raw's alone).
bench/RESULTS.md gives both schedules.
`--alone R` runs each loop alone in a fresh process instead, the loops alternating, R times,
and adds minor page faults and kernel time a step: on CPU the 33M-parameter regime is bound by
page faults (PyTorch's CPU allocator returns large blocks to the OS, every step faults them in
again: ~175k faults and most of the step's CPU time in the kernel, for every loop).
`--cache-malloc` runs the timing with glibc's malloc keeping freed memory, as CUDA's caching
allocator does on a GPU: the faults go, the step halves, and what is left is the optimizer and
the model, which is what that regime is meant to measure.
Peak memory: each loop alone in a fresh process, peak RSS growth (CUDA: max allocated) from
before the loop is made to the end of its first steps, so that the optimizer state counts for
every loop (ftrain allocates it when the TrainState is created, torch.optim at its first step);
the model, the data and the imports are the baseline. Median over the memory rounds.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

# glibc malloc keeping what the process frees (`--cache-malloc`): one arena (a thread's own arena
# cannot hold a block above 64 MB without mmap), no mmap'd blocks, no trimming of the heap's top.
CACHE_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}


def _malloc_caches() -> bool:
    return all(os.environ.get(k) == v for k, v in CACHE_MALLOC.items())


if __name__ == "__main__" and "--cache-malloc" in sys.argv and not _malloc_caches():
    # glibc reads its tunables at start-up: run this command again with them (before torch).
    # sys.orig_argv keeps the interpreter's own flags (-X, -W, -u).
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {**os.environ, **CACHE_MALLOC})  # fmt: skip

import torch  # noqa: E402  (after the --cache-malloc restart)
import torch.nn.functional as F  # noqa: E402  (after the --cache-malloc restart)
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402  (after the --cache-malloc restart)
from transformers.modeling_outputs import CausalLMOutput  # noqa: E402  (after the --cache-malloc restart)

import ftrain as ft  # noqa: E402  (after the --cache-malloc restart)

ACCUM, CLIP, WD, LOG_EVERY = 2, 1.0, 0.1, 10
LOGGED: list[tuple[float, float]] = []  # what the loops log, so that the reads happen
LOOPS = ("raw", "exact", "ftrain", "fabric", "hf")  # the default table
NAMED = (*LOOPS, "guarded")  # every name --loops takes
REGIMES = ("mlp", "embedding", "llama")

Step = Callable[[list[Any], int], None]


class MLPForCausalLM(torch.nn.Module):
    """A 2-layer MLP language model with an HF causal LM's interface: `model(input_ids,
    attention_mask=None, labels=None, **kwargs)` returns `.logits` and, given labels, `.loss` from
    transformers' `ForCausalLMLoss` (`num_items_in_batch` makes it a sum over that count)."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = torch.nn.Embedding(vocab, dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, vocab)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        logits = self.fc2(F.gelu(self.fc1(self.embed(input_ids))))
        loss = None if labels is None else ForCausalLMLoss(logits, labels, self.vocab, **kwargs)
        return CausalLMOutput(loss=loss, logits=logits)


def build(regime: str) -> tuple[torch.nn.Module, list[list[dict[str, torch.Tensor]]], int]:
    """(model, step batches, steps per block) for one regime; deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    gpt2 = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    gpt2 |= {"bos_token_id": 0, "eos_token_id": 0}
    if regime == "mlp":  # per-step overhead dominates
        model: torch.nn.Module = MLPForCausalLM()
        bs, seq, vocab, steps = 4, 16, 64, 100
    elif regime == "tiny":  # a 1-layer GPT-2 (bench_compile.py, bench_compiled_step.py)
        config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2, **gpt2)
        model = GPT2LMHeadModel(config)
        bs, seq, vocab, steps = 4, 16, 128, 100
    elif regime == "embedding":  # ~33M parameters, mostly embeddings: the optimizer dominates
        config = GPT2Config(
            vocab_size=50_000, n_positions=32, n_embd=576, n_layer=1, n_head=4, **gpt2
        )
        model = GPT2LMHeadModel(config)
        bs, seq, vocab, steps = 2, 16, 50_000, 8
    elif regime == "llama":  # compute dominates
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=1024,
                hidden_size=256,
                intermediate_size=688,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                max_position_embeddings=256,
            )
        )
        bs, seq, vocab, steps = 8, 128, 1024, 4
    else:
        raise ValueError(f"unknown regime {regime!r}")
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(steps):
        micro = []
        for _ in range(ACCUM):
            ids = torch.randint(0, vocab, (bs, seq), generator=g)
            micro.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
        data.append(micro)
    return model, data, steps


def _log(k: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
    if (k + 1) % LOG_EVERY == 0:
        LOGGED.append((float(loss), float(norm)))


def raw_loop(model: torch.nn.Module, total: int, compiled_step: bool = False) -> Step:
    """The loop people write by hand, logging every LOG_EVERY steps like the README loop.
    `compiled_step`: torch's compiled-optimizer recipe instead of fused AdamW (a foreach AdamW
    with a tensor lr, its `step` under `torch.compile`; bench_compiled_step.py)."""
    if compiled_step:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.0), weight_decay=WD)
        opt_step = torch.compile(opt.step)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=WD, fused=True)
        opt_step = opt.step
    lr = ft.schedules.warmup_cosine(1e-3, 10, total)

    def step(micro: list[Any], k: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for batch in micro:
            loss = model(**batch).loss / len(micro)
            loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for group in opt.param_groups:
            if compiled_step:
                group["lr"].fill_(lr(k))  # a tensor lr: no recompile when it changes
            else:
                group["lr"] = lr(k)
        opt_step()
        _log(k, loss_sum, norm)

    return step


def exact_loop(model: torch.nn.Module, total: int) -> Step:
    """The raw loop with exact token-weighted accumulation (the HF Trainer's way): the step's
    label tokens counted first, each loss a sum divided by that count."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=WD, fused=True)
    lr = ft.schedules.warmup_cosine(1e-3, 10, total)

    def step(micro: list[Any], k: int) -> None:
        opt.zero_grad(set_to_none=True)
        n = sum((b["labels"][:, 1:] != -100).sum() for b in micro)
        loss_sum = 0.0
        for batch in micro:
            loss = model(**batch, num_items_in_batch=n).loss
            loss.backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for group in opt.param_groups:
            group["lr"] = lr(k)
        opt.step()
        _log(k, loss_sum, norm)

    return step


def guarded_loop(model: torch.nn.Module, total: int) -> Step:
    """The exact raw loop plus the other guarantees the README loop keeps, written by hand as
    cheaply as we know how (no ftrain call but the schedule): a padding position predicts
    nothing (`ft.losses.causal_targets`' left-padding rule), the label tokens counted first,
    dropout seeded per (step, micro-batch) with the caller's random stream put back, a
    non-finite step skipped on the device (fused AdamW's `found_inf`, as `GradScaler` sets
    it: no host sync), the tokens and samples seen counted on the device. What ftrain's
    contract costs when you write it yourself: the README loop's ratio over this one is
    ftrain's own overhead."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=WD, fused=True)
    lr = ft.schedules.warmup_cosine(1e-3, 10, total)
    gens = [torch.default_generator]
    if DEVICE.type == "cuda":
        gens.append(torch.cuda.default_generators[DEVICE.index or 0])
    seen = torch.zeros(2, dtype=torch.int64, device=DEVICE)  # tokens, samples

    def step(micro: list[Any], k: int) -> None:
        opt.zero_grad(set_to_none=True)
        targets = []
        for b in micro:
            t = F.pad(b["labels"], (-1, 1), value=-100)
            t.masked_fill_(b["attention_mask"].logical_not(), -100)
            targets.append(t)
        n = sum((t != -100).sum() for t in targets)
        saved = [g.get_state() for g in gens]
        loss_sum = 0.0
        samples = 0
        try:
            for i, (b, t) in enumerate(zip(micro, targets, strict=True)):
                for g in gens:
                    g.manual_seed((k << 8) + i)
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                loss = (
                    F.cross_entropy(logits.view(-1, logits.shape[-1]), t.view(-1), reduction="sum")
                    / n
                )
                loss.backward()
                loss_sum += loss.detach()
                seen[0] += b["attention_mask"].sum()
                samples += b["input_ids"].shape[0]
        finally:
            for g, s in zip(gens, saved, strict=True):
                g.set_state(s)
        seen[1] += samples
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.found_inf = (~torch.isfinite(norm)).float()  # type: ignore[attr-defined]
        for group in opt.param_groups:
            group["lr"] = lr(k)
        opt.step()
        _log(k, loss_sum, norm)

    return step


def ftrain_loop(
    model: torch.nn.Module, total: int, strategy: Any = None, compile: bool = False
) -> Step:
    """The README loop's body as README.md writes it. `grads` and `stats` live across
    iterations (held in `loop`, as the README's loop variables stay bound until reassigned);
    `should_eval`/`should_save` are asked every step with cadences past this run.
    `compile` is `clip_and_step`'s (bench_compiled_step.py)."""
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=WD), strategy=strategy)
    lr = ft.schedules.warmup_cosine(1e-3, 10, total)
    loop: dict[str, Any] = {"state": state, "grads": None, "stats": None}
    extra = {"compile": True} if compile else {}  # so that trees without it run this bench too
    never = 10 * total + 1  # evaluation and checkpoints are not the loop's overhead

    def step(micro: list[Any], k: int) -> None:
        state = loop["state"]
        loop["grads"], loop["stats"] = ft.accumulate_grads(state, micro)
        state, info = ft.clip_and_step(
            state, loop["grads"], stats=loop["stats"], lr=lr(state.step), max_norm=CLIP, **extra
        )
        loop["state"] = state
        if ft.should_log(state, every=LOG_EVERY):
            LOGGED.append((float(loop["stats"].loss), float(info.grad_norm)))
        if ft.should_eval(state, every=never, total_steps=10 * total):
            raise AssertionError("the benchmark never evaluates")
        if ft.should_save(state, every=never, total_steps=10 * total):
            raise AssertionError("the benchmark never saves")
        if state.step >= 10 * total:
            raise AssertionError("the benchmark never reaches total_steps")

    return step


def fabric_loop(model: torch.nn.Module, total: int) -> Step:
    """Lightning Fabric's documented loop with gradient accumulation and clipping."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator=DEVICE.type, devices=1, precision="32-true")
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=WD, fused=True)
    module, opt = fabric.setup(model, opt)
    lr = ft.schedules.warmup_cosine(1e-3, 10, total)

    def step(micro: list[Any], k: int) -> None:
        loss_sum = 0.0
        for i, batch in enumerate(micro):
            with fabric.no_backward_sync(module, enabled=i < len(micro) - 1):
                loss = module(**batch).loss / len(micro)
                fabric.backward(loss)
            loss_sum += loss.detach()
        norm = fabric.clip_gradients(module, opt, max_norm=CLIP)
        for group in opt.param_groups:
            group["lr"] = lr(k)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _log(k, loss_sum, norm)

    return step


class HFTurns:
    """The HF Trainer in a thread, held by a callback after every optimizer step.

    `step(micro, k)` lets it run one step and waits for it; the micro-batches come from the
    Trainer's own data loader (the same pre-collated batches, in order). While it is held, the
    thread runs the functions given to `call`: the other loops' steps run there too, so that
    every loop's tensor ops come from one thread (one OpenMP team: two teams on two cores
    spin against each other and skew the times). `close()` lets it run to `max_steps` and
    joins it. `times` holds each step's time, from the end of the previous turn (when the
    callback let it go) to the end of this step (`on_step_end`).
    """

    def __init__(self, model: torch.nn.Module, data: list[Any], total_steps: int) -> None:
        from transformers import Trainer, TrainerCallback, TrainingArguments
        from transformers.trainer_callback import PrinterCallback

        turns = self
        self.jobs: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self.results: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self.times: list[float] = []
        self._t0 = 0.0

        class Hold(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                turns.times.append(time.perf_counter() - turns._t0)
                turns.results.put((True, None))  # this step is done
                while (job := turns.jobs.get()) is not None:  # None: run the next step
                    try:
                        turns.results.put((True, job()))
                    except BaseException as e:  # re-raised by `call`
                        turns.results.put((False, e))
                turns._t0 = time.perf_counter()

        class Micro(torch.utils.data.IterableDataset):
            def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
                while True:
                    for micro in data:
                        yield from micro

        self._tmp = tempfile.TemporaryDirectory()
        args = TrainingArguments(
            output_dir=self._tmp.name,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=ACCUM,
            max_steps=total_steps,
            learning_rate=1e-3,
            lr_scheduler_type="cosine",
            warmup_steps=10,
            weight_decay=WD,
            max_grad_norm=CLIP,
            optim="adamw_torch_fused",
            logging_steps=LOG_EVERY,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=DEVICE.type == "cpu",
            dataloader_num_workers=0,
            seed=0,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer = Trainer(
                model=model,
                args=args,
                train_dataset=Micro(),
                data_collator=lambda rows: rows[0],  # each row is a collated micro-batch
                callbacks=[Hold()],
            )
        self.trainer.remove_callback(PrinterCallback)  # its log lines, not the loop's work
        self.thread = threading.Thread(target=self._train, daemon=True)
        self._started = False

    def _train(self) -> None:
        try:
            self._t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.trainer.train()
            self.results.put((True, None))  # the end of the run
        except BaseException as e:
            self.results.put((False, e))

    def _result(self) -> Any:
        ok, value = self.results.get(timeout=900)
        if not ok:
            raise RuntimeError("the HF Trainer's thread failed") from value
        return value

    def step(self, micro: list[Any], k: int) -> None:
        if self._started:
            self.jobs.put(None)
        else:
            self._started = True
            self.thread.start()
        self._result()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in the Trainer's thread while it is held (after its first step)."""
        self.jobs.put(fn)
        return self._result()

    def close(self) -> None:
        if self._started and self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(timeout=600)
        self._tmp.cleanup()


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _to_device(model: torch.nn.Module, data: list[Any]) -> tuple[torch.nn.Module, list[Any]]:
    return model.to(DEVICE), [[{k: v.to(DEVICE) for k, v in b.items()} for b in m] for m in data]


def _block(step: Step, data: list[Any], offset: int) -> list[float]:
    times = []
    for i, micro in enumerate(data):
        _sync()
        t0 = time.perf_counter()
        step(micro, offset + i)
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def make_loop(name: str, model: torch.nn.Module, data: list[Any], total: int) -> Any:
    """A loop by name: a `Step` function, or an `HFTurns` for the HF Trainer."""
    if name == "raw":
        return raw_loop(model, total)
    if name == "exact":
        return exact_loop(model, total)
    if name == "guarded":
        return guarded_loop(model, total)
    if name == "ftrain":
        return ftrain_loop(model, total)
    if name == "fabric":
        return fabric_loop(model, total)
    if name == "hf":
        return HFTurns(model, data, total)
    raise ValueError(f"unknown loop {name!r}")


def _kind(name: str) -> str:
    """The loop a name runs: "ftrain#2" is a second, independent ftrain loop."""
    return name.split("#")[0]


def numbered(loops: list[str]) -> list[str]:
    """Names for the loops, a repeated one numbered: raw, ftrain, ftrain#2."""
    return [n if loops[:i].count(n) == 0 else f"{n}#{loops[:i].count(n) + 1}"
            for i, n in enumerate(loops)]  # fmt: skip


def available(loops: list[str]) -> list[str]:
    """The loops whose packages are installed (the peers come with `.[bench]`)."""
    out = []
    for name in loops:
        try:
            if name == "fabric":
                import lightning.fabric  # noqa: F401
            if name == "hf":
                import transformers.trainer  # noqa: F401
        except ImportError:
            print(f"skipping {name}: not installed (pip install -e '.[bench]')", file=sys.stderr)
            continue
        out.append(name)
    return out


def time_regime(
    regime: str, rounds: int, loops: list[str], steps: int | None = None, block: int = 20
) -> dict[str, Any]:
    """Median step time of each loop, the loops taking turns step by step; `steps` per round
    (the regime's own when None)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    model, data, n = build(regime)
    steps = n if steps is None else min(steps, n)
    block = min(block, steps)
    model, data = _to_device(model, data[:steps])
    total = steps * (rounds + 1)
    made = {name: make_loop(_kind(name), copy.deepcopy(model), data, total) for name in loops}
    hf = made.get("hf")
    assert hf is None or isinstance(hf, HFTurns)

    def run(name: str, batches: list[Any], offset: int) -> list[float]:
        if name == "hf":  # its own step times, not the hand-over
            assert hf is not None
            return [(hf.step(m, offset + i), hf.times[-1])[1] for i, m in enumerate(batches)]
        step = made[name]
        if hf is None:
            return _block(step, batches, offset)
        return hf.call(lambda: _block(step, batches, offset))  # in the Trainer's thread

    try:
        order = sorted(loops, key=lambda n: n != "hf")  # the Trainer's thread starts first
        for name in order:  # warm-up block (allocator, first-step state init)
            run(name, data, 0)
        per_round: dict[str, list[list[float]]] = {name: [] for name in loops}
        per_turn: dict[str, list[float]] = {name: [] for name in loops}  # each turn's median
        for r in range(rounds):
            for name in loops:
                per_round[name].append([])
            for turn, i in enumerate(range(0, steps, block)):
                shift = (r * steps + turn) % len(loops)  # rotate who goes first
                for name in loops[shift:] + loops[:shift]:
                    times = run(name, data[i : i + block], steps * (r + 1) + i)
                    per_round[name][-1] += times
                    per_turn[name].append(statistics.median(times))
    finally:
        if hf is not None:
            hf.close()
    med = {n: statistics.median(t for rnd in rs for t in rnd) for n, rs in per_round.items()}
    spread = {}
    for n, rs in per_round.items():
        raw = per_round["raw"]
        ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(rs, raw, strict=True)]
        spread[n] = (min(ratios), max(ratios))
    paired = {
        n: statistics.median(a / b for a, b in zip(ts, per_turn["raw"], strict=True))
        for n, ts in per_turn.items()
    }
    return {
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "ms": {n: v * 1e3 for n, v in med.items()},
        "ratio": {n: v / med["raw"] for n, v in med.items()},
        "paired": paired,
        "round_ratio_range": spread,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS, so that the peak measures
    the loop, not imports and set-up before it (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_child(regime: str, loop: str) -> None:
    model, data, _ = build(regime)
    model, data = _to_device(model, data)
    data = data[:2]  # the peak comes with the first steps (gradients, optimizer state)
    cuda = DEVICE.type == "cuda"
    with torch.no_grad():  # lazy imports of the forward and the losses: not the loop's memory
        model(**data[0][0])
        ft.losses.default_loss(model, data[0][0])
    if loop == "hf":  # imports are not the loop's memory
        import accelerate  # noqa: F401
        import transformers.trainer  # noqa: F401
    elif loop == "fabric":
        import lightning.fabric  # noqa: F401
    # From before the loop is made: ftrain allocates the optimizer state when the
    # TrainState is created, torch.optim at the first step; both are the loop's memory.
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    elif not _reset_peak_rss():
        raise SystemExit("cannot reset the peak RSS (/proc/self/clear_refs): no memory figures")
    base = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    made = make_loop(loop, model, data, 2 * len(data))
    step = made.step if isinstance(made, HFTurns) else made
    _block(step, data, 0)
    _block(step, data, len(data))
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes()
    if isinstance(made, HFTurns):
        made.close()
    print(json.dumps({"peak_growth_mb": (peak - base) / 2**20}))


def memory_regime(regime: str, rounds: int, loops: list[str]) -> dict[str, float]:
    growth: dict[str, list[float]] = {n: [] for n in loops}
    env = {k: v for k, v in os.environ.items() if k not in CACHE_MALLOC}  # the default malloc
    for r in range(rounds):
        shift = r % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            out = subprocess.run(
                [sys.executable, __file__, "--memory-child", regime, loop],
                env=env,
                check=True,
                capture_output=True,
                text=True,
                timeout=900,
            ).stdout
            growth[loop].append(json.loads(out.strip().splitlines()[-1])["peak_growth_mb"])
    return {n: statistics.median(v) for n, v in growth.items()}


ALONE_ROUNDS = {"mlp": 30, "embedding": 3, "llama": 6, "tiny": 3}  # ~3 s of steps each


def alone_child(regime: str, loop: str, steps: int | None = None) -> None:
    """One loop alone in this process: a warm-up round, then `ALONE_ROUNDS` rounds (a fixed
    count: the Trainer runs to its max_steps before it ends), or one round of `steps` steps;
    median ms a step, minor page faults and system (kernel) CPU time a step (`getrusage`)."""
    model, data, n = build(regime)
    model, data = _to_device(model, data)
    rounds = ALONE_ROUNDS[regime]
    if steps:
        data, rounds = data[:steps], 1
        n = len(data)
    made = make_loop(loop, model, data, (rounds + 1) * n)
    step = made.step if isinstance(made, HFTurns) else made
    _block(step, data, 0)
    before = resource.getrusage(resource.RUSAGE_SELF)
    times = [t for r in range(rounds) for t in _block(step, data, (r + 1) * n)]
    after = resource.getrusage(resource.RUSAGE_SELF)
    if isinstance(made, HFTurns):
        made.close()
    k = len(times)
    print(json.dumps({
        "ms": statistics.median(times) * 1e3,
        "faults": (after.ru_minflt - before.ru_minflt) / k,
        "sys_ms": (after.ru_stime - before.ru_stime) / k * 1e3,
    }))  # fmt: skip


def alone(regime: str, rounds: int, loops: list[str], steps: int | None = None) -> None:
    """Each loop alone in a fresh process, the loops alternating, `rounds` times: nothing
    shared with another loop (caches, allocator, memory placement), where the main table
    interleaves them in one process (a repeated name, `raw#2`, is a control: the same loop in
    other processes). Prints median ms a step over the processes, the ratio to
    raw's (and the range of the rounds' ratios, each against raw's process of that round),
    minor page faults and kernel time a step."""
    got: dict[str, list[dict[str, float]]] = {n: [] for n in loops}
    for r in range(rounds):
        shift = r % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            more = [f"--steps={steps}"] if steps else []
            out = subprocess.run(
                [sys.executable, __file__, "--alone-child", regime, _kind(loop), *more],
                check=True, capture_output=True, text=True, timeout=1800,
            ).stdout  # fmt: skip
            got[loop].append(json.loads(out.strip().splitlines()[-1]))
    med = {n: {f: statistics.median(x[f] for x in v) for f in v[0]} for n, v in got.items()}
    if _malloc_caches():
        print("malloc caching (--cache-malloc)")
    print("| regime | loop | ms/step alone | time ratio (round range) | minor faults/step | "
          "sys ms/step |\n|---|---|---|---|---|---|")  # fmt: skip
    for n, m in med.items():
        per = [a["ms"] / b["ms"] for a, b in zip(got[n], got["raw"], strict=True)]
        print(f"| {regime} | {n} | {m['ms']:.2f} | **{m['ms'] / med['raw']['ms']:.3f}** "
              f"({min(per):.3f}-{max(per):.3f}) | {m['faults']:.0f} | {m['sys_ms']:.1f} |",
              flush=True)  # fmt: skip


def profile(regime: str, steps: int, loops: list[str]) -> None:
    """Per-step counts of top-level aten ops (torch.profiler) and of Python function calls
    (cProfile) for `loops` (raw, exact and ftrain from `--loops`, in its order), the ops with
    the most self CPU time, and each loop's median step time alone (`steps` steps; `--steps`
    sets it, 300 by default), one loop after the other in this process."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, data, n = build(regime)
    model, data = _to_device(model, data)
    k = len(data[:10])  # steps profiled
    for name in loops:
        step = make_loop(name, copy.deepcopy(model), data, 10 * steps)
        _block(step, data, 0)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            _block(step, data[:k], n)
        top = Counter(e.name for e in prof.events() if e.cpu_parent is None)
        ops = sum(top.values()) / k
        pr = cProfile.Profile()
        pr.enable()
        _block(step, data[:k], n + k)
        pr.disable()
        calls = pstats.Stats(pr).total_calls / k  # type: ignore[attr-defined]
        times = [t for _ in range(max(1, steps // n)) for t in _block(step, data, n)]
        print(f"{name}: {ops:.1f} top-level aten ops/step, {calls:.0f} Python calls/step, "
              f"{statistics.median(times) * 1e6:.0f} us/step alone")  # fmt: skip
        print("   " + ", ".join(f"{op} {v / k:g}" for op, v in top.most_common(40)))
        own = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        print("   self CPU us/step: " + ", ".join(
            f"{e.key} {e.self_cpu_time_total / k:.0f}" for e in own))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(  # no abbreviations: --cache-malloc is looked for before torch
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )  # fmt: skip
    p.add_argument("--regime", choices=[*REGIMES, "tiny", "all"], default="all")
    p.add_argument(
        "--loops",
        default=",".join(LOOPS),
        help="comma-separated: " + ",".join(NAMED) + " (a repeated name runs a second copy)",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--memory-rounds", type=int, default=3)
    p.add_argument("--steps", type=int, help="steps per round (default: the regime's)")
    p.add_argument(
        "--block", type=int, default=20, help="steps a loop runs per turn (at most a round)"
    )
    p.add_argument(
        "--profile", action="store_true", help="op counts and times (mlp unless --regime)"
    )
    p.add_argument("--memory-child", nargs=2, metavar=("REGIME", "LOOP"), help=argparse.SUPPRESS)
    p.add_argument(
        "--alone",
        type=int,
        metavar="ROUNDS",
        help="each loop alone in fresh processes, ROUNDS times",
    )
    p.add_argument("--alone-child", nargs=2, metavar=("REGIME", "LOOP"), help=argparse.SUPPRESS)
    p.add_argument(
        "--cache-malloc",
        action="store_true",
        help="glibc's malloc keeps freed memory (one arena, no mmap, no trim), as CUDA's caching "
        "allocator does: the steps stop faulting pages in (CPU; the memory rounds still run "
        "with the default allocator)",
    )
    args = p.parse_args()
    if args.cache_malloc and not _malloc_caches():
        raise SystemExit("--cache-malloc: the restart with glibc's tunables did not take")
    warnings.filterwarnings("ignore")  # peers' notices on a CPU machine
    if args.memory_child:  # its last stdout line is the result (peers print banners)
        memory_child(*args.memory_child)
        return
    if args.alone_child:  # its last stdout line is the result
        alone_child(*args.alone_child, steps=args.steps)
        return
    if args.profile:
        order = [x for x in args.loops.split(",") if x in ("raw", "exact", "guarded", "ftrain")]
        profile("mlp" if args.regime == "all" else args.regime, args.steps or 300, order)
        return
    loops = [x for x in args.loops.split(",") if x]
    unknown = set(loops) - set(NAMED)
    if unknown or "raw" not in loops or loops.count("hf") > 1:
        p.error(
            f"--loops takes names from {','.join(NAMED)} (repeat one to run independent copies "
            "of it; hf at most once) and must include raw"
        )
    loops = numbered(available(loops))
    regimes = list(REGIMES) if args.regime == "all" else [args.regime]
    if args.alone:
        for regime in regimes:
            alone(regime, args.alone, loops, args.steps)
        return
    cached = ", malloc caching (--cache-malloc)" if _malloc_caches() else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {DEVICE.type}, "
          f"{args.rounds} rounds, {args.memory_rounds} memory rounds{cached}")  # fmt: skip
    print("| regime | params (M) | loop | ms/step | time ratio (round range) | paired ratio | "
          "peak MB | memory ratio |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for regime in regimes:
        t = time_regime(regime, args.rounds, loops, args.steps, args.block)
        once = [n for n in loops if n == _kind(n)]  # a copy's memory is the same loop's
        m = memory_regime(regime, args.memory_rounds, once) if args.memory_rounds else {}
        for n in loops:
            lo, hi = t["round_ratio_range"][n]
            k = _kind(n)
            mem = f"{m[k]:.1f} | {m[k] / m['raw']:.3f}" if m else "- | -"
            print(f"| {regime} | {t['params_m']:.2f} | {n} | {t['ms'][n]:.2f} | "
                  f"**{t['ratio'][n]:.3f}** ({lo:.3f}-{hi:.3f}) | {t['paired'][n]:.3f} | "
                  f"{mem} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
