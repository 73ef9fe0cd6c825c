"""LoRA through PEFT and QLoRA through bitsandbytes, set up like qlora.py; merged export."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import ftrain as ft
from helpers import ragged_rows, tiny_llama, train_steps

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
ROWS = ragged_rows(24, seed=5)


def _train(state, steps):
    return train_steps(state, ROWS, steps)


def _eval_loss(state):
    return ft.evaluate(state, ft.make_batches(ROWS, batch_size=8, shuffle=False))["eval_loss"]


def test_targets_are_every_linear_layer_but_the_head():
    model = tiny_llama()
    assert ft.lora.find_all_linear_names(model) == LINEAR
    peft_model = ft.lora.apply(model, r=4, alpha=8)
    state = ft.TrainState.create(peft_model, ft.optim.adamw(), seed=0)
    # Only adapters train: A and B of every targeted layer in both blocks.
    assert all("lora_" in n for n in state.params)
    assert len(state.params) == 2 * len(LINEAR) * 2
    adapted = {n.split(".lora_")[0].split(".")[-1] for n in state.params}
    assert adapted == set(LINEAR)
    assert not any("lm_head" in n or "embed" in n for n in state.params)


def test_lora_trains_and_exports_adapter_and_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    tiny_llama().save_pretrained(base_dir)
    model = ft.lora.apply(AutoModelForCausalLM.from_pretrained(base_dir), r=4, alpha=8)
    state = ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.0), seed=0)
    before = _eval_loss(state)
    state = _train(state, 8)
    assert _eval_loss(state) < before - 0.05
    ids = torch.tensor([[3, 17, 42, 9, 11]])
    state.model.eval()
    with torch.no_grad():
        want = state.model(input_ids=ids).logits
    # The adapter alone, loaded on the base with peft ...
    ft.export_pretrained(state, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # ... and merged: a plain model that transformers loads without peft.
    ft.export_pretrained(state, tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
    assert any("lora" in n for n, _ in state.model.named_parameters())  # live model untouched
    # The CLI exports the adapter from a checkpoint alone (the adapter config is in state.json).
    import contextlib
    import io

    from ftrain.extras.cli import main

    ckpt = ft.save_checkpoint(state, tmp_path / "ckpt")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", str(ckpt), "--to", str(tmp_path / "cli")]) == 0
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, tmp_path / "cli").eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="PEFT model"):
        ft.export_pretrained(ft.TrainState.create(tiny_llama(), ft.optim.sgd()), tmp_path / "x",
                             merge=True)  # fmt: skip


def test_qlora_needs_bitsandbytes_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'ftrain\[qlora\]'"):
        ft.lora.load_4bit(tmp_path)


@pytest.mark.skipif(
    not HAS_BNB, reason="bitsandbytes is not installed (pip install 'ftrain[qlora]')"
)
def test_qlora_4bit_base_trains_adapters_and_resumes_exactly(tmp_path):
    """qlora.py on CPU: NF4 base weights (bitsandbytes >= 0.49 quantizes on CPU), adapters on
    every linear layer, gradient checkpointing, 8-bit AdamW through ft.optim.from_torch, clip
    0.3. The checkpoint holds the adapters and the 8-bit optimizer state only, and resuming
    from it reproduces the uninterrupted run."""
    import bitsandbytes as bnb
    from transformers import LlamaConfig, LlamaForCausalLM

    # bitsandbytes' CPU 4-bit kernels want output sizes in multiples of 32.
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    base_dir = tmp_path / "base"
    LlamaForCausalLM(config).save_pretrained(base_dir)

    def fresh():
        model = ft.lora.load_4bit(base_dir, compute_dtype=torch.float32)
        assert ft.lora.is_quantized(model)
        assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
        assert (
            getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
        )
        assert ft.lora.find_all_linear_names(model) == LINEAR
        torch.manual_seed(1)  # LoRA's A matrices start random
        model = ft.lora.apply(model, r=8, alpha=16)
        opt = ft.optim.from_torch(bnb.optim.AdamW8bit, weight_decay=0.0)
        return ft.TrainState.create(model, opt, seed=0)

    state = fresh()
    before = _eval_loss(state)
    full = _train(state, 6)
    assert _eval_loss(full) < before - 0.02
    half = _train(fresh(), 3)
    path = ft.save_checkpoint(half, tmp_path / "ckpt")
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert all("lora_" in k for k in f.keys())  # noqa: SIM118 (safe_open is not a dict)
    with safe_open(str(path / "optimizer.safetensors"), "pt") as f:
        assert any(k.endswith("state1") for k in f.keys())  # noqa: SIM118 (8-bit moments)
    resumed = _train(ft.load_checkpoint(path, fresh()), 6)
    for n, p in full.params.items():
        assert torch.equal(resumed.params[n], p), n
    with pytest.raises(ValueError, match="quantization"):
        ft.export_pretrained(full, tmp_path / "merged", merge=True)


@pytest.mark.skipif(
    not HAS_BNB, reason="bitsandbytes is not installed (pip install 'ftrain[qlora]')"
)
def test_paged_optimizers_fall_back_on_cpu_and_say_so():
    """Paged optimizers page their state to host memory through CUDA unified memory: on a CPU
    there is nothing to page, and bitsandbytes says it runs them unpaged."""
    import bitsandbytes as bnb

    state = ft.TrainState.create(
        ft.lora.apply(tiny_llama(), r=4), ft.optim.from_torch(bnb.optim.PagedAdamW32bit)
    )
    micro = next(iter(ft.make_batches(ROWS, batch_size=4)))
    grads, stats = ft.accumulate_grads(state, micro)
    with pytest.warns(UserWarning, match="Paged optimizers are not supported on CPU"):
        ft.clip_and_step(state, grads, lr=1e-3, stats=stats)


def _classifier(name="llama", seed=0):
    import warnings

    from transformers import (
        BartConfig,
        BartForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    torch.manual_seed(seed)
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on tiny configs
        if name == "bart":  # a head whose layers (dense, out_proj) are LoRA targets by name
            cfg = BartConfig(
                vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                decoder_ffn_dim=32, num_labels=3, max_position_embeddings=32, pad_token_id=1,
                bos_token_id=0, eos_token_id=2, dropout=0.0,
            )  # fmt: skip
            return BartForSequenceClassification(cfg)
        if name == "roberta":  # a head with modules inside it (classifier.dense, .out_proj)
            cfg = RobertaConfig(vocab_size=32, max_position_embeddings=40, num_labels=3, **small)
            return RobertaForSequenceClassification(cfg)
        cfg = LlamaConfig(vocab_size=32, num_labels=3, pad_token_id=0, **small)
        return LlamaForSequenceClassification(cfg)


def _apply_quiet(model, **kwargs):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes inside PEFT
        return ft.lora.apply(model, r=2, alpha=4, **kwargs)


def _logits(model):
    ids = torch.tensor([[3, 4, 5, 2], [7, 8, 9, 2]])  # 2: BART's eos, read by its head
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_modules_to_save_entry_inside_the_head_is_dropped_and_the_adapter_reloads(tmp_path):
    # "classifier.dense" beside the auto-added "classifier" nested one saved copy in another:
    # PeftModel.from_pretrained then failed with PEFT's KeyError on classifier.dense.weight.
    from peft import PeftModel

    model = _apply_quiet(_classifier("roberta"), modules_to_save=["classifier.dense"])
    assert model.peft_config["default"].modules_to_save == ["classifier", "score"]
    with torch.no_grad():
        model.base_model.model.classifier.modules_to_save["default"].dense.weight.add_(1.0)
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(_classifier("roberta"), tmp_path)
    model.eval(), reloaded.eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model))
    # "dense" names the head's dense layer and the backbone's: no single reading keeps both.
    with pytest.raises(ValueError, match=r"modules_to_save entry 'dense' matches \['classifier"):
        _apply_quiet(_classifier("roberta"), modules_to_save=["dense"])


@pytest.mark.parametrize("name, head", [("llama", "score"), ("bart", "classification_head")])
def test_train_head_false_keeps_a_trained_classifiers_head_frozen(name, head, tmp_path):
    # A trained classifier or reward model had its head trained in full, with no way to keep it.
    # BART's head layers (dense, out_proj) are LoRA targets by name: no adapter on them either.
    from peft import PeftModel

    model = _apply_quiet(_classifier(name), train_head=False)
    frozen = {n: p.clone() for n, p in model.named_parameters() if f".{head}." in n}
    state = ft.TrainState.create(model, ft.optim.adamw(), seed=0)
    assert state.params and all("lora_" in n for n in state.params)
    assert not [n for n in state.params if f".{head}." in n]
    rows = [{"input_ids": [3, 4, 5, 2], "labels": i % 3} for i in range(8)]
    for micro in ft.make_batches(rows, batch_size=4, shuffle=False):
        grads, stats = ft.accumulate_grads(state, micro)
        state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-2)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    ft.export_pretrained(state, tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_classifier(name), tmp_path / "adapter")
    model.eval(), reloaded.eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model))


def test_train_head_false_keeps_the_heads_biases_frozen_under_bias_all():
    # bias="all" unfroze every bias, the frozen head's too (BART's dense and out_proj biases).
    model = _apply_quiet(_classifier("bart"), train_head=False, bias="all")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(n.endswith(".bias") for n in trained)
    assert not [n for n in trained if ".classification_head." in n]


def test_train_head_false_is_refused_where_it_cannot_act():
    with pytest.raises(ValueError, match=r"train_head=False, but LlamaForCausalLM has no"):
        ft.lora.apply(tiny_llama(), r=2, train_head=False)
    with pytest.raises(ValueError, match=r"modules_to_save \['score'\] lie in the head"):
        _apply_quiet(_classifier(), train_head=False, modules_to_save=["score"])
    with pytest.raises(TypeError, match=r"train_head must be True or False, got 'no'"):
        _apply_quiet(_classifier(), train_head="no")


def test_a_string_modules_to_save_is_refused_not_read_letter_by_letter():
    # PEFT matched each letter of "lm_head" as a name ending: the whole decoder (`model`, which
    # ends in "l"), its final norm and the head were copied and trained in full.
    with pytest.raises(TypeError, match=r"modules_to_save must be a list of module names, got "
                       r"'lm_head'; e\.g\. modules_to_save=\['lm_head'\]"):  # fmt: skip
        ft.lora.apply(tiny_llama(), r=2, modules_to_save="lm_head")
    with pytest.raises(TypeError, match=r"modules_to_save must be a list of module names, got "):
        _apply_quiet(_classifier(), modules_to_save=[3])


def _tiny_t5_32():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def test_an_adapter_on_t5s_shared_embedding_is_named_as_untrained():
    """transformers 5 gives T5 separate `shared` and `encoder.embed_tokens` modules that share
    one weight; the forward calls the latter, so an adapter on `shared` never got a gradient
    and was never trained, silently. `ft.lora.apply` refuses it (below); one put there by PEFT
    directly is named after NO_GRAD_STEPS steps without one."""
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes inside PEFT
        model = get_peft_model(
            _tiny_t5_32(),
            LoraConfig(r=2, lora_alpha=4, target_modules=["shared", "q"], task_type="SEQ_2_SEQ_LM"),
        )
    state = ft.TrainState.create(model, ft.optim.adamw())
    batch = {"input_ids": torch.randint(1, 32, (2, 5)), "labels": torch.randint(1, 32, (2, 4))}
    from ftrain.grads import NO_GRAD_STEPS

    for _ in range(NO_GRAD_STEPS - 1):
        grads, stats = ft.accumulate_grads(state, [batch])
        state, _ = ft.clip_and_step(state, grads, lr=1e-3, stats=stats)
    with pytest.warns(UserWarning, match=r"'base_model\.model\.shared\.lora_embedding_A\.default'"
                      rf", .* received no gradient in steps 0 to {NO_GRAD_STEPS - 1}"):  # fmt: skip
        grads, _ = ft.accumulate_grads(state, [batch])
    assert not any("shared" in n for n in grads)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"targets": ["shared", "q"]},
        {"targets": r".*\.q|shared"},  # a regular expression, as PEFT fullmatches it
        {"targets": ["q"], "modules_to_save": ["shared"]},  # a trained copy is as dead
    ],
)
def test_an_adapter_on_a_tied_module_the_forward_never_calls_is_refused_at_apply(kwargs):
    """The adapter on T5's `shared` (above) was named only after 32 steps of training it
    silently did not do (or, with no other adapter, by an autograd error naming nothing).
    Its weight is tied to `encoder.embed_tokens`, `decoder.embed_tokens` and `lm_head`, the
    modules the forward calls (HF's accessors say which): apply refuses, naming the module and
    the modules to adapt instead, before any step."""
    with pytest.raises(
        ValueError,
        match=r"on 'shared' \(Embedding\), whose weight T5ForConditionalGeneration's forward uses "
        r"through 'encoder\.embed_tokens', 'decoder\.embed_tokens', 'lm_head' \(tied to it\) "
        r"and never through 'shared' itself: .* no gradient .* adapt the modules the forward "
        r"calls: 'encoder\.embed_tokens', 'decoder\.embed_tokens', 'lm_head'",
    ):
        _apply_quiet(_tiny_t5_32(), **kwargs)


def test_adapters_on_tied_modules_the_forward_calls_train_and_are_not_refused():
    """The modules the forward calls pass, tied or not: T5's `embed_tokens` (both stacks) and
    its `lm_head`, a tied Llama's `lm_head`, BART's `embed_tokens`. Each of their adapters gets
    a gradient on the first step. The transformers 4 layout, where `encoder.embed_tokens` is
    the `shared` module itself (one module under three names), is refused as in 5."""
    import warnings

    from transformers import BartConfig, BartForConditionalGeneration, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
        max_position_embeddings=16,
    ))  # fmt: skip
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, tie_word_embeddings=True,
    ))  # fmt: skip
    ids = torch.randint(3, 32, (2, 5))
    cases = [
        (_tiny_t5_32(), ["q", "embed_tokens", "lm_head"], {"input_ids": ids, "labels": ids}),
        (llama, ["q_proj", "lm_head"], {"input_ids": ids, "labels": ids}),
        (bart, ["q_proj", "embed_tokens"], {"input_ids": ids, "labels": ids}),
    ]
    for base, targets, batch in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # none of ftrain's
            warnings.filterwarnings("ignore", message=".*(tie_word_embeddings|deprecated).*")
            model = ft.lora.apply(base, r=2, alpha=4, targets=targets)
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:
                torch.nn.init.normal_(p)  # B is 0 at first: A's gradients would be 0 too
        state = ft.TrainState.create(model, ft.optim.adamw())
        grads, _ = ft.accumulate_grads(state, [batch])
        assert set(grads) == set(state.params), type(base).__name__
    aliased = _tiny_t5_32()
    aliased.encoder.embed_tokens = aliased.decoder.embed_tokens = aliased.shared
    with pytest.raises(ValueError, match=r"on 'shared' \(Embedding\), whose weight .* through "
                       r"'encoder\.embed_tokens', 'decoder\.embed_tokens', 'lm_head'"):  # fmt: skip
        _apply_quiet(aliased, targets=["q", "shared"])


def test_a_module_reachable_under_two_names_warns_naming_both():
    """A model of your own that reaches one module under two names (no HF accessors to say
    which the forward calls): PEFT adapts it under the first name only, so the call through
    the other ran without the adapter, which got no gradient. apply warns, naming both."""

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.block = torch.nn.Module()
            self.block.proj = self.proj  # the forward calls it as block.proj
            self.out = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.block.proj(x))

    warned = (
        r"LoRA adapter on 'proj', whose weight \(or the module itself\) is also reachable as "
        r"'block\.proj': PEFT adapts it under"
    )
    with pytest.warns(UserWarning, match=warned):
        model = ft.lora.apply(Shared(), r=2, alpha=4, targets=["proj", "out"])
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    model(torch.randn(3, 4)).sum().backward()
    assert model.base_model.model.proj.lora_A.default.weight.grad is None  # the warned case
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.lora.apply(Shared(), r=2, alpha=4, targets=["out"])  # untouched: no warning
