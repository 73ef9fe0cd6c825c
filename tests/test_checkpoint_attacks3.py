"""Checkpoint attacks, third session: forged files, exports and retention (docs/checkpoints.md)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal

import pytest
import torch

import ftrain as ft
from ftrain.extras.cli import main
from helpers import tiny_llama
from test_checkpoint_hf import train  # the same short run (a copy of it was here)


def _lora(**kw):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **kw)
    return get_peft_model(tiny_llama(), cfg)


def test_an_adapter_export_never_drops_a_base_weight_unfrozen_by_hand(tmp_path):
    # PEFT's save_pretrained writes adapters and modules_to_save only: an lm_head unfrozen by
    # hand was trained and checkpointed, and silently missing from the exported adapter.
    model = _lora()
    model.base_model.model.lm_head.weight.requires_grad_(True)
    state = train(ft.TrainState.create(model, ft.optim.adamw()), 1)
    with pytest.raises(ValueError, match=r"would not hold 1 trained parameter.*lm_head"):
        ft.export_pretrained(state, tmp_path / "a")
    ckpt = ft.save_checkpoint(state, tmp_path / "run")
    with pytest.raises(ValueError, match=r"would not hold 1 trained parameter.*lm_head"):
        ft.export_checkpoint(ckpt, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # The ways the message names work: modules_to_save, or a merged full model.
    ft.export_pretrained(state, tmp_path / "merged", merge=True)
    kept = train(ft.TrainState.create(_lora(modules_to_save=["lm_head"]), ft.optim.adamw()), 1)
    ft.export_pretrained(kept, tmp_path / "c")
    ft.export_checkpoint(ft.save_checkpoint(kept, tmp_path / "run2"), tmp_path / "d")


@pytest.fixture
def alarm():
    """Fail a call that hangs (a FIFO read blocks forever) instead of hanging the suite."""

    def fire(*_):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_rotation_reads_a_stray_folders_state_json_as_load_does_never_hanging(tmp_path, alarm):
    # Rotation read each committed folder's state.json with read_text: a FIFO there (or a link
    # to /dev/zero) hung every later save with keep_last; now unreadable = unranked.
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    stray = tmp_path / "step-3"
    stray.mkdir()
    (stray / "COMMITTED").write_text("{}")
    os.mkfifo(stray / "state.json")
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / "COMMITTED").write_text("{}")
    (tmp_path / "step-4" / "state.json").symlink_to("/dev/zero")
    path = ft.save_checkpoint(
        state, tmp_path, keep_last=1, metrics={"eval_loss": 1.0, "eval_loss_fn": "ce"},
        best_metric="eval_loss",
    )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert ft.latest_checkpoint(tmp_path) == path


def _reseal(path, edit):
    meta = json.loads((path / "state.json").read_text())
    edit(meta)
    data = json.dumps(meta).encode()
    (path / "state.json").write_bytes(data)
    (path / "COMMITTED").write_text(json.dumps({"state.json": hashlib.sha256(data).hexdigest()}))


def test_a_metric_beyond_floats_range_is_refused_not_a_crash_of_rotation_or_inspect(
    tmp_path, capsys
):
    # An int metric of 10**400 (forged, or passed by a user) made math.isfinite raise
    # OverflowError: inspect printed a traceback, and every later save with keep_last raised
    # after committing (its rotation never ran again).
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    with pytest.raises(ValueError, match=r"metrics\['eval_loss'\] is an int beyond float"):
        ft.save_checkpoint(state, tmp_path, metrics={"eval_loss": 10**400})
    assert list(tmp_path.iterdir()) == []
    first = ft.save_checkpoint(state, tmp_path, metrics={"eval_loss": 1.0})
    _reseal(first, lambda meta: meta["metrics"].update(eval_loss=10**400))
    assert main(["inspect", str(tmp_path)]) == 1
    assert "malformed 'metrics'" in capsys.readouterr().out
    with pytest.raises(ft.CheckpointError, match="malformed 'metrics'"):
        ft.load_checkpoint(first, ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd()))
    later = ft.save_checkpoint(
        state.replace(step=1), tmp_path, keep_last=1, metrics={"eval_loss": 2.0},
        best_metric="eval_loss",
    )  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == [later.name]


def _llama(**settings):
    from transformers import LlamaForCausalLM

    cfg = tiny_llama().config
    for k, v in settings.items():
        setattr(cfg, k, v)
    torch.manual_seed(1)
    return LlamaForCausalLM(cfg)


def test_a_model_of_the_same_tensors_built_from_another_config_is_a_mismatch(tmp_path):
    # Same names, shapes and dtypes, another activation (or RoPE base, norm epsilon): the
    # tensors matched, so the resume went on silently training another function.
    path = ft.save_checkpoint(ft.TrainState.create(_llama(), ft.optim.adamw()), tmp_path)
    other = ft.TrainState.create(_llama(hidden_act="gelu"), ft.optim.adamw())
    with pytest.raises(ft.checkpoint.CheckpointMismatchError) as info:
        ft.load_checkpoint(path, other)
    assert info.value.summary == (
        "the model's config differs from the checkpoint's: hidden_act 'silu' in the "
        "checkpoint, 'gelu' in the model"
    )
    assert info.value.differences == [
        "model config hidden_act: checkpoint has 'silu', model has 'gelu'"
    ]
    with pytest.warns(ft.checkpoint.CheckpointMismatchWarning, match="model config hidden_act"):
        ft.load_checkpoint(path, other, strict=False)
    # Runtime switches and dropout change no function: a resume may change them.
    same = _llama(use_cache=False, attention_dropout=0.1)
    ft.load_checkpoint(path, ft.TrainState.create(same, ft.optim.adamw()))


def test_an_export_with_overwrite_never_replaces_a_run_folder_or_a_checkpoint(tmp_path, capsys):
    # overwrite=True with the run folder (or the checkpoint) as the target replaced it with
    # the export: every checkpoint deleted, and latest_checkpoint then found none.
    state = ft.TrainState.create(_llama(), ft.optim.sgd())
    root = tmp_path / "run"
    path = ft.save_checkpoint(state, root)
    for target in (root, path, tmp_path):
        with pytest.raises(
            ValueError, match=r"would replace .* which is a (run|checkpoint|folder of runs)"
        ):
            ft.export_pretrained(state, target, overwrite=True)
        with pytest.raises(ValueError, match="export to a directory of its own"):
            ft.export_checkpoint(path, target, overwrite=True)
    assert main(["export", str(path), "--to", str(root), "--overwrite"]) == 1
    assert "which is a run folder" in capsys.readouterr().err
    assert ft.latest_checkpoint(root) == path
    ft.load_checkpoint(path, ft.TrainState.create(_llama(), ft.optim.sgd()))
    ft.export_pretrained(state, tmp_path / "out")
    ft.export_pretrained(state, tmp_path / "out", overwrite=True)  # an export: replaced


def test_an_export_with_overwrite_never_replaces_a_sweep_of_runs(tmp_path, capsys):
    # Only one level was looked into: a sweep's folder (sweep/run-a/step-0) was replaced by the
    # export, and every run of the sweep deleted with it.
    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    path = ft.save_checkpoint(state, tmp_path / "sweep" / "group" / "run-a")
    with pytest.raises(ValueError, match=r"which is a folder holding checkpoints \("):
        ft.export_pretrained(state, tmp_path / "sweep", overwrite=True)
    with pytest.raises(ValueError, match="export to a directory of its own"):
        ft.export_checkpoint(path, tmp_path, overwrite=True)
    assert main(["export", str(path), "--to", str(tmp_path / "sweep"), "--overwrite"]) == 1
    assert "which is a folder holding checkpoints" in capsys.readouterr().err
    assert ft.latest_checkpoint(path.parent) == path


def test_another_compute_dtype_in_a_quantization_config_is_another_precision_not_a_mismatch(
    tmp_path,
):
    def quantized(**settings):
        model = _llama()
        q = {"quant_method": "bitsandbytes", "bnb_4bit_quant_type": "nf4", "_load_in_4bit": True}
        model.config.quantization_config = {**q, **settings}
        return ft.TrainState.create(model, ft.optim.adamw())

    path = ft.save_checkpoint(quantized(bnb_4bit_compute_dtype="bfloat16"), tmp_path)
    ft.load_checkpoint(path, quantized(bnb_4bit_compute_dtype="float16"))
    with pytest.raises(ft.checkpoint.CheckpointMismatchError, match="quantization_config"):
        ft.load_checkpoint(path, quantized(bnb_4bit_quant_type="fp4"))


def _covered_once(parts, full):
    """The oracle: every element of `full` lies in exactly one box (points enumerated)."""
    import itertools

    for point in itertools.product(*[range(n) for n in full]):
        inside = sum(
            all(o <= x < o + s for x, o, s in zip(point, off, shape, strict=True))
            for off, shape in parts
        )
        if inside != 1:
            return False
    return sum(math.prod(shape) for _, shape in parts) == math.prod(full)


def test_the_shard_cover_check_is_exact_and_linear_in_the_shards():
    """`_tiles` compared every pair of shards: a forged sharded checkpoint of ~100k one-element
    shard files took about an hour to refuse. It counts the cells of the grid the shards'
    edges cut instead; random boxes and grid tilings agree with an element-by-element count."""
    import itertools
    import random

    from ftrain.checkpoint._verify import _tiles

    rng = random.Random(0)
    tilings = 0
    for _ in range(3000):
        full = [rng.randint(0, 4) for _ in range(rng.randint(1, 3))]
        parts = []
        for _ in range(rng.randint(0, 5)):
            off = [rng.randint(0, n) for n in full]
            parts.append((off, [rng.randint(0, n - o) for o, n in zip(off, full, strict=True)]))
        if rng.random() < 0.3 and all(full):  # a grid of uneven shards, as DCP writes
            cuts = [sorted({0, n, *rng.sample(range(1, n), rng.randint(0, n - 1))}) for n in full]
            ranges = [range(len(c) - 1) for c in cuts]
            parts = [
                ([c[i] for c, i in zip(cuts, at, strict=True)],
                 [c[i + 1] - c[i] for c, i in zip(cuts, at, strict=True)])
                for at in itertools.product(*ranges)
            ]  # fmt: skip
        assert _tiles(parts, full) == _covered_once(parts, full), (parts, full)
        tilings += _covered_once(parts, full)
    assert tilings > 500  # the grids and some random ones
    n = 100_000
    ones = [([i], [1]) for i in range(n)]
    assert _tiles(ones, [n])
    assert not _tiles([*ones[:5], ([4], [1]), *ones[6:]], [n])  # one shard twice, one missing
