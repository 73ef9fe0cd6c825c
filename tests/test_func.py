"""ft.func: per-example gradients vs Opacus, DP-SGD, the accountant, ensembles, meta-gradients."""

from __future__ import annotations

import copy
import math
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ftrain as ft
from helpers import train_steps

opacus = pytest.importorskip("opacus")


def ce_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum"), batch["y"].numel()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def conv(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.ReLU(), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)
    )


def tiny_bert(seed=0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",  # vmap has no batching rule for CPU flash attention
    )  # fmt: skip
    return BertForSequenceClassification(cfg).eval()


def bert_batch(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (n, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, 5:] = 0  # ragged rows
    labels = torch.randint(0, 3, (n,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def opacus_grad_sample(model, batch, loss_fn):
    """Opacus' per-example gradients of the summed loss."""
    gsm = opacus.GradSampleModule(copy.deepcopy(model).train(), loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' full-backward-hook notice
        loss_fn(gsm, batch)[0].backward()
    return {n: p.grad_sample for n, p in gsm._module.named_parameters() if p.requires_grad}


def data(n=7, seed=0, shape=(6,)):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, *shape, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


@pytest.mark.parametrize(("build", "shape"), [(mlp, (6,)), (conv, (2, 6, 6))], ids=["mlp", "conv"])
def test_per_sample_grads_equal_opacus(build, shape):
    model, batch = build(), data(shape=shape)
    state = ft.TrainState.create(model, ft.optim.sgd())
    got = ft.func.per_sample_grads(state, batch, ce_loss)
    want = opacus_grad_sample(model, batch, ce_loss)
    assert set(got) == set(want) == set(state.params)
    for n in want:
        assert got[n].shape == (7, *state.params[n].shape)
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


def hf_loss(m, b):  # default_loss through Opacus' wrapper, which forwards the kwargs
    out = m(**{k: v for k, v in b.items() if k != "labels"}).logits
    return F.cross_entropy(out, b["labels"], reduction="sum"), b["labels"].numel()


def test_per_sample_grads_hf_model_equal_opacus_and_exclude_frozen():
    model = tiny_bert()
    model.bert.embeddings.position_embeddings.weight.requires_grad_(False)  # frozen (see below)
    batch = bert_batch()
    del batch["attention_mask"]  # no padding: vmap runs the whole batch at once
    state = ft.TrainState.create(model, ft.optim.sgd())
    got = ft.func.per_sample_grads(state, batch)  # the default HF loss
    want = opacus_grad_sample(model, batch, hf_loss)
    assert "bert.embeddings.position_embeddings.weight" not in got
    assert set(got) == set(want) == set(state.params)
    assert any("LayerNorm" in n for n in got) and any("word_embeddings" in n for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6)


def test_hf_padding_masks_need_chunk_size_one_and_say_so():
    model, batch = tiny_bert(), bert_batch()  # ragged rows with an attention_mask
    # Opacus gives position embeddings (indexed by a shared (1, seq) row) one sample, not five.
    model.bert.embeddings.position_embeddings.weight.requires_grad_(False)
    state = ft.TrainState.create(model, ft.optim.sgd())
    # transformers checks `attention_mask.all()` in Python: data-dependent, so vmap refuses.
    with pytest.raises(ft.func.FuncError, match="chunk_size=1"):
        ft.func.per_sample_grads(state, batch)
    got = ft.func.per_sample_grads(state, batch, chunk_size=1)
    want = opacus_grad_sample(model, batch, hf_loss)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6)


def test_per_sample_grads_sum_to_the_batch_gradient():
    state = ft.TrainState.create(tiny_bert(), ft.optim.sgd())
    batch = bert_batch(6)
    per = ft.func.per_sample_grads(state, batch, chunk_size=1)
    grads, stats = ft.accumulate_grads(state, [batch])
    for n, g in grads.items():
        torch.testing.assert_close(per[n].sum(0) / stats.num_items, g, rtol=1e-4, atol=1e-6)


def test_chunk_size_bounds_the_examples_per_pass_and_keeps_the_result():
    state = ft.TrainState.create(mlp(), ft.optim.sgd())
    batch, calls = data(7), []

    def counting(model, b):
        calls.append(1)  # traced once per vectorized pass
        return ce_loss(model, b)

    whole = ft.func.per_sample_grads(state, batch, counting)
    assert len(calls) == 1
    chunked = ft.func.per_sample_grads(state, batch, counting, chunk_size=3)
    assert len(calls) == 1 + 3  # ceil(7 / 3) passes of at most 3 examples
    for n in whole:
        torch.testing.assert_close(chunked[n], whole[n])
    with pytest.raises(ValueError, match="chunk_size"):
        ft.func.per_sample_grads(state, batch, ce_loss, chunk_size=0)


class Running(nn.Module):
    """Writes a batch statistic into a buffer in forward: not vectorizable over examples."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("seen", torch.zeros(6))

    def forward(self, x):
        self.seen.add_(x.sum(0))
        return self.lin(x)


def test_clear_errors_for_what_torch_func_cannot_handle():
    batch = data(4)
    bn = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    state = ft.TrainState.create(bn, ft.optim.sgd())
    with pytest.raises(ft.func.FuncError, match=r"1 is BatchNorm1d in training mode.*eval"):
        ft.func.per_sample_grads(state, batch, ce_loss)
    bn.eval()  # running statistics: per-example gradients are defined
    assert ft.func.per_sample_grads(state, batch, ce_loss)["0.weight"].shape == (4, 6, 6)
    state = ft.TrainState.create(Running(), ft.optim.sgd())
    with pytest.raises(ft.func.FuncError, match=r"could not vectorize.*in-place"):
        ft.func.per_sample_grads(state, batch, ce_loss)

    def inplace_input(model, b):
        b["x"].mul_(2.0)
        return ce_loss(model, b)

    state = ft.TrainState.create(mlp(), ft.optim.sgd())
    with pytest.raises(ft.func.FuncError, match="modified the batch in place"):
        ft.func.per_sample_grads(state, batch, inplace_input)

    def item_loss(model, b):
        loss, n = ce_loss(model, b)
        return (loss if loss.item() > 0 else -loss), n

    with pytest.raises(ft.func.FuncError, match=r"\.item\(\)"):
        ft.func.per_sample_grads(state, batch, item_loss)
    with pytest.raises(TypeError, match="leaves are all tensors"):
        ft.func.per_sample_grads(state, {"x": batch["x"], "y": [0, 1, 2, 0]}, ce_loss)


# --- DP-SGD ---------------------------------------------------------------------------------


def opacus_dp_step(model, batch, *, max_norm, lr):
    """One Opacus DPOptimizer step without noise; returns the gradient it applied."""
    from opacus.optimizers import DPOptimizer

    gsm = opacus.GradSampleModule(model, loss_reduction="mean")
    opt = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=lr), noise_multiplier=0.0, max_grad_norm=max_norm,
        expected_batch_size=len(batch["y"]), loss_reduction="mean",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        F.cross_entropy(gsm(batch["x"]), batch["y"]).backward()
    opt.step()
    return {n: p.grad.clone() for n, p in gsm._module.named_parameters()}


def test_private_grads_without_noise_equal_opacus_dp_optimizer():
    model, batch = mlp(), data(8)
    ref_model = copy.deepcopy(model)
    want = opacus_dp_step(ref_model, batch, max_norm=0.5, lr=0.1)
    state = ft.TrainState.create(model, ft.optim.sgd())
    micro = [{k: v[:5] for k, v in batch.items()}, {k: v[5:] for k, v in batch.items()}]
    grads, stats = ft.func.private_grads(
        state, micro, ce_loss, max_norm=0.5, noise_multiplier=0.0, chunk_size=2
    )
    assert int(stats.num_samples) == 8 and stats.num_micro == 2
    for n in want:
        torch.testing.assert_close(grads[n], want[n], rtol=1e-5, atol=1e-7)
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    for n, p in ref_model.named_parameters():
        torch.testing.assert_close(state.params[n], p, rtol=1e-5, atol=1e-7)


def test_private_grads_of_a_list_of_a_group_keep_its_data_position():
    """`private_grads(state, list(micro))` reported no position, as accumulate_grads did before
    lists of a group carried it: clip_and_step then kept none, and a resume counted its cursor
    in micro-batches of whatever size it was given."""
    data = [{"x": torch.randn(6), "y": torch.tensor(i % 3)} for i in range(12)]
    state = ft.TrainState.create(mlp(), ft.optim.sgd())
    micro = next(ft.make_batches(data, state, batch_size=2, accum=2))
    _, stats = ft.func.private_grads(state, list(micro), ce_loss, max_norm=1.0, noise_multiplier=0)
    assert stats.position is not None and stats.position == micro.position


def test_private_grads_clip_every_example_to_max_norm():
    state = ft.TrainState.create(mlp(), ft.optim.sgd())
    batch = {"x": torch.randn(1, 6) * 100, "y": torch.tensor([0])}
    grads, _ = ft.func.private_grads(state, [batch], ce_loss, max_norm=0.1, noise_multiplier=0)
    norm = torch.cat([g.flatten() for g in grads.values()]).norm()
    assert 0.1 * (1 - 1e-4) < norm <= 0.1  # one large example: clipped to exactly max_norm


KEY = bytes(range(32))  # a test key; a run uses secrets.token_bytes(32), kept outside the run


def test_private_grads_noise_has_the_promised_scale_and_is_a_function_of_key_and_position():
    torch.manual_seed(0)
    model = nn.Linear(300, 300)  # 90,300 noise coordinates

    def loss_fn(m, b):
        return ((m(b["x"]) - b["y"]) ** 2).sum(), b["y"].shape[0]

    state = ft.TrainState.create(model, ft.optim.sgd(), seed=3).replace(step=5)
    batch = {"x": torch.randn(4, 300), "y": torch.randn(4, 300)}
    kw = {"max_norm": 2.0, "expected_batch_size": 10, "noise_key": KEY}
    clean, _ = ft.func.private_grads(state, [batch], loss_fn, noise_multiplier=0.0, **kw)
    noisy, _ = ft.func.private_grads(state, [batch], loss_fn, noise_multiplier=1.5, **kw)
    noise = torch.cat([(noisy[n] - clean[n]).flatten() * 10 for n in clean]).double()
    n, std = noise.numel(), 1.5 * 2.0
    # Six standard errors: a sound bound (false alarm ~1e-9) that a wrong scale (a missing or
    # extra factor of the batch size, of max_norm, of sqrt(2)) cannot pass.
    assert abs(noise.mean()) < 6 * std / math.sqrt(n)
    assert abs(noise.var() / std**2 - 1) < 6 * math.sqrt(2 / n)
    again, _ = ft.func.private_grads(state, [batch], loss_fn, noise_multiplier=1.5, **kw)
    later, _ = ft.func.private_grads(
        state.replace(step=6), [batch], loss_fn, noise_multiplier=1.5, **kw
    )
    assert all(torch.equal(again[k], noisy[k]) for k in noisy)  # resume draws the same noise
    assert not torch.equal(later["weight"], noisy["weight"])  # each step draws anew
    elsewhere = state.replace(data=state.data.replace(cursor=3))  # e.g. after a guard rollback
    other_data, _ = ft.func.private_grads(elsewhere, [batch], loss_fn, noise_multiplier=1.5, **kw)
    assert not torch.equal(other_data["weight"], noisy["weight"])  # no noise reused on new data
    kw["noise_key"] = KEY[::-1]
    other_key, _ = ft.func.private_grads(state, [batch], loss_fn, noise_multiplier=1.5, **kw)
    assert not torch.equal(other_key["weight"], noisy["weight"])


_NOISE_CHILD = """
import hashlib, sys, torch, ftrain as ft
torch.manual_seed(0)
state = ft.TrainState.create(torch.nn.Linear(6, 3), ft.optim.sgd(), seed=0).replace(step=4)
batch = {"x": torch.randn(4, 6), "y": torch.tensor([0, 1, 2, 0])}
def loss_fn(m, b):
    return torch.nn.functional.cross_entropy(m(b["x"]), b["y"], reduction="sum"), 4
for key in (None, bytes(range(32))):
    g, _ = ft.func.private_grads(state, [batch], loss_fn, max_norm=1.0, noise_multiplier=1.0,
                                 noise_key=key)
    print(hashlib.sha256(b"".join(t.numpy().tobytes() for t in g.values())).hexdigest())
"""


def test_default_noise_is_secret_per_process_and_a_key_makes_it_reproducible():
    # Before: the noise was a pure function of (state.seed, state.step), both stored in plain
    # text in every checkpoint, so anyone holding one could rebuild it (issue 27, item 10).
    runs = [
        subprocess.Popen([sys.executable, "-c", _NOISE_CHILD], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    (default_1, keyed_1), (default_2, keyed_2) = [
        r.communicate(timeout=300)[0].split() for r in runs
    ]
    assert all(r.returncode == 0 for r in runs)
    assert default_1 != default_2  # the default: a fresh secret from the OS in each process
    assert keyed_1 == keyed_2  # the same key: the same noise in any process


def test_the_noise_key_is_never_written_to_a_checkpoint(tmp_path):
    key = bytes.fromhex("9f" * 8 + "a5" * 8 + "3c" * 16)
    state = ft.TrainState.create(mlp(), ft.optim.sgd(momentum=0.9), seed=7)
    grads, stats = ft.func.private_grads(
        state, [data(4)], ce_loss, max_norm=0.5, noise_multiplier=1.0, noise_key=key
    )
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    ft.save_checkpoint(state, tmp_path, metrics={"eval_loss": 1.0})
    forms = [
        key,
        key.hex().encode(),
        key.hex().upper().encode(),
        str(int.from_bytes(key, "big")).encode(),
        repr(key).encode(),
    ]
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert any(f.name == "state.json" for f in files)
    for f in files:
        content = f.read_bytes()
        assert not any(form in content for form in forms), f


@pytest.mark.parametrize(
    ("key", "error", "match"),
    [
        ("9f" * 32, TypeError, r"noise_key must be bytes .* got str.*bytes\.fromhex"),
        (1.5, TypeError, r"noise_key must be bytes .* got float"),
        (True, TypeError, r"noise_key must be bytes .* got bool"),
        (b"short", ValueError, r"noise_key of 5 bytes is guessable"),
        (1234, ValueError, r"noise_key must be an int >= 2\*\*64"),
        (-(2**80), ValueError, r"noise_key must be an int >= 2\*\*64"),
    ],
    ids=["str", "float", "bool", "short", "small_int", "negative"],
)
def test_a_bad_noise_key_is_refused_without_showing_it(key, error, match):
    state = ft.TrainState.create(mlp(), ft.optim.sgd())
    with pytest.raises(error, match=match) as info:
        ft.func.private_grads(state, [data(2)], ce_loss, max_norm=1.0, noise_multiplier=1.0,
                              noise_key=key)  # fmt: skip
    assert str(key) not in str(info.value)
    grads, _ = ft.func.private_grads(
        state, [data(2)], ce_loss, max_norm=1.0, noise_multiplier=1.0, noise_key=2**64 + 12345
    )
    assert all(torch.isfinite(g).all() for g in grads.values())  # a big enough int is a key


def test_private_grads_validate_their_arguments():
    state = ft.TrainState.create(mlp(), ft.optim.sgd())
    micro = [data(2)]
    for kw, name in [
        ({"max_norm": 0, "noise_multiplier": 1.0}, "max_norm"),
        ({"max_norm": 1.0, "noise_multiplier": -1}, "noise_multiplier"),
        ({"max_norm": 1.0, "noise_multiplier": 1, "expected_batch_size": 0}, "expected_batch"),
    ]:
        with pytest.raises(ValueError, match=name):
            ft.func.private_grads(state, micro, ce_loss, **kw)
    with pytest.raises(ValueError, match="micro is empty"):
        ft.func.private_grads(state, [], ce_loss, max_norm=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize(
    ("q", "sigma", "steps", "delta"),
    [(0.01, 1.1, 1000, 1e-5), (0.004, 0.8, 5000, 1e-6), (0.1, 2.0, 50, 1e-5), (1.0, 5.0, 10, 1e-5)],
)
def test_epsilon_matches_opacus_rdp_accountant(q, sigma, steps, delta):
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha"
        want = acc.get_epsilon(delta)
    got = ft.func.epsilon(sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta)
    assert got == pytest.approx(want, rel=1e-9)


def test_epsilon_validates_and_grows_with_steps():
    kw = {"sample_rate": 0.01, "noise_multiplier": 1.0, "delta": 1e-5}
    assert ft.func.epsilon(steps=100, **kw) < ft.func.epsilon(steps=1000, **kw)
    assert ft.func.epsilon(steps=10, sample_rate=0.1, noise_multiplier=0, delta=1e-5) == math.inf
    with pytest.raises(ValueError, match="delta"):
        ft.func.epsilon(steps=10, sample_rate=0.1, noise_multiplier=1, delta=0)
    with pytest.raises(ValueError, match="orders"):
        ft.func.epsilon(steps=10, orders=[1.0], **kw)


# --- ensembles and sweeps ------------------------------------------------------------------


def reg_rows(n=24):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return [{"x": x[i], "y": torch.tensor(i % 3)} for i in range(n)]


def run_loop(state, loss, until, *, clip=None, lr=1e-2):
    """The README loop (tests/workers/helpers.py) to step `until` on `reg_rows()`."""
    return train_steps(state, reg_rows(), until, loss_fn=loss, lr=lr, max_norm=clip)


def clip_each_member(max_norm):
    """`clip_members` as an optimizer transform: chain it before the ensemble's optimizer."""

    def update(grads, state, params):
        ft.func.clip_members(grads, max_norm)
        return grads, state

    return ft.optim.Transform(lambda params: (), update)


def test_ensemble_with_one_optimizer_equals_separate_runs_with_per_member_clipping():
    separate = [
        run_loop(ft.TrainState.create(mlp(i), ft.optim.adamw()), ce_loss, 4, clip=0.05)
        for i in range(3)
    ]
    opt = ft.optim.chain(clip_each_member(0.05), ft.optim.adamw())  # one fused call for all
    ens = ft.TrainState.create(ft.func.Ensemble([mlp(i) for i in range(3)]), opt)
    ens = run_loop(ens, ft.func.ensemble_loss(ce_loss), 4)
    for i, s in enumerate(separate):
        member = ens.model.member(i)
        for n, p in member.named_parameters():
            torch.testing.assert_close(p, s.params[n], rtol=0, atol=1e-6)
    assert not torch.equal(ens.model.member(0)[0].weight, mlp(0)[0].weight)  # it trained


def sweep_state():
    wds, lrs = [0.0, 0.1, 0.3], [1.0, 0.5, 2.0]
    opt = ft.func.sweep([ft.optim.adamw(weight_decay=w) for w in wds], lr_factors=lrs)
    return ft.TrainState.create(ft.func.Ensemble([mlp(i) for i in range(3)]), opt, seed=0)


def test_sweep_gives_each_member_its_own_lr_and_weight_decay():
    ens = run_loop(sweep_state(), ft.func.ensemble_loss(ce_loss), 5)
    for i, (wd, lr) in enumerate([(0.0, 1e-2), (0.1, 5e-3), (0.3, 2e-2)]):
        alone = ft.TrainState.create(mlp(i), ft.optim.adamw(weight_decay=wd))
        alone = run_loop(alone, ce_loss, 5, lr=lr)
        for n, p in ens.model.member(i).named_parameters():
            torch.testing.assert_close(p, alone.params[n], rtol=0, atol=1e-6)


def test_ensemble_state_checkpoints_and_resumes_exactly(tmp_path):
    loss = ft.func.ensemble_loss(ce_loss)
    ft.testing.assert_resume_exact(
        sweep_state, lambda s, until: run_loop(s, loss, until), steps=6, stop_at=4,
        directory=tmp_path,
    )  # fmt: skip
    saved = ft.load_checkpoint(ft.latest_checkpoint(tmp_path), sweep_state())
    assert saved.step == 4 and saved.params["stacked.0.weight"].shape == (3, 8, 6)


def test_ensemble_errors_name_the_problem():
    with pytest.raises(ValueError, match="non-empty"):
        ft.func.Ensemble([])
    with pytest.raises(
        ValueError,
        match=r"member 1 differs from member 0 in parameter names or "
        r"shapes: 'weight' is \(1, 3\) in member 1, \(1, 2\) in member 0",
    ):
        ft.func.Ensemble([nn.Linear(2, 1), nn.Linear(3, 1)])  # fmt: skip
    with pytest.raises(ft.func.FuncError, match="BatchNorm1d in training mode"):
        ft.func.Ensemble([nn.BatchNorm1d(3) for _ in range(2)])
    with pytest.raises(ValueError, match=r"sweep of 2 optimizers.*Ensemble of 2"):
        ft.TrainState.create(mlp(), ft.func.sweep([ft.optim.sgd(), ft.optim.sgd()]))
    with pytest.raises(ValueError, match="lr_factors must be 2"):
        ft.func.sweep([ft.optim.sgd(), ft.optim.sgd()], lr_factors=[1.0])
    with pytest.raises(TypeError, match=r"needs an ft\.func\.Ensemble"):
        ft.func.ensemble_loss(ce_loss)(mlp(), data(2))


class _Scaled(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.lin, self.act = nn.Linear(3, 2), act

    def forward(self, x):
        return self.act(self.lin(x))


def _mlp_with(act):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), act, nn.Linear(4, 2))


@pytest.mark.parametrize(
    "odd, match",
    [
        (_mlp_with(nn.Tanh()), r"in module types: '1' is Tanh in member 2, ReLU in member 0"),
        (_mlp_with(nn.LeakyReLU(0.3)), r"in module types: '1' is LeakyReLU in member 2, ReLU"),
        (nn.Sequential(nn.Linear(3, 4), nn.ReLU()), r"in module types: '2' is missing from "
         r"member 2"),
        (_mlp_with(nn.ReLU()).double(), r"in dtype: '0.weight' is torch.float64 in member 2, "
         r"torch.float32 in member 0"),
        (_mlp_with(nn.ReLU()).to("meta"), r"in device: '0.weight' is device\(type='meta'\) in "
         r"member 2, device\(type='cpu'\)"),
        (_mlp_with(nn.ReLU()).requires_grad_(False), r"in requires_grad: '0.weight' is False in "
         r"member 2, True in member 0"),
        (_mlp_with(nn.ReLU()).eval(), r"in module settings: '<root>.training' is False in member "
         r"2, True in member 0"),
    ],
    ids=["tanh", "leaky_relu", "fewer_modules", "float64", "device", "frozen", "eval_mode"],
)  # fmt: skip
def test_ensemble_refuses_members_unlike_member_0_naming_the_member(odd, match):
    # Before: Tanh/LeakyReLU members silently ran member 0's ReLU, one float64 member turned
    # every member into float64 (issue 27, item 6).
    members = [_mlp_with(nn.ReLU()), _mlp_with(nn.ReLU()), odd]
    with pytest.raises(ValueError, match=r"Ensemble member 2 differs from member 0 " + match):
        ft.func.Ensemble(members)


def test_ensemble_compares_module_settings_and_function_attributes():
    with pytest.raises(
        ValueError,
        match=r"member 1 .* settings: '1.negative_slope' is 0.2 in "
        r"member 1, 0.01 in member 0",
    ):
        ft.func.Ensemble([_mlp_with(nn.LeakyReLU()), _mlp_with(nn.LeakyReLU(0.2))])  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"member 1 .* settings: '<root>.act' is "
        r"'torch.nn.functional.silu' in member 1, 'torch.nn.functional.relu'",
    ):
        ft.func.Ensemble([_Scaled(F.relu), _Scaled(F.silu)])  # fmt: skip
    with pytest.raises(ValueError, match=r"member 1 .* settings: '1.p' is 0.5 in member 1"):
        ft.func.Ensemble([_mlp_with(nn.Dropout(0.1)), _mlp_with(nn.Dropout(0.5))])
    # Members built alike, lambdas from one line included, are accepted and each runs its own
    # weights.
    alike = [_Scaled(lambda x: 2 * x) for _ in range(3)]
    out = ft.func.Ensemble(alike)(torch.ones(1, 3))
    for k, m in enumerate(alike):
        torch.testing.assert_close(out[k], m(torch.ones(1, 3)))


def test_ensemble_train_and_eval_reach_the_members():
    ens = ft.func.Ensemble([nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)) for _ in range(2)])
    x = torch.ones(4, 3)
    assert not torch.equal(ens(x), ens(x))  # dropout on in training mode
    ens.eval()  # before: ignored, member 0's training mode ran for good
    torch.testing.assert_close(ens(x), torch.stack([ens.member(k)(x) for k in range(2)]))


@pytest.mark.slow
def test_ensemble_example_prints_one_line(capsys):
    from helpers import load_example

    threads = torch.get_num_threads()
    try:
        diff, _ = load_example("ensemble").main(
            ["--members", "3", "--epochs", "1", "--repeats", "1"]
        )
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"max_diff_vs_separate=\S+ speedup=\d+\.\d\d", lines[0])
    assert diff <= 1e-5


# --- differentiable optimization -------------------------------------------------------------


def sine_tasks(n, seed=0):
    from helpers import load_example

    gen = torch.Generator().manual_seed(seed)
    return [load_example("maml").task(gen, shots=5) for _ in range(n)]


def sine_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))


def sq_loss(model, b):
    return ((model(b["x"]) - b["y"]) ** 2).sum(), len(b["y"])


def reference_meta_grads(model, tasks, *, steps, lr):
    """Hand-written MAML: functional MLP, autograd.grad(create_graph=True) per inner step."""
    w1, b1, w2, b2 = (p.detach().clone().requires_grad_() for p in model.parameters())

    def fwd(ps, x):
        return F.linear(torch.tanh(F.linear(x, ps[0], ps[1])), ps[2], ps[3])

    total, items = 0.0, 0
    for t in tasks:
        fast = [w1, b1, w2, b2]
        for _ in range(steps):
            s = t["support"]
            inner = ((fwd(fast, s["x"]) - s["y"]) ** 2).sum() / len(s["y"])
            g = torch.autograd.grad(inner, fast, create_graph=True)
            fast = [p - lr * gi for p, gi in zip(fast, g, strict=True)]
        q = t["query"]
        total = total + ((fwd(fast, q["x"]) - q["y"]) ** 2).sum()
        items += len(q["y"])
    return torch.autograd.grad(total / items, [w1, b1, w2, b2])


def test_maml_meta_gradients_equal_a_hand_written_reference():
    model, tasks = sine_mlp(), sine_tasks(3)
    state = ft.TrainState.create(model, ft.optim.adam())
    loss = ft.func.maml_loss(sq_loss, inner_steps=2, inner_lr=0.05)
    grads, _ = ft.accumulate_grads(state, tasks, loss)
    want = reference_meta_grads(model, tasks, steps=2, lr=0.05)
    for (n, g), w in zip(grads.items(), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=n)
    first, _ = ft.accumulate_grads(
        state, tasks, ft.func.maml_loss(sq_loss, inner_steps=2, inner_lr=0.05, first_order=True)
    )
    assert not torch.allclose(first["0.weight"], want[0])  # second-order terms matter


def test_hyperparameter_gradient_of_the_inner_lr_matches_finite_differences():
    model, (t,) = sine_mlp().double(), sine_tasks(1)
    t = {k: {kk: vv.double() for kk, vv in v.items()} for k, v in t.items()}

    def query_loss(lr):
        params = {n: p.detach().requires_grad_() for n, p in model.named_parameters()}
        adapted = ft.func.inner_loop(
            model, params, [t["support"]] * 3, sq_loss,
            optimizer=ft.func.inner_sgd(momentum=0.9), lr=lr,
        )  # fmt: skip
        loss, n = ft.func.functional_loss(model, adapted, t["query"], sq_loss)
        return loss / n

    lr = torch.tensor(0.02, dtype=torch.float64, requires_grad=True)
    (hyper,) = torch.autograd.grad(query_loss(lr), lr)
    h = 1e-6
    numeric = (query_loss(0.02 + h) - query_loss(0.02 - h)).detach() / (2 * h)
    assert float(hyper) == pytest.approx(float(numeric), rel=1e-5)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_inner_optimizers_compute_the_ft_optim_updates(wd):
    torch.manual_seed(0)
    params = {"w": torch.randn(5), "v": torch.randn(3, 2)}
    for inner, outer in [
        (ft.func.inner_adam(weight_decay=wd), ft.optim.adamw(weight_decay=wd)),
        (
            ft.func.inner_sgd(momentum=0.9, weight_decay=wd),
            ft.optim.sgd(momentum=0.9, weight_decay=wd),
        ),
    ]:
        mine, theirs = dict(params), {k: v.clone() for k, v in params.items()}
        s_in, s_out = inner.init(mine), outer.init(theirs)
        for step in range(3):
            grads = {k: torch.randn_like(v) for k, v in params.items()}
            mine, s_in = inner.update(grads, s_in, mine, lr=0.1, step=step)
            s_out = outer.update(
                {k: g.clone() for k, g in grads.items()}, s_out, theirs, lr=0.1, step=step
            )
        for k in params:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6)


def test_maml_loss_validates():
    with pytest.raises(ValueError, match="inner_steps"):
        ft.func.maml_loss(sq_loss, inner_steps=0, inner_lr=0.1)
    state = ft.TrainState.create(sine_mlp(), ft.optim.adam())
    loss = ft.func.maml_loss(sq_loss, inner_steps=1, inner_lr=0.1)
    with pytest.raises(KeyError, match="'support' and 'query'"):
        ft.accumulate_grads(state, [{"x": torch.ones(2, 1), "y": torch.ones(2, 1)}], loss)


@pytest.mark.slow
def test_maml_example_learns_a_better_initialization_than_random(capsys):
    from helpers import load_example

    learned, scratch = load_example("maml").main(
        ["--steps", "60", "--meta-lr", "0.01", "--eval-tasks", "30"]
    )
    assert re.fullmatch(r"maml_init_loss=\S+ random_init_loss=\S+\n", capsys.readouterr().out)
    assert learned < 0.9 * scratch  # measured: 2.59 vs 3.31


def test_dp_sgd_loop_resumes_exactly(tmp_path):
    rows = reg_rows(16)

    def make_state():
        return ft.TrainState.create(mlp(), ft.optim.sgd(momentum=0.9), seed=7)

    def train(state, until):
        while state.step < until:
            for micro in ft.make_batches(rows, state, batch_size=4, accum=2):
                grads, stats = ft.func.private_grads(
                    state, micro, ce_loss, max_norm=0.5, noise_multiplier=1.0, noise_key=KEY
                )
                state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
                if state.step >= until:
                    break
            else:
                state = ft.next_epoch(state)
        return state

    ft.testing.assert_resume_exact(make_state, train, steps=5, stop_at=3, directory=tmp_path)


def test_private_grads_refuse_what_they_do_not_support_and_autocast_applies():
    from helpers import FakeRank

    micro, kw = [data(4)], {"max_norm": 1.0, "noise_multiplier": 1.0}
    state = ft.TrainState.create(mlp(), ft.optim.sgd(), strategy=FakeRank(0, 2))
    with pytest.raises(ft.func.FuncError, match="world_size=2"):
        ft.func.private_grads(state, micro, ce_loss, **kw)
    fp16 = ft.strategies.SingleDevice("cpu", precision="fp16")
    state = ft.TrainState.create(mlp(), ft.optim.sgd(), strategy=fp16)
    with pytest.raises(ft.func.FuncError, match="float16"):
        ft.func.private_grads(state, micro, ce_loss, **kw)
    bf16 = ft.strategies.SingleDevice("cpu", precision="bf16")
    low = ft.func.per_sample_grads(ft.TrainState.create(mlp(), ft.optim.sgd(), strategy=bf16),
                                   micro[0], ce_loss)  # fmt: skip
    full = ft.func.per_sample_grads(ft.TrainState.create(mlp(), ft.optim.sgd()), micro[0], ce_loss)
    for n in full:  # bf16 matmuls: close, not equal
        torch.testing.assert_close(low[n], full[n], rtol=0.1, atol=0.02)
    assert not all(torch.equal(low[n], full[n]) for n in full)
