"""chunked_causal_lm_loss(kernel="liger" | "cce"): Liger-Kernel and Cut Cross-Entropy on a GPU
give the plain loss's sum, item count and gradients (issue 16 item 4).

Needs CUDA and the optional packages (`pip install 'ftrain[kernels]'`, or the two pure-Python
wheels with `--no-deps` next to a CUDA torch that ships triton); skipped otherwise, saying which.
Tolerances: float32 (Liger only: CCE's backward is half precision and refuses it; no TF32,
torch's default matmul precision) loss rtol 1e-5, gradients rtol 1e-4 / atol 1e-6 (other
summation orders over the vocabulary); bf16 autocast, where the plain loss rounds the logits
to bf16 and CCE does not (and CCE sums the weight gradient in bf16), loss rtol 1e-2 and a
relative gradient error (L2) below 3e-2.
"""

import copy

import pytest
import torch

import ftrain as ft
from helpers import ragged_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KERNELS = [("liger", "liger_kernel"), ("cce", "cut_cross_entropy")]


def _model(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).to(dtype)


def _micro(all_ignored: bool = False):
    rows = ragged_rows(12, seed=4, lo=5, hi=30)  # padded rows with masked prompts
    for r in rows:
        r["input_ids"] = [(t * 37) % 1000 for t in r["input_ids"]]  # use the whole vocabulary
        r["labels"] = [-100 if (all_ignored or y == -100) else (y * 37) % 1000 for y in r["labels"]]
    return next(iter(ft.make_batches(rows, batch_size=6, accum=2, shuffle=False)))


def _run(model, micro, loss_fn, precision=None):
    strategy = ft.strategies.SingleDevice("cuda", precision=precision)
    state = ft.TrainState.create(model, ft.optim.sgd(), strategy=strategy)
    grads, stats = ft.accumulate_grads(state, micro, loss_fn)
    sums = torch.stack([stats.loss.double() * stats.num_items, stats.num_items.double()])
    return {n: g.float().clone() for n, g in grads.items()}, sums.cpu()


def _library(module):
    pytest.importorskip(module, reason=f"{module} is not installed (pip install 'ftrain[kernels]')")


def test_liger_equals_the_plain_loss_in_float32():
    _library("liger_kernel")
    model, micro = _model(), _micro()
    want, want_sums = _run(copy.deepcopy(model), micro, ft.losses.causal_lm_loss())
    got, got_sums = _run(model, micro, ft.chunked_causal_lm_loss(kernel="liger"))
    assert got_sums[1] == want_sums[1]  # the same item count
    torch.testing.assert_close(got_sums[0], want_sums[0], rtol=1e-5, atol=0)  # summed loss
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_cce_refuses_float32_instead_of_rounding():
    _library("cut_cross_entropy")
    with pytest.raises(ValueError, match="bfloat16/float16 only"):
        _run(_model(), _micro(), ft.chunked_causal_lm_loss(kernel="cce"))


@pytest.mark.parametrize("kernel,module", KERNELS, ids=[k for k, _ in KERNELS])
def test_the_kernel_equals_the_plain_loss_under_bf16_autocast(kernel, module):
    _library(module)
    model, micro = _model(), _micro()
    plain = ft.losses.causal_lm_loss()
    want, want_sums = _run(copy.deepcopy(model), micro, plain, precision="bf16")
    got, got_sums = _run(model, micro, ft.chunked_causal_lm_loss(kernel=kernel), "bf16")
    assert got_sums[1] == want_sums[1]
    torch.testing.assert_close(got_sums[0], want_sums[0], rtol=1e-2, atol=0)
    for n in want:
        err = (got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-12)
        assert err < 3e-2, (n, float(err))


@pytest.mark.parametrize(
    "kernel,module,precision,rel",
    [("liger", "liger_kernel", None, 1e-5), ("cce", "cut_cross_entropy", "bf16", 1e-2)],
    ids=["liger", "cce"],
)
def test_the_kernel_in_evaluation_and_with_every_label_ignored(kernel, module, precision, rel):
    _library(module)
    model = _model().cuda()
    strategy = ft.strategies.SingleDevice("cuda", precision=precision)
    state = ft.TrainState.create(model, ft.optim.sgd(), strategy=strategy)
    val = _micro()
    plain = ft.evaluate(state, [val])
    fused = ft.evaluate(state, [val], ft.chunked_causal_lm_loss(kernel=kernel))
    assert fused["eval_items"] == plain["eval_items"]
    assert fused["eval_loss"] == pytest.approx(plain["eval_loss"], rel=rel)
    # A micro-batch with no counted label (e.g. all prompt): a zero sum, zero gradients.
    batch = strategy.to_device(_micro(all_ignored=True)[0])
    with strategy.autocast():
        loss, n = ft.chunked_causal_lm_loss(kernel=kernel)(model, batch)
    loss.backward()
    assert int(n) == 0 and float(loss.detach()) == 0.0
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters() if p.grad is not None)


def test_auto_picks_an_installed_kernel_on_cuda():
    from ftrain.extras import _lce_kernels

    installed = [k for k, _ in KERNELS if _lce_kernels.available(k)]
    if not installed:
        pytest.skip("neither liger-kernel nor cut-cross-entropy is installed")
    head = torch.nn.Linear(8, 16, bias=False, device="cuda")
    h = torch.ones(3, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # where both kernels can run
        assert _lce_kernels.pick("auto", h, head.weight, None) == installed[0]
    assert _lce_kernels.pick("auto", h.cpu(), head.weight.cpu(), None) == "torch"
    if installed == ["cce"]:  # float32: CCE cannot, so auto takes the torch path
        assert _lce_kernels.pick("auto", h, head.weight, None) == "torch"
