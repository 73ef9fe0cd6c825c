import weakref

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain.data import pad_collate
from helpers import ragged_rows, tiny_gpt2, tiny_llama


def _full_batch_grads(model, rows):
    """Reference: one padded batch holding every row; mean next-token loss over labels != -100.

    Written out here in the model's dtype (HF's own loss upcasts to float32, too coarse for a
    float64 comparison).
    """
    model.zero_grad(set_to_none=True)
    batch = pad_collate()(rows)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, loss.detach()


@pytest.mark.parametrize("accum,bs", [(1, 12), (3, 4), (4, 3), (12, 1)])
def test_accumulation_equals_one_big_batch_float64(accum, bs):
    """Ragged lengths and masked prompts: k micro-batches give the gradients of one batch."""
    model = tiny_llama(torch.float64)
    rows = ragged_rows(12, seed=1)
    ref, ref_loss = _full_batch_grads(model, rows)
    state = ft.TrainState.create(model, ft.optim.sgd())
    (micro,) = list(ft.make_batches(rows, batch_size=bs, accum=accum, shuffle=False))
    assert len(micro) == accum
    grads, stats = ft.accumulate_grads(state, micro)
    assert set(grads) == set(ref)
    # Llama's RMSNorm computes in float32 even for a float64 model, so reorderings of the same
    # sums differ by ~1e-8; the mean-of-means error guarded below is ~1e-3.
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-6, atol=5e-8, msg=n)
    torch.testing.assert_close(stats.loss.double(), ref_loss, rtol=1e-6, atol=0)  # float32 stat
    n_items = sum(sum(t != -100 for t in r["labels"][1:]) for r in rows)
    assert int(stats.num_items) == n_items
    assert int(stats.num_tokens) == sum(len(r["input_ids"]) for r in rows)
    assert int(stats.num_samples) == 12 and stats.num_micro == accum


def test_mean_of_means_would_differ():
    """Guard the test above: averaging per-micro-batch means (the 2024 HF bug) is measurably off."""
    model = tiny_llama(torch.float64)
    rows = ragged_rows(12, seed=1)
    ref, _ = _full_batch_grads(model, rows)
    model.zero_grad(set_to_none=True)
    for batch in next(iter(ft.make_batches(rows, batch_size=3, accum=4, shuffle=False))):
        (model(**batch).loss / 4).backward()
    err = max((p.grad - ref[n]).abs().max().item() for n, p in model.named_parameters())
    assert err > 1e-4


def test_stats_are_device_tensors_and_grads_are_the_param_grads(llama):
    state = ft.TrainState.create(llama, ft.optim.sgd())
    micro = next(iter(ft.make_batches(ragged_rows(8), batch_size=4, accum=2)))
    grads, stats = ft.accumulate_grads(state, micro)
    for field in ("loss", "num_items", "num_tokens", "num_samples"):
        assert isinstance(getattr(stats, field), torch.Tensor), field
    assert all(grads[n] is p.grad for n, p in state.params.items())


def test_sequence_classification_default_loss():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=3,
        pad_token_id=0,
    )
    model = LlamaForSequenceClassification(cfg).double()
    rows = [{"input_ids": r["input_ids"], "labels": i % 3} for i, r in enumerate(ragged_rows(9))]
    batch = pad_collate()(rows)
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.nn.functional.cross_entropy(logits, batch["labels"]).backward()  # mean over samples
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = ft.TrainState.create(model, ft.optim.sgd())
    micro = next(iter(ft.make_batches(rows, batch_size=4, accum=3, shuffle=False)))
    grads, stats = ft.accumulate_grads(state, micro)
    assert int(stats.num_items) == 9
    for n, g in grads.items():  # float32 RMSNorm inside, as above
        torch.testing.assert_close(g, ref[n], rtol=1e-6, atol=5e-8)


def test_custom_loss_fn_counts_items():
    model = torch.nn.Linear(3, 1).double()
    x = torch.randn(10, 3, dtype=torch.float64)

    def loss_fn(m, batch):
        return (m(batch) ** 2).sum(), torch.tensor(batch.shape[0])

    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, stats = ft.accumulate_grads(state, [x[:3], x[3:]], loss_fn)
    model.zero_grad()
    (model(x) ** 2).mean().backward()
    torch.testing.assert_close(grads["weight"], model.weight.grad)
    assert int(stats.num_items) == 10
    assert int(stats.num_tokens) == 10  # float features: one token per sample


def test_token_count_of_id_pairs_is_every_token():
    emb = torch.nn.Embedding(10, 4)

    def loss_fn(m, batch):
        x, y = batch
        return m(x).sum(), torch.tensor(y.numel())

    state = ft.TrainState.create(emb, ft.optim.sgd())
    x = torch.randint(0, 10, (3, 5))
    _, stats = ft.accumulate_grads(state, [(x, x), (x[:2], x[:2])], loss_fn)
    assert int(stats.num_tokens) == 25 and int(stats.num_samples) == 5


def test_label_smoothing_matches_hf_label_smoother():
    from transformers.trainer_pt_utils import LabelSmoother

    model = tiny_llama(torch.float64)
    batch = pad_collate()(ragged_rows(6, seed=2))
    loss_sum, n = ft.losses.causal_lm_loss(label_smoothing=0.1)(model, batch)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    ref = LabelSmoother(epsilon=0.1)(out, batch["labels"], shift_labels=True)
    torch.testing.assert_close(loss_sum / n, ref.to(loss_sum.dtype), rtol=1e-6, atol=1e-7)
    plain, _ = ft.losses.causal_lm_loss()(model, batch)
    assert abs(float((plain - loss_sum).detach())) > 1e-3, "smoothing must change the loss"


def test_dropout_is_pure_function_of_seed_step_micro():
    model = tiny_llama(dropout=0.3)
    rows = ragged_rows(8)
    micro = next(iter(ft.make_batches(rows, batch_size=4, accum=2, shuffle=False)))

    def grads_at(state):
        g, _ = ft.accumulate_grads(state, micro)
        return {k: v.clone() for k, v in g.items()}

    s = ft.TrainState.create(model, ft.optim.sgd(), seed=7)
    torch.manual_seed(123)
    before = torch.rand(3)
    a, b = grads_at(s), grads_at(s)
    c = grads_at(s.replace(step=1))
    d = grads_at(s.replace(seed=8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert any(not torch.equal(a[k], d[k]) for k in a)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before), "caller's RNG stream must be untouched"


def test_empty_micro_and_missing_labels_raise(llama):
    state = ft.TrainState.create(llama, ft.optim.sgd())
    with pytest.raises(ValueError, match="empty"):
        ft.accumulate_grads(state, [])
    with pytest.raises(KeyError, match="labels"):
        ft.accumulate_grads(state, [{"input_ids": torch.ones(1, 3, dtype=torch.long)}])


def test_accumulation_is_exact_to_float64_rounding_on_gpt2():
    """GPT-2 computes in the model's dtype throughout, so float64 agreement is ~1e-15."""
    model = tiny_gpt2(seed=0, dropout=0.0).double()
    rows = ragged_rows(12, seed=5)
    ref, _ = _full_batch_grads(model, rows)
    state = ft.TrainState.create(model, ft.optim.sgd())
    (micro,) = list(ft.make_batches(rows, batch_size=3, accum=4, shuffle=False))
    grads, _ = ft.accumulate_grads(state, micro)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-12, atol=1e-14, msg=n)


def test_zero_weight_stand_in_runs_but_counts_nothing(llama):
    rows = ragged_rows(6, seed=8)
    (micro,) = list(ft.make_batches(rows[:4], batch_size=4, shuffle=False))
    (other,) = list(ft.make_batches(rows[4:], batch_size=2, shuffle=False))
    calls = []
    state = ft.TrainState.create(llama, ft.optim.sgd())

    def loss_fn(model, batch):
        calls.append(batch["input_ids"].shape[0])
        return ft.losses.default_loss(model, batch)

    ref, ref_stats = ft.accumulate_grads(state, micro, loss_fn)
    ref = {n: g.clone() for n, g in ref.items()}
    grads, stats = ft.accumulate_grads(state, [*micro, ft.data.ZeroWeight(other[0])], loss_fn)
    assert calls == [4, 4, 2]  # the stand-in ran its forward and backward
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], rtol=0, atol=0)
    for f in ("loss", "num_items", "num_tokens", "num_samples"):
        assert torch.equal(getattr(stats, f), getattr(ref_stats, f)), f
    out = ft.evaluate(state, [[*micro, ft.data.ZeroWeight(other[0])]])
    assert out == ft.evaluate(state, [micro])


def test_hf_gradient_checkpointing_gives_the_same_training():
    """Recomputing activations in the backward (HF's gradient_checkpointing_enable) changes
    nothing: with dropout active, 3 steps of accumulation give the same parameters."""
    rows = ragged_rows(16, seed=6)

    def run(checkpointing: bool):
        model = tiny_llama(dropout=0.1)
        if checkpointing:  # renamed activation_checkpointing_enable in transformers 5
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
        state = ft.TrainState.create(model, ft.optim.adamw(), seed=2)
        for micro in ft.make_batches(rows, batch_size=4, accum=2, seed=0):
            grads, stats = ft.accumulate_grads(state, micro)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2, max_norm=1.0)
        return state

    plain, recomputed = run(False), run(True)
    assert getattr(recomputed.model, "is_activation_checkpointing", True)
    assert not getattr(plain.model, "is_activation_checkpointing", False)
    for n, p in plain.params.items():
        torch.testing.assert_close(recomputed.params[n], p, rtol=1e-6, atol=1e-7, msg=n)


def test_counting_items_first_divides_the_loss_and_gives_the_same_gradients(monkeypatch):
    """Large models divide each loss by the global count before backward (no pass over the
    gradients, issue 12); the gradients are those of one big batch either way."""
    import ftrain.grads as grads_module

    model = tiny_llama(torch.float64)
    rows = ragged_rows(12, seed=1)
    ref, ref_loss = _full_batch_grads(model, rows)
    state = ft.TrainState.create(model, ft.optim.sgd())
    (micro,) = list(ft.make_batches(rows, batch_size=4, accum=3, shuffle=False))
    counted = []
    spy = lambda fn, b, m: counted.append(1) or ft.losses._items_before_forward(fn, b, m)  # noqa: E731
    monkeypatch.setattr(grads_module, "_items_before_forward", spy)
    ft.accumulate_grads(state, micro)
    assert counted == []  # a 0.02M-parameter model: dividing the gradients is cheaper
    monkeypatch.setattr(grads_module, "COUNT_FIRST_NUMEL", 1)
    stand_in = ft.data.ZeroWeight(micro[0])  # runs, counts nothing
    grads, stats = ft.accumulate_grads(state, [*micro, stand_in])
    assert len(counted) == 4
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-6, atol=5e-8, msg=n)
    torch.testing.assert_close(stats.loss.double(), ref_loss, rtol=1e-6, atol=0)
    assert int(stats.num_items) == sum(sum(t != -100 for t in r["labels"][1:]) for r in rows)


def test_counts_sum_exactly_whatever_their_dtype_and_place():
    """Issue 30: the per-micro-batch values are stacked once after the last backward. Integer
    counts above 2**24 (a float32 stack would round them) sum exactly; a loss whose counts are
    device tensors for one micro-batch and host numbers for another, or a step that counts
    nothing at all, gives the same stats as adding them up by hand."""
    model = torch.nn.Linear(3, 1).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    state = ft.TrainState.create(model, ft.optim.sgd())
    big = 2**24 + 1

    def huge(m, batch):
        return m(batch).sum(), torch.tensor(big)

    _, stats = ft.accumulate_grads(state, [x, x, x], huge)
    # the float64 sum: exact for integers below 2**53, and fractional weighted counts stay
    assert int(stats.num_items) == 3 * big and stats.num_items.dtype == torch.float64

    def mixed(m, batch):  # a device count, then a host one
        n = batch.shape[0]
        return m(batch).sum(), (torch.tensor(n) if n == 4 else n)

    grads, stats = ft.accumulate_grads(state, [x, x[:3]], mixed)
    model.zero_grad()
    (model(torch.cat([x, x[:3]])).sum() / 7).backward()
    torch.testing.assert_close(grads["weight"], model.weight.grad)
    assert (int(stats.num_items), int(stats.num_samples), int(stats.num_tokens)) == (7, 7, 7)
    want = (model(x).sum() + model(x[:3]).sum()).detach() / 7
    torch.testing.assert_close(stats.loss.double(), want, rtol=1e-6, atol=0)

    grads, stats = ft.accumulate_grads(state, [ft.data.ZeroWeight(x)], huge)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())
    assert (int(stats.num_items), int(stats.num_tokens), int(stats.num_samples)) == (0, 0, 0)
    assert torch.isnan(stats.loss) and not stats.loss.requires_grad


def test_weighted_fractional_counts_divide_by_the_exact_sum():
    """A loss may count weighted items (2.5 of them): the gradient is the sum over that
    weight, not over its integer part (Stats' counts are int64, the divisor is not)."""
    model = torch.nn.Linear(3, 1).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    state = ft.TrainState.create(model, ft.optim.sgd())

    def weighted(m, batch):
        return m(batch).sum(), torch.tensor(1.25, dtype=torch.float64)

    grads, stats = ft.accumulate_grads(state, [x, x], weighted)
    model.zero_grad()
    (model(torch.cat([x, x])).sum() / 2.5).backward()
    torch.testing.assert_close(grads["weight"], model.weight.grad, rtol=1e-12, atol=0)
    want = 2 * model(x).sum().detach() / 2.5
    torch.testing.assert_close(stats.loss.double(), want, rtol=1e-6, atol=0)

    def on_host(m, batch):  # the same count as a Python float
        return m(batch).sum(), 1.25

    host_grads, _ = ft.accumulate_grads(state, [x, x], on_host)
    torch.testing.assert_close(host_grads["weight"], model.weight.grad, rtol=1e-12, atol=0)


def test_a_loss_that_pops_keys_leaves_the_batches_as_they_were():
    """`labels = batch.pop("labels")`, as in a Trainer's compute_loss: the micro-batches the
    caller holds (re-read next epoch) keep their keys."""
    model = torch.nn.Linear(3, 2)
    batch = {"x": torch.randn(4, 3), "labels": torch.tensor([0, 1, 1, 0])}
    state = ft.TrainState.create(model, ft.optim.sgd())

    def popping(m, b):
        labels = b.pop("labels")
        return F.cross_entropy(m(b["x"]), labels, reduction="sum"), labels.numel()

    for _ in range(2):
        ft.accumulate_grads(state, [batch], popping)
    assert set(batch) == {"x", "labels"}


def test_a_micro_batch_graph_is_freed_before_the_next_forward():
    """What a custom autograd function keeps on its ctx (bitsandbytes' 8-bit matmul keeps its
    input) lives as long as the micro-batch's graph: it must be gone when the next
    micro-batch runs, not kept to the end of the step with the loss."""
    alive: list[weakref.ref] = []
    seen: list[bool] = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.kept = x.detach().clone()  # held on the ctx, not saved for backward
            alive.append(weakref.ref(ctx.kept))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    model = torch.nn.Linear(3, 1)

    def loss(m, batch):
        seen.append(all(ref() is None for ref in alive))  # earlier micro-batches' ctx gone
        return Keep.apply(m(batch)).sum(), batch.shape[0]

    state = ft.TrainState.create(model, ft.optim.sgd())
    ft.accumulate_grads(state, [torch.randn(2, 3) for _ in range(3)], loss)
    assert seen == [True, True, True]


def test_batch_counts_of_a_nested_batch_count_its_rows_not_its_keys():
    """A batch whose first field is a dict of tensors (tabular features) counted the dict's
    keys as its samples: samples_seen grew by 2 per batch of 8 rows."""
    from ftrain.grads import batch_counts

    nested = {"features": {"num": torch.ones(8, 3), "cat": torch.zeros(8, 2)}, "y": torch.ones(8)}
    assert batch_counts(nested) == (8, 8)
    # a list of per-sample tensors (detection images, ragged sequences) is one row per element
    ragged = [torch.ones(3, 5, 7), torch.ones(3, 4, 4)]
    assert batch_counts(({"images": ragged}, [{"boxes": torch.ones(1, 4)}] * 2)) == (2, 2)
    assert batch_counts((ragged, torch.ones(2))) == (2, 2)
    assert batch_counts({"x": [[1, 2], [3, 4], [5, 6]]}) == (3, 3)  # rows of host lists

    def loss_fn(model, batch):
        out = model(batch["features"]["num"]).squeeze(-1)
        return ((out - batch["y"]) ** 2).sum(), batch["y"].numel()

    state = ft.TrainState.create(torch.nn.Linear(3, 1), ft.optim.sgd())
    _, stats = ft.accumulate_grads(state, [nested, nested], loss_fn)
    assert int(stats.num_samples) == 16


def test_a_parameter_unfrozen_after_create_is_refused_not_left_untrained():
    """Gradual unfreezing on the same state: the parameter got a `.grad` each step that no
    step applied (state.params was taken at create), and it never trained, silently."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].weight.requires_grad_(False)
    state = ft.TrainState.create(model, ft.optim.adamw())

    def loss_fn(m, x):
        return m(x).sum(), torch.tensor(x.shape[0])

    grads, stats = ft.accumulate_grads(state, [torch.ones(3, 2)], loss_fn)
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    model[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"parameter '0\.weight' was frozen when the TrainState"):
        ft.accumulate_grads(state, [torch.ones(3, 2)], loss_fn)
    # Re-created after unfreezing, it trains; freezing again is a partial step (no error).
    state = ft.TrainState.create(model, ft.optim.adamw())
    before = model[0].weight.detach().clone()
    grads, stats = ft.accumulate_grads(state, [torch.ones(3, 2)], loss_fn)
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert not torch.equal(model[0].weight, before)
    model[1].weight.requires_grad_(False)
    grads, _ = ft.accumulate_grads(state, [torch.ones(3, 2)], loss_fn)
    assert "1.weight" not in grads


def test_batch_counts_of_a_preference_batch_count_both_sides_without_padding():
    """A DPO batch has no `input_ids`/`attention_mask`: its token count was the chosen side's
    ids only, padding included, the rejected side left out (`tokens_seen` off)."""
    from ftrain.grads import batch_counts

    ids = {"chosen_input_ids": torch.ones(2, 5, dtype=torch.long),
           "rejected_input_ids": torch.ones(2, 7, dtype=torch.long)}  # fmt: skip
    labels = {
        "chosen_labels": ids["chosen_input_ids"],
        "rejected_labels": ids["rejected_input_ids"],
    }
    assert batch_counts({**ids, **labels}) == (24, 2)
    masks = {"chosen_attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
             "rejected_attention_mask": torch.ones(2, 7, dtype=torch.long)}  # fmt: skip
    tokens, rows = batch_counts({**ids, **labels, **masks})
    assert int(tokens) == 22 and rows == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_division_by_a_fractional_item_count_is_the_float64_counts_in_every_dtype(dtype):
    """The gradients are divided by the step's float64 item count (a weighted loss counts
    fractional items). For float32 and half gradients the count is cast to float32 once before
    the division (fewer kernel set-ups, issue 30): the same bits as dividing by the float64
    count, which the kernel casts to float32 itself; float64 gradients keep the float64 count."""
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 3).to(dtype)
    xs = [torch.randn(5, 7, dtype=dtype), torch.randn(4, 7, dtype=dtype)]
    weights = [0.3, 0.7 / 3]  # the count: 0.3 * 5 + 0.7 / 3 * 4, not a float32 number

    def weighted(m, x):
        w = weights[0] if x.shape[0] == 5 else weights[1]
        loss = m(x).float().pow(2).sum().to(dtype) * w
        return loss, torch.tensor(w * x.shape[0], dtype=torch.float64)

    state = ft.TrainState.create(model, ft.optim.sgd())
    grads, stats = ft.accumulate_grads(state, xs, weighted)
    f64 = torch.float64
    count = torch.tensor(0.3 * 5, dtype=f64) + torch.tensor(0.7 / 3 * 4, dtype=f64)
    assert stats.num_items.dtype == torch.float64 and stats.num_items == count
    ref = torch.nn.Linear(7, 3).to(dtype)
    ref.load_state_dict(model.state_dict())
    for x in xs:
        loss, _ = weighted(ref, x)
        loss.backward()
    for n, p in ref.named_parameters():
        expected = p.grad.clone()
        torch._foreach_div_([expected], count)  # the float64 count, as the kernel takes it
        assert torch.equal(grads[n], expected), n


class _TiedTwice(torch.nn.Module):
    """Two handles on one embedding weight, as T5's `shared` and `encoder.embed_tokens` in
    transformers 5: the forward calls one; an adapter put on the other gets no gradient."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Embedding(5, 3)
        self.embed = torch.nn.Embedding(5, 3)
        self.embed.weight = self.shared.weight
        self.shared_adapter = torch.nn.Parameter(torch.zeros(3))  # only `shared` would add it
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.embed(x)).sum()


def _steps(state, n, loss_fn, batch=lambda k: torch.tensor([[1, 2]])):
    for k in range(n):
        grads, stats = ft.accumulate_grads(state, [batch(k)], loss_fn)
        state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    return state


def test_a_trainable_parameter_that_never_gets_a_gradient_is_named_once_per_model():
    """A trainable parameter the forward never reaches (a LoRA adapter on T5's `shared`, which
    the forward does not call in transformers 5) got no `.grad`, so no step ever trained it,
    silently. After NO_GRAD_STEPS steps without one it is named, once per model. A parameter
    trained on some steps only (a multi-task head) or frozen after create (gradual freezing)
    is not."""
    from ftrain.grads import NO_GRAD_STEPS

    def loss_fn(m, x):
        return m(x), torch.tensor(x.shape[0])

    state = ft.TrainState.create(_TiedTwice(), ft.optim.adamw())
    state = _steps(state, NO_GRAD_STEPS - 1, loss_fn)  # (warnings are errors in the tests)
    with pytest.warns(UserWarning, match=rf"parameter 'shared_adapter' of the TrainState "
                      rf"received no gradient in steps 0 to {NO_GRAD_STEPS - 1} "
                      rf"\({NO_GRAD_STEPS} steps in a row\)"):  # fmt: skip
        state = _steps(state, 1, loss_fn)
    assert "shared_adapter" not in ft.accumulate_grads(state, [torch.tensor([[1]])], loss_fn)[0]
    _steps(state, 2 * NO_GRAD_STEPS, loss_fn)  # once per model

    class TwoHeads(_TiedTwice):
        def forward(self, x):  # the adapter trained every third step only
            return super().forward(x) + (self.shared_adapter.sum() if x.shape[1] == 3 else 0)

    third = lambda k: torch.tensor([[1, 2, 3]] if k % 3 == 2 else [[1, 2]])  # noqa: E731
    _steps(ft.TrainState.create(TwoHeads(), ft.optim.adamw()), 3 * NO_GRAD_STEPS, loss_fn, third)
    frozen = _TiedTwice()
    state = ft.TrainState.create(frozen, ft.optim.adamw())
    frozen.shared_adapter.requires_grad_(False)  # frozen after create: a partial step
    _steps(state, 2 * NO_GRAD_STEPS, loss_fn)


def test_a_dataloaders_inputs_labels_batch_is_refused_as_micro_batches():
    """A DataLoader's `[inputs, labels]` batch passed as `micro` (without the wrapping list)
    was taken for two micro-batches. Float features with float targets (a regression's
    TensorDataset) passed the dtype check: `Linear(4, 1)` ran on the targets as if they were a
    row, a wrong gradient with no error. Tensors of different ranks now raise; chunks of one
    batch still pass, and so do the micro-batches of a multi-task step (dicts that share no
    key, a dict beside a tuple: each task's own columns)."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 4), torch.randn(4)
    state = ft.TrainState.create(torch.nn.Linear(4, 1), ft.optim.adamw())

    def loss_fn(m, b):
        return m(b["x"] if isinstance(b, dict) else b).sum(), 1

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    refused = {
        r"tensors of different ranks \(shapes \[\(4, 4\), \(4,\)\]\)": next(iter(loader)),
    }
    for what, micro in refused.items():
        with pytest.raises(TypeError, match=rf"cannot be micro-batches of one step, {what}: a "
                           r"DataLoader's \[inputs, labels\] batch"):  # fmt: skip
            ft.accumulate_grads(state, micro, loss_fn)
    tasks = [{"x": x[:2]}, {"features": x[2:], "task": 1}]  # a multi-task step: no shared key

    def by_task(m, b):
        return m(b["x"] if "x" in b else b["features"]).sum(), 1

    for micro, fn in (([x[:2], x[2:]], loss_fn), ([{"x": x[:2]}, {"x": x[2:]}], loss_fn),
                      (tasks, by_task)):  # fmt: skip
        _, stats = ft.accumulate_grads(state, micro, fn)
        assert stats.num_micro == 2


def test_a_4d_attention_mask_is_not_summed_as_a_token_count():
    """A 4-D attention mask (a packed row's block-diagonal mask, which HF models take) was
    summed as if it were a padding mask: pairs of positions for a bool mask, -inf for an
    additive one, so `num_tokens` and `tokens_seen` (checkpointed) were garbage, silently.
    Only a 2-D mask counts tokens; otherwise every input id does."""
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    allowed = torch.ones(4, 4, dtype=torch.bool).tril().expand(2, 1, 4, 4)
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~allowed, float("-inf"))
    state = ft.TrainState.create(torch.nn.Embedding(10, 2), ft.optim.sgd())

    def loss_fn(m, b):
        return m(b["input_ids"]).sum(), b["input_ids"].numel()

    for mask in (allowed, additive):
        batch = {"input_ids": ids, "attention_mask": mask}
        assert int(ft.grads.batch_counts(batch)[0]) == 8
        grads, stats = ft.accumulate_grads(state, [batch, batch], loss_fn)
        assert int(stats.num_tokens) == 16
        state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    assert int(state.data.tokens_seen) == 32
    padded = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    assert int(ft.accumulate_grads(state, [padded], loss_fn)[1].num_tokens) == 5
