"""Record the README loop's trajectory in eleven configurations; compare two records bit for bit.

For changes to the step path that must not change a single bit (issue 30): record with the old
tree, record with the new one, compare.

    PYTHONPATH=/path/to/old/checkout python bench/step_trajectories.py dump /tmp/old.pt
    PYTHONPATH=. python bench/step_trajectories.py dump /tmp/new.pt
    python bench/step_trajectories.py compare /tmp/old.pt /tmp/new.pt   # exit 1 on a difference

Against a tree older than 2026-11-26 (b795846 and before), `stats.loss` of the causal LM
configurations differs in the last bit: `causal_lm_loss` now shifts the labels, not the
logits, and sums the same terms in another order. Everything else compares equal.

Each configuration trains a few steps and records every stats field, every gradient, the norm,
the skip flag, the data counters, the final parameters and optimizer state, and the caller's
RNG stream: a 2-layer MLP LM with dropout (accumulation 1, 2, 3, ragged padding and masked
labels, a step with no label token, no clipping and no skip check, SGD without donation, a
loss counting on the host), a plain Sequential with tensor batches, GPT-2 with dropout,
GPT-2 above the count-first threshold, fp16 loss scaling and bf16 autocast.
"""

import copy
import sys

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.modeling_outputs import CausalLMOutput

import ftrain as ft

torch.set_num_threads(1)


def _gpt2(vocab_size: int) -> GPT2LMHeadModel:
    """A 1-layer, 32-wide GPT-2 (initialised from torch's global generator, in call order)."""
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                   bos_token_id=0, eos_token_id=0)
    )  # fmt: skip


class MLPForCausalLM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, hidden=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, vocab)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return CausalLMOutput(logits=self.fc2(self.drop(F.gelu(self.fc1(self.embed(input_ids))))))


def lm_batches(vocab, steps, accum, bs, seq, ragged, g, empty_step=None):
    out = []
    for s in range(steps):
        micro = []
        for _ in range(accum):
            ids = torch.randint(0, vocab, (bs, seq), generator=g)
            mask = torch.ones_like(ids)
            labels = ids.clone()
            if ragged:
                for r in range(bs):
                    n = int(torch.randint(1, seq + 1, (1,), generator=g))
                    mask[r, n:] = 0
                    labels[r, n:] = -100
                labels[:, : int(torch.randint(0, 3, (1,), generator=g))] = -100
            if s == empty_step:
                labels[:] = -100
            micro.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        out.append(micro)
    return out


def run(name, model, data, loss_fn=None, strategy=None, opt=None, **kw):
    torch.manual_seed(123)
    state = ft.TrainState.create(
        model, opt or ft.optim.adamw(weight_decay=0.1), seed=3, strategy=strategy
    )
    rec = []
    for k, micro in enumerate(data):
        args = (state, micro) if loss_fn is None else (state, micro, loss_fn)
        grads, stats = ft.accumulate_grads(*args)
        rec += [
            stats.loss.clone(),
            stats.num_items.clone(),
            stats.num_tokens.clone(),
            stats.num_samples.clone(),
        ]
        rec += [g.clone() for g in grads.values()]
        state2, info = ft.clip_and_step(state, grads, stats=stats, lr=1e-2 * (1 + k % 3), **kw)
        state = state2
        rec += [
            info.grad_norm.clone(),
            info.skipped.clone(),
            state.data.tokens_seen.clone(),
            state.data.samples_seen.clone(),
        ]
    rec += [p.detach().clone() for p in state.params.values()]
    rec += [
        t.clone()
        for t in torch.utils._pytree.tree_leaves(state.opt_state)
        if isinstance(t, torch.Tensor)
    ]
    if state.scaler.scale is not None:
        rec += [state.scaler.scale.clone(), state.scaler.growth_tracker.clone()]
    rec.append(torch.tensor(torch.rand(1).item()))  # the caller's RNG stream is untouched
    return name, rec


def configs():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    mlp = MLPForCausalLM()
    yield run(
        "mlp",
        copy.deepcopy(mlp),
        lm_batches(64, 12, 2, 4, 16, False, g, empty_step=5),
        max_norm=1.0,
    )
    yield run(
        "mlp-ragged-accum3", copy.deepcopy(mlp), lm_batches(64, 10, 3, 4, 16, True, g), max_norm=0.5
    )
    yield run(
        "mlp-noclip-nocheck",
        copy.deepcopy(mlp),
        lm_batches(64, 6, 2, 4, 16, True, g, empty_step=2),
        skip_nonfinite=False,
    )
    yield run(
        "mlp-nodonate-sgd",
        copy.deepcopy(mlp),
        lm_batches(64, 6, 1, 4, 16, True, g),
        opt=ft.optim.sgd(momentum=0.9),
        donate=False,
        max_norm=1.0,
    )
    yield run("mlp-accum1", copy.deepcopy(mlp), lm_batches(64, 6, 1, 4, 16, True, g), max_norm=1.0)

    def host_loss(m, b):
        return m(input_ids=b["input_ids"]).logits.float().pow(2).sum(), b["input_ids"].shape[0]

    yield run(
        "mlp-hostloss",
        copy.deepcopy(mlp),
        lm_batches(64, 6, 2, 4, 16, True, g),
        loss_fn=host_loss,
        max_norm=1.0,
    )
    seq = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    xs = [[torch.randn(8, 16, generator=g) for _ in range(2)] for _ in range(6)]
    yield run(
        "seq-tensor",
        seq,
        xs,
        loss_fn=lambda m, b: (m(b).pow(2).sum(), torch.tensor(b.shape[0])),
        max_norm=1.0,
    )
    gpt = _gpt2(128)
    yield run("gpt2-dropout-ragged", gpt, lm_batches(128, 8, 2, 4, 16, True, g), max_norm=1.0)
    big = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=20000,
            n_positions=32,
            n_embd=64,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    yield run(
        "gpt2-countfirst", big, lm_batches(20000, 4, 2, 2, 16, True, g, empty_step=2), max_norm=1.0
    )
    small = _gpt2(128)
    yield run(
        "gpt2-fp16",
        small,
        lm_batches(128, 5, 2, 4, 16, True, g),
        strategy=ft.strategies.SingleDevice("cpu", precision="fp16"),
        max_norm=1.0,
    )
    small = _gpt2(128)
    yield run(
        "gpt2-bf16",
        small,
        lm_batches(128, 5, 2, 4, 16, True, g),
        strategy=ft.strategies.SingleDevice("cpu", precision="bf16"),
        max_norm=1.0,
    )


if __name__ == "__main__" and sys.argv[1] == "dump":
    torch.save(dict(configs()), sys.argv[2])
elif __name__ == "__main__":
    a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
    ok = True
    for name in a:
        ra, rb = a[name], b[name]
        same = len(ra) == len(rb) and all(
            x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
            and torch.equal(x.isnan(), y.isnan())
            for x, y in zip(ra, rb, strict=False)
        )
        bad = [
            i
            for i, (x, y) in enumerate(zip(ra, rb, strict=False))
            if not (x.dtype == y.dtype and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)))
        ]
        print(f"{name:22s} {'BIT-EQUAL' if same else 'DIFFERENT'} ({len(ra)} tensors) {bad[:8]}")
        ok &= same
    sys.exit(0 if ok else 1)
