"""Where checkpoints cross other features: each case here was silently wrong once.

A committed checkpoint that no load accepts, a resume that mixes the checkpoint with another
model, a value rounded on its way back, a forged counter that loads, an unchecksummed file, a
stale `latest_checkpoint`, a copy of a state whose EMA swap is never undone.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, NamedTuple

import pytest
import torch

import ftrain as ft
from ftrain.checkpoint import CheckpointMismatchError, CheckpointMismatchWarning
from helpers import edit_state_json, hold_background_writes


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _state(**kw: Any) -> ft.TrainState:
    return ft.TrainState.create(_mlp(), ft.optim.adamw(), **kw)


# --- a save never commits what no load accepts ------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Tracked(ft.TrainState):
    running_loss: float = 0.0  # a user keeps the device tensor here to avoid a host sync
    count: int = 0
    flag: Any = None  # undeclared: whatever was saved comes back
    done: torch.Tensor = dataclasses.field(default_factory=lambda: torch.tensor(False))


def _tracked() -> _Tracked:
    return _Tracked.create(_mlp(), ft.optim.adamw())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s.replace(running_loss=torch.tensor(0.25)), "running_loss"),
        (lambda s: s.replace(count=3.0), "count"),
        (lambda s: s.replace(count=None), "count"),
        (
            lambda s: s.replace(
                early_stopping=s.early_stopping.replace(best_metric=torch.tensor(0.5))
            ),
            "early_stopping.best_metric",
        ),
        (lambda s: s.replace(data=s.data.replace(tokens_seen=12)), "data.tokens_seen"),
        (lambda s: s.replace(data=s.data.replace(batch_size=0)), "data.batch_size"),
        (lambda s: s.replace(seed=2**64), "seed"),
    ],
    ids=[
        "tensor-in-float",
        "float-in-int",
        "none-in-int",
        "tensor-best",
        "int-tokens",
        "bs-0",
        "seed-2**64",
    ],
)
@pytest.mark.parametrize("blocking", [True, False])
def test_a_field_that_load_would_refuse_is_refused_at_save(tmp_path, change, field, blocking):
    """They used to be written and committed: `latest_checkpoint` then returned a checkpoint
    whose load raised 'state field ... is malformed' (the run could never resume)."""
    with pytest.raises(ft.CheckpointError, match=rf"TrainState field '{field}' holds"):
        ft.save_checkpoint(change(_tracked()), tmp_path, blocking=blocking)
    assert ft.wait_for_checkpoint() is None
    assert ft.latest_checkpoint(tmp_path) is None


def test_bool_and_undeclared_tensor_fields_round_trip(tmp_path):
    """A 0-dim bool tensor was saved as JSON `true` and refused at load; a tensor in an
    undeclared field whose default is None was refused too."""
    state = _tracked().replace(done=torch.tensor(True), flag=torch.tensor(7, dtype=torch.int16))
    out = ft.load_checkpoint(ft.save_checkpoint(state, tmp_path), _tracked())
    assert out.done.dtype == torch.bool and bool(out.done)
    assert out.flag.dtype == torch.int16 and int(out.flag) == 7


@dataclasses.dataclass(frozen=True, eq=False)
class _Acc(ft.TrainState):
    acc: torch.Tensor = dataclasses.field(default_factory=lambda: torch.tensor(0.0))


def test_a_tensor_field_saved_in_another_dtype_is_a_mismatch_not_a_rounding(tmp_path):
    """A float64 field came back cast to the template's float32: 0.10000000000100001 loaded as
    0.10000000149011612, and the resumed run drifted."""
    value = torch.tensor(0.1, dtype=torch.float64) + 1e-12
    path = ft.save_checkpoint(_Acc.create(_mlp(), ft.optim.sgd()).replace(acc=value), tmp_path)
    fresh = _Acc.create(_mlp(), ft.optim.sgd())
    with pytest.raises(CheckpointMismatchError) as info:
        ft.load_checkpoint(path, fresh)
    assert info.value.differences == ["state field acc: checkpoint has float64, state has float32"]
    with pytest.warns(CheckpointMismatchWarning, match="state field acc"):
        out = ft.load_checkpoint(path, _Acc.create(_mlp(), ft.optim.sgd()), strict=False)
    assert out.acc.dtype == torch.float32 and float(out.acc) == 0.0  # kept, not rounded
    same = _Acc.create(_mlp(), ft.optim.sgd()).replace(acc=torch.zeros((), dtype=torch.float64))
    assert ft.load_checkpoint(path, same).acc.item() == value.item()


# --- frozen parameters: the model loaded into must be the model saved ----------------------------


class _Lora(torch.nn.Module):
    def __init__(self, *, head: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(3, 3).to(dtype).requires_grad_(False)
        self.adapter = torch.nn.Linear(3, 3)
        if head:  # a frozen module the other side does not have
            self.head = torch.nn.Linear(3, 3).requires_grad_(False)


def _lora(**kw: Any) -> ft.TrainState:
    return ft.TrainState.create(_Lora(**kw), ft.optim.adamw())


def test_frozen_parameters_that_differ_are_a_mismatch(tmp_path):
    """Frozen parameters are not saved; only a changed shape was reported. A base with an
    extra or a missing frozen module, or in another dtype, loaded silently: the adapter then
    continued on another model."""
    path = ft.save_checkpoint(_lora(), tmp_path / "a")
    with pytest.raises(CheckpointMismatchError) as info:
        ft.load_checkpoint(path, _lora(head=True))
    assert info.value.differences == [
        "frozen parameter missing from checkpoint: head.weight float32[3, 3]",
        "frozen parameter missing from checkpoint: head.bias float32[3]",
    ]
    with pytest.raises(CheckpointMismatchError) as info:
        ft.load_checkpoint(path, _lora(dtype=torch.float64))
    assert info.value.differences == [
        "frozen base.weight: checkpoint has float32[3, 3], model has float64[3, 3]",
        "frozen base.bias: checkpoint has float32[3], model has float64[3]",
    ]
    with pytest.raises(CheckpointMismatchError, match="2 unexpected") as info:
        ft.load_checkpoint(ft.save_checkpoint(_lora(head=True), tmp_path / "b"), _lora())
    assert "unexpected frozen parameter in checkpoint: head.weight float32[3, 3]" in str(info.value)
    with pytest.warns(CheckpointMismatchWarning, match="frozen parameter missing"):
        out = ft.load_checkpoint(path, _lora(head=True), strict=False)  # the adapter loads
    assert out.step == 0 and torch.equal(out.opt_state.steps, torch.zeros(()))
    ft.load_checkpoint(path, _lora())  # the same model still loads


# --- forged (resealed) counters ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),  # gave seed 0's data order and dropout
        ("step", 2**63),
        ("early_stopping.patience_counter", -1000),  # early stopping 1000 evaluations late
        ("early_stopping.best_step", -7),
        ("data.batch_size", -3),
        ("data.tokens_seen", {"dtype": "int64", "value": -99}),
        ("data.samples_seen", {"dtype": "int64", "value": 2.5}),  # loaded as 2
        ("scaler.growth_tracker", {"dtype": "int32", "value": -5}),
    ],
)
def test_forged_counters_out_of_their_range_are_refused(tmp_path, field, value):
    fp16 = ft.strategies.SingleDevice("cpu", precision="fp16")
    path = ft.save_checkpoint(_state(strategy=fp16), tmp_path)
    edit_state_json(path, lambda m: m["fields"].__setitem__(field, value))
    with pytest.raises(ft.CheckpointError, match=rf"state field '{field}'"):
        ft.load_checkpoint(path, _state(strategy=fp16))


# --- every file is checksummed, in every layout ---------------------------------------------------


class _Sharded(ft.strategies.SingleDevice):
    """The sharded layout (FSDP's) written by one process."""

    checkpoint_sharded = True


class _Config:
    def __init__(self, eps: float) -> None:
        self.eps = eps

    def to_dict(self) -> dict[str, Any]:
        return {"layer_norm_eps": self.eps}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def test_a_sharded_checkpoints_config_json_is_checksummed(tmp_path):
    """The sharded layout did not record config.json: a flipped digit in it (an epsilon of
    1e-05 read as 1e-01) loaded and exported without a word."""

    def state() -> ft.TrainState:
        model = _mlp()
        model.config = _Config(1e-05)
        return ft.TrainState.create(model, ft.optim.adamw(), strategy=_Sharded("cpu"))

    path = ft.save_checkpoint(state(), tmp_path)
    meta = json.loads((path / "state.json").read_text())
    assert meta["sharded"] is True and len(meta["config_file"]["sha256"]) == 64
    assert ft.load_checkpoint(path, state()).step == 0
    cfg = path / "config.json"
    cfg.write_text(cfg.read_text().replace("1e-05", "1e-01"))
    with pytest.raises(ft.CheckpointError, match=r"config\.json does not match its recorded"):
        ft.load_checkpoint(path, state())
    with pytest.raises(ft.CheckpointError, match=r"config\.json"):
        ft.checkpoint.open_checkpoint(path)


@pytest.mark.parametrize(
    "dtype",
    [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.complex64],
)
def test_a_tensor_of_any_dtype_safetensors_writes_loads_back(tmp_path, dtype):
    """safetensors writes them, the hand-written header check refused them: a committed
    checkpoint with a float8 buffer could never load ('malformed header entry')."""

    def state() -> ft.TrainState:
        model = _mlp()
        model.register_buffer("table", torch.zeros(3, dtype=dtype))
        return ft.TrainState.create(model, ft.optim.sgd())

    saved = state()
    saved.model.table.copy_(torch.tensor([1, 2, 3]).to(dtype))
    path = ft.save_checkpoint(saved, tmp_path)
    for verify in (True, False):
        out = ft.load_checkpoint(path, state(), verify=verify)
        assert out.model.table.dtype == dtype
        assert (
            out.model.table.view(torch.uint8).tolist()
            == saved.model.table.view(torch.uint8).tolist()
        )


# --- background saves ----------------------------------------------------------------------------


def test_latest_checkpoint_waits_for_this_process_background_save_into_the_folder(
    tmp_path, monkeypatch
):
    """`save_checkpoint(step 10, blocking=False)` then `latest_checkpoint` returned step 5: the
    process was told the newest checkpoint is one older than the one it just saved."""
    ft.save_checkpoint(_state().replace(step=5), tmp_path)
    release = hold_background_writes(monkeypatch)
    ft.save_checkpoint(_state().replace(step=10), tmp_path, blocking=False)
    assert ft.latest_checkpoint(tmp_path / "other") is None  # another folder: no wait
    timer = threading.Timer(0.3, release.set)
    timer.start()
    begin = time.monotonic()
    assert ft.latest_checkpoint(tmp_path).name == "step-10"
    assert time.monotonic() - begin > 0.1
    timer.join()
    assert ft.wait_for_checkpoint() is None


# --- EMA x snapshot -------------------------------------------------------------------------------


def test_snapshot_inside_swap_ema_is_refused(tmp_path):
    """The copy's model held the average and its EmaState the live weights, and being a new
    EmaState it was never swapped back: saving the copy wrote the average as the weights."""
    state = ft.TrainState.create(_mlp(), ft.optim.ema(ft.optim.sgd(), decay=0.5, warmup=False))
    with torch.no_grad():
        state.opt_state.ema["0.weight"].add_(1.0)  # an average that differs from the weights
    live = state.params["0.weight"].clone()
    with (
        ft.optim.swap_ema(state),
        pytest.raises(ValueError, match=r"snapshot of a state inside ft\.optim\.swap_ema"),
    ):
        ft.snapshot(state)
    copy = ft.snapshot(state)  # outside the block: the live weights
    assert torch.equal(copy.params["0.weight"], live)
    path = ft.save_checkpoint(copy, tmp_path)
    fresh = ft.TrainState.create(_mlp(), ft.optim.ema(ft.optim.sgd(), decay=0.5, warmup=False))
    assert torch.equal(ft.load_checkpoint(path, fresh).params["0.weight"], live)


def test_a_checkpoint_passed_as_the_run_folder_is_refused(tmp_path):
    """`latest_checkpoint("runs/x/step-500")` returned None, so the run started afresh; a save
    into it nested checkpoints that the run folder's rotation deleted with it."""
    path = ft.save_checkpoint(_state().replace(step=500), tmp_path)
    with pytest.raises(ValueError, match=r"root='.*step-500' is a checkpoint, not a run folder"):
        ft.latest_checkpoint(path)
    with pytest.raises(ValueError, match=r"root='.*step-500' is a checkpoint, not a run folder"):
        ft.save_checkpoint(_state().replace(step=600), path)
    assert sorted(p.name for p in path.iterdir()) == [
        "COMMITTED", "model.safetensors", "optimizer.safetensors", "state.json"
    ]  # fmt: skip
    assert ft.latest_checkpoint(tmp_path) == path


class _AdamStateBefore(NamedTuple):  # AdamState as checkpoints before its per-parameter counts
    steps: torch.Tensor
    mu: dict
    nu: dict


_AdamStateBefore.__name__ = _AdamStateBefore.__qualname__ = "AdamState"


@pytest.mark.parametrize("wrap", ["adamw", "ema"])
def test_an_adam_checkpoint_from_before_per_parameter_counts_resumes_exactly(tmp_path, wrap):
    """Those counted one step for all parameters; every parameter takes that count, so a run
    whose parameters all had gradients continues as if uninterrupted."""

    def make():
        torch.manual_seed(0)
        opt = ft.optim.adamw() if wrap == "adamw" else ft.optim.ema(ft.optim.adamw())
        return ft.TrainState.create(torch.nn.Linear(3, 2), opt, seed=0)

    def loss_fn(model, x):
        return model(x).pow(2).sum(), x.shape[0]

    data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(5)]

    def run(state, steps):
        for x in steps:
            grads, stats = ft.accumulate_grads(state, [x], loss_fn)
            state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
        return state

    whole = run(make(), data)
    state = run(make(), data[:3])
    opt = state.opt_state
    inner = opt if wrap == "adamw" else opt.inner
    before = _AdamStateBefore(inner.steps, inner.mu, inner.nu)
    old = state.replace(opt_state=before if wrap == "adamw" else opt._replace(inner=before))
    loaded = ft.load_checkpoint(ft.save_checkpoint(old, tmp_path), make())
    resumed = run(loaded, data[3:])
    for name, p in whole.params.items():
        assert torch.equal(resumed.params[name], p), name


def test_mode_max_without_best_metric_is_refused(tmp_path):
    """mode="max" with no best_metric ranked nothing: rotation kept the ranking an earlier save
    recorded (or none), and the argument was ignored."""
    state = ft.TrainState.create(torch.nn.Linear(1, 1), ft.optim.sgd())
    with pytest.raises(ValueError, match="mode='max' needs best_metric"):
        ft.save_checkpoint(state, tmp_path, mode="max")
    from ftrain.extras import ray as ray_ft

    with pytest.raises(ValueError, match="mode='max' needs best_metric"):
        ray_ft.checkpoint_config(keep_last=2, mode="max")
    ft.save_checkpoint(state, tmp_path, mode="max", best_metric="acc", metrics={"acc": 1.0})


# --- another precision on resume ---------------------------------------------------------------


def _in(precision: Any) -> ft.TrainState:
    return _state(strategy=ft.strategies.SingleDevice("cpu", precision=precision))


_FP16 = ft.precision.Precision(torch.float16, ft.precision.LossScaling(init_scale=8.0))


@pytest.mark.parametrize(("saved", "loaded"), [(_FP16, "fp32"), (_FP16, "bf16"), ("bf16", _FP16)])
def test_another_precision_drops_or_restarts_the_loss_scale_as_documented(tmp_path, saved, loaded):
    """docs/checkpoints.md: a run may change precision on resume. Without loss scaling the saved
    scale goes (it means nothing there); with it, a checkpoint without one starts from
    init_scale, as a fresh fp16 run does. Everything else loads."""
    state = _in(saved).replace(step=5)
    if state.scaler.scale is not None:  # a scale and tracker a fresh state would not have
        tracker = torch.tensor(3, dtype=torch.int32)
        state = state.replace(
            scaler=state.scaler.replace(scale=torch.tensor(2.0), growth_tracker=tracker)
        )
    with torch.no_grad():
        state.params["0.weight"].add_(1.0)
    resumed = ft.load_checkpoint(ft.save_checkpoint(state, tmp_path), _in(loaded))
    assert resumed.step == 5
    assert torch.equal(resumed.params["0.weight"], state.params["0.weight"])
    if loaded is _FP16:
        assert float(resumed.scaler.scale) == 8.0 and int(resumed.scaler.growth_tracker) == 0
    else:
        assert resumed.scaler.scale is None and resumed.scaler.growth_tracker is None
    x = torch.randn(2, 3)
    grads, stats = ft.accumulate_grads(resumed, [x], lambda m, b: (m(b).pow(2).sum(), 2))
    ft.clip_and_step(resumed, grads, lr=0.1, stats=stats)  # the scaler fits the strategy


@pytest.mark.parametrize("kept", ["scaler.scale", "scaler.growth_tracker"])
@pytest.mark.parametrize("how", ["null", "absent"])
def test_half_a_loss_scale_is_refused(tmp_path, kept, how):
    """A save writes the scale and its growth tracker together; one without the other loaded
    the scale with a fresh tracker (or the reverse) without a word."""
    path = ft.save_checkpoint(_in(_FP16), tmp_path)
    other = next(n for n in ("scaler.scale", "scaler.growth_tracker") if n != kept)
    edit_state_json(
        path,
        lambda m: m["fields"].pop(other) if how == "absent" else m["fields"].update({other: None}),
    )
    for precision in (_FP16, "fp32"):
        with pytest.raises(ft.CheckpointError, match=rf"'{kept}' is saved without '{other}'"):
            ft.load_checkpoint(path, _in(precision))
