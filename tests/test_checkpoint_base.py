"""A checkpoint loads only onto the base model it was trained on (docs/checkpoints.md, "The
base model").

Frozen parameters are not saved: a LoRA checkpoint, or one of a model with frozen layers,
took them from the model loaded into, and a base of the same architecture but other weights
(the chat variant, a random init) resumed silently. A save now records each frozen
parameter's sum and sum of squares, and a load compares them.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain.extras.cli import inspect
from helpers import rank_env, tiny_llama
from launch import run_ranks

MISMATCH = ft.checkpoint.CheckpointMismatchError
REFUSED = "the model's frozen weights differ from the checkpoint's"


def _mlp(seed: int = 0) -> torch.nn.Module:
    """Layer 0 frozen (the base), layer 1 trained; uneven sizes (shards of 2 and 1 rows)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    return model


def _state(model: torch.nn.Module, optimizer=None, **kw) -> ft.TrainState:
    return ft.TrainState.create(model, optimizer or ft.optim.adamw(), **kw)


def _step(state: ft.TrainState) -> ft.TrainState:
    """One AdamW step on a fixed batch, for a checkpoint whose trainable weights moved."""
    x = torch.ones(4, 5)

    def loss_fn(model, batch):
        return model(batch).square().sum(), torch.tensor(4)

    grads, stats = ft.accumulate_grads(state, [x], loss_fn)
    return ft.clip_and_step(state, grads, stats=stats, lr=1e-2)[0]


def _meta(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())


def _reseal(path: Path, edit) -> None:
    meta = _meta(path)
    edit(meta)
    data = json.dumps(meta).encode()
    (path / "state.json").write_bytes(data)
    (path / "COMMITTED").write_text(json.dumps({"state.json": hashlib.sha256(data).hexdigest()}))


def test_a_checkpoint_refuses_a_base_with_other_frozen_weights(tmp_path):
    path = ft.save_checkpoint(_step(_state(_mlp(0))), tmp_path)
    with pytest.raises(MISMATCH) as info:
        ft.load_checkpoint(path, _state(_mlp(1)))  # same names, shapes, dtypes: another init
    assert info.value.summary == (
        f"{REFUSED} (2 parameter(s): 0.weight, 0.bias), which it does not hold: load into the "
        "base model it was trained on (the same pretrained weights). If it is that base, its "
        "weights changed in memory before the save or this load: in place, by merging and "
        "unmerging adapters (merge_adapter/unmerge_adapter round them) or by "
        "resize_token_embeddings (random new rows); or drawn at random when the model was "
        "built (a new head or layer, another adapter: seed both runs alike before building). "
        "Pass allow_other_base=True to load onto this one on purpose"
    )
    assert [d.split(":")[0] for d in info.value.differences] == [
        "frozen weights 0.weight",
        "frozen weights 0.bias",
    ]
    assert "checkpoint has sum " in info.value.differences[0]
    loaded = ft.load_checkpoint(path, _state(_mlp(0)))  # the base it was trained on
    assert loaded.step == 1
    with pytest.warns(ft.checkpoint.CheckpointMismatchWarning, match="frozen weights 0.weight"):
        ft.load_checkpoint(path, _state(_mlp(1)), strict=False)
    on_purpose = ft.load_checkpoint(path, _state(_mlp(1)), allow_other_base=True)
    torch.testing.assert_close(on_purpose.params["1.weight"], loaded.params["1.weight"])
    with pytest.raises(TypeError, match="allow_other_base must be True or False, got 1"):
        ft.load_checkpoint(path, _state(_mlp(0)), allow_other_base=1)


def test_lora_adapters_refuse_another_base_model(tmp_path):
    """PEFT adapters trained on one base, loaded onto another of the same config (the chat
    variant of a model; here another init): refused. The same base loads."""
    peft = pytest.importorskip("peft")

    def lora(seed: int) -> torch.nn.Module:
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(tiny_llama(seed=seed), cfg)

    path = ft.save_checkpoint(_state(lora(0)), tmp_path)
    with pytest.raises(MISMATCH, match=REFUSED) as info:
        ft.load_checkpoint(path, _state(lora(1)))
    assert "base_model.model.model.embed_tokens.weight" in info.value.summary
    ft.load_checkpoint(path, _state(lora(0)))


def test_integer_frozen_weights_are_summed_exactly(tmp_path):
    """bitsandbytes keeps quantized weights as frozen uint8/int8 parameters: int64 sums,
    compared exactly (one byte changed by one is refused)."""

    def quantized(bump: int = 0) -> torch.nn.Module:
        model = _mlp(0)
        q = torch.arange(-100, 100, dtype=torch.int8).reshape(10, 20)
        model.q = torch.nn.Parameter(q, requires_grad=False)
        packed = torch.arange(256, dtype=torch.uint8)
        packed[7] += bump
        model.packed = torch.nn.Parameter(packed, requires_grad=False)
        return model

    path = ft.save_checkpoint(_state(quantized()), tmp_path)
    sums = _meta(path)["frozen_sums"]
    assert sums["q"] == [-100, sum(i * i for i in range(-100, 100))]
    assert sums["packed"] == [sum(range(256)), sum(i * i for i in range(256))]
    ft.load_checkpoint(path, _state(quantized()))
    with pytest.raises(MISMATCH, match=r"\(1 parameter\(s\): packed\)"):
        ft.load_checkpoint(path, _state(quantized(bump=1)))


def test_a_tied_frozen_weight_is_recorded_once_and_compared(tmp_path):
    def tied(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
        model[1].weight = model[0].weight  # an LM head tied to the embeddings
        model.head = torch.nn.Linear(4, 2)
        model[0].requires_grad_(False)
        return model

    path = ft.save_checkpoint(_state(tied(0)), tmp_path)
    assert list(_meta(path)["frozen_sums"]) == ["0.weight"]
    ft.load_checkpoint(path, _state(tied(0)))
    with pytest.raises(MISMATCH, match=r"\(1 parameter\(s\): 0.weight\)"):
        ft.load_checkpoint(path, _state(tied(1)))


def test_a_parameter_trained_then_frozen_is_not_silently_reset(tmp_path):
    """Layer 1 trained, then frozen: the checkpoint does not hold it, and a fresh model of the
    same init resumed with its initial weights. Its trained weights' sums refuse that."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    state = _step(_state(model))
    model[1].requires_grad_(False)
    path = ft.save_checkpoint(_state(model).replace(step=state.step), tmp_path)
    fresh = _mlp(0)
    fresh[0].requires_grad_(True)
    fresh[1].requires_grad_(False)
    with pytest.raises(MISMATCH, match=r"\(2 parameter\(s\): 1.weight, 1.bias\)"):
        ft.load_checkpoint(path, _state(fresh))
    # Unfrozen in the model loaded into: its values still come from that model, and are
    # compared (beside the table's "missing from checkpoint").
    unfrozen = _mlp(0).requires_grad_(True)
    with pytest.raises(MISMATCH) as info:
        ft.load_checkpoint(path, _state(unfrozen))
    assert "frozen weights 1.weight" in str(info.value)
    assert "missing from checkpoint: 1.weight" in str(info.value)


def test_ema_runs_and_saves_inside_swap_ema_record_the_base(tmp_path):
    state = _state(_mlp(0), ft.optim.ema(ft.optim.adamw(), decay=0.5))
    state = _step(state)
    with ft.optim.swap_ema(state):
        path = ft.save_checkpoint(state, tmp_path)
    ft.load_checkpoint(path, _state(_mlp(0), ft.optim.ema(ft.optim.adamw(), decay=0.5)))
    with pytest.raises(MISMATCH, match=REFUSED):
        ft.load_checkpoint(path, _state(_mlp(1), ft.optim.ema(ft.optim.adamw(), decay=0.5)))


def test_a_background_save_records_the_base(tmp_path):
    state = _step(_state(_mlp(0)))
    path = ft.save_checkpoint(state, tmp_path, blocking=False)
    assert ft.wait_for_checkpoint() == path
    sums = _meta(path)["frozen_sums"]
    assert set(sums) == {"0.weight", "0.bias"}
    assert all(type(v) is float for pair in sums.values() for v in pair)
    ft.load_checkpoint(path, _state(_mlp(0)))
    with pytest.raises(MISMATCH, match=REFUSED):
        ft.load_checkpoint(path, _state(_mlp(1)))


def test_the_sums_do_not_depend_on_how_the_weights_are_split(tmp_path, monkeypatch):
    """Summed in chunks of 7 elements at save, whole at load: equal within the tolerance."""
    from ftrain.checkpoint import _frozen

    monkeypatch.setattr(_frozen, "_CHUNK", 7)
    path = ft.save_checkpoint(_state(_mlp(0)), tmp_path)
    monkeypatch.undo()
    ft.load_checkpoint(path, _state(_mlp(0)))
    # The tolerance is float64 rounding's (1e-9 relative): the largest of these 15 weights
    # moved by one float32 ulp away from 0 changes the sum of squares by more, and is refused.
    model = _mlp(0)
    with torch.no_grad():
        w = model[0].weight.view(-1)
        i = w.abs().argmax()
        w[i] = torch.nextafter(w[i], w[i] * 2)
    with pytest.raises(MISMATCH, match=r"\(1 parameter\(s\): 0.weight\)"):
        ft.load_checkpoint(path, _state(model))


def test_a_checkpoint_without_the_record_loads_onto_any_base(tmp_path):
    """Checkpoints written before the sums were recorded: nothing to compare."""
    path = ft.save_checkpoint(_state(_mlp(0)), tmp_path)
    _reseal(path, lambda meta: meta.pop("frozen_sums"))
    ft.load_checkpoint(path, _state(_mlp(1)))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nan", "'frozen_sums' is not a dict"),
        ([1.0, 2.0], "'frozen_sums' is not a dict"),
        ({"0.weight": ["1", 2.0]}, "'frozen_sums' of '0.weight' is malformed"),
        ({"0.weight": [1.0]}, "'frozen_sums' of '0.weight' is malformed"),
        ({"0.weight": [1.0, 2.0, 3.0]}, "'frozen_sums' of '0.weight' is malformed"),
        ({"0.weight": [1.0] * 100_000}, "'frozen_sums' of '0.weight' is malformed"),
        ({"0.weight": [True, 2.0]}, "'frozen_sums' of '0.weight' is malformed"),
        ({"0.weight": [[1.0], 2.0]}, "'frozen_sums' of '0.weight' is malformed"),
        ({"0.weight": [10**400, 2.0]}, "'frozen_sums' of '0.weight' is malformed"),
        ({"0.weight": None}, "'frozen_sums' of '0.weight' is malformed"),
        ({"1.weight": [1.0, 2.0]}, "'frozen_sums' names '1.weight', no frozen parameter"),
        ({"nope": [1.0, 2.0]}, "'frozen_sums' names 'nope', no frozen parameter"),
    ],
)
def test_a_forged_record_is_refused_by_load_and_inspect(tmp_path, capsys, value, message):
    path = ft.save_checkpoint(_state(_mlp(0)), tmp_path)
    _reseal(path, lambda meta: meta.update(frozen_sums=value))
    with pytest.raises(ft.CheckpointError, match=message):
        ft.load_checkpoint(path, _state(_mlp(0)))
    assert inspect(path) == 1
    assert message in capsys.readouterr().out


@pytest.mark.parametrize(
    "value",
    [[1.5, 2], [1, -1], [2**63, 1]],
    ids=["float", "negative square sum", "beyond int64"],
)
def test_a_forged_record_of_an_integer_weight_is_refused(tmp_path, value):
    model = _mlp(0)
    model.q = torch.nn.Parameter(torch.ones(3, dtype=torch.uint8), requires_grad=False)
    path = ft.save_checkpoint(_state(model), tmp_path)
    _reseal(path, lambda meta: meta["frozen_sums"].update(q=value))
    with pytest.raises(ft.CheckpointError, match="'frozen_sums' of 'q' is malformed"):
        ft.load_checkpoint(path, _state(model))


# --- several processes: DDP (rank 0 saves whole tensors), FSDP (every rank its shards), HSDP
# (every rank holds a replica: each part counted twice by the sum over processes)

_KINDS = {"ddp": ("ddp", {}), "fsdp": ("fsdp", {}), "hsdp": ("fsdp", {"replicate": 2})}


def _base_ranks(rank: int, world: int, port: int, root: str, case: str) -> None:
    """Every rank: a save, a load onto the same base, one onto another (refused on every rank,
    none left waiting in a collective), one with allow_other_base."""
    rank_env(rank, world, port)
    kind, kw = _KINDS[case]
    with ft.strategies.from_env(kind, timeout=timedelta(seconds=60), **kw) as strategy:
        path = ft.save_checkpoint(_state(_mlp(0), strategy=strategy), Path(root))
        ft.load_checkpoint(path, _state(_mlp(0), strategy=strategy))
        try:
            ft.load_checkpoint(path, _state(_mlp(1), strategy=strategy))
        except MISMATCH as e:
            assert e.summary.startswith(f"{REFUSED} (2 parameter(s)"), e.summary
        else:
            raise AssertionError(f"rank {rank}: loaded onto another base")
        ft.load_checkpoint(path, _state(_mlp(1), strategy=strategy), allow_other_base=True)
        ft.load_checkpoint(path, _state(_mlp(0), strategy=strategy))  # still in step


@pytest.mark.parametrize("case", list(_KINDS))
def test_every_rank_refuses_another_base_and_the_record_is_layout_free(tmp_path, case):
    run_ranks(_base_ranks, str(tmp_path), case, world=2, timeout=150)
    path = ft.latest_checkpoint(tmp_path)
    assert _meta(path).get("sharded", False) is (case != "ddp")
    # Summed shard by shard over 2 ranks at save, whole in one process here.
    ft.load_checkpoint(path, _state(_mlp(0)))
    with pytest.raises(MISMATCH, match=REFUSED):
        ft.load_checkpoint(path, _state(_mlp(1)))
