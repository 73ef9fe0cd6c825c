"""chunked_causal_lm_loss: the plain causal LM loss and its gradients without the full logits."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from helpers import ragged_rows, tiny_gpt2, tiny_llama


def _grads(model, micro, loss_fn):
    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, stats = ft.accumulate_grads(state, micro, loss_fn)
    return {n: g.clone() for n, g in grads.items()}, float(stats.loss), int(stats.num_items)


def _padded(accum):
    rows = ragged_rows(16, seed=4)
    return next(iter(ft.make_batches(rows, batch_size=16 // accum, accum=accum, shuffle=False)))


def _packed():
    rows = ft.data.pack_examples(ragged_rows(16, seed=4), max_length=24)
    collate = ft.sft.packed_collate(pad_id=0)
    return next(iter(ft.make_batches(rows, batch_size=3, accum=2, collate_fn=collate)))


@pytest.mark.parametrize(
    "make_model,micro",
    [
        (tiny_llama, _padded(1)),
        (tiny_llama, _padded(4)),
        (tiny_llama, _packed()),
        (lambda: tiny_gpt2(dropout=0.0), _padded(4)),  # tied input/output embeddings
    ],
    ids=["llama-accum1", "llama-accum4", "llama-packed", "gpt2-tied-accum4"],
)
def test_gradients_equal_the_plain_loss(make_model, micro):
    model = make_model()
    want, want_loss, want_n = _grads(copy.deepcopy(model), micro, ft.losses.causal_lm_loss())
    got, got_loss, got_n = _grads(model, micro, ft.chunked_causal_lm_loss(chunk_size=7))
    assert got_n == want_n and got_loss == pytest.approx(want_loss, rel=1e-6)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-6, msg=n)


def test_the_chunked_function_with_bias_in_float64_and_under_no_grad():
    from ftrain.extras.chunked_loss import _LinearCrossEntropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (13,), generator=g)
    y[[2, 5]] = -100
    want = F.cross_entropy(F.linear(h, w, b), y, reduction="sum", ignore_index=-100)
    want_grads = torch.autograd.grad(want * 0.5, (h, w, b))
    got = _LinearCrossEntropy.apply(h, w, b, y, 4)
    got_grads = torch.autograd.grad(got * 0.5, (h, w, b))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # evaluation: the loss only, same value
        torch.testing.assert_close(_LinearCrossEntropy.apply(h, w, b, y, 5, False), want)


def test_evaluate_with_the_chunked_loss_equals_the_plain_loss():
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    val = lambda: ft.make_batches(ragged_rows(12, seed=1), batch_size=4, shuffle=False)  # noqa: E731
    plain = ft.evaluate(state, val())
    chunked = ft.evaluate(state, val(), ft.chunked_causal_lm_loss(chunk_size=16))
    assert chunked["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)
    assert chunked["eval_items"] == plain["eval_items"]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="chunk_size"):
        ft.chunked_causal_lm_loss(chunk_size=0)
    loss = ft.chunked_causal_lm_loss()
    with pytest.raises(KeyError, match="labels"):
        loss(tiny_llama(), {"input_ids": torch.ones(1, 3, dtype=torch.long)})
    with pytest.raises(TypeError, match="get_output_embeddings"):
        loss(torch.nn.Linear(2, 2), {"labels": torch.ones(1, 3, dtype=torch.long)})
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3).long()}
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30\.0"):
        loss(model, batch)


def test_auto_kernel_on_cpu_is_the_chunked_torch_loss():
    model, micro = tiny_llama(), _padded(2)
    want = _grads(copy.deepcopy(model), micro, ft.chunked_causal_lm_loss(chunk_size=7))
    got = _grads(model, micro, ft.chunked_causal_lm_loss(chunk_size=7, kernel="auto"))
    assert got[1:] == want[1:]  # the same function ran: equal to the last bit
    for n in want[0]:
        assert torch.equal(got[0][n], want[0][n]), n


def test_an_explicit_kernel_never_falls_back_silently(monkeypatch):
    import sys

    from ftrain import process_state
    from ftrain.extras import _lce_kernels

    with pytest.raises(ValueError, match="kernel must be"):
        ft.chunked_causal_lm_loss(kernel="triton")
    with pytest.raises(ValueError, match=r"chunk_size=64 applies to the torch path"):
        ft.chunked_causal_lm_loss(kernel="liger", chunk_size=64)
    # A library that does not import (here: hidden) is named, with the way out.
    for kernel, module, package in [
        ("liger", "liger_kernel", "liger-kernel"),
        ("cce", "cut_cross_entropy", "cut-cross-entropy"),
    ]:
        process_state.STATE.kernel_import_errors.clear()
        monkeypatch.setitem(sys.modules, module, None)
        with pytest.raises(ImportError, match=rf"kernel='{kernel}' needs the {package} package"):
            ft.chunked_causal_lm_loss(kernel=kernel)
    process_state.STATE.kernel_import_errors.clear()
    # Installed but handed CPU tensors: refused, not run on the torch path.
    monkeypatch.setattr(_lce_kernels, "_import_error", lambda kernel: None)
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3).long()}
    for kernel in ("liger", "cce"):
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16)  # CCE wants half precision
        with pytest.raises(ValueError, match=rf"kernel='{kernel}' runs on CUDA tensors"), bf16:
            ft.chunked_causal_lm_loss(kernel=kernel)(tiny_llama(), batch)
    lin, h = torch.nn.Linear(16, 61), torch.ones(3, 16)  # a head with a bias: CCE has none
    assert _lce_kernels.pick("auto", h, lin.weight, lin.bias) == "torch"  # CPU
    with pytest.raises(ValueError, match="no bias term"):
        _lce_kernels.pick("cce", h, lin.weight, lin.bias)
    # CCE's backward is half precision only: float32 is refused, not silently rounded.
    with pytest.raises(ValueError, match=r"bfloat16/float16 only .* torch.float32"):
        _lce_kernels.pick("cce", h, lin.weight, None)


def test_a_router_loss_the_model_returns_is_refused_as_causal_lm_loss_refuses_it():
    """A mixture-of-experts model with output_router_logits adds its router loss to its own
    loss; causal_lm_loss refused it, the chunked loss trained without it, silently."""
    from helpers import tiny_mixtral

    def mixtral(router_logits):
        return tiny_mixtral(router_logits).eval()

    ids = torch.tensor([[3, 4, 5, 6]])
    batch = {"input_ids": ids, "labels": ids}
    with pytest.raises(ValueError, match=r"MixtralForCausalLM returned aux_loss"):
        ft.chunked_causal_lm_loss()(mixtral(router_logits=True), batch)
    model = mixtral(router_logits=False)
    with torch.no_grad():
        got, want = (
            ft.chunked_causal_lm_loss()(model, batch),
            ft.losses.causal_lm_loss()(model, batch),
        )
    torch.testing.assert_close(got[0], want[0])
    assert int(got[1]) == int(want[1]) == 3
