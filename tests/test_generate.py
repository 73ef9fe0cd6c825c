"""ft.generate (equal to HF generate one prompt at a time; gathered over 2 ranks in dataset
order) and qlora.py's multiple-choice scoring against a hand computation."""

from __future__ import annotations

import json
import math

import pytest
import torch

import ftrain as ft
import generate_workers as W
from helpers import tiny_llama, tiny_t5
from launch import run_ranks


def _tokenizer():
    """A word-level tokenizer over the tiny Llama's 61 ids ("w0" is padding), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(61)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", eos_token="w2")


def _one_at_a_time(model, prompts, **kwargs):
    outs = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([p["input_ids"]]), **kwargs)
        outs.append(out[0, len(p["input_ids"]) :].tolist())
    return outs


def test_generate_equals_hf_generate_one_prompt_at_a_time():
    model = W.model()
    prompts = W.PROMPTS
    # An end-of-sequence token that some greedy completions reach early, so that the rows of a
    # batch end at different lengths (HF pads the finished ones; one prompt alone stops).
    (probe,) = _one_at_a_time(model, prompts[:1], **W.KWARGS, eos_token_id=None)
    eos = probe[2]
    kwargs = {**W.KWARGS, "eos_token_id": eos, "pad_token_id": 0}
    want = _one_at_a_time(model, prompts, **kwargs)
    assert len({len(w) for w in want}) > 1  # some stop early, some run to max_new_tokens

    tok = _tokenizer()
    state = ft.TrainState.create(model, ft.optim.sgd())
    model.train()
    batches = ft.make_batches(prompts, batch_size=4, shuffle=False)  # right-padded by collate
    out = list(ft.generate(state, batches, tokenizer=tok, **kwargs))
    assert [len(b["token_ids"]) for b in out] == [4, 4, 1]
    assert [ids for b in out for ids in b["token_ids"]] == want
    assert [t for b in out for t in b["text"]] == tok.batch_decode(want, skip_special_tokens=True)
    assert model.training  # its mode is restored


def test_generate_rejects_what_it_cannot_honour():
    state = ft.TrainState.create(torch.nn.Linear(2, 2), ft.optim.sgd())
    with pytest.raises(TypeError, match=r"needs a model with \.generate"):
        next(ft.generate(state, []))
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    with pytest.raises(TypeError, match=r"not from \['input_ids'\]"):
        next(ft.generate(state, [], input_ids=torch.ones(1, 1, dtype=torch.long)))
    state.model.generation_config.pad_token_id = None
    with pytest.raises(ValueError, match="pad token id"):
        next(ft.generate(state, []))


def test_left_pad_keeps_tokens_in_order():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0], [4, 0, 0]])
    mask = (ids != 0).long()
    left, lmask = ft.generation.left_pad(ids, mask, pad_id=0)
    assert left.tolist() == [[5, 6, 7], [0, 8, 9], [0, 0, 4]]
    assert lmask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]


def _spawn_bounded(fn, *args, timeout=150):
    """2 spawned ranks; killed (and the test failed) past `timeout` seconds, never hanging."""
    run_ranks(fn, *args, timeout=timeout)


@pytest.mark.slow
def test_generate_gathers_every_ranks_rows_in_dataset_order_under_ddp_and_fsdp(tmp_path):
    """9 prompts at 2 per rank under DDP and FSDP (lockstep generation): every rank yields all
    9 completions, in the order one process generates them, each rank's own share disjoint."""
    _spawn_bounded(W.gather, str(tmp_path))
    model = W.model()
    want = _one_at_a_time(model, W.PROMPTS, **W.KWARGS, pad_token_id=0)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"generate-{rank}.json").read_text())
        for kind in ("ddp", "fsdp"):
            assert [len(b) for b in got[kind]] == [4, 4, 1]
            assert [ids for b in got[kind] for ids in b] == want, kind
            # This rank's own rows: rank 0 has rows 0-1, 4-5, 8; rank 1 rows 2-3, 6-7.
            mine = [i for i in range(9) if (i // 2) % 2 == rank]
            assert [ids for b in got[f"{kind}-local"] for ids in b] == [want[i] for i in mine]


# --- multiple-choice scoring (qlora.py's MMLU evaluation) ---

CHOICES = [11, 12, 13, 14]  # the tokens of "A", "B", "C", "D"
SUBJECTS = ["law", "art", "math"]


def _mc_rows(n=10, seed=0):
    """Prompt tokens (labels -100), then the answer letter and an end token as labels."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(20, 61) for _ in range(rng.randrange(3, 9))]
        answer = rng.choice(CHOICES)
        ids = [*prompt, answer, 2]
        rows.append({"input_ids": ids, "labels": [-100] * len(prompt) + [answer, 2],
                     "subject": [0, 0, 1, 2, 2][i % 5]})  # fmt: skip
    return rows


def test_multiple_choice_metrics_match_a_hand_computation_of_qloras_scoring():
    model = tiny_llama(dtype=torch.float64, seed=1)
    rows = _mc_rows()
    # By hand, one row at a time: qlora.py's logit[label_non_zero_id - 1][abcd_idx].
    preds, refs, loss_sum, n_tokens = [], [], 0.0, 0
    for r in rows:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
        first = next(i for i, lab in enumerate(r["labels"]) if lab != -100)
        preds.append(CHOICES[int(logits[first - 1, CHOICES].argmax())])
        refs.append(r["labels"][first])
        for t in range(1, len(r["labels"])):
            if r["labels"][t] != -100:
                loss_sum -= float(torch.log_softmax(logits[t - 1], -1)[r["labels"][t]])
                n_tokens += 1
    per_subject = {}
    for s, name in enumerate(SUBJECTS):
        idx = [i for i, r in enumerate(rows) if r["subject"] == s]
        per_subject[name] = sum(preds[i] == refs[i] for i in idx) / len(idx)

    metrics_fn = ft.multiple_choice_metrics(choice_ids=CHOICES, subjects=[*SUBJECTS, "empty"])
    state = ft.TrainState.create(model, ft.optim.sgd())
    batches = ft.make_batches(rows, batch_size=3, shuffle=False)  # ragged, right-padded
    got = ft.evaluate(state, batches, metrics_fn=metrics_fn)
    for name, acc in per_subject.items():
        assert got[f"eval_accuracy_{name}"] == pytest.approx(acc)
    assert math.isnan(got["eval_accuracy_empty"])  # no rows: left out of the mean
    right = sum(p == r for p, r in zip(preds, refs, strict=True))
    assert got["eval_accuracy"] == pytest.approx(right / 10)
    assert got["eval_loss"] == pytest.approx(loss_sum / n_tokens)
    mean = ft.generation.mean_over_subjects(got)
    assert mean == pytest.approx(sum(per_subject.values()) / 3)


def test_multiple_choice_metrics_reject_bad_choices_and_answers():
    with pytest.raises(ValueError, match="distinct"):
        ft.multiple_choice_metrics(choice_ids=[5, 5])
    rows = _mc_rows(3)
    rows[1]["labels"][-2] = 40  # an answer that is not a choice letter
    state = ft.TrainState.create(tiny_llama(), ft.optim.sgd())
    with pytest.raises(ValueError, match="not one of choice_ids"):
        ft.evaluate(state, ft.make_batches(rows, batch_size=3, shuffle=False),
                    metrics_fn=ft.multiple_choice_metrics(choice_ids=CHOICES))  # fmt: skip
    with pytest.raises(ValueError, match="no per-subject accuracy"):
        ft.generation.mean_over_subjects({"eval_accuracy": 1.0})


def _prompt_batches(prompts, **collate):
    return ft.make_batches(prompts, batch_size=len(prompts), shuffle=False, **collate)


def test_a_decoder_only_models_max_length_is_refused_for_max_new_tokens():
    """max_length counts the left-padded prompt: a short prompt batched beside a long one got
    fewer new tokens than it gets alone (4 instead of 15 here), without a word."""
    from transformers import GenerationConfig

    state = ft.TrainState.create(W.model(), ft.optim.sgd())
    prompts = [{"input_ids": list(range(3, 17))}, {"input_ids": [5, 6, 7]}]
    with pytest.raises(ValueError, match=r"max_length=18 .* pass max_new_tokens=\.\.\. instead"):
        next(ft.generate(state, _prompt_batches(prompts), max_length=18))
    config = GenerationConfig(min_length=18)
    with pytest.raises(ValueError, match=r"min_length=18 .* pass min_new_tokens=\.\.\. instead"):
        next(ft.generate(state, _prompt_batches(prompts), generation_config=config))
    state.model.generation_config.max_length = 18  # a checkpoint's generation_config.json
    with pytest.raises(ValueError, match="max_length=18"):
        next(ft.generate(state, _prompt_batches(prompts)))
    (out,) = ft.generate(state, _prompt_batches(prompts), max_new_tokens=3, eos_token_id=None)
    assert [len(ids) for ids in out["token_ids"]] == [3, 3]  # max_new_tokens wins, as in HF
    t5 = ft.TrainState.create(tiny_t5(), ft.optim.sgd())  # the decoder's length: no padding
    (out,) = ft.generate(t5, _prompt_batches(prompts[1:]), max_length=4, eos_token_id=None)
    assert [len(ids) for ids in out["token_ids"]] == [3]  # without the decoder start token


def test_batches_generation_would_misread_are_refused():
    state = ft.TrainState.create(W.model(), ft.optim.sgd())
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "id": "a"},
            {"input_ids": [9, 10], "labels": [-100, 10], "id": "b"}]  # fmt: skip
    with pytest.raises(ValueError, match="the prompts hold their answers"):
        next(ft.generate(state, _prompt_batches(rows), max_new_tokens=2))
    prompts = [
        {"input_ids": r["input_ids"][:2], "labels": [-100, -100], "id": r["id"]} for r in rows
    ]
    (out,) = ft.generate(state, _prompt_batches(prompts), max_new_tokens=2, eos_token_id=None)
    assert [len(ids) for ids in out["token_ids"]] == [2, 2]  # labels and a text id: ignored
    packed = ft.sft.packed_collate(pad_id=0)(ft.data.pack_examples(prompts, max_length=8))
    with pytest.raises(ValueError, match=r"also holds \['position_ids'\], which its forward"):
        next(ft.generate(state, [packed], max_new_tokens=2))
    with pytest.raises(TypeError, match="dict batches with 'input_ids'"):
        next(ft.generate(state, [torch.ones(2, 3, dtype=torch.long)], max_new_tokens=2))


def test_prompts_holding_the_pad_id_need_their_attention_mask():
    """A padded batch without attention_mask was generated from with a mask of ones: every pad
    token was prompt text (HF infers the mask; ft.generate passed ones), silently."""
    state = ft.TrainState.create(W.model(), ft.optim.sgd())
    kw = dict(max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    for ids, rows in [
        ([[5, 6, 7, 0], [9, 10, 11, 12]], r"\[0\]"),
        ([[5, 6, 7, 8], [0, 5, 6, 7]], r"\[1\]"),
    ]:
        batch = {"input_ids": torch.tensor(ids)}
        with pytest.raises(ValueError, match=rf"pad id 0 \(rows {rows}\) but no attention_mask"):
            next(ft.generate(state, [batch], **kw))
    t5 = ft.TrainState.create(tiny_t5(), ft.optim.sgd())  # the encoder's input: same rule
    with pytest.raises(ValueError, match="but no attention_mask"):
        next(ft.generate(t5, [{"input_ids": torch.tensor([[5, 6, 0]])}], **kw))
    ids = torch.tensor([[5, 6, 7, 8]])
    (plain,) = ft.generate(state, [{"input_ids": ids}], **kw)  # no pad id: no mask needed
    (masked,) = ft.generate(state, _prompt_batches([{"input_ids": [5, 6, 7, 8]}]), **kw)
    assert plain["token_ids"] == masked["token_ids"]
    with pytest.raises(ValueError, match=r"pad id 0 \(rows \[1\]\) but no attention_mask"):
        ft.generation.left_pad(torch.tensor([[1, 2], [3, 0]]), None, pad_id=0)
