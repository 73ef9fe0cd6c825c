"""Silent failures of everyday fine-tuning, fourth pass: left truncation, (inputs, labels) batches,
LoRA's task type, and sampled generation; each pinned by what the user asked for."""

from __future__ import annotations

import warnings

import pytest
import torch

import ftrain as ft

TEXT = "the quick brown fox jumps over the lazy dog and then the cat sat on a mat "


@pytest.fixture(scope="module")
def tok():
    return ft.sft.train_tokenizer([TEXT[i:] + TEXT[:i] for i in range(0, 64, 4)], 300)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _encode(tok, row, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.sft.TruncationWarning)
        return ft.sft.SFTCollator(tok, **kwargs).encode(row)


@pytest.mark.parametrize("side", ["left", "right"])
def test_left_truncation_cuts_the_prompts_start_and_never_the_responses_start(tok, side):
    # truncation_side="left" cut the response at its start too: the labels began mid-answer
    # (" on a mat" trained to follow the prompt) while its first tokens were never trained.
    row = {"input": " the quick brown fox jumps", "output": " and then the cat sat on a mat"}
    p, a = _ids(tok, row["input"]), _ids(tok, row["output"])
    bos, eos = tok.bos_token_id, tok.eos_token_id
    tok.truncation_side = side
    try:
        got = _encode(tok, row, source_max_len=4, target_max_len=3)
        whole = _encode(tok, row, source_max_len=64, target_max_len=64)
    finally:
        tok.truncation_side = "right"
    prompt = p[-3:] if side == "left" else p[:3]
    assert got["input_ids"] == [bos, *prompt, *a[:3]]
    assert got["labels"] == [-100] * 4 + a[:3]  # the response's start, on either side
    assert whole["labels"] == [-100] * (len(p) + 1) + [*a, eos]  # nothing cut: as before


def test_left_truncation_warning_says_which_ends_were_cut(tok):
    tok.truncation_side = "left"
    try:
        collator = ft.sft.SFTCollator(tok, source_max_len=3, target_max_len=2)
        with pytest.warns(ft.sft.TruncationWarning) as record:
            collator([{"input": " the quick brown fox", "output": " the lazy dog sat"}])
    finally:
        tok.truncation_side = "right"
    message = str(record[0].message)
    assert "cut the starts of 1 of 1 prompts" in message
    assert "the ends of 1 of 1 responses" in message
    assert collator.truncated == ft.sft.TruncationCounts(rows=1, prompts=1, responses=1)


def _llama_state():
    from helpers import tiny_llama

    return ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=0)


def _split_rows(n=4):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30, (n, 6), generator=g)
    return ids, [({"input_ids": ids[i]}, {"labels": ids[i]}) for i in range(n)]


def _pair_loss(model, batch):
    # A loss_fn for (inputs, labels) batches; given the parts one at a time, it scores the
    # inputs dict as if it held labels too (its own "input_ids" read as labels).
    inputs, labels = batch if isinstance(batch, tuple) else (batch, {"labels": None})
    out = model(**inputs, labels=labels["labels"])
    return out.loss * 5, 5


@pytest.mark.parametrize("run", ["evaluate", "predict"])
def test_a_dataloaders_inputs_labels_batch_is_refused_not_read_as_two_batches(run):
    # A DataLoader over (inputs, labels) rows yields [inputs, labels] (default collate): read as
    # a group of two batches, each dict went to the loss_fn alone.
    state = _llama_state()
    _, rows = _split_rows()
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    go = {
        "evaluate": lambda b: ft.evaluate(state, b, loss_fn=_pair_loss),
        "predict": lambda b: list(ft.predict(state, b, lambda m, x: {"n": torch.ones(2)})),
    }[run]
    with pytest.raises(TypeError, match=r"a batch is a list of 2 dicts that share no key"):
        go(loader)
    with pytest.raises(TypeError, match=r"Merge them into one dict \(\{\*\*inputs, \*\*labels\}"):
        go(rows[0])  # one (inputs, labels) row passed as the batches: each dict a "batch"


def test_inputs_labels_batches_as_tuples_or_merged_dicts_evaluate_as_one_batch():
    # The two ways the error offers give the loss of the whole batch.
    state = _llama_state()
    ids, rows = _split_rows()

    def as_tuple(items):
        return tuple(torch.utils.data.default_collate(items))

    def merged(items):
        inputs, labels = torch.utils.data.default_collate(items)
        return {**inputs, **labels}

    tuples = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=as_tuple)
    dicts = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=merged)
    want = ft.evaluate(state, [{"input_ids": ids, "labels": ids}])["eval_loss"]
    assert ft.evaluate(state, dicts)["eval_loss"] == pytest.approx(want, rel=1e-5)
    got = ft.evaluate(state, tuples, loss_fn=_pair_loss)["eval_loss"]
    assert got == pytest.approx(want, rel=1e-5)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on tiny configs
        return fn(*args, **kwargs)


def _llama_classifier(seed=0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return _quiet(LlamaForSequenceClassification, cfg)


def _bart_classifier(seed=0):
    from transformers import BartConfig, BartForSequenceClassification

    torch.manual_seed(seed)
    cfg = BartConfig(
        vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_labels=3,
        max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2, dropout=0.0,
    )  # fmt: skip
    return _quiet(BartForSequenceClassification, cfg)


def _model(name):
    from helpers import tiny_bert_tagger, tiny_llama, tiny_t5

    return {
        "llama": tiny_llama, "t5": tiny_t5, "tagger": tiny_bert_tagger,
        "llama_cls": _llama_classifier, "bart_cls": _bart_classifier,
    }[name]()  # fmt: skip


@pytest.mark.parametrize(
    "name, wrapper",
    [
        ("llama", "PeftModelForCausalLM"),
        ("t5", "PeftModelForSeq2SeqLM"),
        ("llama_cls", "PeftModelForSequenceClassification"),
        ("bart_cls", "PeftModelForSequenceClassification"),
        ("tagger", "PeftModelForTokenClassification"),
    ],
)
def test_lora_takes_the_task_type_of_the_models_head(name, wrapper):
    # CAUSAL_LM was the default for every model: T5 got PeftModelForCausalLM, and classifiers
    # raised from deep in PEFT (no prepare_inputs_for_generation).
    model = _quiet(ft.lora.apply, _model(name), r=2, alpha=4)
    assert type(model).__name__ == wrapper
    trained = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    if name in ("llama", "t5"):
        assert not trained  # adapters only
    else:  # the new head trains in full, with no adapter on it
        head = {"llama_cls": "score", "bart_cls": "classification_head", "tagger": "classifier"}
        assert trained and all(f".{head[name]}.modules_to_save." in n for n in trained)
        assert not any("lora_" in n and f".{head[name]}." in n for n, _ in model.named_parameters())


def test_lora_refuses_a_task_type_that_contradicts_the_head():
    with pytest.raises(ValueError, match=r"task_type='CAUSAL_LM', but T5ForConditionalGeneration "):
        ft.lora.apply(_model("t5"), r=2, task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"drop task_type \(it is inferred: 'SEQ_CLS'\)"):
        ft.lora.apply(_model("llama_cls"), r=2, task_type="CAUSAL_LM")
    from peft import TaskType

    model = _quiet(ft.lora.apply, _model("t5"), r=2, task_type=TaskType.SEQ_2_SEQ_LM)
    assert type(model).__name__ == "PeftModelForSeq2SeqLM"


@pytest.mark.parametrize("task_type", [None, "SEQ_CLS"])
@pytest.mark.parametrize("name", ["llama_cls", "bart_cls"])
def test_a_lora_classifiers_trained_head_is_saved_with_its_adapter(name, task_type, tmp_path):
    # BART's head (classification_head) is not one of PEFT's guesses (classifier, score): it
    # stayed frozen at its random init, and a reloaded adapter came with another random head.
    from peft import PeftModel

    base = _model(name)
    base.save_pretrained(tmp_path / "base")
    cls = type(base)
    state = ft.TrainState.create(
        _quiet(
            ft.lora.apply, cls.from_pretrained(tmp_path / "base"), r=2, alpha=4, task_type=task_type
        ),
        ft.optim.adamw(weight_decay=0.0),
        seed=0,
    )
    g = torch.Generator().manual_seed(1)
    eos = [base.config.eos_token_id]  # BART's classifier reads the last eos
    rows = [
        {"input_ids": torch.randint(3, 30, (5,), generator=g).tolist() + eos, "labels": i % 3}
        for i in range(8)
    ]
    pad = base.config.pad_token_id
    batch = ft.pad_collate(pad_id=pad)(rows)
    before = ft.evaluate(state, [batch])["eval_loss"]
    for _ in range(3):
        grads, stats = ft.accumulate_grads(state, [batch])
        state, _ = ft.clip_and_step(state, grads, lr=0.05, stats=stats)
    assert ft.evaluate(state, [batch])["eval_loss"] < before - 0.05
    head = {"llama_cls": "score", "bart_cls": "classification_head"}[name]
    trained = state.model.get_base_model().get_submodule(head).modules_to_save["default"]
    base_head = base.get_submodule(head)
    assert not all(map(torch.equal, trained.state_dict().values(), base_head.state_dict().values()))
    with torch.no_grad():
        want = state.model.eval()(**batch).logits
    ft.export_pretrained(state, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        got = loaded.eval()(**batch).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _sampled(state, batch, **kwargs):
    out = ft.generate(state, [batch], max_new_tokens=8, do_sample=True, pad_token_id=0, **kwargs)
    return next(iter(out))["token_ids"]


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_sampled_generation_is_reproducible_and_leaves_the_global_stream_alone(name):
    # do_sample drew from torch's global generator: the same call twice sampled other tokens,
    # a resumed run sampled otherwise, and every later draw (dropout, data) moved.
    model = _model(name)
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]])}
    torch.manual_seed(123)
    first = _sampled(state, batch)
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), after)  # the caller's stream did not move
    assert _sampled(state, batch) == first
    resumed = ft.TrainState.create(_model(name), ft.optim.adamw(), seed=0)  # same weights
    assert _sampled(resumed, batch) == first
    assert _sampled(state, batch, seed=0) == first  # seed defaults to state.seed
    draws = {str(_sampled(state, batch, seed=s)) for s in range(1, 6)}
    assert len(draws | {str(first)}) > 1  # another seed, other samples


def test_generate_refuses_a_bad_seed_and_a_generator():
    state = _llama_state()
    batch = {"input_ids": torch.tensor([[5, 6, 7]])}
    for bad in (1.5, True, "0"):  # the wrong type is a TypeError (STYLE 4)
        with pytest.raises(TypeError, match=rf"seed must be an int, got {bad!r}"):
            _sampled(state, batch, seed=bad)
    for bad in (-1, 2**63):  # TrainState.create's range
        with pytest.raises(ValueError, match=rf"seed must be in \[0, 2\*\*63\), got {bad}"):
            _sampled(state, batch, seed=bad)
    with pytest.raises(TypeError, match=r"takes no generator; pass seed=\.\.\."):
        _sampled(state, batch, generator=torch.Generator())


def test_lora_gives_models_without_a_known_head_a_plain_peft_model():
    # CAUSAL_LM for every model made PEFT look for prepare_inputs_for_generation on a masked LM
    # or a module of one's own, and raise from deep inside; their heads are not new either.
    from transformers import BertConfig, BertForMaskedLM

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    cfg = BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32,
    )  # fmt: skip
    for model in (Own(), _quiet(BertForMaskedLM, cfg)):
        wrapped = ft.lora.apply(model, r=2)
        assert type(wrapped).__name__ == "PeftModel"
        assert all("lora_" in n for n, p in wrapped.named_parameters() if p.requires_grad)
