"""Silent failures of everyday fine-tuning, third pass (generation, evaluation, collation and the
examples): each pinned by what the same data gives without the trap, usually the rows alone."""

from __future__ import annotations

import warnings

import pytest
import torch

import ftrain as ft


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config notes on tiny models
        return fn(*args, **kwargs)


def _bart():
    """A 1-layer BART (learned absolute positions; pad 1, eos 2 = decoder start), no dropout;
    init_std=0.5 so that greedy completions differ between prompts."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(
        vocab_size=20, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_bos_token_id=None, dropout=0.0, init_std=0.5,
    )  # fmt: skip
    return _quiet(BartForConditionalGeneration, cfg)


PROMPTS = [[5, 6, 7, 8, 9, 10, 2], [11, 12, 2], [13, 14, 15, 2]]


def _generated(state, batch, **kwargs):
    return next(iter(ft.generate(state, [batch], max_new_tokens=6, **kwargs)))["token_ids"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_an_encoder_decoders_padded_prompts_complete_as_they_do_alone(side):
    # BART's encoder has absolute positions: a left-padded prompt started at position 4, not 0,
    # and its completion changed ([9, 11, 11, 9, 9, 2] for [9, 9, 9, 9, 9, 2] alone).
    state = ft.TrainState.create(_bart(), ft.optim.adamw(), seed=0)
    alone = [_generated(state, {"input_ids": torch.tensor([p])})[0] for p in PROMPTS]
    batch = ft.pad_collate(pad_id=1, padding_side=side)([{"input_ids": p} for p in PROMPTS])
    assert _generated(state, batch) == alone
    assert _generated(state, batch, num_beams=2) == [
        _generated(state, {"input_ids": torch.tensor([p])}, num_beams=2)[0] for p in PROMPTS
    ]


SEQ2SEQ_ROWS = [
    {"input_ids": [5, 6, 7, 8, 2], "labels": [9, 10, 2]},
    {"input_ids": [11, 12, 2], "labels": [13, 14, 15, 16, 2]},
]


@pytest.mark.parametrize("model_fn", [_bart, "t5"])
def test_predict_gives_an_encoder_decoder_the_decoder_inputs_of_its_labels(model_fn):
    # predict left the labels out of the call and gave no decoder inputs: BART then decoded its
    # own input_ids shifted (logits of the right shape, of another sequence), T5 raised its own
    # unclear error. The Trainer's prediction_step gets the logits of the labels.
    from helpers import tiny_t5

    model = tiny_t5(vocab_size=20) if model_fn == "t5" else model_fn()
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    batch = ft.pad_collate(pad_id=model.config.pad_token_id)(SEQ2SEQ_ROWS)
    with torch.no_grad():
        want = model.eval()(**batch).logits
    out = next(iter(ft.predict(state, [batch])))
    torch.testing.assert_close(torch.from_numpy(out["logits"]), want)
    assert out["labels"].tolist() == batch["labels"].tolist()
    prompts = {k: v for k, v in batch.items() if k != "labels"}
    with pytest.raises(
        ValueError, match=r"predict: .*encoder-decoder.* no labels or decoder_input_ids"
    ):
        next(iter(ft.predict(state, [prompts])))


@pytest.fixture(scope="module")
def small_tok():
    text = "the quick brown fox jumps over the lazy dog and then the cat sat on a mat "
    return ft.sft.train_tokenizer([text[i:] + text[:i] for i in range(0, 64, 4)], 300)


def test_sft_collator_cuts_on_the_tokenizers_truncation_side(small_tok):
    # A tokenizer set to truncation_side="left" (keep the end of a long prompt, next to the
    # response) was cut on the right anyway: the prompt's end was lost without a word.
    tok = small_tok
    prompt = " the quick brown fox jumps over the lazy dog"
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    a = tok(" and then the cat sat", add_special_tokens=False)["input_ids"]
    row = {"input": prompt, "output": " and then the cat sat"}
    tok.truncation_side = "left"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ft.sft.TruncationWarning)
            got = ft.sft.SFTCollator(tok, source_max_len=4, target_max_len=3).encode(row)
    finally:
        tok.truncation_side = "right"
    bos = tok.bos_token_id
    # The response keeps its start (test_finetune_attacks3: its start is what the loss trains).
    assert got["input_ids"] == [bos, *p[-3:], *a[:3]]
    assert got["labels"] == [-100] * 4 + a[:3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.sft.TruncationWarning)
        right = ft.sft.SFTCollator(tok, source_max_len=4, target_max_len=3).encode(row)
    assert right["input_ids"] == [bos, *p[:3], *a[:3]]  # qlora.py's cut, as before


def test_alpaca_refuses_a_missing_output_rather_than_train_on_the_text_none():
    # str(None): a row with no output trained the model to answer "None".
    with pytest.raises(ValueError, match="alpaca: the example's 'output' is None"):
        ft.sft.alpaca({"instruction": "Add 2 and 3.", "output": None})
    with pytest.raises(ValueError, match="alpaca: the example's 'instruction' is None"):
        ft.sft.alpaca({"instruction": None, "output": "5"})
    assert ft.sft.alpaca({"instruction": "Add 2 and 3.", "output": 5})["output"] == "5"


@pytest.mark.parametrize(
    "option", ["output_scores", "output_logits", "output_attentions", "output_hidden_states"]
)
def test_generate_refuses_outputs_it_would_drop(option):
    # Passed on to model.generate, computed, and thrown away: generate yields token ids and text.
    from transformers import GenerationConfig

    state = ft.TrainState.create(_bart(), ft.optim.adamw(), seed=0)
    batch = {"input_ids": torch.tensor([PROMPTS[1]])}
    for kwargs in (
        {option: True, "return_dict_in_generate": True, "max_new_tokens": 2},
        {"generation_config": GenerationConfig(max_new_tokens=2, **{option: True})},
    ):
        with pytest.raises(ValueError, match=f"generate: {option}=True asks for outputs"):
            next(iter(ft.generate(state, [batch], **kwargs)))
    assert _generated(state, batch, **{option: False})  # False asks for nothing: accepted


def test_predict_and_generate_refuse_no_batches_as_evaluate_does():
    # An eval set smaller than the batch in a DataLoader with drop_last=True (make_batches
    # raises itself): evaluate raised, but predict and generate yielded nothing, and an accuracy
    # over their (no) outputs read 0 or NaN.
    from helpers import tiny_t5

    state = ft.TrainState.create(tiny_t5(vocab_size=20), ft.optim.adamw(), seed=0)

    def loader():
        collate = ft.pad_collate()
        return torch.utils.data.DataLoader(SEQ2SEQ_ROWS, 4, drop_last=True, collate_fn=collate)

    with pytest.raises(ValueError, match="evaluate got no batches"):
        ft.evaluate(state, loader())
    with pytest.raises(ValueError, match=r"predict got no batches \(.*drop_last"):
        list(ft.predict(state, loader()))
    with pytest.raises(ValueError, match=r"generate got no batches \(.*drop_last"):
        list(ft.generate(state, loader(), max_new_tokens=2))


def test_evaluate_and_predict_read_a_dataloaders_list_batches_whole():
    # A DataLoader over a TensorDataset yields [x, y] lists, which evaluate and predict took for
    # groups of micro-batches: x and y ran as two batches, each unpacked into two of its rows
    # (eval_loss 1.777 for 1.660 here; predict yielded one row per "batch").
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    x, y = torch.randn(6, 4), torch.randn(6, 4)

    def loss_fn(m, batch):
        inputs, targets = batch
        return F.mse_loss(m(inputs), targets, reduction="sum"), torch.tensor(targets.numel())

    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    with torch.no_grad():
        want = F.mse_loss(model(x), y).item()
    assert ft.evaluate(state, loader, loss_fn)["eval_loss"] == pytest.approx(want)
    shapes = [o["pred"].shape for o in ft.predict(state, loader, lambda m, b: {"pred": m(b[0])})]
    assert shapes == [(2, 4)] * 3
    # Groups of micro-batches are still read batch by batch, as make_batches yields them.
    groups = [[(x[:3], y[:3]), (x[3:], y[3:])]]
    assert ft.evaluate(state, groups, loss_fn)["eval_loss"] == pytest.approx(want)


def test_accumulate_grads_refuses_a_dataloaders_x_y_batch_passed_as_micro_batches():
    """The [x, y] batch of a DataLoader over a TensorDataset, passed as `micro` (a plain loop's
    `for batch in loader` without the wrapping list), was taken for two micro-batches, x then
    y, each indexed by the loss_fn into rows: a wrong gradient, no error. Features and labels
    of different dtypes now raise; tensors of one dtype may be micro-batches (chunks of one
    batch) and still pass: a regression's float [x, y] stays ambiguous."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(4, 4), torch.tensor([0, 2, 1, 0])

    def loss_fn(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1], reduction="sum"), batch[1].numel()

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    batch = next(iter(loader))
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    with pytest.raises(TypeError, match=r"micro is a list of 2 tensors of different dtypes"):
        ft.accumulate_grads(state, batch, loss_fn)
    _, stats = ft.accumulate_grads(state, [batch], loss_fn)  # wrapped: one micro-batch
    assert int(stats.num_items) == 4
    chunks = [x[:2], x[2:]]  # single-tensor micro-batches of one dtype pass
    ft.accumulate_grads(state, chunks, lambda m, t: (m(t).sum(), t.shape[0]))


def test_predict_and_generate_refuse_shuffled_batches():
    # make_batches shuffles by default (it is the training loader): predict and generate then
    # yielded outputs in a shuffled order, and zipped with the dataset (the Trainer's
    # trainer.predict(test) never shuffles) every prediction met another row's answer.
    from helpers import tiny_t5

    state = ft.TrainState.create(tiny_t5(vocab_size=20), ft.optim.adamw(), seed=0)
    rows = SEQ2SEQ_ROWS * 2
    with pytest.raises(ValueError, match=r"predict: .* shuffled .* shuffle=False"):
        next(iter(ft.predict(state, ft.make_batches(rows, batch_size=2))))
    with pytest.raises(ValueError, match=r"generate: .* shuffled .* shuffle=False"):
        next(iter(ft.generate(state, ft.make_batches(rows, batch_size=2), max_new_tokens=2)))
    ordered = ft.make_batches(rows, batch_size=2, shuffle=False)
    assert len(list(ft.predict(state, ordered))) == 2
    assert ft.evaluate(state, ft.make_batches(rows, batch_size=2))["eval_items"] == 16


def test_a_collator_that_left_pads_an_encoder_decoders_labels_is_refused():
    """DataCollatorForSeq2Seq pads labels on its tokenizer's padding_side: left-padded, the
    decoder reads padding between its start token and the target (no decoder mask), so a row's
    loss depended on the rows padded with it (20.904 for 20.755 alone here). pad_collate
    refuses left-padded targets; make_batches now refuses such a collator for an
    encoder-decoder (the collator's model, else the state's), and leaves causal LMs alone."""
    from transformers import DataCollatorForSeq2Seq

    from ftrain.losses import default_loss
    from helpers import digit_tokenizer, tiny_llama, tiny_t5

    model, tok = tiny_t5(vocab_size=16).eval(), digit_tokenizer()
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [8, 7, 6, 5, 1]},
        {"input_ids": [9, 10], "labels": [10, 9, 1]},
    ]
    with torch.no_grad():
        collate = DataCollatorForSeq2Seq(tok, model=model, return_tensors="pt")
        alone = sum(float(default_loss(model, collate([r]))[0]) for r in rows)
        tok.padding_side = "left"
        batch = DataCollatorForSeq2Seq(tok, model=model, return_tensors="pt")(rows)
        assert batch["labels"][1, 0] == -100  # left-padded
        assert float(default_loss(model, batch)[0]) != pytest.approx(alone, rel=1e-5)  # why
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    for collator, given in [
        (DataCollatorForSeq2Seq(tok, model=model, return_tensors="pt"), None),
        (DataCollatorForSeq2Seq(tok, return_tensors="pt"), state),  # the state's model
    ]:
        with pytest.raises(ValueError, match=r"pads the labels on the left .* encoder-decoder"):
            ft.make_batches(rows, given, batch_size=2, collate_fn=collator, shuffle=False)
    causal = ft.TrainState.create(tiny_llama(), ft.optim.adamw(), seed=0)
    lm_rows = [{"input_ids": r["input_ids"], "labels": r["input_ids"]} for r in rows]
    groups = ft.make_batches(lm_rows, causal, batch_size=2, collate_fn=DataCollatorForSeq2Seq(tok))
    assert next(iter(groups))[0]["labels"][1, 0] == -100  # a causal LM's left padding is fine


def test_predict_and_generate_check_their_arguments_as_evaluate_does():
    # A single tensor passed as `batches` was iterated row by row: predict yielded one output
    # per row, each row's features read as its samples; gather="no" (truthy) gathered.
    model = torch.nn.Linear(4, 3)
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    batch = {"x": torch.randn(2, 4), "labels": torch.tensor([0, 1])}

    def out(m, b):
        return {"p": m(b["x"] if isinstance(b, dict) else b)}

    for bad in (torch.randn(3, 4), batch):
        with pytest.raises(TypeError, match="batches must be an iterable of batches"):
            list(ft.predict(state, bad, out))
        with pytest.raises(TypeError, match="batches must be an iterable of batches"):
            ft.evaluate(state, bad, lambda m, b: (m(b).sum(), torch.tensor(1)))
        with pytest.raises(TypeError, match="batches must be an iterable of batches"):
            list(ft.generate(state, bad))
    with pytest.raises(TypeError, match="gather must be True or False, got 'no'"):
        list(ft.predict(state, [batch], out, gather="no"))
    with pytest.raises(TypeError, match="gather must be True or False, got 'no'"):
        list(ft.generate(state, [batch], gather="no"))
    with pytest.raises(TypeError, match="output_fn must be a function"):
        list(ft.predict(state, [batch], "logits"))
    with pytest.raises(TypeError, match=r"state must be an ft\.TrainState"):
        list(ft.predict(model, [batch], out))


def test_neftune_twice_on_one_model_is_refused():
    # A second call (a notebook cell run again, a resume path that calls it as well) added a
    # second hook: two draws of noise, sqrt(2) times the alpha asked for, without a word.
    from helpers import tiny_llama

    model = tiny_llama()
    handle = ft.sft.neftune(model, 5.0)
    with pytest.raises(ValueError, match=r"neftune: .* already has NEFTune noise"):
        ft.sft.neftune(model, 5.0)
    handle.remove()
    ft.sft.neftune(model, 1.0).remove()  # removed, it may be added again


def test_predict_and_generate_run_each_batch_in_eval_mode_whatever_the_loop_body_did():
    # A training step inside the loop over predict (accumulate_grads puts the model in training
    # mode) left the next batches' forward with dropout on: other outputs, without a word.
    import numpy as np

    from helpers import tiny_llama

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    state = ft.TrainState.create(model, ft.optim.sgd(), seed=0)
    x = torch.randn(4, 4)
    batches = [{"x": x}, {"x": x}]

    def out(m, b):
        return {"y": m(b["x"])}

    with torch.no_grad():
        want = model[0](x).numpy()
    it = ft.predict(state, batches, out)
    first = next(it)
    model.train()  # what accumulate_grads does in the loop body
    second = next(it)
    np.testing.assert_allclose(first["y"], want, rtol=1e-6)
    np.testing.assert_allclose(second["y"], want, rtol=1e-6)

    llama = tiny_llama(dropout=0.5)
    state = ft.TrainState.create(llama, ft.optim.sgd(), seed=0)
    prompt = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    alone = next(iter(ft.generate(state, [prompt], max_new_tokens=4, pad_token_id=0)))
    it = ft.generate(state, [prompt] * 3, max_new_tokens=4, pad_token_id=0)
    assert next(it) == alone
    for _ in range(2):
        llama.train()
        assert next(it) == alone


def test_generate_leaves_a_decoder_prompt_out_of_the_new_tokens():
    # decoder_input_ids=... (a decoder prompt: forced language or task tokens) came back as
    # generated tokens: only the decoder start token was cut.
    state = ft.TrainState.create(_bart(), ft.optim.adamw(), seed=0)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 2]])}
    prompt = torch.tensor([[2, 9, 9]])  # the start token, then the decoder's prompt
    with torch.no_grad():
        full = state.model.generate(**batch, decoder_input_ids=prompt, max_new_tokens=6)
    new = full[0, 3:].tolist()
    new = new[: new.index(2) + 1] if 2 in new else new  # up to the first eos, as generate ends
    assert _generated(state, batch, decoder_input_ids=prompt) == [new]
    # A prompt without the start token: HF puts it in front, and the prompt's last token was
    # returned as generated (the cut counted the prompt only).
    with torch.no_grad():
        full = state.model.generate(**batch, decoder_input_ids=prompt[:, 1:], max_new_tokens=6)
    assert full[0, :3].tolist() == [2, 9, 9]
    new = full[0, 3:].tolist()
    new = new[: new.index(2) + 1] if 2 in new else new
    assert _generated(state, batch, decoder_input_ids=prompt[:, 1:]) == [new]


def test_generate_takes_a_model_whose_config_outputs_hidden_states():
    """HF copies a model config's output_hidden_states into its generation_config: a model
    built to return hidden states in its training forward could not generate (refused as if
    generate had been asked for them); a keyword asking for them still raises."""
    from helpers import tiny_llama

    model = tiny_llama()
    model.config.output_hidden_states = True
    model.generation_config.output_hidden_states = True
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    batch = {"input_ids": torch.tensor([[5, 6, 7]])}
    out = next(iter(ft.generate(state, [batch], max_new_tokens=2, do_sample=False)))
    assert len(out["token_ids"][0]) <= 2
    with pytest.raises(ValueError, match=r"output_hidden_states=True asks for outputs"):
        next(iter(ft.generate(state, [batch], max_new_tokens=2, output_hidden_states=True)))
