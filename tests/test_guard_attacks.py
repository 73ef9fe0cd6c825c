"""Review of the guard, the chunked loss, SFT, the CLI and ft.testing: each case once gave a
silent wrong result (or took an argument and ignored it); now it is right or it raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ftrain as ft
from ftrain.extras.cli import inspect as cli_inspect
from ftrain.extras.cli import main
from ftrain.grads import Stats
from helpers import tiny_llama

IDS = torch.tensor([[3, 7, 11, 5, 9, 2], [4, 8, 1, 6, 10, 12]])


def _batch(labels=None):
    return {"input_ids": IDS, "labels": IDS.clone() if labels is None else labels}


# --- chunked_causal_lm_loss ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("logits_scaling", 8.0), ("logits_soft_cap", 30.0), ("lm_head_multiplier", 0.5)],
)
def test_chunked_loss_refuses_configs_that_change_the_logits_after_the_head(field, value):
    # Granite divides its logits by logits_scaling, RecurrentGemma softcaps with
    # logits_soft_cap, Falcon-H1 multiplies by lm_head_multiplier: the chunks left them out
    # (Granite with logits_scaling=8: 39.0992 against the model's own 39.1142).
    model = tiny_llama()
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=rf"config sets {field}={value!r}"):
        ft.chunked_causal_lm_loss(chunk_size=4)(model, _batch())


def test_chunked_loss_refuses_a_real_granite_and_an_encoder_decoder():
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        GraniteConfig,
        GraniteForCausalLM,
    )

    granite = GraniteForCausalLM(
        GraniteConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, logits_scaling=8.0)
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"logits_scaling=8\.0"):
        ft.chunked_causal_lm_loss()(granite, _batch())
    # BART's labels are not shifted: the chunks scored each position against the next label
    # (38.73 over 10 items, where its own loss is 46.66 over 12).
    bart = BartForConditionalGeneration(
        BartConfig(vocab_size=61, d_model=16, encoder_layers=1, decoder_layers=1,
                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                   decoder_ffn_dim=32)
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"shifts the labels .* seq2seq_loss"):
        ft.chunked_causal_lm_loss()(bart, _batch())


def test_chunked_loss_refuses_labels_that_do_not_match_the_tokens():
    # Labels longer than the tokens: the plain loss raises a size mismatch; the chunks paired
    # hidden row i with label i across rows and summed 12 "items" for 8 predictions.
    labels = torch.cat([IDS, IDS[:, :2]], dim=1)
    with pytest.raises(RuntimeError):
        ft.losses.causal_lm_loss()(tiny_llama(), _batch(labels))
    with pytest.raises(ValueError, match=r"labels' shape \(2, 8\) differs .* \(2, 6\)"):
        ft.chunked_causal_lm_loss(chunk_size=5)(tiny_llama(), _batch(labels))


def test_chunked_loss_refuses_a_head_that_is_not_a_plain_linear():
    import peft

    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_llama(), lora)
    head = model.base_model.model.lm_head
    # head= given: the adapter was skipped (32.96 against the model's own 32.06).
    with pytest.raises(TypeError, match=r"head must be a plain nn.Linear.*lora"):
        ft.chunked_causal_lm_loss(head=head)
    with pytest.raises(TypeError, match=r"output embeddings must be a plain nn.Linear.*lora"):
        ft.chunked_causal_lm_loss()(model, _batch())

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2.0

    with pytest.raises(TypeError, match=r"head must be a plain nn.Linear.*Scaled"):
        ft.chunked_causal_lm_loss(head=Scaled(16, 61))
    # A plain head passed explicitly still runs, and equals the plain loss.
    model = tiny_llama().eval()
    got = ft.chunked_causal_lm_loss(chunk_size=4, head=model.lm_head)(model, _batch())
    want = ft.losses.causal_lm_loss()(model, _batch())
    torch.testing.assert_close(got[0], want[0])


# --- SFT -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    texts = ["the cat sat on the mat", "a dog ran in the park", "hello world, how are you"]
    return ft.sft.train_tokenizer(texts * 20, vocab_size=300)


def test_sft_collator_pads_packed_rows_without_an_attention_mask(tok):
    # With an attention mask of ones, HF models ignore the restarting position_ids and the
    # packed examples attended to each other (113.9737 against 113.9852 apart).
    collate = ft.sft.SFTCollator(tok, source_max_len=16, target_max_len=16)
    rows = [{"input": "the cat", "output": "sat on the mat"},
            {"input": "a dog", "output": "ran in the park"},
            {"input": "hello", "output": "world, how are you"}]  # fmt: skip
    packed = ft.data.pack_examples(collate.encode_batch(rows), max_length=20)
    assert len(packed) == 2
    got, want = collate(packed), ft.sft.packed_collate(pad_id=tok.pad_token_id)(packed)
    assert got.keys() == want.keys() and "attention_mask" not in got
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # Unpacked rows keep their mask.
    assert "attention_mask" in collate(rows)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(train_on_source="no"), "train_on_source must be True or False"),  # was: trained on it
        (dict(add_eos="False"), "add_eos must be True or False"),  # was: EOS added
        (dict(add_bos=0), "add_bos must be True or False"),
        (dict(source_max_len=True), "source_max_len must be an int >= 1, got True"),  # was: 1
        (dict(target_max_len=2.5), "target_max_len must be an int >= 1, got 2.5"),
        (dict(pad_to_multiple_of=True), "pad_to_multiple_of must be None or an int >= 1"),
    ],
)
def test_sft_collator_refuses_flags_and_lengths_of_the_wrong_type(tok, kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ft.sft.SFTCollator(tok, **kw)


def test_neftune_refuses_an_alpha_that_is_not_a_finite_number():
    emb = torch.zeros(1, 4, 8)
    for alpha in (True, float("nan"), -1.0):
        with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
            ft.sft.neftune_noise(emb, alpha)
        with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
            ft.sft.neftune(tiny_llama(), alpha)


# --- the guard -----------------------------------------------------------------------------------


def _stats(loss, items):
    t = torch.tensor
    return Stats(loss=t(loss), num_items=t(items), num_tokens=t(8), num_samples=t(2), num_micro=1)


def test_a_step_without_items_is_not_a_nonfinite_loss():
    # Every label -100 (a completion-only batch whose responses were masked): the mean is NaN
    # by contract and clip_and_step skips it. Three of them in a row rolled back to the last
    # checkpoint as "3 non-finite losses in a row".
    guard = ft.guard.SpikeGuard(warmup=2, max_nonfinite=3)
    state = ft.guard.GuardedState.create(nn.Linear(2, 1), ft.optim.sgd())
    for loss in (2.0, 2.1, 1.9):
        state, _ = guard.observe(state, _stats(loss, 10))
    memory = (state.loss_avg, state.loss_var, state.loss_count)
    for _ in range(5):
        state, verdict = guard.observe(state, _stats(float("nan"), 0))
        assert not verdict.rollback and "no items" in verdict.reason
    assert (state.loss_avg, state.loss_var, state.loss_count, state.nonfinite_run) == (*memory, 0)
    for _ in range(3):  # a NaN over real items still counts
        state, verdict = guard.observe(state, _stats(float("nan"), 10))
    assert verdict.rollback and verdict.reason == "3 non-finite losses in a row"


@pytest.mark.parametrize("bad", [float("inf"), "3", True])
def test_the_guard_refuses_a_factor_that_is_not_a_finite_number(bad):
    with pytest.raises(ValueError, match=r"SpikeGuard factor must be a finite number > 1"):
        ft.guard.SpikeGuard(factor=bad)
    with pytest.raises(ValueError, match=r"SpikeGuard beta must be a number in \[0, 1\)"):
        ft.guard.SpikeGuard(beta=bad)


# --- ft.testing ----------------------------------------------------------------------------------


def test_no_host_sync_flags_tolist_and_numpy_of_a_value():
    # On a GPU each of these waits for the device; on the CPU machine they dispatched no op
    # and passed, unlike .item().
    import numpy as np

    w = torch.ones(3, requires_grad=True)
    flagged = r"(?s)1 host-device sync.*Tensor\.(tolist|numpy|__array__)"
    for read in (lambda t: t.tolist(), lambda t: t.numpy(), np.asarray):
        with pytest.raises(AssertionError, match=flagged):
            ft.testing.assert_no_host_sync(read, (w * 2).sum().detach())
    # The data path holds host tensors only (its epoch order is a CPU randperm): not flagged.
    rows = [{"x": torch.randn(2)} for _ in range(8)]
    ft.testing.assert_no_host_sync(lambda: list(ft.make_batches(rows, batch_size=2, seed=1)))


def test_assert_pure_sees_into_grads_micro_batches_and_batch_encodings():
    from transformers import BatchEncoding

    from ftrain.data import MicroBatches
    from ftrain.grads import Grads

    def halve_in_place(container):
        batches = container if isinstance(container, MicroBatches) else [container]
        for b in batches:
            for t in b.values():
                t.mul_(0.5)

    for arg in (
        Grads({"w": torch.ones(2)}),
        MicroBatches(({"x": torch.ones(2)},)),
        BatchEncoding({"input_ids": torch.ones(2)}),
    ):
        with pytest.raises(AssertionError, match=r"changed an input .*argument 0/0"):
            ft.testing.assert_pure(halve_in_place, arg)


def test_assert_pure_catches_a_loss_that_edits_a_micro_batch_through_accumulate_grads():
    def normalising_loss(model, batch):
        batch["x"].sub_(batch["x"].mean())  # the broken line
        return (model(batch["x"]).squeeze(-1) - batch["y"]).pow(2).sum(), len(batch["y"])

    state = ft.TrainState.create(nn.Linear(3, 1), ft.optim.sgd())
    rows = [{"x": torch.randn(3), "y": float(i)} for i in range(4)]
    micro = next(ft.make_batches(rows, batch_size=2, accum=2, shuffle=False))
    with pytest.raises(AssertionError, match=r"accumulate_grads changed an input.*argument 1/"):
        ft.testing.assert_pure(ft.accumulate_grads, state, micro, normalising_loss)


# --- the command line ----------------------------------------------------------------------------


def test_inspect_refuses_ranking_flags_on_a_single_checkpoint(tmp_path, capsys):
    state = ft.TrainState.create(nn.Linear(2, 1), ft.optim.sgd())
    path = ft.save_checkpoint(state, tmp_path, metrics={"eval_loss": 1.0, "eval_accuracy": 0.5})
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(path), "--metric", "eval_accuracy", "--mode", "max"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "metric='eval_accuracy' and mode='max' rank the checkpoints of a run folder" in err
    assert main(["inspect", str(path)]) == 0
    assert main(["inspect", str(tmp_path), "--metric", "eval_accuracy", "--mode", "max"]) == 0
    with pytest.raises(ValueError, match="mode='max' rank the checkpoints"):
        cli_inspect(path, mode="max")


def test_inspect_refuses_mode_max_without_a_metric(tmp_path, capsys):
    # Without --metric a run folder's best is ranked by eval_loss: --mode max marked the
    # checkpoint with the highest loss "best eval_loss", as plot --mode max did.
    state = ft.TrainState.create(nn.Linear(2, 1), ft.optim.sgd())
    ft.save_checkpoint(state, tmp_path, metrics={"eval_loss": 1.0})
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(tmp_path), "--mode", "max"])
    assert exit_.value.code == 2
    assert "mode='max' without a metric ranks eval_loss" in capsys.readouterr().err
    with pytest.raises(ValueError, match="mode='max' without a metric ranks eval_loss"):
        cli_inspect(tmp_path, mode="max")
    assert main(["inspect", str(tmp_path), "--metric", "eval_loss", "--mode", "max"]) == 0


def test_export_refuses_config_with_base(tmp_path, capsys):
    # The model is loaded from --base with the base's own config: --config was ignored, even
    # one that does not exist.
    argv = ["export", str(tmp_path / "step-0"), "--to", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--config", str(tmp_path / "nowhere.json"), "--base", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--config would be ignored" in capsys.readouterr().err


def test_plot_refuses_mode_max_without_metrics(tmp_path, capsys):
    # Without --metrics the marked best step is eval_loss's: --mode max marked its highest.
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 2.0, "eval_loss": 1.0}\n{"step": 2, "eval_loss": 3.0}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(log), "-o", str(tmp_path / "x.png"), "--mode", "max"])
    assert exit_.value.code == 2
    assert "plot --mode max ranks the first of --metrics" in capsys.readouterr().err


def test_export_checkpoint_refuses_config_with_base(tmp_path):
    """The Python call behind the CLI: with base the model is the base's, config was ignored."""
    from ftrain.extras.hf_export import export_checkpoint

    with pytest.raises(ValueError, match="takes config or base, not both"):
        export_checkpoint(tmp_path / "step-0", tmp_path / "out", config=tmp_path, base=tmp_path)


def test_allow_other_base_without_base_is_refused_not_ignored(tmp_path, capsys):
    # The model is built from the checkpoint's config without --base: the flag acted on nothing.
    from ftrain.extras.hf_export import export_checkpoint

    argv = ["export", str(tmp_path / "step-0"), "--to", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--allow-other-base"])
    assert exit_.value.code == 2
    assert "--allow-other-base without --base" in capsys.readouterr().err
    with pytest.raises(ValueError, match="allow_other_base=True without base"):
        export_checkpoint(tmp_path / "step-0", tmp_path / "out", allow_other_base=True)


def test_rollback_onto_another_base_on_purpose_passes_allow_other_base(tmp_path):
    """A run moved onto another base model on purpose (`load_checkpoint(...,
    allow_other_base=True)`) rolls back to a checkpoint its first base wrote when the rollback
    is told so too; without it the refusal names the way out (it had none: the guard's load
    took no such argument)."""

    def model(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
        m[0].requires_grad_(False)  # the frozen base
        return m

    state = ft.guard.GuardedState.create(model(0), ft.optim.adamw())
    ft.save_checkpoint(state, tmp_path)  # step 0, on base A
    template = ft.guard.GuardedState.create(model(1), ft.optim.adamw())  # base B
    state = ft.load_checkpoint(ft.latest_checkpoint(tmp_path), template, allow_other_base=True)
    guard = ft.guard.SpikeGuard()
    with pytest.raises(ft.checkpoint.CheckpointMismatchError, match="allow_other_base=True"):
        guard.rollback(state, tmp_path, skip=1)
    state = guard.rollback(state, tmp_path, skip=1, allow_other_base=True)
    assert (state.step, state.rollbacks, state.data.cursor) == (0, 1, 1)
