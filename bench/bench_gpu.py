"""GPU: the README loop vs a raw loop and vs nanoGPT; MFU; the checkpoint stall.

    python bench/bench_gpu.py [--rounds 5] [--peak-tflops 989]      # the Llama suite
    python bench/bench_gpu.py --nanogpt ~/nanoGPT                   # the main example vs nanoGPT

The Llama suite needs CUDA. Both loops train their own copy of one Llama
(768 hidden, 12 layers, 12 heads, tied 32k embedding: ~110M parameters) on the same data with
bf16 autocast, AdamW (fused, wd 0.1), accumulation 2, clip 1.0: the raw loop with
`torch.autocast` and `torch.optim.AdamW(fused=True)`, ftrain with
`SingleDevice(precision="bf16")` and the README loop (`grads` bound across iterations).
Step times are medians of interleaved blocks; peak memory is `max_memory_allocated` growth
over the set-up baseline, each loop alone in a fresh subprocess. MFU uses HF's 6 * N FLOPs per
token over the peak given (989 TFLOP/s: H100/H200 dense bf16). The checkpoint stall is how long
`save_checkpoint(blocking=False)` holds the loop up, against a step's time.

`--nanogpt PATH` (a nanoGPT checkout; nothing is downloaded) runs the main example's model
(`CharGPT` of examples/shakespeare_char.py: nanoGPT's GPT as an HF model) at GPT-2-124M shapes
(12 layers, 12 heads, 768 wide, block 1024, vocabulary 50304) with bf16 autocast in the README
loop, compiled as the example's `--compile` does (the loss function, the model called in it),
and nanoGPT's own `train.py` at the same shapes, batch, accumulation, optimizer (fused AdamW,
betas (0.9, 0.95), wd 0.1, clip 1.0) and data (random tokens in a `train.bin` written here), one
process after the other, alternating, `--rounds` times. `--sides` picks the runs: `ftrain` reads
the tokens the example's way (`make_batches` over every window, shuffled, pinned on CUDA,
`--workers` processes), `ftrain+get_batch` with nanoGPT's `get_batch` in the README loop (random
windows of a fresh memmap, as nanoGPT reads them), `ftrain+divide` with the example's loss
returning its count beside its sum (the gradients divided by the count after the last backward,
not each loss before it: what `ft.losses.counted` saves), `raw` nanoGPT's own loop on the example's
model (the model's share of a gap apart from the loop's). All read the loss on the host every
iteration (nanoGPT's `--log_interval=1`); the first `--warmup` iterations (compilation) are
dropped. Reported: median ms per iteration, tokens/s and MFU for both, MFU by nanoGPT's own
formula (6 N + 12 L H Q T FLOPs per token, N without the position embedding) over
`--peak-tflops` (nanoGPT's own printout assumes an A100's 312). nanoGPT's files are linked into
a temporary folder that holds the data, so the checkout is not written to. The shapes, device,
precision and compilation are flags, so a CPU test runs it all at tiny shapes.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch and ftrain are imported where they run: the --nanogpt driver only starts processes
# (nanoGPT's train.py and this script's --worker-ftrain, which import them), so it starts in
# ~0.3 s instead of ~2 s. bench_loop (its constants, `_block`) imports transformers: the Llama
# part imports it where it runs, so that the nanoGPT comparison's processes start without it.

BS, SEQ, VOCAB, STEPS = 8, 1024, 32_000, 6


def build() -> tuple[torch.nn.Module, list[list[dict[str, torch.Tensor]]]]:
    import torch
    from bench_loop import ACCUM
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).cuda()
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS):
        micro = []
        for _ in range(ACCUM):
            ids = torch.randint(0, VOCAB, (BS, SEQ), generator=g).cuda()
            micro.append({"input_ids": ids, "labels": ids})
        data.append(micro)
    return model, data


def raw_loop(model: torch.nn.Module) -> Callable[[list[Any], int], None]:
    import torch
    from bench_loop import CLIP, WD

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=WD, fused=True)

    def step(micro: list[Any], k: int) -> None:
        opt.zero_grad(set_to_none=True)
        for batch in micro:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()

    return step


def ftrain_loop(model: torch.nn.Module) -> tuple[Callable[[list[Any], int], None], dict]:
    from bench_loop import CLIP, WD

    import ftrain as ft

    strategy = ft.strategies.SingleDevice("cuda", precision="bf16")
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=WD), strategy=strategy)
    loop: dict[str, Any] = {"state": state, "grads": None}

    def step(micro: list[Any], k: int) -> None:
        state = loop["state"]
        loop["grads"], stats = ft.accumulate_grads(state, micro)
        loop["state"], _ = ft.clip_and_step(state, loop["grads"], stats=stats, lr=3e-4,
                                            max_norm=CLIP)  # fmt: skip

    return step, loop


def memory_child(loop: str) -> None:
    import torch
    from bench_loop import _block

    model, data = build()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step = raw_loop(model) if loop == "raw" else ftrain_loop(model)[0]
    _block(step, data, 0)
    _block(step, data, STEPS)
    print(json.dumps({"peak_mb": (torch.cuda.max_memory_allocated() - base) / 2**20}))


def memory(rounds: int) -> dict[str, float]:
    peaks: dict[str, list[float]] = {"raw": [], "ftrain": []}
    for r in range(rounds):
        for loop in ["raw", "ftrain"] if r % 2 == 0 else ["ftrain", "raw"]:
            out = subprocess.run([sys.executable, __file__, "--memory-child", loop], check=True,
                                 capture_output=True, text=True, timeout=900).stdout  # fmt: skip
            peaks[loop].append(json.loads(out.strip().splitlines()[-1])["peak_mb"])
    return {k: statistics.median(v) for k, v in peaks.items()}


def checkpoint_stall(loop: dict, data: list[Any], step_s: float, saves: int = 3) -> dict:
    """Time `save_checkpoint(blocking=False)` holds the loop, then the wait for the write.

    The first save also pins its host buffers (torch's caching host allocator keeps them for
    the next); later saves show the steady-state stall.
    """
    import torch

    import ftrain as ft

    stalls, writes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(saves):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ft.save_checkpoint(loop["state"], tmp, blocking=False, keep_last=1)
            stalls.append(time.perf_counter() - t0)
            ft.wait_for_checkpoint()
            writes.append(time.perf_counter() - t0)
            loop["state"] = loop["state"].replace(step=loop["state"].step + 1)
    steady = statistics.median(stalls[1:]) if saves > 1 else stalls[0]
    return {
        "first_stall_ms": round(stalls[0] * 1e3, 1),
        "stall_ms": round(steady * 1e3, 1),
        "write_ms": round(statistics.median(writes) * 1e3, 1),
        "stall_in_steps": round(steady / step_s, 3),
    }


# --- the main example's GPT vs nanoGPT's train.py (--nanogpt) ----------------------------------

ROOT = Path(__file__).resolve().parent.parent
ITER_LINE = re.compile(r"^iter (\d+): loss ([0-9.naif]+), time ([0-9.]+)ms", re.MULTILINE)


def write_tokens(directory: Path, vocab: int, n: int = 1 << 20) -> None:
    """`train.bin`/`val.bin`: uint16 random tokens, the format nanoGPT's prepare scripts write,
    and `meta.pkl` with the vocabulary size, from which nanoGPT's train.py sizes its model
    (without one it takes 50304 whatever `--vocab` says, and the two models would differ)."""
    import pickle  # nanoGPT's own format for meta.pkl; written here, never read by ftrain

    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in ("train", "val"):
        rng.integers(0, vocab, size=n, dtype=np.uint16).tofile(directory / f"{name}.bin")
    with open(directory / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": vocab}, f)


def get_batch(data_dir: Path, block: int, batch: int, device: torch.device) -> list[torch.Tensor]:
    """nanoGPT's `get_batch("train")`: random windows of a fresh memmap, pinned, non-blocking."""
    import numpy as np
    import torch

    data = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block, (batch,))
    x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
    if device.type == "cuda":
        return [t.pin_memory().to(device, non_blocking=True) for t in (x, y)]
    return [x.to(device), y.to(device)]


def flops_per_token(n_params: int, layers: int, heads: int, width: int, block: int) -> float:
    """nanoGPT's `estimate_mfu` numerator per token: 6 N + 12 L H Q T."""
    return 6 * n_params + 12 * layers * heads * (width // heads) * block


def raw_worker(a: argparse.Namespace, model: torch.nn.Module, loss_fn: Callable) -> dict:
    """nanoGPT's own loop on the example's model: the mean loss / accum, backward, the next
    micro-batch read while the GPU computes, `clip_grad_norm_`, fused AdamW over nanoGPT's
    groups (2-D weights decay), `zero_grad(set_to_none=True)`, the loss read every iteration.
    Set beside nanoGPT, it tells the model's share of a gap from the loop's."""
    import torch

    device = torch.device(a.device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.precision]
    ctx = torch.autocast(device.type, dtype=dtype, enabled=a.precision != "fp32")
    data_dir = Path(a.data)
    times, last, lossf = [], time.perf_counter(), float("nan")
    x, y = get_batch(data_dir, a.block_size, a.batch_size, device)
    for it in range(a.iters):
        lr = 6e-4 * min(1.0, (it + 1) / 11)  # (the warm-up's cost, not its exact shape)
        for group in opt.param_groups:
            group["lr"] = lr
        for _ in range(a.accum):
            with ctx:
                s, n = loss_fn(model, [x, y])
                loss = s / n / a.accum
            x, y = get_batch(data_dir, a.block_size, a.batch_size, device)  # while it computes
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lossf = loss.item() * a.accum
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return {"times": times, "loss": lossf}


def ftrain_worker(a: argparse.Namespace) -> None:
    """The README loop (or nanoGPT's, `--loop raw`) on the example's CharGPT; prints one JSON
    line: per-iteration times, the last loss, the parameter count, the device's name and torch's
    version."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from shakespeare_char import CharGPT, CharGPTConfig, next_char_sum, targets_in

    import ftrain as ft

    device = torch.device(a.device)
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT's train.py
    torch.backends.cudnn.allow_tf32 = True
    config = CharGPTConfig(
        vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
        n_embd=a.n_embd,
    )  # fmt: skip
    model = CharGPT(config).to(device)
    # As the example's --compile: the model and its loss one graph (nanoGPT's forward holds it)
    # As the example: a loss counted from the batch (each loss divided before backward at
    # these sizes); `--loss plain` (side ftrain+divide) returns the count beside the sum, as
    # the example did before, so the step divides every gradient after the last backward.
    sum_fn = torch.compile(next_char_sum) if a.compile else next_char_sum
    loss_fn = ft.losses.counted(sum_fn, items=targets_in)
    if a.loss == "plain":

        def loss_fn(model: torch.nn.Module, batch: list) -> tuple:
            return sum_fn(model, batch), batch[1].new_tensor(batch[1].numel())

    loop = raw_worker if a.loop == "raw" else readme_loop
    result = loop(a, model, loss_fn)
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    print(json.dumps({**result, "n_params": n, "device": name, "torch": torch.__version__,
                      "compiled": a.compile}))  # fmt: skip


def readme_loop(a: argparse.Namespace, model: torch.nn.Module, loss_fn: Callable) -> dict:
    """The README loop, reading the tokens the example's way or nanoGPT's (`--reader`)."""
    import torch

    import ftrain as ft

    device = torch.device(a.device)
    optimizer = ft.optim.adamw(betas=(0.9, 0.95), weight_decay=0.1, mask=ft.optim.decay_mask(model))
    strategy = ft.strategies.SingleDevice(device, precision=a.precision)
    state = ft.TrainState.create(model, optimizer, strategy=strategy)
    lr = ft.schedules.warmup_cosine(peak_lr=6e-4, warmup_steps=10, total_steps=a.iters)
    data_dir = Path(a.data)
    if a.reader == "make_batches":  # the example's: every window, shuffled, pinned
        import numpy as np
        from shakespeare_char import CharWindows

        tokens = np.fromfile(data_dir / "train.bin", dtype=np.uint16).astype(np.int64)
        windows = CharWindows(tokens, a.block_size)
        pin = device.type == "cuda"

        def steps() -> Iterator[Any]:
            nonlocal state
            while True:  # epochs, as the example's loop (past one, make_batches yields none)
                yield from ft.make_batches(
                    windows,
                    state,
                    batch_size=a.batch_size,
                    accum=a.accum,
                    num_workers=a.workers,
                    pin_memory=pin,
                )
                state = ft.next_epoch(state)
    else:  # nanoGPT's get_batch, `accum` windows of random rows read in the loop

        def steps() -> Iterator[Any]:
            while True:
                yield [get_batch(data_dir, a.block_size, a.batch_size, device)
                       for _ in range(a.accum)]  # fmt: skip

    times, last = [], time.perf_counter()
    grads = stats = None
    for micro in steps():
        grads, stats = ft.accumulate_grads(state, micro, loss_fn)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step), max_norm=1.0)
        if ft.should_log(state, every=1):  # nanoGPT --log_interval=1: a host read per iteration
            loss = float(stats.loss)
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if state.step >= a.iters:
            break
    del grads
    return {"times": times, "loss": loss}


def nanogpt_cmd(a: argparse.Namespace, run_dir: Path) -> list[str]:
    """nanoGPT's train.py at the same shapes and batch; evaluation only at iteration 0."""
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[a.precision]
    return [
        sys.executable, str(run_dir / "train.py"), f"--out_dir={run_dir / 'out'}",
        "--dataset=bench", f"--device={a.device}", f"--dtype={dtype}", f"--compile={a.compile}",
        f"--n_layer={a.n_layer}", f"--n_head={a.n_head}", f"--n_embd={a.n_embd}",
        f"--block_size={a.block_size}", f"--batch_size={a.batch_size}",
        f"--gradient_accumulation_steps={a.accum}", f"--max_iters={a.iters}",
        f"--lr_decay_iters={a.iters}", "--warmup_iters=10", "--learning_rate=6e-4",
        "--weight_decay=0.1", "--beta2=0.95", "--grad_clip=1.0", "--dropout=0.0",
        "--bias=False", f"--eval_interval={10 * a.iters + 1}", "--eval_iters=1",
        "--log_interval=1", "--always_save_checkpoint=False", "--wandb_log=False",
        "--init_from=scratch",
    ]  # fmt: skip


def versus_nanogpt(a: argparse.Namespace) -> None:
    checkout = Path(a.nanogpt).expanduser().resolve()
    for name in ("train.py", "configurator.py"):
        if not (checkout / name).is_file():
            raise SystemExit(f"--nanogpt {checkout}: no {name} there (a nanoGPT checkout?)")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        for f in checkout.glob("*.py"):  # train.py, model.py, configurator.py, ...
            (run_dir / f.name).symlink_to(f)
        data_dir = run_dir / "data" / "bench"
        write_tokens(data_dir, a.vocab)
        worker = [sys.executable, __file__, "--worker-ftrain", str(data_dir)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
            if k in WORKER_ARGS
        ]  # fmt: skip
        worker += ["--compile"] if a.compile else ["--no-compile"]
        sides = ["nanogpt"] + [s for s in a.sides.split(",") if s != "nanogpt"]
        unknown = set(sides) - {"nanogpt", "ftrain", "ftrain+get_batch", "ftrain+divide", "raw"}
        if unknown:
            raise SystemExit(f"--sides: unknown {sorted(unknown)} (nanogpt, ftrain, "
                             "ftrain+get_batch, ftrain+divide, raw)")  # fmt: skip
        if a.workers and "ftrain" not in sides:
            raise SystemExit("--workers is the ftrain side's make_batches setting: add ftrain")
        commands = {"nanogpt": nanogpt_cmd(a, run_dir), "ftrain": worker,
                    "ftrain+get_batch": [*worker, "--reader=get_batch"],
                    "ftrain+divide": [*worker, "--loss=plain"],
                    "raw": [*worker, "--loop=raw"]}  # fmt: skip
        runs: dict[str, list[float]] = {side: [] for side in sides}
        loss: dict[str, float] = {}
        n_params, device, torch_version = 0, a.device, "?"
        for r in range(a.rounds):
            # nanoGPT first: a checkout it cannot run with (its vocabulary) stops before ours
            for side in sides if r % 2 == 0 else sides[:1] + sides[:0:-1]:
                cmd = commands[side]
                out = subprocess.run(
                    cmd, cwd=run_dir, capture_output=True, text=True, timeout=a.timeout
                )
                if out.returncode:
                    raise SystemExit(f"{side} failed ({out.returncode}):\n{out.stderr[-3000:]}")
                if side != "nanogpt":
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                    times, n_params = result["times"], result["n_params"]
                    loss[side] = result["loss"]
                    if result["compiled"] != a.compile:  # (--no-compile once did not reach it)
                        raise SystemExit(f"{side} ran with compile={result['compiled']}")
                    device, torch_version = result["device"], result["torch"]
                else:
                    vocab = re.search(r"^found vocab_size = (\d+)", out.stdout, re.MULTILINE)
                    if vocab is None or int(vocab.group(1)) != a.vocab:
                        raise SystemExit(
                            f"nanoGPT did not size its model to --vocab {a.vocab} from "
                            f"data/bench/meta.pkl (its output: {out.stdout[:500]!r}): the two "
                            "models would differ"
                        )
                    lines = ITER_LINE.findall(out.stdout)
                    times = [float(ms) / 1e3 for _, _, ms in lines]
                    loss[side] = float(lines[-1][1]) if lines else float("nan")
                    times = times[1:]  # nanoGPT's iteration 0 times its first evaluation too
                if len(times) <= a.warmup:
                    raise SystemExit(f"{side}: {len(times)} iterations, --warmup {a.warmup}")
                runs[side] += times[a.warmup :]
                print(
                    f"round {r + 1}/{a.rounds} {side}: median "  # as it goes: a run cut off
                    f"{statistics.median(times[a.warmup :]) * 1e3:.1f} ms/iter",
                    flush=True,
                )
    tokens = a.batch_size * a.accum * a.block_size
    fpt = flops_per_token(n_params, a.n_layer, a.n_head, a.n_embd, a.block_size)
    print(f"{device}, torch {torch_version}, GPT {n_params / 1e6:.1f}M non-embedding params, "
          f"{a.n_layer} layers x {a.n_head} heads x {a.n_embd}, block {a.block_size}, batch "
          f"{a.batch_size} x accum {a.accum}, {a.precision}, compile={a.compile}, "
          f"{a.rounds} rounds x {a.iters - a.warmup} timed iterations")  # fmt: skip
    print("| run | ms/iter | tokens/s | MFU | time ratio | last loss |\n|---|---|---|---|---|---|")
    med = {k: statistics.median(v) for k, v in runs.items()}
    for side, t in med.items():
        mfu = fpt * tokens / t / (a.peak_tflops * 1e12)
        print(f"| {side} | {t * 1e3:.1f} | {tokens / t:,.0f} | {mfu:.3f} | "
              f"{t / med['nanogpt']:.3f} | {loss[side]:.4f} |")  # fmt: skip
    print("(last loss: nanoGPT's is its last micro-batch's, ftrain's the mean of the iteration's)")


WORKER_ARGS = ("device", "precision", "n_layer", "n_head", "n_embd", "block_size", "vocab",
               "batch_size", "accum", "iters", "workers")  # fmt: skip


def nanogpt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nanogpt", help="a nanoGPT checkout: compare the main example's GPT with it")
    p.add_argument("--worker-ftrain", metavar="DATA", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch-size", type=int, default=12, help="nanoGPT's train_gpt2.py: 12")
    p.add_argument("--accum", type=int, default=4, help="gradient accumulation steps")
    p.add_argument("--iters", type=int, default=40, help="iterations per run")
    p.add_argument("--warmup", type=int, default=10, help="first iterations not timed")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--sides", default="nanogpt,ftrain",
                   help="what runs: nanogpt; ftrain (the example's data path: make_batches over "
                   "every window, pinned on CUDA); ftrain+get_batch (nanoGPT's reader in the "
                   "README loop); ftrain+divide (the loss returning its count beside its sum: "
                   "every gradient divided after backward); raw (nanoGPT's loop on our "
                   "model)")  # fmt: skip
    p.add_argument("--workers", type=int, default=0, help="ftrain's make_batches num_workers")
    p.add_argument("--reader", choices=["make_batches", "get_batch"], default="make_batches",
                   help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--loop", choices=["readme", "raw"], default="readme", help=argparse.SUPPRESS)
    p.add_argument("--loss", choices=["counted", "plain"], default="counted",
                   help=argparse.SUPPRESS)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--memory-rounds", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--memory-child", choices=["raw", "ftrain"], help=argparse.SUPPRESS)
    nanogpt_args(p)
    args = p.parse_args()
    if args.worker_ftrain:
        args.data = args.worker_ftrain
        ftrain_worker(args)
        return
    if args.nanogpt:
        versus_nanogpt(args)
        return
    import torch

    import ftrain as ft

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    if args.memory_child:
        memory_child(args.memory_child)
        return
    from bench_loop import ACCUM, _block

    model, data = build()
    ft_step, ft_loop = ftrain_loop(copy.deepcopy(model))
    loops = {"raw": raw_loop(copy.deepcopy(model)), "ftrain": ft_step}
    del model
    for step in loops.values():
        _block(step, data, 0)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in loops}
    for r in range(args.rounds):
        for name in list(loops) if r % 2 == 0 else list(reversed(loops)):
            times[name] += _block(loops[name], data, STEPS * (r + 1))
    med = {k: statistics.median(v) for k, v in times.items()}
    inner = ft_loop["state"].strategy.unwrap(ft_loop["state"].model)
    flops = ft.logging.flops_per_token(inner) * BS * SEQ * ACCUM
    n = sum(p.numel() for p in inner.parameters()) / 1e6
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Llama {n:.1f}M params, "
          f"bf16, batch {BS}x{SEQ} x accum {ACCUM}")  # fmt: skip
    print("| loop | ms/step | ratio | MFU |\n|---|---|---|---|")
    for k in loops:
        mfu = flops / med[k] / (args.peak_tflops * 1e12)
        print(f"| {k} | {med[k] * 1e3:.1f} | {med[k] / med['raw']:.3f} | {mfu:.3f} |")
    mem = memory(args.memory_rounds)
    print(f"peak memory growth MiB: raw {mem['raw']:.0f}, ftrain {mem['ftrain']:.0f}, "
          f"ratio {mem['ftrain'] / mem['raw']:.3f}")  # fmt: skip
    print("background checkpoint:", checkpoint_stall(ft_loop, data, med["ftrain"]))


if __name__ == "__main__":
    main()
