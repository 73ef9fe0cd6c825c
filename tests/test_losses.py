"""The default loss decides by the model (issue 26): causal LMs shift, encoder-decoder and
token-classification models do not, anything else is told to pass loss_fn=."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from helpers import (
    digit_tokenizer,
    ragged_rows,
    reverse_rows,
    tiny_bert_tagger,
    tiny_llama,
    tiny_t5,
)

L = ft.losses


def _tag_rows(n, seed=0):
    """Token-classification rows: random ids, a tag per token, the first token's tag -100."""
    rows = ragged_rows(n, seed=seed, mask_prompt=False)
    return [
        {"input_ids": r["input_ids"], "labels": [-100] + [t % 5 for t in r["input_ids"][1:]]}
        for r in rows
    ]


def _seq2seq_batch(model, rows):
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(digit_tokenizer(), model=model)(rows)


def test_loss_for_decides_by_the_model_not_the_labels():
    from transformers import BartConfig, BartForConditionalGeneration, BertForSequenceClassification

    bart = BartForConditionalGeneration(
        BartConfig(vocab_size=16, d_model=16, encoder_layers=1, decoder_layers=1,
                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                   decoder_ffn_dim=32, max_position_embeddings=32)
    )  # fmt: skip
    seq_cls = BertForSequenceClassification(tiny_bert_tagger().config)
    assert L.loss_for(tiny_llama()) is L._CAUSAL
    assert L.loss_for(tiny_t5()) is L._SEQ2SEQ
    assert L.loss_for(bart) is L._SEQ2SEQ
    assert L.loss_for(tiny_bert_tagger()) is L._TOKENS
    assert L.loss_for(seq_cls) is L._CLASSIFY


def test_loss_for_looks_through_wrappers():
    from peft import LoraConfig, get_peft_model

    t5 = tiny_t5()
    assert L.loss_for(torch.compile(t5)) is L._SEQ2SEQ  # compiles nothing until called
    assert L.loss_for(torch.nn.DataParallel(tiny_bert_tagger())) is L._TOKENS  # DDP's .module
    lora = get_peft_model(tiny_t5(), LoraConfig(r=2, target_modules=["q", "v"]))
    assert L.loss_for(lora) is L._SEQ2SEQ


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


def test_a_plain_module_is_told_to_pass_loss_fn():
    state = ft.TrainState.create(_Plain(), ft.optim.sgd())
    batch = {"x": torch.randn(4, 3), "labels": torch.tensor([0, 1, 0, 1])}
    # Before: torch's "forward() got an unexpected keyword argument 'input_ids'"-style errors.
    with pytest.raises(TypeError, match=r"does not know _Plain.*loss_fn="):
        ft.accumulate_grads(state, [batch])
    _, stats = ft.accumulate_grads(state, [batch], ft.losses.classification_loss())
    assert int(stats.num_items) == 4


def test_token_classification_does_not_shift():
    model = tiny_bert_tagger().double()
    batch = ft.pad_collate()(_tag_rows(6))
    loss, n = L.default_loss(model, batch)
    labels = batch["labels"]
    assert int(n) == int((labels != -100).sum())  # every tag counts, none lost to a shift
    hf = model(**batch).loss  # HF's own mean over the same tokens
    torch.testing.assert_close(loss / n, hf, rtol=1e-12, atol=0)
    torch.testing.assert_close(L.token_classification_loss()(model, batch)[0], loss)


@pytest.mark.parametrize("with_decoder_inputs", [True, False])
def test_seq2seq_does_not_shift_and_builds_decoder_inputs(with_decoder_inputs):
    model = tiny_t5().double()
    batch = _seq2seq_batch(model, reverse_rows(5))
    if not with_decoder_inputs:
        del batch["decoder_input_ids"]  # built from the labels, as the model would
    loss, n = L.default_loss(model, batch)
    assert int(n) == int((batch["labels"] != -100).sum())
    hf = model(**batch).loss  # T5 computes the mean over labels != -100 itself
    torch.testing.assert_close(loss / n, hf, rtol=1e-12, atol=0)


def test_seq2seq_without_prepare_method_shifts_behind_the_start_token():
    model = tiny_t5().double()
    batch = _seq2seq_batch(model, reverse_rows(4, seed=3))
    want = batch.pop("decoder_input_ids")

    class NoPrepare(type(model)):
        prepare_decoder_input_ids_from_labels = None

    model.__class__ = NoPrepare
    assert torch.equal(L._decoder_inputs(model, batch["labels"]), want)
    model.config.decoder_start_token_id = None
    with pytest.raises(ValueError, match="decoder_input_ids"):
        L.default_loss(model, batch)


@pytest.mark.parametrize("make", [tiny_t5, tiny_bert_tagger, tiny_llama])
def test_counting_first_counts_as_the_loss_does(monkeypatch, make):
    """The count-first path (large models) counts unshifted labels for T5 and taggers, shifted
    ones for causal LMs; gradients equal the divide-after path's."""
    import ftrain.grads as grads_module

    model = make().double()
    if make is tiny_t5:
        rows = reverse_rows(8, seed=2)
        micro = [_seq2seq_batch(model, rows[i : i + 4]) for i in (0, 4)]
    else:
        rows = _tag_rows(8, seed=2) if make is tiny_bert_tagger else ragged_rows(8, seed=2)
        (micro,) = list(ft.make_batches(rows, batch_size=4, accum=2, shuffle=False))
    state = ft.TrainState.create(model, ft.optim.sgd())
    ref, ref_stats = ft.accumulate_grads(state, micro)
    ref = {k: g.clone() for k, g in ref.items()}
    shift = 1 if make is tiny_llama else 0
    want = sum(int((b["labels"][:, shift:] != -100).sum()) for b in micro)
    assert int(ref_stats.num_items) == want
    monkeypatch.setattr(grads_module, "COUNT_FIRST_NUMEL", 1)
    n = L._items_before_forward(ft.losses.default_loss, micro[0], model)
    assert int(n) == int((micro[0]["labels"][:, shift:] != -100).sum())
    grads, stats = ft.accumulate_grads(state, micro)
    assert int(stats.num_items) == want
    for k, g in grads.items():
        torch.testing.assert_close(g, ref[k], rtol=1e-6, atol=5e-8, msg=k)  # as test_grads


def _sum_over_items(outputs, labels, num_items_in_batch):
    """The Trainer's documented exact-accumulation loss (`compute_loss_func`): a sum over label
    tokens / the step's item count. Needed because BertForTokenClassification and T5 accept
    `**kwargs` but ignore `num_items_in_batch` (transformers 5.23): left to the model, the
    Trainer adds up per-micro-batch means without dividing by the accumulation steps."""
    logits = outputs.logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
    )
    return loss / num_items_in_batch


def _assert_trainer_parity(make_model, rows, collate, trainer_cls, args_cls, tmp_path):
    """12 steps of the README loop and of the HF Trainer (batch 4, accum 2, linear schedule
    with warmup, clipping at 0.5, same order): loss, grad norm, learning rate and parameters
    agree at every step."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.logs, self.params = [], []

        def on_log(self, args, state, control, logs=None, **kw):
            if "loss" in logs:
                self.logs.append(dict(logs))

        def on_step_end(self, args, state, control, model=None, **kw):
            self.params.append({k: v.detach().clone() for k, v in model.named_parameters()})

    steps, peak = 12, 3e-3
    args = args_cls(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=steps, learning_rate=peak, lr_scheduler_type="linear", warmup_steps=2,
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        train_sampling_strategy="sequential", disable_tqdm=True,
    )  # fmt: skip
    record = Record()
    trainer = trainer_cls(
        model=make_model(), args=args, train_dataset=rows, data_collator=collate,
        callbacks=[record], compute_loss_func=_sum_over_items,
    )  # fmt: skip
    trainer.train()
    assert len(record.logs) == len(record.params) == steps

    state = ft.TrainState.create(make_model(), ft.optim.adamw(weight_decay=0.0))
    lr = ft.schedules.from_name("linear", peak_lr=peak, warmup_steps=2, total_steps=steps)
    batches = ft.make_batches(rows, state, batch_size=4, accum=2, shuffle=False, collate_fn=collate)
    for micro in batches:
        grads, stats = ft.accumulate_grads(state, micro)  # the default loss
        hf = record.logs[state.step]
        assert hf["learning_rate"] == pytest.approx(lr(state.step), rel=1e-12)
        state, info = ft.clip_and_step(state, grads, stats=stats, lr=lr(state.step), max_norm=0.5)
        assert float(stats.loss) == pytest.approx(hf["loss"], rel=1e-6), state.step
        assert float(info.grad_norm) == pytest.approx(hf["grad_norm"], rel=1e-6), state.step
        for k, p in state.params.items():
            torch.testing.assert_close(p, record.params[state.step - 1][k], rtol=1e-5, atol=1e-6)
        if state.step == steps:
            break
    assert state.step == steps
    assert sum(float(r["grad_norm"]) > 0.5 for r in record.logs) > steps // 2  # clipping acts


def test_token_classification_equals_the_trainer_step_by_step(tmp_path):
    from transformers import Trainer, TrainingArguments

    rows = _tag_rows(96, seed=4)
    _assert_trainer_parity(
        tiny_bert_tagger, rows, ft.pad_collate(), Trainer, TrainingArguments, tmp_path
    )


def test_seq2seq_equals_the_seq2seq_trainer_step_by_step(tmp_path):
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    rows = reverse_rows(96, seed=4)
    collate = DataCollatorForSeq2Seq(digit_tokenizer(), model=tiny_t5())  # decoder_input_ids too
    _assert_trainer_parity(
        tiny_t5, rows, collate, Seq2SeqTrainer, Seq2SeqTrainingArguments, tmp_path
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("ignored", [0.0, 0.4, 1.0])
def test_token_losses_take_the_count_from_the_cross_entropy_kernel(dtype, ignored):
    """Issue 30: the count is nll_loss's total weight, not a separate pass over the labels. The
    loss, its gradient and the count equal F.cross_entropy and (labels != -100).sum() exactly.
    The causal loss shifts the labels (HF's ForCausalLMLoss layout: -100 after the last
    token), not the logits: its gradient is bit for bit that of the sliced logits, and its
    loss that sum added in another order."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[torch.rand(3, 7, generator=g) < ignored] = -100

    class Fixed(torch.nn.Module):
        def forward(self, input_ids):
            return logits

    batch = {"input_ids": labels.clamp(min=0), "labels": labels}
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    for loss_fn, shift in ((L.causal_lm_loss(), 1), (L.token_classification_loss(), 0)):
        loss, n = loss_fn(Fixed(), batch)
        (grad,) = torch.autograd.grad(loss, logits)
        target = shifted if shift else labels
        want = torch.nn.functional.cross_entropy(
            L.upcast(logits).reshape(-1, 11), target.reshape(-1), ignore_index=-100, reduction="sum"
        )
        (want_grad,) = torch.autograd.grad(want, logits)
        assert torch.equal(loss, want) and torch.equal(grad, want_grad)
        assert n.dtype == torch.int64 and int(n) == int((labels[:, shift:] != -100).sum())
        sliced = torch.nn.functional.cross_entropy(
            L.upcast(logits[:, : logits.shape[1] - shift]).reshape(-1, 11),
            labels[:, shift:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (sliced_grad,) = torch.autograd.grad(sliced, logits)
        assert torch.equal(grad, sliced_grad)
        torch.testing.assert_close(loss, sliced, rtol=1e-6, atol=1e-6)


def test_causal_lm_loss_equals_transformers_for_causal_lm_loss():
    """The causal loss is transformers' ForCausalLMLoss (what every HF causal LM computes) as a
    sum, bit for bit, and its gradient too."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, 13, generator=g).requires_grad_()
    labels = torch.randint(0, 13, (2, 9), generator=g)
    labels[0, :3] = -100  # a masked prompt
    batch = {"input_ids": labels.clamp(min=0), "labels": labels}

    class Fixed(torch.nn.Module):
        def forward(self, input_ids):
            return logits

    loss, n = L.causal_lm_loss()(Fixed(), batch)
    (grad,) = torch.autograd.grad(loss, logits)
    one = torch.tensor(1)  # num_items_in_batch: HF sums, then divides by it
    hf = ForCausalLMLoss(logits, labels, 13, num_items_in_batch=one)
    (hf_grad,) = torch.autograd.grad(hf, logits)
    assert torch.equal(loss, hf) and torch.equal(grad, hf_grad)
    assert int(n) == int((labels[:, 1:] != -100).sum())
    empty = torch.zeros(2, 0, dtype=torch.long)  # no position: nothing to shift, nothing counted
    logits = torch.zeros(2, 0, 13, requires_grad=True)
    loss, n = L.causal_lm_loss()(Fixed(), {"input_ids": empty, "labels": empty})
    assert float(loss.detach()) == 0 and int(n) == 0


def test_the_keys_a_model_takes_are_remembered_only_where_the_call_is_the_same():
    """`accumulate_grads`' forward remembers, per model and tuple of batch keys, the keys
    `model_inputs` passed (issue 30): the second call passes the same arguments. A batch with
    a key the forward does not take (warned each time), packed rows' `position_ids` (whose
    check reads the values) and a dict subclass are not remembered."""
    import warnings

    from ftrain.losses import _call
    from ftrain.process_state import STATE

    seen = []

    class Lm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
            seen.append((attention_mask is None, position_ids is None, use_cache))
            return input_ids.float() * self.w

    model = Lm()
    ids = torch.tensor([[1, 2]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    _call(model, batch)
    assert STATE.model_calls[model] == {
        ("input_ids", "attention_mask", "labels"): (("input_ids", "attention_mask"), True)
    }
    _call(model, dict(batch))
    assert seen[0] == seen[1] == (False, True, False)  # the mask passed, use_cache=False added
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _call(model, {**batch, "id": ["a"]})
        _call(model, {**batch, "id": ["a"]})
    assert len(caught) == 2  # a dropped key warns every time: not remembered
    _call(model, {"input_ids": ids, "position_ids": torch.tensor([[0, 1]]), "labels": ids})
    assert len(STATE.model_calls[model]) == 1


def test_left_padded_seq2seq_labels_are_refused_not_trained_on_padding():
    """Labels padded on the left (DataCollatorForSeq2Seq pads them on the tokenizer's
    padding_side; no model= so no decoder_input_ids) gave decoder inputs with the pad id before
    the target, read by the decoder: the loss changed with the padding, silently. The first
    batches are checked; right padding (or decoder inputs in the batch) passes."""
    from transformers import DataCollatorForSeq2Seq

    tok = digit_tokenizer()
    tok.padding_side = "left"
    rows = reverse_rows(4, seed=1)
    left = DataCollatorForSeq2Seq(tok)(rows)
    assert "decoder_input_ids" not in left and (left["labels"][:, 0] == -100).any()
    with pytest.raises(ValueError, match=r"seq2seq labels hold -100 before a counted label \(row"):
        L.default_loss(tiny_t5(), left)
    with pytest.raises(ValueError, match=r"padding_side='right'"):
        ft.accumulate_grads(ft.TrainState.create(tiny_t5(), ft.optim.adamw()), [left])
    # With its decoder inputs in the batch, the user chose them: not checked.
    L.default_loss(tiny_t5(), DataCollatorForSeq2Seq(tok, model=tiny_t5())(rows))
    tok.padding_side = "right"
    right = DataCollatorForSeq2Seq(tok)(rows)
    model = tiny_t5()
    L.default_loss(model, right)


def _tiny_mbart():
    """A tiny mBART-50-style translator: labels `[lang] tokens </s>`, decoder start `</s>` (2),
    the language code 30 forced as the first generated token; pad 1."""
    from transformers import MBartConfig, MBartForConditionalGeneration

    torch.manual_seed(0)
    return MBartForConditionalGeneration(MBartConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
        max_position_embeddings=32, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        forced_bos_token_id=30, dropout=0.0,
    )).eval()  # fmt: skip


def _tiny_whisper():
    """A tiny Whisper: decoder start <|startoftranscript|> 51, then language 52, task 53 and
    <|notimestamps|> 54 (the prefix generation forces), end and pad 50."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=60, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_mel_bins=8,
        max_source_positions=8, max_target_positions=16, pad_token_id=50, eos_token_id=50,
        bos_token_id=50, decoder_start_token_id=51, dropout=0.0,
    )).eval()  # fmt: skip


def test_masked_forced_leading_labels_are_told_apart_from_left_padding_and_how_to_train_them():
    """mBART-50 and Whisper fine-tuning masks the forced first label tokens (the target
    language code; the language, task and no-timestamps tokens), which generation is given,
    out of the loss. The labels check refused them as "left padding?" and said to pad on the
    right, which they were. The refusal stays: built from the masked labels, the decoder
    inputs hold the pad id where the tokens were (mBART's shift also wrapped a content token
    into the start position), so the decoder would be trained never to see them. It now names
    the masked prefix and the way to train it, decoder inputs built before masking
    (`ft.losses.decoder_input_ids`), which gives the model's own loss on those inputs."""
    mbart = _tiny_mbart()
    lang, ids = 30, torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1]])
    labels = torch.tensor([[lang, 11, 12, 13, 2], [lang, 14, 15, 2, -100]])
    masked = labels.clone()
    masked[:, 0] = -100
    batch = {"input_ids": ids, "attention_mask": (ids != 1).long(), "labels": masked}
    assert L.decoder_input_ids(mbart, masked)[:, :2].tolist() == [[13, 1], [15, 1]]  # why
    with pytest.raises(ValueError, match=r"the first 1 label\(s\) of every row masked: a forced "
                       r"language or task token.*Build decoder_input_ids from the labels before "
                       r"masking them"):  # fmt: skip
        L.default_loss(mbart, batch)
    starts = L.decoder_input_ids(mbart, labels)
    assert starts.tolist() == [[2, lang, 11, 12, 13], [2, lang, 14, 15, 2]]
    fixed = {**batch, "decoder_input_ids": starts}
    with torch.no_grad():
        loss, n = L.default_loss(mbart, fixed)
        own = mbart(**fixed).loss  # HF's mean over the same counted tokens
    assert int(n) == 7 and float(loss / n) == pytest.approx(float(own), rel=1e-6)
    state = ft.TrainState.create(_tiny_mbart(), ft.optim.adamw())
    _, stats = ft.accumulate_grads(state, [fixed])
    assert int(stats.num_items) == 7  # the language code is not counted

    whisper = _tiny_whisper()
    feats = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[52, 53, 54, 10, 11, 50], [52, 53, 54, 12, 50, -100]])
    masked = labels.masked_fill(torch.arange(6) < 3, -100)
    with pytest.raises(ValueError, match=r"first 3 label\(s\) of every row masked"):
        L.default_loss(whisper, {"input_features": feats, "labels": masked})
    fixed = {"input_features": feats, "labels": masked,
             "decoder_input_ids": L.decoder_input_ids(whisper, labels)}  # fmt: skip
    assert fixed["decoder_input_ids"][0].tolist() == [51, 52, 53, 54, 10, 11]
    with torch.no_grad():
        loss, n = L.default_loss(whisper, fixed)
        own = whisper(**fixed).loss
    assert int(n) == 5 and float(loss / n) == pytest.approx(float(own), rel=1e-6)

    # Left padding (leading runs of different lengths) is still called that.
    left = torch.tensor([[lang, 11, 12, 13, 2], [-100, lang, 14, 15, 2]])
    with pytest.raises(ValueError, match=r"row 1: \[-100, 30, 14, 15, 2\]; left padding\?\).*"
                       r"padding_side='right'"):  # fmt: skip
        L.default_loss(_tiny_mbart(), {**batch, "labels": left})
    inside = torch.tensor([[lang, -100, 12, 13, 2], [lang, 14, 15, 2, -100]])
    with pytest.raises(ValueError, match=r"a masked span\?"):
        L.default_loss(_tiny_mbart(), {**batch, "labels": inside})


def test_causal_labels_shifted_already_are_refused_on_the_first_step():
    """nanoGPT-style windows, `input_ids=data[i:i+n]` and `labels=data[i+1:i+n+1]`, under the
    default loss of a causal LM were shifted a second time: the model was trained to predict
    the token after the next, silently (the loss just stayed high). A model's first step
    checks its micro-batches; labels equal to input_ids (with -100 prompts) pass."""
    torch.manual_seed(0)
    data = torch.randint(1, 61, (2, 9))
    x, y = data[:, :-1], data[:, 1:].clone()
    y[0, :2] = -100  # a masked prompt does not hide it
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw())
    with pytest.raises(ValueError, match=r"the labels are input_ids shifted left already"):
        ft.accumulate_grads(state, [{"input_ids": x, "labels": x}, {"input_ids": x, "labels": y}])
    prompt = x.clone()
    prompt[:, :3] = -100
    state = ft.TrainState.create(tiny_llama(), ft.optim.adamw())
    _, stats = ft.accumulate_grads(state, [{"input_ids": x, "labels": prompt}])
    assert int(stats.num_items) == 2 * 5  # the labels after the prompt


def test_a_forward_patched_after_a_call_is_read_again():
    """The names a model's forward takes were read once per model: a forward patched later (on
    the instance, as liger-kernel patches a model, or on its class) kept losing the arguments
    it gained, with a warning that it took no such key."""
    import types
    import warnings

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 3)

        def forward(self, input_ids):
            return self.emb(input_ids)

    model = Tagger()
    batch = {"input_ids": torch.tensor([[1, 2]]), "scale": torch.tensor(2.0)}
    with pytest.warns(UserWarning, match=r"the model's forward \(Tagger\) takes no 'scale'"):
        assert sorted(L.model_inputs(model, batch)) == ["input_ids"]

    def scaled(self, input_ids, scale=None):
        return self.emb(input_ids) * scale

    model.forward = types.MethodType(scaled, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(L.model_inputs(model, batch)) == ["input_ids", "scale"]
    del model.forward
    Tagger.forward = lambda self, input_ids, scale, bias=0: self.emb(input_ids) * scale + bias
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(L.model_inputs(model, batch)) == ["input_ids", "scale"]
    with pytest.raises(TypeError, match=r"the model's forward \(Tagger\) needs 'scale'"):
        L.model_inputs(model, {"input_ids": batch["input_ids"]})


def _xy_sum(model, batch):
    """A loss of one's own: cross-entropy summed over (x, y) rows."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum")


def _xy_plain(model, batch):
    return _xy_sum(model, batch), batch[1].numel()


def _xy_batches(n, rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(rows - i, 6, generator=g, dtype=torch.float64), torch.arange(rows - i) % 3]
        for i in range(n)
    ]


def test_counted_counts_before_the_forward_and_trains_as_the_plain_loss(monkeypatch):
    """`ft.losses.counted`: a loss of one's own whose count is read from the batch takes the
    count-first path (each loss divided before backward, no pass over the gradients) from
    `COUNT_FIRST_NUMEL` on, with the gradients and stats of the plain (sum, count) loss; a
    ZeroWeight stand-in counts nothing and a fractional (weighted) count stays exact."""
    import ftrain.grads as grads_module

    model = torch.nn.Linear(6, 3).double()
    state = ft.TrainState.create(model, ft.optim.sgd())
    micro = [*_xy_batches(3), ft.data.ZeroWeight(_xy_batches(1, seed=9)[0])]
    ref, ref_stats = ft.accumulate_grads(state, micro, _xy_plain)
    ref = {k: g.clone() for k, g in ref.items()}
    paths = []
    real = grads_module._forward_backward

    def spy(*args):
        totals, divided = real(*args)
        paths.append(divided)
        return totals, divided

    monkeypatch.setattr(grads_module, "_forward_backward", spy)
    counted = L.counted(_xy_sum, items=lambda b: b[1].numel())
    monkeypatch.setattr(grads_module, "COUNT_FIRST_NUMEL", 1)
    for loss_fn in (_xy_plain, counted):
        grads, stats = ft.accumulate_grads(state, micro, loss_fn)
        for k, g in grads.items():
            torch.testing.assert_close(g, ref[k], rtol=1e-12, atol=1e-14, msg=k)
        assert int(stats.num_items) == int(ref_stats.num_items) == 5 + 4 + 3
        torch.testing.assert_close(stats.loss, ref_stats.loss, rtol=1e-12, atol=0)
    assert paths == [False, True]  # the plain loss cannot be counted ahead; counted is

    # Weighted counts: host floats and device tensors mixed, divided by their exact sum.
    half = L.counted(_xy_sum, items=lambda b: b[1].numel() / 2 if len(b[1]) % 2 else
                     torch.tensor(b[1].numel() / 2, dtype=torch.float64))  # fmt: skip
    grads, stats = ft.accumulate_grads(state, micro, half)
    assert float(stats.num_items) == 6.0 and paths[-1] is True
    for k, g in grads.items():
        torch.testing.assert_close(g, 2 * ref[k], rtol=1e-12, atol=1e-14, msg=k)


def test_counted_is_a_plain_loss_elsewhere_and_named_by_its_sum():
    """Below the size, in evaluate and in `loss_name`, a counted loss is its sum and count."""
    model = torch.nn.Linear(6, 3).double()
    counted = L.counted(_xy_sum, items=lambda b: b[1].numel())
    batch = _xy_batches(1)[0]
    total, n = counted(model, batch)
    assert n == 5
    torch.testing.assert_close(total, _xy_sum(model, batch))
    assert L.loss_name(counted) == L.loss_name(_xy_sum) == f"{__name__}._xy_sum"
    import numpy as np  # numpy's numbers are counts too (np.prod of a shape)

    for n in (np.int64(5), np.float32(2.5)):
        assert L.counted(_xy_sum, items=lambda b, n=n: n)(model, batch)[1] == n
    state = ft.TrainState.create(model, ft.optim.sgd())
    got = ft.evaluate(state, _xy_batches(3), counted)
    want = ft.evaluate(state, _xy_batches(3), _xy_plain)
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-12)


@pytest.mark.parametrize(
    ("sum_fn", "items", "match"),
    [
        (_xy_plain, lambda b: 5, "must return the loss \\*sum\\* as a one-element tensor"),
        (lambda m, b: m(b[0]), lambda b: 5, "one-element tensor.*shape \\(5, 3\\)"),
        (_xy_sum, lambda b: b[1] != 0, "items\\(batch\\) must be one number"),
        (_xy_sum, lambda b: torch.tensor(True), "items\\(batch\\) must be one number"),
        (_xy_sum, lambda b: -1, "items\\(batch\\) must be a number >= 0"),
        (_xy_sum, lambda b: float("nan"), "items\\(batch\\) must be a number >= 0"),
        (_xy_sum, lambda b: True, "items\\(batch\\) must be a number >= 0"),
        (_xy_sum, lambda b: "5", "items\\(batch\\) must be a number >= 0"),
        (_xy_sum, lambda b: __import__("numpy").bool_(True), "must be a number >= 0"),
    ],
)
def test_counted_refuses_what_is_not_a_sum_and_a_count(monkeypatch, sum_fn, items, match):
    """A (sum, count) pair where the sum goes, a per-row loss, a mask or a bool for a count, a
    negative or NaN count: refused naming `counted`, on both paths (counted first or not)."""
    import ftrain.grads as grads_module

    model = torch.nn.Linear(6, 3).double()
    state = ft.TrainState.create(model, ft.optim.sgd())
    bad = L.counted(sum_fn, items)
    for numel in (1 << 30, 1):
        monkeypatch.setattr(grads_module, "COUNT_FIRST_NUMEL", numel)
        with pytest.raises(TypeError, match=f"counted: .*{match}"):
            ft.accumulate_grads(state, _xy_batches(2), bad)
    with pytest.raises(TypeError, match="counted: items must be callable"):
        L.counted(_xy_sum, 5)
    with pytest.raises(TypeError, match="counted: sum_fn must be callable"):
        L.counted(None, lambda b: 1)


def test_counted_weighted_count_below_one_is_not_clamped_to_one(monkeypatch):
    """A `counted` loss whose weighted items sum to less than 1 in all (0.25 here) divides by
    that sum, as the plain (sum, count) loss does, on both paths: it was clamped to 1 (a
    `counted` loss lives in ftrain.losses, whose own losses count whole items), gradients 4x
    smaller than its reported loss (sum / 0.25) says."""
    import ftrain.grads as grads_module

    model = torch.nn.Linear(6, 3).double()
    state = ft.TrainState.create(model, ft.optim.sgd())
    micro = _xy_batches(2)
    want, want_stats = ft.accumulate_grads(state, micro, lambda m, b: (_xy_sum(m, b), 0.125))
    want = {k: g.clone() for k, g in want.items()}
    quarter = L.counted(_xy_sum, items=lambda b: 0.125)
    for numel in (1 << 30, 1):  # divided after backward, then counted first
        monkeypatch.setattr(grads_module, "COUNT_FIRST_NUMEL", numel)
        got, stats = ft.accumulate_grads(state, micro, quarter)
        assert float(stats.num_items) == float(want_stats.num_items) == 0.25
        for k, g in got.items():
            torch.testing.assert_close(g, want[k], rtol=1e-12, atol=1e-14, msg=k)
