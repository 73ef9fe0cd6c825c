"""Probe: does torch's context parallelism / pipelining run on CPU with gloo (issue 14 item 8)?

Spawns 2 processes (gloo, 60 s collective timeout, the whole run bounded by `--timeout`) and
prints one line per experiment: what ran, and the error or the difference to one process.
docs/strategies.md ("Context and pipeline parallelism") quotes the output.

    python bench/probe_cp_pp.py [--timeout 300]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _say(rank: int, what: str, fn, every_rank: bool = False) -> None:
    try:
        msg = fn()
    except Exception as e:  # a probe reports every failure, whatever it is
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        msg = f"FAILED: {last[:400]}"
    if rank == 0 or every_rank:
        print(f"[{what}]{f' rank {rank}:' if every_rank else ''} {msg}", flush=True)


def tiny_llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg)


PP_ONLY = False
BACKEND = None  # None: SDPA's own choice; else a torch.nn.attention.SDPBackend


def _backend():
    import contextlib

    from torch.nn.attention import sdpa_kernel

    return contextlib.nullcontext() if BACKEND is None else sdpa_kernel(BACKEND)


# --- context parallelism --------------------------------------------------------------------


def cp_raw_sdpa(mesh, rank: int) -> str:
    from torch.distributed.tensor.experimental import context_parallel

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    ql, kl, vl = (t.clone() for t in (q, k, v))  # buffers are resized in place: no grad
    with _backend(), context_parallel(mesh, buffers=[ql, kl, vl], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # the head-tail load balancer gives rank r chunks r and 3 - r of 4
    rows = torch.cat([want[:, :, 2 * c : 2 * c + 2] for c in (rank, 3 - rank)], dim=2)
    return f"ran; max |diff| to the single-process rows = {(out - rows).abs().max().item():.2e}"


def cp_raw_sdpa_values(mesh, rank: int) -> str:
    """Without the head-tail load balancer: rank r holds rows [r*S/2, (r+1)*S/2)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    half = slice(4 * rank, 4 * rank + 4)
    ql, kl, vl = (t[:, :, half].contiguous().requires_grad_() for t in (q, k, v))
    A._cp_options.enable_load_balance = False
    A._dispatch_mode = A._DispatchMode.MONKEY_PATCH
    A._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    try:
        with _backend():
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
    finally:
        A._disable_context_parallel_dispatcher_impl()
    diff = (out - want[:, :, half]).abs().max().item()
    return f"ran; max |diff| to the single-process rows = {diff:.2e}"


def cp_llama(mesh, rank: int) -> str:
    from torch.distributed.tensor.experimental import context_parallel

    model = tiny_llama()
    ids = torch.randint(1, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, labels=ids).loss.item()
    pos = torch.arange(16).expand(2, 16).contiguous()
    shift = F.pad(ids[:, 1:], (0, 1), value=-100)  # labels pre-shifted before sharding
    x, p, y = ids.clone(), pos.clone(), shift.clone()
    with _backend(), context_parallel(mesh, buffers=[x, p, y], buffer_seq_dims=[1, 1, 1]):
        logits = model(input_ids=x, position_ids=p).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        n = (y != -100).sum()
        loss.backward()
    tot = torch.stack([loss.detach(), n.float()])
    dist.all_reduce(tot)
    got = (tot[0] / tot[1]).item()
    return f"ran; loss {got:.6f} vs one process {want:.6f} (|diff| {abs(got - want):.2e})"


def cp_flex(mesh, rank: int, backward: bool) -> str:
    """The module-wrapper API with flex_attention: K/V all-gathered, a CP block mask."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as A
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q, kv):
        return q >= kv

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return flex_attention(q, k, v, block_mask=block_mask)

    s = 256  # _create_cp_block_mask wants the length divisible by ranks x 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, s, 8, generator=g, requires_grad=backward) for _ in range(3))
    want = Attn()(q, k, v, create_block_mask(causal, 1, 2, s, s, device="cpu"))
    attn = A._ContextParallel(seq_dim=2, attention_type=A._ContextParallel.AttentionType.FLEX)
    m = attn._apply(Attn(), mesh)
    mask = A._create_cp_block_mask(causal, 1, 2, s, s, mesh)
    qkv = A._context_parallel_shard(mesh, [q.detach(), k.detach(), v.detach()], [2, 2, 2])
    ql, kl, vl = (t.requires_grad_(backward) for t in qkv)
    out = m(ql, kl, vl, mask)
    mine = slice(rank * s // 2, (rank + 1) * s // 2)
    d = torch.tensor([(out - want[:, :, mine]).abs().max().item()])
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    if not backward:
        return f"forward ran (eager flex_attention); max |diff| over both ranks {d.item():.2e}"
    want.square().sum().backward()
    out.square().sum().backward()
    pairs = ((ql, q), (kl, k), (vl, v))
    dg = torch.tensor([max((a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in pairs)])
    dist.all_reduce(dg, op=dist.ReduceOp.MAX)
    return f"backward ran; max |grad diff| over both ranks {dg.item():.2e}"


# --- pipeline parallelism -------------------------------------------------------------------


class _Stage0(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.embed, self.layer, self.rotary = (
            model.model.embed_tokens, model.model.layers[0], model.model.rotary_emb,
        )  # fmt: skip

    def forward(self, ids):
        h = self.embed(ids)
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        return self.layer(h, position_embeddings=self.rotary(h, pos), attention_mask=None)


class _Stage1(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.layer, self.norm, self.head, self.rotary = (
            model.model.layers[1], model.model.norm, model.lm_head, model.model.rotary_emb,
        )  # fmt: skip

    def forward(self, h):
        pos = torch.arange(h.shape[1]).expand(h.shape[0], -1)
        h = self.layer(h, position_embeddings=self.rotary(h, pos), attention_mask=None)
        return self.head(self.norm(h))


def pp_schedule(mesh, rank: int, schedule: str) -> str:
    from torch.distributed import pipelining as P

    model = tiny_llama()
    ids = torch.randint(1, 61, (4, 12), generator=torch.Generator().manual_seed(2))
    want = model(input_ids=ids, labels=ids).loss  # mean over 4 * 11 tokens
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def loss_fn(logits, y):  # per micro-batch; the schedule averages over micro-batches
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    part = _Stage0(model) if rank == 0 else _Stage1(model)
    stage = P.PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=2, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    if rank == 0:
        sched.step(ids)
    else:
        sched.step(target=ids, losses=losses)
    own = dict(part.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    diff = max((p.grad - ref[names[id(p)]]).abs().max().item() for p in own.values())
    gd = torch.tensor([diff])
    dist.all_reduce(gd, op=dist.ReduceOp.MAX)
    lv = torch.tensor([sum(x.item() for x in losses) / 2 if losses else 0.0])
    dist.all_reduce(lv)
    return (
        f"ran; mean loss {lv.item():.6f} vs one process {want.item():.6f}; "
        f"max |grad diff| {gd.item():.2e}"
    )


def pp_ragged(mesh, rank: int) -> str:
    """A second step whose batch has another sequence length (ragged padding per step)."""
    from torch.distributed import pipelining as P

    model = tiny_llama()
    part = _Stage0(model) if rank == 0 else _Stage1(model)
    stage = P.PipelineStage(part, rank, 2, torch.device("cpu"))

    def loss_fn(logits, y):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    sched = P.ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    for length in (12, 9):
        ids = torch.randint(1, 61, (4, length), generator=torch.Generator().manual_seed(length))
        if rank == 0:
            sched.step(ids)
        else:
            sched.step(target=ids, losses=[])
    return "ran: a step with sequence length 12, then one with 9"


def pp_trace() -> str:
    """pipeline(): split a whole HF model by tracing it (torch.export), no hand-written stages."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = tiny_llama()
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    pipe = pipeline(model, mb_args=(ids,), split_spec={"model.layers.1": SplitPoint.BEGINNING})
    return f"ran; {pipe.num_stages} stages traced from LlamaForCausalLM"


def worker(rank: int, world: int, port: int, pp_only: bool) -> None:
    global PP_ONLY
    PP_ONLY = pp_only
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    global BACKEND
    from torch.nn.attention import SDPBackend

    for BACKEND in () if PP_ONLY else (None, SDPBackend.MATH):
        b = "default" if BACKEND is None else BACKEND.name
        _say(rank, f"cp/{b}: context_parallel, SDPA on q/k/v", lambda: cp_raw_sdpa(mesh, rank))
        _say(rank, f"cp/{b}: no load balancer", lambda: cp_raw_sdpa_values(mesh, rank))
        _say(rank, f"cp/{b}: HF Llama (sdpa) ids/positions/labels", lambda: cp_llama(mesh, rank))
        dist.barrier()
    if not PP_ONLY:
        _say(rank, "cp: flex_attention, module wrapper", lambda: cp_flex(mesh, rank, False))
        dist.barrier()
        _say(rank, "cp: flex_attention, backward", lambda: cp_flex(mesh, rank, True))
    dist.barrier()
    _say(rank, "pp: ScheduleGPipe, 2 stages", lambda: pp_schedule(mesh, rank, "gpipe"))
    dist.barrier()
    _say(rank, "pp: Schedule1F1B, 2 stages", lambda: pp_schedule(mesh, rank, "1f1b"))
    dist.barrier()
    # Last: a failed step leaves its peer's receive pending, so the group is not used again.
    ragged = "pp: GPipe, two steps of different lengths"
    _say(rank, ragged, lambda: pp_ragged(mesh, rank), every_rank=True)
    dist.destroy_process_group()


def spawn_bounded(fn, args: tuple, *, timeout: float, world: int = 2) -> None:
    """Run `fn(rank, world, port, *args)` in `world` spawned processes; kill them all and exit
    after `timeout` seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(
        fn, args=(world, port, *args), nprocs=world, join=False, start_method="spawn"
    )
    end = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, end - time.monotonic())):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            sys.exit(f"timed out after {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--trace-only", action="store_true", help="only the pipeline() tracer")
    ap.add_argument("--pp-only", action="store_true", help="skip the context-parallel probes")
    args = ap.parse_args()
    _say(0, "pp: pipeline() tracer on HF Llama", pp_trace)
    if args.trace_only:
        return
    spawn_bounded(worker, (args.pp_only,), timeout=args.timeout)
    print(f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
