"""Where checkpoints cross the optimizers and the state: a checkpoint loaded into a state whose
optimizer has other hyperparameters (it loaded silently), and `TrainState.replace` with values
its fields cannot hold (they were stepped on and saved). Each test failed before its fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ftrain as ft
from ftrain.checkpoint import CheckpointMismatchError, CheckpointMismatchWarning
from helpers import edit_state_json


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _state(opt: ft.optim.Optimizer) -> ft.TrainState:
    return ft.TrainState.create(_mlp(), opt)


def _trained(opt: ft.optim.Optimizer, root: Path) -> Path:
    """A checkpoint after one step (nonzero optimizer state)."""
    state = _state(opt)
    grads = {n: torch.full_like(p, 0.5) for n, p in state.params.items()}
    state, _ = ft.clip_and_step(state, grads, lr=0.1)
    return ft.save_checkpoint(state, root)


def _part(name: str) -> str:
    return "o" if name.startswith("1.") else "m"


# (saved optimizer, loaded optimizer, the setting the error names)
CHANGED = {
    "adamw-into-adam": (
        lambda: ft.optim.adamw(weight_decay=0.1),
        lambda: ft.optim.adam(),
        "kind: checkpoint has 'adamw', state has 'adam'",
    ),
    "betas": (
        lambda: ft.optim.adamw(),
        lambda: ft.optim.adamw(betas=(0.8, 0.99)),
        "betas: checkpoint has [0.9, 0.999], state has [0.8, 0.99]",
    ),
    "mask": (
        lambda: ft.optim.adamw(weight_decay=0.1),
        lambda: ft.optim.adamw(weight_decay=0.1, mask=["0.weight", "1.weight"]),
        "no_decay: checkpoint has [], state has ['0.bias', '1.bias']",
    ),
    "sgd-momentum": (
        lambda: ft.optim.sgd(momentum=0.9),
        lambda: ft.optim.sgd(momentum=0.5),
        "momentum: checkpoint has 0.9, state has 0.5",
    ),
    "ema-decay": (
        lambda: ft.optim.ema(ft.optim.adamw(), decay=0.9),
        lambda: ft.optim.ema(ft.optim.adamw(), decay=0.99),
        "decay: checkpoint has 0.9, state has 0.99",
    ),
    "ema-inner": (
        lambda: ft.optim.ema(ft.optim.adamw(weight_decay=0.1)),
        lambda: ft.optim.ema(ft.optim.adamw(weight_decay=0.0)),
        "inner.weight_decay: checkpoint has 0.1, state has 0.0",
    ),
    "chain-transform": (
        lambda: ft.optim.chain(ft.optim.clip(1.0), ft.optim.adamw()),
        lambda: ft.optim.chain(ft.optim.clip(2.0), ft.optim.adamw()),
        "parts.0.max_abs: checkpoint has 1.0, state has 2.0",
    ),
    "partition-lr-factor": (
        lambda: ft.optim.partition({"m": ft.optim.sgd(), "o": ft.optim.adamw()}, _part),
        lambda: ft.optim.partition(
            {"m": ft.optim.sgd(), "o": ft.optim.adamw()}, _part, lr_factors={"o": 0.1}
        ),
        "lr_factors.o: checkpoint has 1.0, state has 0.1",
    ),
    "partition-group": (
        lambda: ft.optim.partition({"m": ft.optim.adamw(), "o": ft.optim.adamw()}, _part),
        lambda: ft.optim.partition({"m": ft.optim.adamw(), "o": ft.optim.adamw(eps=1e-6)}, _part),
        "groups.o.eps: checkpoint has 1e-08, state has 1e-06",
    ),
    "torch-kwargs": (
        lambda: ft.optim.from_torch(torch.optim.SGD, momentum=0.9),
        lambda: ft.optim.from_torch(torch.optim.SGD, momentum=0.5),
        "kwargs.momentum: checkpoint has 0.9, state has 0.5",
    ),
}


@pytest.mark.parametrize("saved, loaded, says", CHANGED.values(), ids=CHANGED.keys())
def test_load_refuses_an_optimizer_with_other_settings(tmp_path, saved, loaded, says):
    """The optimizer state has the same layout, so it used to load silently: the run resumed
    with another weight decay, betas, mask, EMA decay or lr factor than it was trained with."""
    path = _trained(saved(), tmp_path)
    state = _state(loaded())
    before = {n: p.clone() for n, p in state.params.items()}
    with pytest.raises(CheckpointMismatchError, match="the optimizer differs") as info:
        ft.load_checkpoint(path, state)
    assert f"optimizer setting {says}" in info.value.differences
    assert all(torch.equal(before[n], p) for n, p in state.params.items())  # nothing written


def test_equivalent_optimizers_and_a_new_lr_schedule_still_load(tmp_path):
    """The same optimizer written otherwise loads: no mask and a mask of every name, an int
    and a float decay, a torch default given or left out; the lr is each step's argument."""
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    pairs = [
        (ft.optim.adamw(weight_decay=0.1), ft.optim.adamw(weight_decay=0.1, mask=names)),
        (ft.optim.adamw(weight_decay=0), ft.optim.adamw(weight_decay=0.0, mask=["0.bias"])),
        (ft.optim.from_torch(torch.optim.Adam), ft.optim.from_torch(torch.optim.Adam, eps=1e-8)),
    ]
    for i, (saved, loaded) in enumerate(pairs):
        path = _trained(saved, tmp_path / str(i))
        state = ft.load_checkpoint(path, _state(loaded))
        ft.clip_and_step(state, {n: torch.ones_like(p) for n, p in state.params.items()}, lr=3.0)


def test_strict_false_loads_another_setting_with_a_warning(tmp_path):
    """An intentional change stays possible: strict=False loads the optimizer state into the
    new optimizer and names the setting in its warning."""
    path = _trained(ft.optim.adamw(weight_decay=0.1), tmp_path)
    with pytest.warns(CheckpointMismatchWarning, match="optimizer setting weight_decay"):
        state = ft.load_checkpoint(path, _state(ft.optim.adamw()), strict=False)
    assert state.step == 1 and float(state.opt_state.steps) == 1.0
    assert float(state.opt_state.mu["0.weight"].abs().sum()) > 0


def test_a_checkpoint_without_recorded_settings_loads_as_before(tmp_path):
    """Checkpoints written before the settings were recorded hold none: nothing to compare."""
    path = _trained(ft.optim.adamw(weight_decay=0.1), tmp_path)
    edit_state_json(path, lambda meta: meta.pop("optimizer_settings", None))
    state = ft.load_checkpoint(path, _state(ft.optim.adam()))
    assert state.step == 1


@pytest.mark.parametrize(
    "forged",
    [[1, 2], "adamw", {"kind": {"nested": [1]}}, {"kind": "adamw", "betas": [[[[0.9]]]]}],
    ids=["list", "str", "dict-kind", "nested"],
)
def test_forged_settings_fail_cleanly(tmp_path, forged):
    path = _trained(ft.optim.adamw(), tmp_path)
    edit_state_json(path, lambda meta: meta.update(optimizer_settings=forged))
    with pytest.raises(CheckpointMismatchError, match="the optimizer differs"):
        ft.load_checkpoint(path, _state(ft.optim.adamw()))


def test_settings_are_recorded_for_a_background_save(tmp_path):
    state = _state(ft.optim.ema(ft.optim.adamw(weight_decay=0.1), decay=0.9))
    path = ft.save_checkpoint(state, tmp_path, blocking=False)
    ft.wait_for_checkpoint()
    meta = json.loads((path / "state.json").read_text())
    assert meta["optimizer_settings"]["inner"]["weight_decay"] == 0.1
    with pytest.raises(CheckpointMismatchError, match="optimizer setting decay"):
        ft.load_checkpoint(path, _state(ft.optim.ema(ft.optim.adamw(weight_decay=0.1))))


# --- TrainState.replace ----------------------------------------------------------------------


def _silent_before(state: ft.TrainState) -> dict[str, Any]:
    return {
        "data": None,
        "early_stopping": None,
        "scaler": {"scale": None},
        "step": True,
        "epoch": 1.5,
        "loss_fn": 3,
        "strategy": "cpu",
        "model": state.params["0.weight"],
    }


@pytest.mark.parametrize("field", list(_silent_before(_state(ft.optim.sgd()))))
def test_replace_refuses_a_value_its_field_cannot_hold(field):
    """`replace(data=None)` was stepped on and saved (the checkpoint then resumed at cursor 0),
    a `True` step counted as 1, a loss_fn of 3 failed only at the next accumulate_grads."""
    state = _state(ft.optim.sgd())
    with pytest.raises(TypeError, match=rf"^{field} must be"):
        state.replace(**{field: _silent_before(state)[field]})


def test_replace_optimizer_needs_its_opt_state():
    """A new optimizer updated (or, sgd without momentum, ignored) the old one's state."""
    state = _state(ft.optim.adamw())
    with pytest.raises(ValueError, match=r"replace\(optimizer=\.\.\.\) without opt_state="):
        state.replace(optimizer=ft.optim.sgd())
    sgd = ft.optim.sgd()
    new = state.replace(optimizer=sgd, opt_state=sgd.init(state.params))
    assert isinstance(new.opt_state, ft.optim.SGDState)
    assert state.replace(step=3, optimizer=state.optimizer).step == 3
