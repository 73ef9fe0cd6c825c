"""SFT data: qlora.py's collator semantics, formatters, packing boundaries, on an offline BPE."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

import ftrain as ft
from ftrain.data import pack_examples as pack
from ftrain.extras.sft import SFTCollator, TruncationCounts, TruncationWarning, packed_collate

TEXT = Path(__file__).parent.parent / "examples" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def tok():
    text = TEXT.read_text(encoding="utf-8")[:200_000]
    return ft.sft.train_tokenizer(text.split("\n\n"), vocab_size=400)


ROWS = [
    {"input": "First Citizen:\nBefore we proceed", "output": " any further, hear me speak."},
    {"input": "All:", "output": " Speak, speak."},
    {"input": "You are all resolved rather to die than to famish? " * 3, "output": " Resolved."},
    {"input": "Citizen:", "output": " We know't, we know't. " * 6},
]


def qlora_collate(tokenizer, rows, source_max_len, target_max_len, train_on_source):
    """qlora.py's DataCollatorForCausalLM.__call__ (training branch), transcribed."""
    sources = [f"{tokenizer.bos_token}{r['input']}" for r in rows]
    targets = [f"{r['output']}{tokenizer.eos_token}" for r in rows]
    src = tokenizer(sources, max_length=source_max_len, truncation=True, add_special_tokens=False)
    tgt = tokenizer(targets, max_length=target_max_len, truncation=True, add_special_tokens=False)
    input_ids, labels = [], []
    for s, t in zip(src["input_ids"], tgt["input_ids"], strict=True):
        input_ids.append(torch.tensor(s + t))
        if not train_on_source:
            labels.append(torch.tensor([-100 for _ in range(len(s))] + copy.deepcopy(t)))
        else:
            labels.append(torch.tensor(copy.deepcopy(s + t)))
    input_ids = pad_sequence(input_ids, batch_first=True, padding_value=tokenizer.pad_token_id)
    labels = pad_sequence(labels, batch_first=True, padding_value=-100)
    return {
        "input_ids": input_ids,
        "attention_mask": input_ids.ne(tokenizer.pad_token_id),
        "labels": labels,
    }


@pytest.mark.parametrize("train_on_source", [False, True])
@pytest.mark.parametrize(("source_max_len", "target_max_len"), [(1024, 256), (12, 6), (3, 2)])
def test_collator_equals_qlora(tok, train_on_source, source_max_len, target_max_len):
    collator = SFTCollator(tok, source_max_len, target_max_len, train_on_source=train_on_source)
    with warnings.catch_warnings():  # the cutting limits warn; test_truncation_* checks that
        warnings.simplefilter("ignore", TruncationWarning)
        ours = collator(ROWS)
    ref = qlora_collate(tok, ROWS, source_max_len, target_max_len, train_on_source)
    assert torch.equal(ours["input_ids"], ref["input_ids"])
    assert torch.equal(ours["labels"], ref["labels"])
    assert torch.equal(ours["attention_mask"].bool(), ref["attention_mask"])


def test_masking_and_truncation_boundaries(tok):
    c = SFTCollator(tok, source_max_len=5, target_max_len=4)
    with pytest.warns(TruncationWarning, match="1 of 1 prompts"):
        row = c.encode(
            {"input": "First Citizen: Before we proceed", "output": " Speak, speak. " * 4}
        )
    ids, labels = row["input_ids"], row["labels"]
    assert ids[0] == tok.bos_token_id and len(ids) == 5 + 4
    assert labels[:5] == [-100] * 5 and labels[5:] == ids[5:]
    assert tok.eos_token_id not in ids  # the response was cut: its EOS went with it (qlora.py)
    short = c.encode({"input": "All:", "output": " Yes"})
    assert short["input_ids"][-1] == tok.eos_token_id and short["labels"][-1] == tok.eos_token_id
    assert len([x for x in short["labels"] if x != -100]) == len(tok(" Yes")["input_ids"]) + 1
    # Pre-encoded rows pass through the collator unchanged; the mask follows the real lengths
    # even when the pad token is also EOS.
    batch = c([row, short])
    assert batch["attention_mask"].sum(1).tolist() == [len(ids), len(short["input_ids"])]
    tok_pad_is_eos = copy.deepcopy(tok)
    tok_pad_is_eos.pad_token = tok.eos_token
    with pytest.warns(TruncationWarning):
        b = SFTCollator(tok_pad_is_eos, 5, 4)([{"input": "All:", "output": " Yes"}, ROWS[0]])
    assert int(b["attention_mask"][0].sum()) == len(short["input_ids"])  # EOS is not padding


def test_truncation_is_counted_and_warned_once(tok):
    # The case: a template longer than source_max_len keeps the template and drops the
    # instruction and input, for every row.
    rows = [ft.sft.alpaca({"instruction": f"Say {i}.", "output": str(i)}) for i in range(30)]
    c = SFTCollator(tok, source_max_len=8, target_max_len=256)
    with pytest.warns(TruncationWarning, match=r"30 of 30 prompts .*source_max_len=8") as rec:
        c.encode_batch(rows)
    assert len(rec) == 1 and "0 of 30 responses" in str(rec[0].message)
    assert c.truncated == TruncationCounts(rows=30, prompts=30, responses=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per collator: a second cut batch is counted only
        c([*rows[:4], {"input": "All:", "output": " Speak, speak. " * 99}])
    assert c.truncated == TruncationCounts(rows=35, prompts=34, responses=1)
    fits = SFTCollator(tok, source_max_len=1024, target_max_len=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fits(ROWS)
    assert fits.truncated == TruncationCounts(rows=len(ROWS), prompts=0, responses=0)
    cut = SFTCollator(tok, source_max_len=1024, target_max_len=2)
    with pytest.warns(TruncationWarning, match=rf"{len(ROWS)} of {len(ROWS)} responses"):
        cut(ROWS)
    assert cut.truncated.responses == len(ROWS) and SFTCollator(tok) == SFTCollator(tok)


def test_pack_examples_warns_when_it_cuts():
    rows = [{"input_ids": [1] * n, "labels": [1] * n} for n in (3, 9, 4, 7)]
    with pytest.warns(UserWarning, match=r"cut 2 of 4 examples longer than max_length=5"):
        packed = pack(rows, max_length=5)
    assert [len(r["input_ids"]) for r in packed] == [3, 5, 4, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack(rows, max_length=9)


def test_collator_errors(tok):
    with pytest.raises(ValueError, match="source_max_len"):
        SFTCollator(tok, source_max_len=0)
    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="pad token"):
        SFTCollator(no_pad)
    with pytest.raises(KeyError, match="input"):
        SFTCollator(tok)([{"prompt": "x", "output": "y"}])


def test_formatters(tok):
    row = ft.sft.alpaca({"instruction": "Name a play.", "input": "", "output": "Hamlet"})
    assert row["input"].endswith("### Instruction:\nName a play.\n\n### Response: ")
    assert "### Input" not in row["input"] and row["output"] == "Hamlet"
    row = ft.sft.alpaca({"instruction": "Translate.", "input": "Bonjour", "output": "Hello"})
    assert "### Input:\nBonjour\n\n### Response: " in row["input"]
    assert row["input"].startswith("Below is an instruction that describes a task, paired with")
    assert ft.sft.input_output({"input": "a", "output": "b", "extra": 1}) == {
        "input": "a",
        "output": "b",
    }
    fmt = ft.sft.chat(tok)
    messages = [
        {"role": "user", "content": "Who speaks first?"},
        {"role": "assistant", "content": "A citizen."},
    ]
    row = fmt({"messages": messages})
    assert row == {"input": "<|user|>Who speaks first?\n<|assistant|>", "output": "A citizen."}
    with pytest.raises(ValueError, match="assistant"):
        fmt({"messages": messages[:1]})


def test_pack_boundaries(tok):
    c = SFTCollator(tok, source_max_len=64, target_max_len=64)
    with pytest.warns(TruncationWarning, match="3 of 12 prompts"):
        rows = c.encode_batch(ROWS * 3)
    with pytest.warns(UserWarning, match="pack_examples cut 6 of 12 examples"):
        packed = pack(rows, max_length=56)
    # Every token kept, in order, no example split across packed rows, none over max_length.
    assert [t for p in packed for t in p["input_ids"]] == [
        t for r in rows for t in r["input_ids"][:56]
    ]
    i = 0
    for p in packed:
        assert len(p["input_ids"]) <= 56
        starts = [k for k, pos in enumerate(p["position_ids"]) if pos == 0]
        for a, b in zip(starts, [*starts[1:], len(p["input_ids"])], strict=True):
            r = rows[i]
            n = min(len(r["input_ids"]), 56)
            assert p["input_ids"][a:b] == r["input_ids"][:n]
            assert p["labels"][a:b] == [-100, *r["labels"][1:n]]  # no cross-example target
            assert p["position_ids"][a:b] == list(range(n))
            i += 1
    assert i == len(rows)
    assert len(packed) < len(rows)


def test_packed_rows_train_like_separate_examples(tok):
    """Packed without an attention_mask, an HF Llama attends within each example only: the
    summed loss of a packed batch equals the sum over the examples run one by one."""
    from helpers import tiny_llama

    model = tiny_llama()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.config.use_cache = False  # HF detects packed rows only without a KV cache
    model.eval()
    with pytest.warns(TruncationWarning):
        rows = SFTCollator(tok, 64, 64).encode_batch(ROWS)
    batch = packed_collate(tok.pad_token_id)(pack(rows, max_length=80))
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] >= 2
    loss_fn = ft.losses.causal_lm_loss()
    with torch.no_grad():
        packed_sum, packed_n = loss_fn(model, batch)
        alone = [loss_fn(model, SFTCollator(tok, 64, 64)([r])) for r in rows]
    assert int(packed_n) == sum(int(n) for _, n in alone)
    torch.testing.assert_close(packed_sum, sum(s for s, _ in alone), rtol=1e-5, atol=1e-5)
    # Without position_ids the examples would see each other, and the loss would differ.
    with torch.no_grad():
        leaky, _ = loss_fn(model, {k: v for k, v in batch.items() if k != "position_ids"})
    assert abs(float(leaky - packed_sum)) > 1e-2


def test_the_default_collate_refuses_packed_rows(tok):
    """make_batches' default collate made an attention mask for packed rows, and the HF model
    then ignored the example boundaries in position_ids: they attended to each other."""
    with pytest.warns(TruncationWarning):
        rows = SFTCollator(tok, 64, 64).encode_batch(ROWS)
    packed = pack(rows, max_length=80)
    with pytest.raises(ValueError, match=r"row 0 holds packed examples.*packed_collate"):
        ft.data.pad_collate(pad_id=tok.pad_token_id)(packed)
    with pytest.raises(ValueError, match="packed examples"):
        next(ft.make_batches(packed, batch_size=2, accum=1, seed=0))
    batch = ft.data.pad_collate(pad_id=tok.pad_token_id, attention_mask=False)(packed)
    assert "attention_mask" not in batch
    one = [{"input_ids": [5, 6, 7], "position_ids": [0, 1, 2]}]  # one example: a mask is fine
    assert ft.data.pad_collate()(one)["attention_mask"].tolist() == [[1, 1, 1]]


def test_neftune_equals_hf_hook_and_only_in_training():
    from transformers.integrations.neftune import neftune_post_forward_hook

    emb = torch.nn.Embedding(50, 8)
    ids = torch.randint(0, 50, (3, 7))
    out = emb(ids)
    torch.manual_seed(4)
    ours = ft.sft.neftune_noise(out, 5.0)
    emb.neftune_noise_alpha = 5.0
    torch.manual_seed(4)
    theirs = neftune_post_forward_hook(emb, (ids,), out)
    assert torch.equal(ours, theirs)
    bound = 5.0 / (7 * 8) ** 0.5
    assert 0 < float((ours - out).abs().max().detach()) <= bound
    with pytest.raises(ValueError):
        ft.sft.neftune_noise(out, -1.0)


def test_neftune_hook_in_the_loop_is_seeded_and_removable():
    from helpers import ragged_rows, tiny_llama

    rows = ragged_rows(8, seed=2)
    micro = next(iter(ft.make_batches(rows, batch_size=4, accum=2, shuffle=False)))

    def grads_of(alpha):
        state = ft.TrainState.create(tiny_llama(), ft.optim.sgd(), seed=7)
        handle = ft.sft.neftune(state.model, alpha) if alpha else None
        grads, _ = ft.accumulate_grads(state, micro)
        out = {n: g.clone() for n, g in grads.items()}
        if handle is not None:  # eval mode: no noise, whatever the hook
            state.model.eval()
            with torch.no_grad():
                ids = micro[0]["input_ids"]
                noisy = state.model.get_input_embeddings()(ids)
            handle.remove()
            assert torch.equal(noisy, state.model.get_input_embeddings()(ids))
        return out

    plain, a, b = grads_of(0.0), grads_of(5.0), grads_of(5.0)
    for n in plain:
        assert torch.equal(a[n], b[n])  # the noise follows the per-micro-batch seed
    assert any(not torch.equal(a[n], plain[n]) for n in plain)


def test_neftune_of_alpha_0_adds_no_noise_and_post_training_takes_the_model():
    """`neftune(model, alpha=0.0)` (a config's `neftune_alpha: 0`) adds no noise, but
    preference_loss refused the policy as one that does."""

    class Lm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)

        def get_input_embeddings(self):
            return self.embed

        def forward(self, input_ids, attention_mask=None):
            return self.head(self.embed(input_ids))

    ids = torch.tensor([[1, 2, 3]])
    batch = {f"{side}_{k}": v for side in ("chosen", "rejected") for k, v in (
        ("input_ids", ids), ("labels", ids), ("attention_mask", torch.ones_like(ids)))}  # fmt: skip
    torch.manual_seed(0)
    model, reference = Lm(), Lm().eval().requires_grad_(False)
    loss_fn = ft.preference.preference_loss(ft.preference.dpo_loss, reference=reference)
    handle = ft.sft.neftune(model, alpha=0.0)
    loss_fn(model, batch)
    assert ft.sft.neftune_sites(model) == []
    assert torch.equal(model.embed(ids), model.embed.weight[ids])
    handle.remove()
    ft.sft.neftune(model, alpha=5.0)
    assert ft.sft.neftune_sites(model) == ["embed"]
    loss_fn = ft.preference.preference_loss(ft.preference.dpo_loss, reference=reference)
    with pytest.raises(ValueError, match="adds NEFTune noise to its input embeddings"):
        loss_fn(model, batch)  # a new loss_fn: each checks a policy once


def test_a_response_that_already_ends_with_eos_is_refused_as_a_prompt_with_bos_is(tok):
    """A response text holding the EOS token (`"...</s>"`) got a second EOS appended: the row
    ended with two, and the model was trained to emit EOS after EOS."""
    eos = tok.eos_token
    with pytest.raises(ValueError, match="row 1: the response already ends with EOS"):
        SFTCollator(tok).encode_batch(
            [{"input": "a", "output": "b"}, {"input": "a", "output": "b" + eos}]
        )
    row = SFTCollator(tok, add_eos=False).encode({"input": "a", "output": "b" + eos})
    assert row["input_ids"][-1] == tok.eos_token_id != row["input_ids"][-2]
    with pytest.raises(ValueError, match="row 0: the prompt already starts with BOS"):
        SFTCollator(tok).encode({"input": tok.bos_token + "a", "output": "b"})
