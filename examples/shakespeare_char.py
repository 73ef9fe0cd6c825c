"""Train a character-level GPT on Tiny Shakespeare with an explicit ftrain loop.

nanoGPT's CPU configuration of `shakespeare_char` (4 layers, 4 heads, 128-dim embeddings, block
64, batch 12, lr 1e-3 with 100 warmup steps and cosine decay to 1e-4 at 2000 iterations, AdamW
betas (0.9, 0.99), weight decay 0.1, clip 1.0, dropout 0), on nanoGPT's model (no biases, exact
GELU, tied output layer) written as an HF `PreTrainedModel`, `CharGPT`. The text ships in the repo
(examples/data/tinyshakespeare.txt); nothing is downloaded.

    python examples/shakespeare_char.py                 # full run, prints val_loss=... at the end
    python examples/shakespeare_char.py --max-iters 50  # a quick look
    torchrun --nproc_per_node 2 examples/shakespeare_char.py --strategy ddp   # 2 processes
    torchrun --nproc_per_node 2 examples/shakespeare_char.py --strategy fsdp  # sharded
    python examples/shakespeare_char.py --precision bf16 --compile            # faster kernels

The loop is the same for every strategy, precision and compilation: only the objects handed to
`TrainState.create` change.

Checkpoints go to `--out` (default runs/shakespeare_char) at every evaluation, written in the
background; the newest and the best by eval_loss are kept. Run the command again after an
interruption and it resumes exactly where the last checkpoint left off. The final model is
exported to `<out>/final`, loadable with `CharGPT.from_pretrained` (import it from this file).
Logs go to a progress bar in a terminal (printed lines otherwise) and to `<out>/metrics.jsonl`;
draw them with `python -m ftrain plot runs/shakespeare_char/metrics.jsonl -o curves.png`.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

import ftrain as ft
from ftrain.extras.cli import at_least

try:  # transformers 5: leaves weights that from_pretrained loaded alone
    from transformers import initialization as init
except ImportError:  # transformers 4 initializes only the missing ones anyway
    from torch.nn import init

DATA = Path(__file__).parent / "data" / "tinyshakespeare.txt"


class CharWindows(torch.utils.data.Dataset):
    """Every window of `block` characters, with the next character of each position as target."""

    def __init__(self, ids: np.ndarray, block: int) -> None:
        self.ids, self.block = torch.from_numpy(ids), block

    def __len__(self) -> int:
        return len(self.ids) - self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i : i + self.block], self.ids[i + 1 : i + 1 + self.block]


class CharGPTConfig(PretrainedConfig):
    """nanoGPT's GPT: `n_layer` pre-norm blocks of causal self-attention and a GELU MLP."""

    model_type = "char_gpt"

    def __init__(
        self, vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, **kwargs
    ) -> None:
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        super().__init__(**{"tie_word_embeddings": False, **kwargs})  # one matrix, no tying


class Block(nn.Module):
    def __init__(self, c: CharGPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=False)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=False)
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd, bias=False)
        self.attn_proj = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=False)
        self.mlp_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=False)
        self.attn_proj.residual = self.mlp_proj.residual = True  # GPT-2's scaled init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.ln_1(x)).view(b, t, 3, self.n_head, c // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))


class CharGPT(PreTrainedModel):
    """nanoGPT's model (bias-free, exact GELU, output layer tied to the token embedding) as an
    HF model: `CharGPT.from_pretrained("runs/shakespeare_char/final")` loads the export. It is
    not registered with the Auto classes and does not generate (no `GenerationMixin`).

    HF's GPT-2 at the same size has biases, `Conv1D` layers and more module overhead: its
    forward+backward takes 1.17x nanoGPT's at these shapes, this model's 1.02x, and the whole
    job went from 1.03x nanoGPT's time to 0.92x (bench/RESULTS.md)."""

    config_class = CharGPTConfig
    _no_split_modules: ClassVar[list[str]] = ["Block"]  # FSDP shards each block on its own

    def __init__(self, config: CharGPTConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Leaf modules only: transformers 5 skips a module whose own parameters are all
        # initialized, which a parameter-free container (Block) always is.
        if isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
        elif isinstance(module, nn.Linear):  # residual projections: 0.02 / sqrt(2 n_layer)
            scale = math.sqrt(2 * self.config.n_layer) if getattr(module, "residual", 0) else 1
            init.normal_(module.weight, mean=0.0, std=0.02 / scale)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        t = input_ids.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"input_ids has {t} positions; block_size is {self.config.block_size}")
        x = self.wte(input_ids) + self.wpe.weight[:t]
        for block in self.blocks:
            x = block(x)
        return CausalLMOutput(logits=F.linear(self.ln_f(x), self.wte.weight))


def next_char_sum(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Sum of next-character cross-entropies (targets are already shifted)."""
    x, y = batch
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


def targets_in(batch: list[torch.Tensor]) -> int:
    """The items `next_char_sum` sums over: every target character."""
    return batch[1].numel()


# The count is known from the batch alone: from 2**20 parameters on (GPT-2 shapes), the step
# divides each loss by it before backward instead of every gradient after (docs/getting_started).
next_char_loss = ft.losses.counted(next_char_sum, items=targets_in)


def load(path: Path, block: int) -> tuple[CharWindows, CharWindows, int]:
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    lookup = np.zeros(max(map(ord, chars)) + 1, dtype=np.int64)
    lookup[[ord(c) for c in chars]] = np.arange(len(chars))
    ids = lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    split = int(0.9 * len(ids))  # nanoGPT's 90/10 split
    return CharWindows(ids[:split], block), CharWindows(ids[split:], block), len(chars)


def schedule(max_iters: int) -> ft.schedules.Schedule:
    """nanoGPT's: 100 warmup steps to 1e-3, cosine decay to 1e-4 at `max_iters`."""
    return ft.schedules.cosine_with_min_lr(1e-3, 100, max_iters, min_lr=1e-4)


def run_record(args: argparse.Namespace) -> dict[str, object]:
    """The flags a resume must repeat, saved with each checkpoint (beside its eval_loss)."""
    digest = int(hashlib.sha256(Path(args.data).read_bytes()).hexdigest()[:12], 16)  # < 2**53
    return {
        "max_iters": args.max_iters,
        "batch_size": args.batch_size,
        "data_digest": digest,
        "eval_iters": args.eval_iters,
    }


def refuse_another_run(args: argparse.Namespace, ckpt: Path, state: ft.TrainState) -> None:
    """Raise when the flags cannot continue the run `ckpt` was saved from: the resumed run would
    be neither that run nor the one the flags describe."""
    if state.seed != args.seed:  # the checkpoint's seed orders the data: --seed would not act
        raise ValueError(
            f"--seed {args.seed}, but {ckpt} was trained with --seed {state.seed}: a resumed "
            f"run keeps its checkpoint's seed; pass --seed {state.seed}, or another --out"
        )
    if state.step > args.max_iters:  # nothing would train; val_loss would be a longer run's
        raise ValueError(
            f"--max-iters {args.max_iters}, but {ckpt} already trained {state.step} steps: pass "
            f"--max-iters {state.step} or more to go on, or another --out for a shorter run"
        )
    saved, now = ft.checkpoint.read_meta(ckpt)["metrics"], run_record(args)  # older: none
    if saved.get("data_digest", now["data_digest"]) != now["data_digest"]:
        raise ValueError(
            f"--data {args.data} holds another text than {ckpt} was trained on: the resumed run "
            "would train on both; pass the run's --data, or another --out for a new run"
        )
    if saved.get("batch_size", args.batch_size) != args.batch_size:
        raise ValueError(
            f"--batch-size {args.batch_size}, but {ckpt} was trained with --batch-size "
            f"{saved['batch_size']}: the resumed run would mix the two; pass --batch-size "
            f"{saved['batch_size']}, or another --out for a new run"
        )
    if saved.get("eval_iters", args.eval_iters) != args.eval_iters:  # the best is by eval_loss
        raise ValueError(
            f"--eval-iters {args.eval_iters}, but {ckpt} was evaluated on --eval-iters "
            f"{saved['eval_iters']} batches: the best checkpoint would be picked among losses "
            f"over different batches; pass --eval-iters {saved['eval_iters']}, or another --out"
        )
    old, new = schedule(saved.get("max_iters", args.max_iters)), schedule(args.max_iters)
    if any(old(t) != new(t) for t in range(state.step)):  # equal during warmup
        raise ValueError(
            f"--max-iters {args.max_iters}, but {ckpt} was trained {state.step} steps of a "
            f"learning-rate schedule decaying over {saved['max_iters']}: the resumed run would "
            f"follow neither schedule; pass --max-iters {saved['max_iters']}, or another --out"
        )


def train_and_export(args, model, optimizer, strategy, train, val, loss_fn) -> float:
    """Train (resuming from the newest checkpoint), evaluate, export; return the val loss."""
    state = ft.TrainState.create(model, optimizer, seed=args.seed, strategy=strategy)
    main_rank, world = state.strategy.rank == 0, state.strategy.world_size
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by {world} ranks")
    batch_size = args.batch_size // world  # per rank: the global batch stays the same
    lr = schedule(args.max_iters)
    # strategy=: every rank found the same checkpoint, or none (node-local folders raise)
    if args.out and (ckpt := ft.latest_checkpoint(args.out, strategy=state.strategy)):
        state = ft.load_checkpoint(ckpt, state)
        refuse_another_run(args, ckpt, state)
        if main_rank:
            print(f"resumed from {ckpt} (step {state.step})", flush=True)

    def val_loss(iters: int) -> float:
        batches = ft.make_batches(  # a fixed random subset, split over the ranks
            val, batch_size=batch_size, seed=0, strategy=state.strategy
        )
        subset = (b for _, b in zip(range(iters), batches, strict=False))
        return ft.evaluate(state, subset, loss_fn)["eval_loss"]

    # A progress bar in a terminal, printed lines otherwise (rank 0 only); JSONL on rank 0.
    jsonl = (
        ft.logging.JSONLSink(Path(args.out) / "metrics.jsonl") if args.out and main_rank else None
    )
    logger = ft.logging.Logger(
        state, every=args.log_interval, total_steps=args.max_iters, sinks=[jsonl] if jsonl else [],
        epoch_size=ft.data.num_micro_batches(len(train), batch_size, world_size=world),
    )  # fmt: skip
    record, start = run_record(args), time.perf_counter()  # the flags saved with checkpoints
    cuda = state.strategy.device.type == "cuda"  # batches page-locked: the copy does not wait
    while state.step < args.max_iters:
        for micro in ft.make_batches(train, state, batch_size=batch_size, pin_memory=cuda):
            grads, stats = ft.accumulate_grads(state, micro, loss_fn)
            state, info = ft.clip_and_step(
                state, grads, stats=stats, lr=lr(state.step), max_norm=1.0
            )
            logger.step(state, stats, info)  # reads the device back on log steps only
            if ft.should_eval(state, every=args.eval_interval, total_steps=args.max_iters):
                metrics = {"eval_loss": val_loss(args.eval_iters)}
                logger.log({"step": state.step, **metrics})
                if args.out:  # in the background, except the last save of the run
                    ft.save_checkpoint(
                        state, args.out, metrics={**metrics, **record}, keep_last=args.keep_last,
                        best_metric="eval_loss", blocking=state.step >= args.max_iters,
                    )  # fmt: skip
            if state.step >= args.max_iters:
                break
        else:
            state = ft.next_epoch(state)
    logger.close()
    final = val_loss(args.final_eval_iters)
    if args.out:  # on every rank: FSDP gathers the shards, rank 0 writes
        ft.export_pretrained(state, Path(args.out) / "final", overwrite=True)
    if main_rank:
        print(f"train_time={time.perf_counter() - start:.1f}s")
        print(f"val_loss={final:.4f}")
    return final


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--max-iters", type=at_least(1), default=2000)
    p.add_argument("--eval-interval", type=at_least(1), default=250)
    p.add_argument(
        "--eval-iters", type=at_least(1), default=20, help="batches per periodic evaluation"
    )
    p.add_argument(
        "--final-eval-iters", type=at_least(1), default=200, help="batches for the final val_loss"
    )
    p.add_argument("--log-interval", type=at_least(1), default=100)
    p.add_argument(
        "--batch-size", type=at_least(1), default=12, help="global: split over the ranks"
    )
    p.add_argument(
        "--strategy",
        choices=["single", "ddp", "fsdp"],
        default="single",
        help="ddp/fsdp: data parallel (fsdp: sharded) across the processes torchrun starts",
    )
    p.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="autocast dtype"
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the model with its loss, one graph"
    )
    p.add_argument("--block-size", type=at_least(1), default=64)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", default="runs/shakespeare_char", help="checkpoints; '' for none")
    p.add_argument(
        "--keep-last", type=at_least(0), help="newest checkpoints kept (+ the best); default 1"
    )
    args = p.parse_args(argv)
    if args.keep_last is not None and not args.out:
        p.error("--keep-last keeps checkpoints in --out, and --out '' writes none")
    args.keep_last = 1 if args.keep_last is None else args.keep_last

    train, val, vocab = load(args.data, args.block_size)
    torch.manual_seed(args.seed)
    model = CharGPT(CharGPTConfig(vocab_size=vocab, block_size=args.block_size))
    optimizer = ft.optim.adamw(betas=(0.9, 0.99), weight_decay=0.1, mask=ft.optim.decay_mask(model))
    if args.strategy == "single":
        strategy = ft.strategies.SingleDevice(precision=args.precision)
    else:
        strategy = ft.strategies.from_env(args.strategy, precision=args.precision)
    # Compiled with its loss, the forward and the cross-entropy are one graph (as nanoGPT's
    # forward holds its loss): the loss no longer reads the logits back from memory in float32
    # on its own. Compiling the model alone took 1.13x the time a step (bench/RESULTS.md).
    loss_fn = next_char_loss
    if args.compile:
        loss_fn = ft.losses.counted(torch.compile(next_char_sum), items=targets_in)
    with strategy:  # leaves the process group in order on every rank, also after an error
        final = train_and_export(args, model, optimizer, strategy, train, val, loss_fn)
    return final if math.isfinite(final) else float("nan")


if __name__ == "__main__":
    main()
