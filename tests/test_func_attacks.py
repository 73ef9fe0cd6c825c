"""Where the research path crosses other features: each test failed (silently wrong, or a bad
argument accepted) before its fix. Ensembles x tied weights, DP-SGD x ensembles, nested batches
and noise-multiplier sweeps, generation x a passed GenerationConfig, merged LoRA export x tied
embeddings, and the arguments of ft.func, ft.lora and multiple-choice scoring."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ftrain as ft
from helpers import tiny_llama

KEY = bytes(range(32))  # a test key; a run uses secrets.token_bytes(32), kept outside the run


def ce_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum"), batch["y"].numel()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def data(n=6, seed=1, scale=5.0):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, 3, generator=g) * scale,
        "y": torch.randint(0, 2, (n,), generator=g),
    }


class Tied(nn.Module):
    """An embedding whose transpose is the output layer (as in GPT-2 and tied Llamas)."""

    def __init__(self, vocab=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def test_an_ensemble_of_tied_models_keeps_every_members_tie():
    # Before: the skeleton kept member 0's own (unstacked) tensor under the tied name: with
    # vocab == members the forward ran silently with output shape (3, 2) instead of (3, 2, 3),
    # and that tensor was a trainable parameter of the wrong shape.
    torch.manual_seed(0)
    members = [Tied() for _ in range(3)]
    ens = ft.func.Ensemble(members)
    assert all(p.shape[0] == 3 for p in ft.TrainState.create(ens, ft.optim.sgd()).params.values())
    x = torch.tensor([0, 2])
    ens(x).sum().backward()  # the gradient reaches the shared weight through both layers
    for k, m in enumerate(members):
        m(x).sum().backward()
        torch.testing.assert_close(ens.stacked.emb.weight.grad[k], m.emb.weight.grad)
    with torch.no_grad():
        got = ens(x)
        for k, m in enumerate(members):
            torch.testing.assert_close(got[k], m(x))
            alone = ens.member(k)
            assert alone.head.weight is alone.emb.weight
            torch.testing.assert_close(alone(x), m(x))


def test_private_grads_of_an_ensemble_clip_each_member_like_separate_runs():
    # Before: each example was clipped by its norm over all members together, so every member's
    # DP gradient was about 0.55x what its own DP-SGD run gives (0.0302 vs 0.0553).
    members = [mlp(s) for s in range(3)]
    state = ft.TrainState.create(ft.func.Ensemble(members), ft.optim.sgd())
    batch = data()
    kw = {"max_norm": 0.1, "noise_multiplier": 0.0}
    ens, _ = ft.func.private_grads(state, [batch], ft.func.ensemble_loss(ce_loss), **kw)
    for k, m in enumerate(members):
        alone, _ = ft.func.private_grads(
            ft.TrainState.create(m, ft.optim.sgd()), [batch], ce_loss, **kw
        )
        for n, g in alone.items():
            torch.testing.assert_close(ens[f"stacked.{n}"][k], g, rtol=1e-5, atol=1e-7)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

    def forward(self, features):
        return self.a(features["num"]) + self.b(features["cat"])


def test_private_grads_divide_by_the_examples_of_a_nested_batch():
    # Before: the denominator counted the keys of the first (nested) field, 2, not the 8
    # examples, so the DP gradient was 4x the batch's mean gradient.
    def loss_fn(model, b):
        return F.cross_entropy(model(b["features"]), b["y"], reduction="sum"), b["y"].numel()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = {
        "features": {"num": torch.randn(8, 3, generator=g), "cat": torch.randn(8, 4, generator=g)},
        "y": torch.randint(0, 2, (8,), generator=g),
    }
    state = ft.TrainState.create(TwoInputs(), ft.optim.sgd())
    grads, stats = ft.func.private_grads(state, [batch], loss_fn, max_norm=1e3, noise_multiplier=0)
    assert int(stats.num_samples) == 8
    want, _ = ft.accumulate_grads(state, [batch], loss_fn)  # no example reaches max_norm
    for n, w in want.items():
        torch.testing.assert_close(grads[n], w, rtol=1e-5, atol=1e-7)


def test_a_noise_multiplier_sweep_draws_independent_noise():
    # Before: runs differing only in noise_multiplier drew the same N(0, 1) draws, so two of
    # them gave the noiseless gradient back: 2 * g(sigma=1) - g(sigma=2) equalled it to 3e-8.
    torch.manual_seed(0)
    state = ft.TrainState.create(nn.Linear(40, 40), ft.optim.sgd(), seed=0)
    batch = {"x": torch.randn(4, 40), "y": torch.randn(4, 40)}

    def mse(m, b):
        return ((m(b["x"]) - b["y"]) ** 2).sum(), b["y"].shape[0]

    def noise(**kw):
        kw = {"max_norm": 1.0, "noise_key": KEY, **kw}
        clean, _ = ft.func.private_grads(state, [batch], mse, **{**kw, "noise_multiplier": 0.0})
        noisy, _ = ft.func.private_grads(state, [batch], mse, **kw)
        return torch.cat([(noisy[n] - clean[n]).flatten() for n in clean]).double()

    one, two = noise(noise_multiplier=1.0), noise(noise_multiplier=2.0)
    assert abs(torch.corrcoef(torch.stack([one, two]))[0, 1]) < 0.2  # 1640 coordinates
    wider = noise(noise_multiplier=1.0, max_norm=3.0)
    assert abs(torch.corrcoef(torch.stack([one, wider]))[0, 1]) < 0.2
    assert torch.equal(noise(noise_multiplier=1.0), one)  # the same run still resumes exactly


PROMPTS = [[5, 9, 12], [7, 30, 2, 44, 18], [11, 4], [25, 26, 27, 28]]


def test_generate_reads_eos_and_pad_from_a_passed_generation_config():
    # Before: the rows were cut at the model's own eos (none here), so a row that stopped early
    # came back with the padding HF filled in: [10, 22, 15, 0, 0, 0] instead of [10, 22, 15].
    from transformers import GenerationConfig

    model = tiny_llama(dtype=torch.float64).eval()  # its generation config: pad 0, no eos

    def one_at_a_time(**kw):
        with torch.no_grad():
            return [
                model.generate(input_ids=torch.tensor([p]), **kw)[0, len(p) :].tolist()
                for p in PROMPTS
            ]

    free = one_at_a_time(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = free[0][2]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = one_at_a_time(generation_config=config)
    assert len({len(w) for w in want}) > 1  # a row stops early, so HF pads it in a batch
    state = ft.TrainState.create(model, ft.optim.sgd())

    def generated():
        rows = [{"input_ids": p} for p in PROMPTS]
        batches = ft.make_batches(rows, batch_size=4, shuffle=False)  # right-padded
        return [
            r for b in ft.generate(state, batches, generation_config=config) for r in b["token_ids"]
        ]

    assert generated() == want
    # The pad token of the passed config counts too (before: "generate needs a pad token id").
    model.generation_config.pad_token_id = None
    assert generated() == want
    assert config.pad_token_id == 0 and config.eos_token_id == eos  # the caller's is unchanged


def tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_merged_export_refuses_an_adapter_on_a_tied_weight(tmp_path, target):
    # Before: merging the adapter of embed_tokens (lm_head) into the weight they share changed
    # the other layer too: the exported model's logits differed from the trained one's by 32.9
    # (9.1). The adapter export stays right.
    with pytest.warns(UserWarning, match="ensure_weight_tying"):  # peft's notice
        model = ft.lora.apply(tied_llama(), r=4, alpha=8, targets=[target, "q_proj"])
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)  # as training would
    state = ft.TrainState.create(model, ft.optim.sgd())
    with pytest.raises(ValueError, match=rf"merge=True.*{target}.*tied"):
        ft.export_pretrained(state, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged").exists()
    with pytest.warns(UserWarning, match="save_embedding_layers"):  # peft saves the tied layer
        ft.export_pretrained(state, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def _private(**kw):
    state = ft.TrainState.create(mlp(), ft.optim.sgd())
    return ft.func.private_grads(
        state, [data(4)], ce_loss, **{"max_norm": 1.0, "noise_multiplier": 0.0, **kw}
    )


def _per_sample(**kw):
    return ft.func.per_sample_grads(ft.TrainState.create(mlp(), ft.optim.sgd()), data(4), ce_loss,
                                    **kw)  # fmt: skip


BAD = [
    # expected_batch_size=True divided the summed gradient by 1: 4x the gradient, silently.
    (lambda: _private(expected_batch_size=True), "expected_batch_size"),
    (lambda: _private(max_norm=True), "max_norm"),
    (lambda: _private(noise_multiplier=True), "noise_multiplier"),
    (lambda: _private(chunk_size=True), "chunk_size"),
    (lambda: _per_sample(chunk_size=True), "chunk_size"),
    (lambda: _per_sample(micro_index=True), "micro_index"),
    (lambda: _per_sample(micro_index=-1), "micro_index"),
    (lambda: ft.func.clip_members({"w": torch.ones(2, 3)}, True), "max_norm"),
    (lambda: ft.func.sweep([ft.optim.sgd()] * 2, lr_factors=[math.inf, 1.0]), "lr_factors"),
    (lambda: ft.func.sweep([ft.optim.sgd()] * 2, lr_factors=[True, 1.0]), "lr_factors"),
    (lambda: ft.func.maml_loss(ce_loss, inner_steps=True, inner_lr=0.1), "inner_steps"),
    (lambda: ft.func.maml_loss(ce_loss, inner_steps=1, inner_lr=-0.1), "inner_lr"),
    (lambda: ft.func.maml_loss(ce_loss, inner_steps=1, inner_lr=math.nan), "inner_lr"),
    (lambda: ft.func.maml_loss(ce_loss, inner_steps=1, inner_lr="0.1"), "inner_lr"),
    (lambda: ft.func.inner_sgd(momentum=math.nan), "momentum"),
    (lambda: ft.func.inner_sgd(weight_decay=math.inf), "weight_decay"),
    (lambda: ft.func.inner_adam(eps=math.nan), "eps"),
    (lambda: ft.func.inner_adam(weight_decay=math.nan), "weight_decay"),
    (
        lambda: ft.func.epsilon(sample_rate=True, noise_multiplier=1.0, steps=1, delta=1e-5),
        "sample_rate",
    ),
    (lambda: ft.func.rdp(sample_rate=0.1, noise_multiplier=1.0, steps=-5, order=2), "steps"),
    (lambda: ft.func.rdp(sample_rate=0.1, noise_multiplier=1.0, steps=1, order=0.5), "order"),
    # alpha=0 scales the adapters by 0: nothing ever trains; dropout<0 or NaN became no dropout.
    (lambda: ft.lora.apply(tiny_llama(), r=4, alpha=0), "alpha"),
    (lambda: ft.lora.apply(tiny_llama(), r=4, alpha=-8), "alpha"),
    (lambda: ft.lora.apply(tiny_llama(), r=True, alpha=8), "r"),
    (lambda: ft.lora.apply(tiny_llama(), r=4, alpha=8, dropout=-0.5), "dropout"),
    (lambda: ft.lora.apply(tiny_llama(), r=4, alpha=8, dropout=math.nan), "dropout"),
]


@pytest.mark.parametrize(("call", "name"), BAD, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD)])
def test_a_bad_argument_of_the_research_path_is_refused_naming_it(call, name):
    with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
        call()


def test_multiple_choice_refuses_an_answer_without_a_position_before_it():
    # Before: an answer at position 0 was scored with the logits of the row's last position
    # (index -1 wrapped around), silently.
    metrics_fn = ft.multiple_choice_metrics(choice_ids=[7, 8, 9, 10])
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    rows = [
        {"input_ids": [8, 4, 5, 6], "labels": [8, -100, -100, -100]},
        {"input_ids": [3, 4, 5, 9], "labels": [-100, -100, -100, 9]},
    ]
    with pytest.raises(ValueError, match="position 0"):
        ft.evaluate(state, ft.make_batches(rows, batch_size=2, shuffle=False),
                    metrics_fn=metrics_fn)  # fmt: skip
