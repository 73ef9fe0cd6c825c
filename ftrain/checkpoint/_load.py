"""load_checkpoint: verify everything, compare with the live state, then copy in place.

Nothing is written into the state until every file has been read, verified and matched, so a
failed load leaves the state as it was.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import torch

from ftrain.checkpoint import _frozen
from ftrain.checkpoint import _layout as L
from ftrain.checkpoint._inflight import wait_for_save_into
from ftrain.checkpoint._io import CheckpointError
from ftrain.checkpoint._save import raise_pending_save_error
from ftrain.checkpoint._tree import Node, describe, flatten_tree, unflatten
from ftrain.checkpoint._tree import _children as children
from ftrain.checkpoint._verify import Opened, field_hints, fits, open_checkpoint
from ftrain.checkpoint._verify import _dtype as dtype_named
from ftrain.checkpoint._verify import _is_saved_tensor as is_saved_tensor
from ftrain.optim import TorchOptimizerState, ema_swapped
from ftrain.optim import describe as optimizer_settings
from ftrain.state import TrainState
from ftrain.strategies import SingleDevice, Strategy

__all__ = [
    "CheckpointMismatchError",
    "CheckpointMismatchWarning",
    "base_differences",
    "load_checkpoint",
    "read_model_tensors",
]


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the state; `differences` lists every mismatch.

    The message opens with one line saying why (`summary`): the model config's difference
    from the checkpoint's when there is one, else (without a `cause`) the frozen weights'
    (`base_differences`) when they differ, else counts of missing / unexpected / mis-shaped
    entries. The full list follows, then `hint`: what to pass to go on anyway.
    """

    def __init__(
        self,
        path: Path,
        differences: list[str],
        *,
        cause: str | None = None,
        hint: str = "pass strict=False to load what matches",
    ) -> None:
        self.differences = differences
        frozen = [d for d in differences if d.startswith(_frozen.PREFIX)]
        self.summary = cause or _frozen.base_cause(frozen) or _count(differences)
        lines = "\n  ".join(differences)
        super().__init__(
            f"{self.summary}\ncheckpoint {path} does not match the state ({len(differences)} "
            f"difference(s)):\n  {lines}\n{hint}"
        )


def _count(differences: list[str]) -> str:
    kinds = {
        "missing": 0,
        "unexpected": 0,
        "mis-shaped": 0,
        "optimizer setting(s) changed": 0,
        "adapter setting(s) changed": 0,
        "model config setting(s) changed": 0,
        "frozen weights differ": 0,
    }
    for d in differences:
        kind = "missing" if "missing" in d else "unexpected" if "unexpected" in d else None
        if d.startswith(_SETTING):
            kind = "optimizer setting(s) changed"
        elif d.startswith(_ADAPTER):
            kind = "adapter setting(s) changed"
        elif d.startswith(_CONFIG):
            kind = "model config setting(s) changed"
        elif d.startswith(_frozen.PREFIX):
            kind = "frozen weights differ"
        kinds[kind or "mis-shaped"] += 1
    parts = [f"{n} {kind}" for kind, n in kinds.items() if n]
    return "checkpoint does not fit the state: " + ", ".join(parts) + " (details below)"


_CONFIG = "model config "  # how each line of `_config_diffs` opens
# HF config keys that do not change the function the weights compute: names and versions,
# runtime switches (a resume may turn the cache off for gradient checkpointing, or pick another
# attention kernel: the `_` keys), the init scale, label names (their count shows in the
# tensors), and dropout, which changes training, not the function (as for adapters).
_CONFIG_SKIP = frozenset(
    {
        "transformers_version", "torch_dtype", "dtype", "architectures", "use_cache",
        "output_attentions", "output_hidden_states", "return_dict", "torchscript",
        "initializer_range", "id2label", "label2id",
    }
)  # fmt: skip


def _config_compared(key: Any) -> bool:
    if not isinstance(key, str) or key.startswith("_") or key in _CONFIG_SKIP:
        return False
    return "dropout" not in key and not key.endswith("_pdrop")


def _model_config(module: torch.nn.Module) -> dict[str, Any] | None:
    """The model's HF config as the checkpoint's config.json holds it (JSON), or None."""
    to_json = getattr(getattr(module, "config", None), "to_json_string", None)
    if not callable(to_json):
        return None
    ours = json.loads(to_json())
    return ours if isinstance(ours, dict) else None


def _changed_config(saved: Any, module: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, model's value) for each compared HF config setting that both
    record and that differs; empty without two configs. `saved` comes from the file."""
    ours = _model_config(module)
    if not isinstance(saved, dict) or ours is None:
        return []
    keys = sorted(k for k in saved.keys() & ours.keys() if _config_compared(k))
    return [(k, saved[k], ours[k]) for k in keys if _compared(saved[k]) != _compared(ours[k])]


def _compared(value: Any, depth: int = 0) -> Any:
    """A nested config value without what is not compared: a `quantization_config` resumed
    with another `bnb_4bit_compute_dtype` is another precision, which is no difference."""
    if not isinstance(value, dict) or depth > 16:
        return value
    return {
        k: _compared(v, depth + 1)
        for k, v in value.items()
        if _config_compared(k) and "dtype" not in k
    }


def _config_diffs(saved: Any, module: torch.nn.Module) -> list[str]:
    """One line per HF config setting that differs (`_changed_config`): a model of the same
    tensors built with another activation, RoPE base or norm epsilon computes another
    function, and resuming it would train on silently."""
    return [
        f"{_CONFIG}{k}: checkpoint has {_short(a)}, model has {_short(b)}"
        for k, a, b in _changed_config(saved, module)
    ]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _config_cause(opened: Opened, module: torch.nn.Module) -> str | None:
    """'config differs: hidden_size 64 in the checkpoint, 32 in the model' when both have an
    HF config and they differ, else None."""
    changed = _changed_config(opened.config, module)
    if not changed:
        return None
    parts = [f"{k} {_short(a)} in the checkpoint, {_short(b)} in the model" for k, a, b in changed]
    more = f" (+{len(parts) - 3} more)" if len(parts) > 3 else ""
    return "the model's config differs from the checkpoint's: " + "; ".join(parts[:3]) + more


class CheckpointMismatchWarning(UserWarning):
    """Issued by `load_checkpoint(..., strict=False)` for what it did not load."""


def load_checkpoint(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    strict: bool = True,
    verify: bool = True,
    allow_other_base: bool = False,
) -> TrainState:
    """Load a checkpoint into `state`'s tensors (in place) and return the resumed state.

    `state` is the template: build it exactly as for a fresh run (same model, optimizer and
    strategy). Parameters, buffers and optimizer state are copied into its tensors and the
    counters are replaced; frozen parameters keep their values. `state` is consumed.

    Frozen parameters are not saved (a LoRA checkpoint holds the adapters), so they must be
    the ones the run trained on: their sums, recorded at save, are compared with the model's
    (one pass over the frozen weights). A checkpoint written before they were recorded has
    nothing to compare.

    The strategy's precision may differ from the saving run's (fp16 to bf16 on new hardware):
    a state without loss scaling drops the checkpoint's loss scale, and an fp16 state loading
    a checkpoint without one starts from its `LossScaling.init_scale`, as a fresh run does.
    Such a resume is not bit-exact; the checkpoint does not record the precision.

    Args:
        path: a `root/step-<N>` directory, e.g. from `latest_checkpoint`.
        state: the freshly created state to load into.
        strict: raise on any mismatch; False loads what matches and warns about the rest.
        verify: check every file against the SHA-256 recorded at save. Turning it off skips
            reading whole files into memory (for very large checkpoints) but lets silent
            corruption of tensor data through.
        allow_other_base: skip comparing the frozen weights with the checkpoint's, to load
            on purpose onto another base model of the same architecture (adapters trained on
            a base moved onto its chat variant).

    Returns:
        The state at the checkpoint's step, epoch and cursor.

    Raises:
        CheckpointMismatchError: (strict) listing every missing, unexpected or reshaped
            parameter and optimizer-state difference, and the frozen parameters whose weights
            differ from those the checkpoint was trained on.
        ValueError: inside `ft.optim.swap_ema(state)` (load before or after the block).

        CheckpointError: when the checkpoint is incomplete, corrupted or not a checkpoint
            (a loss scale saved without its growth tracker included).

    A checkpoint written with one number of data-parallel ranks loads with another, whole
    (DDP, one process) or sharded (FSDP) either way: torch.distributed.checkpoint reshards.
    With a process group up, call it on every rank. `cursor` counts global micro-batches, so
    keep `batch_size * ranks` the same across the change for the data order to continue
    exactly.
    """
    _check_args(path, state, strict=strict, verify=verify, allow_other_base=allow_other_base)
    if ema_swapped(state):  # the swap back would exchange what was loaded
        raise ValueError(
            "load_checkpoint inside ft.optim.swap_ema(state): the model holds the EMA average "
            "until the block ends; load before or after it"
        )
    path = Path(path)
    opened = _open_on_every_rank(path, state.strategy, verify=verify)
    meta, tensors = opened.meta, opened.tensors
    module = state.strategy.unwrap(state.model)
    live_params = state.params
    live = L.model_tensors(module, dict(live_params))
    opt_flat = flatten_tree(state.opt_state)
    # Collective when sharded: every rank opened the same checkpoint and compares alike.
    saved_base = None if allow_other_base else meta.get(L.FROZEN)
    base = _frozen.base_diffs(saved_base, meta["params"], module, state.strategy)
    if meta.get("sharded") is not True:
        _adam_counts_of_older_checkpoints(meta["optimizer"], tensors["optimizer"])
        _sgd_started_of_older_checkpoints(meta["optimizer"], tensors["optimizer"], opt_flat)
    diffs, model_pairs = _match_model(meta, tensors["model"], live, module)
    opt_diffs, opt_values = _match_optimizer(meta, tensors["optimizer"], state.opt_state, live)
    fields, field_diffs = _fields(meta, state)  # may reject the file: before anything is written
    settings = []  # same state layout (another layout is reported above): same settings?
    if not opt_diffs:
        ours = optimizer_settings(state.optimizer, list(live_params))
        settings = _settings_diffs(meta.get(L.SETTINGS), ours)
    adapter = _adapter_diffs(meta.get("peft"), L.peft_config(module))
    diffs += base + opt_diffs + field_diffs + settings + adapter
    if not diffs:  # else the config's difference opens the message (`_config_cause`) already
        diffs = _config_diffs(opened.config, module)
    if diffs and strict:
        cause = (
            _config_cause(opened, module)
            or _frozen.base_cause(base)
            or _cause(settings, _SETTING, *_CAUSES["optimizer"])
            or _cause(adapter, _ADAPTER, *_CAUSES["adapter"])
        )
        raise CheckpointMismatchError(path, diffs, cause=cause)
    lazy = sorted(p for p in opt_values if p not in opt_flat)  # a torch optimizer's own state
    if lazy and state.strategy.checkpoint_sharded:
        raise CheckpointError(
            f"{path}: the state of a from_torch optimizer ({lazy[0]}, ...) cannot be loaded "
            "into sharded (FSDP) parameters; use an ft.optim optimizer with FSDP"
        )
    if diffs:
        warnings.warn(
            f"load_checkpoint({path}) found {len(diffs)} difference(s) (what does not fit was "
            "skipped; the state of an optimizer or adapter with other settings, and the tensors "
            "of a model with another config or other frozen weights, were loaded): "
            + "; ".join(diffs),
            CheckpointMismatchWarning,
            stacklevel=2,
        )
    strategy = state.strategy
    with torch.no_grad():
        if meta.get("sharded") is True:  # the shards fill the live tensors, resharded
            read_shards(strategy, path / L.MODEL_DIR, {n: dst for n, dst, _ in model_pairs})
            targets = {
                p: opt_flat[p] if p in opt_flat else torch.empty_like(v, device=strategy.device)
                for p, v in opt_values.items()
                if isinstance(v, torch.Tensor)
            }
            read_shards(strategy, path / L.OPTIM_DIR, targets)
            opt_values.update(targets)
        else:
            for _, dst, src in model_pairs:
                strategy.copy_whole(dst, src)
        copy = strategy.copy_whole
        opt_state = unflatten(state.opt_state, opt_values, copy) if opt_values else state.opt_state
    # The shards were filled in place: whole copies an earlier forward kept must not serve the
    # next one (FSDP2's state_dict hook drops them today; this does not depend on it).
    strategy.drop_gathered(state.model)
    return state.consume("load_checkpoint", opt_state=opt_state, **fields)


def _adam_counts_of_older_checkpoints(
    entries: dict[str, Any], saved: dict[str, torch.Tensor]
) -> None:
    """An Adam state saved before `AdamState.counts` (ftrain 0.x, 2026-11-26) counted one
    step for every parameter: give each parameter that count, so the run continues as it
    would have (a whole-layout checkpoint; a sharded one still reports `counts` missing)."""
    for path, entry in list(entries.items()):
        if entry != {"node": "tuple:AdamState"}:
            continue
        at = f"{path}/" if path else ""
        steps = saved.get(f"{at}steps")
        if f"{at}counts" in entries or steps is None or entries.get(f"{at}mu") != {"node": "dict"}:
            continue
        entries[f"{at}counts"] = {"node": "dict"}
        for key in [k for k in entries if k.startswith(f"{at}mu/")]:
            name = f"{at}counts/{key[len(at) + 3 :]}"
            entries[name] = {"shape": [], "tensor": entries[f"{at}steps"]["tensor"]}
            saved[name] = steps.clone()


def _sgd_started_of_older_checkpoints(
    entries: dict[str, Any], saved: dict[str, torch.Tensor], template: dict[str, Any]
) -> None:
    """An `sgd(momentum=, dampening=)` state saved before `DampedSGDState` (2026-11-26) is an
    `SGDState` without `started`: where the state wants a `DampedSGDState`, a parameter whose
    saved buffer holds a nonzero value has started, an all-zero one has not (torch's rule
    but for a parameter whose every gradient so far was exactly zero). A whole-layout
    checkpoint; a sharded one still reports the other state."""
    for path, node in template.items():
        if node != "tuple:DampedSGDState":
            continue
        at = f"{path}/" if path else ""
        if entries.get(path) != {"node": "tuple:SGDState"} or f"{at}started" in entries:
            continue
        entries[path] = {"node": "tuple:DampedSGDState"}
        entries[f"{at}started"] = {"node": "dict"}
        for key in [k for k in entries if k.startswith(f"{at}momentum/")]:
            buffer = saved.get(key)
            if buffer is not None:
                name = f"{at}started/{key[len(at) + len('momentum/') :]}"
                entries[name] = {"tensor": "bool", "shape": []}
                saved[name] = buffer.ne(0).any()


# What a layout difference means when an older ftrain wrote the checkpoint: (saved, ours) ->
# the words after the difference.
_OLDER = MappingProxyType(
    {
        ("tuple:SGDState", "tuple:DampedSGDState"): (
            " (sgd with dampening, saved before ftrain recorded when each momentum buffer "
            "started: a whole-layout checkpoint loads as it is; this sharded one cannot, and "
            "strict=False would restart every momentum buffer)"
        ),
    }
)
_SETTING = "optimizer setting "  # how each line of `_settings_diffs` opens


def _settings_diffs(saved: Any, ours: Any, at: str = "") -> list[str]:
    """How the optimizer the checkpoint recorded (`ft.optim.describe`) differs from the
    state's: one line per setting. Nothing to compare where either side is None (a checkpoint
    written before settings were recorded, an optimizer ftrain cannot describe).

    `saved` comes from the file: any JSON, compared without trusting its shape.
    """
    try:
        return _walk_settings(saved, ours, at)
    except RecursionError:  # a forged, deeply nested record
        return [f"{_SETTING}record in the checkpoint is malformed (nested too deep)"]


def _walk_settings(saved: Any, ours: Any, at: str) -> list[str]:
    if saved is None or ours is None:
        return []
    name = at or "kind"
    if isinstance(saved, dict) and isinstance(ours, dict):
        if saved.get("kind") != ours.get("kind"):  # another optimizer: its settings differ too
            kind = f"{at}.kind" if at else "kind"
            return [_setting_line(kind, saved.get("kind"), ours.get("kind"))]
        out = []
        # A setting recorded on one side only is not compared: a later ftrain may describe
        # more of an optimizer, and the checkpoints written before must still load.
        for key in sorted(saved.keys() & ours.keys(), key=str):
            sub = f"{at}.{key}" if at else str(key)
            out += _walk_settings(saved[key], ours[key], sub)
        return out
    nested = any(isinstance(v, (dict, list)) for v in (*_items(saved), *_items(ours)))
    if isinstance(saved, list) and isinstance(ours, list) and len(saved) == len(ours) and nested:
        return [
            d
            for i, (a, b) in enumerate(zip(saved, ours, strict=True))
            for d in _walk_settings(a, b, f"{at}.{i}")
        ]
    same = saved == ours and (type(saved) is bool) == (type(ours) is bool)
    return [] if same else [_setting_line(name, saved, ours)]


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _setting_line(name: str, saved: Any, ours: Any) -> str:
    def short(v: Any) -> str:
        text = repr(v)
        return text if len(text) <= 80 else text[:77] + "..."

    return f"{_SETTING}{name}: checkpoint has {short(saved)}, state has {short(ours)}"


# The first line of a load refused for settings alone: (what differs, how to go on).
_CAUSES = MappingProxyType(
    {
        "optimizer": (
            "the optimizer differs from the checkpoint's",
            "build the state with the checkpoint's optimizer, or pass strict=False to load its "
            "state into this one",
        ),
        "adapter": (
            "the model's LoRA adapter differs from the checkpoint's",
            "apply the adapter with the checkpoint's settings (its state.json holds them "
            "under 'peft')",
        ),
    }
)


def _cause(diffs: list[str], prefix: str, what: str, fix: str) -> str | None:
    """`what: <first two differences> (+n more); fix`, or None without differences."""
    if not diffs:
        return None
    first = "; ".join(d.removeprefix(prefix) for d in diffs[:2])
    more = f" (+{len(diffs) - 2} more)" if len(diffs) > 2 else ""
    return f"{what}: {first}{more}; {fix}"


_ADAPTER = "adapter setting "  # how each line of `_adapter_diffs` opens
# The LoRA settings that change the function the adapters compute with tensors of the same
# names and shapes: another lora_alpha (or rsLoRA) scales every adapter's output otherwise.
# (Targets, ranks and biases show in the tensors' names and shapes, compared anyway; a
# dropout changes training, not the function, as a model's own dropout does.)
_ADAPTER_KEYS = ("lora_alpha", "alpha_pattern", "use_rslora", "use_dora", "fan_in_fan_out")


def _adapter_diffs(saved: Any, ours: dict[str, Any] | None) -> list[str]:
    """How the PEFT adapter the checkpoint was saved with differs from the model's: one line
    per setting in `_ADAPTER_KEYS` that both record. `saved` comes from the file: any JSON."""
    if not isinstance(saved, dict) or ours is None:
        return []
    return [
        f"{_ADAPTER}{k}: checkpoint has {saved[k]!r}, model has {ours[k]!r}"
        for k in _ADAPTER_KEYS
        if k in saved and k in ours and saved[k] != ours[k]
    ]


def _check_args(path: Any, state: Any, **flags: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"path must be a checkpoint directory (str or Path, e.g. from latest_checkpoint), "
            f"got {type(path).__name__}"
        )
    if not isinstance(state, TrainState):
        raise TypeError(
            f"state must be the ft.TrainState to load into (TrainState.create(...)), got "
            f"{type(state).__name__}"
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def base_differences(opened: Opened, module: torch.nn.Module) -> list[str]:
    """One line per frozen parameter of `module` whose weights differ from the base `opened`
    was trained on (its `frozen_sums`), as `load_checkpoint` compares them; empty when they
    match or the checkpoint predates the record. For tools that put a checkpoint onto a base
    model without a `TrainState` (`ft.export_checkpoint`). One process, any device.

    Example:
        >>> import tempfile, torch, ftrain as ft
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> _ = model[0].requires_grad_(False)
        >>> state = ft.TrainState.create(model, ft.optim.sgd())
        >>> path = ft.save_checkpoint(state, tempfile.mkdtemp())
        >>> opened = ft.checkpoint.open_checkpoint(path, keep=())
        >>> ft.checkpoint.base_differences(opened, model)
        []
        >>> with torch.no_grad():
        ...     _ = model[0].bias.add_(1.0)
        >>> [d.split(":")[0] for d in ft.checkpoint.base_differences(opened, model)]
        ['frozen weights 0.bias']
    """
    device = next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))
    meta = opened.meta
    return _frozen.base_diffs(meta.get(L.FROZEN), meta["params"], module, SingleDevice(device))


def read_model_tensors(
    opened: Opened, *, weights: Literal["live", "ema"] = "live", live_buffers: bool = False
) -> dict[str, torch.Tensor]:
    """The model's tensors (trainable parameters and persistent buffers) of a checkpoint that
    `open_checkpoint(path, keep=["model"])` opened, whole and on the CPU.

    A whole-layout checkpoint's were read by `open_checkpoint` already; a sharded one's are
    assembled here from every rank's shard files, in this one process. For tools that read
    a checkpoint without a `TrainState` (`ft.export_checkpoint`); training resumes with
    `load_checkpoint`.

    Args:
        opened: the checkpoint (with `keep=["model", "optimizer"]` for `weights="ema"` of a
            whole-layout checkpoint: the averages are optimizer state).
        weights: "live", the weights training goes on from; "ema", each trainable parameter's
            EMA average (`ft.optim.ema`, what evaluation inside `swap_ema` uses) in its place,
            buffers as saved.
        live_buffers: with `weights="ema"`, accept running statistics (BatchNorm's
            `running_mean`/`running_var`), which `ft.optim.ema` does not average: they are the
            live weights', as `swap_ema(state, live_buffers=True)` accepts them.

    Raises:
        ValueError: if `opened` was opened without the tensors `weights` needs; for
            `weights="ema"` of a checkpoint without an EMA average of every trainable
            parameter, or with running statistics and not `live_buffers=True`.
        CheckpointError: if the shard files cannot be read.
    """
    if weights not in ("live", "ema"):
        raise ValueError(f"weights must be 'live' or 'ema', got {weights!r}")
    if "model" not in opened.tensors:
        raise ValueError('open the checkpoint with keep=["model"] to read its model tensors')
    if not isinstance(live_buffers, bool):
        raise TypeError(f"live_buffers must be True or False, got {live_buffers!r}")
    shapes = opened.tensors["model"]
    sharded = opened.meta.get("sharded") is True
    averages = _ema_paths(opened) if weights == "ema" else {}
    if averages and not live_buffers:
        _refuse_running_stats(opened, shapes)
    if averages and not sharded and "optimizer" not in opened.tensors:
        raise ValueError(
            'open the checkpoint with keep=["model", "optimizer"] to read its EMA averages'
        )
    if not sharded:
        saved = opened.tensors.get("optimizer", {})
        return {**shapes, **{n: saved[p] for n, p in averages.items()}}
    whole = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in shapes.items()}
    read_shards(SingleDevice("cpu"), opened.path / L.MODEL_DIR, whole)
    if averages:
        records = opened.meta["optimizer"]
        ema = {p: torch.empty(records[p]["shape"], dtype=dtype_named(records[p]["tensor"]))
               for p in averages.values()}  # fmt: skip
        read_shards(SingleDevice("cpu"), opened.path / L.OPTIM_DIR, ema)
        whole.update({n: ema[p] for n, p in averages.items()})
    return whole


_RUNNING_STATS = (".running_mean", ".running_var")  # BatchNorm's, as swap_ema finds them


def _refuse_running_stats(opened: Opened, shapes: Mapping[str, Any]) -> None:
    """Refuse EMA weights beside running statistics of the live weights (as `swap_ema` does):
    the exported average would normalise with statistics it never produced."""
    trained = {r[0] for r in opened.meta["params"]}
    stats = sorted(n for n in shapes if n not in trained and ("." + n).endswith(_RUNNING_STATS))
    if stats:
        raise ValueError(
            f"weights='ema', but {opened.path} holds running statistics {stats[:4]}, which "
            "ft.optim.ema does not average: they are the live weights', and the averaged "
            "model would normalise with them (timm's ModelEmaV2 averages them). Pass "
            "live_buffers=True (export --live-buffers) to take them anyway, as "
            "swap_ema(state, live_buffers=True) does, or export the live weights "
            "(weights='live')"
        )


def _ema_paths(opened: Opened) -> dict[str, str]:
    """Trainable parameter -> its EMA average's path; raises unless every one has one."""
    averages = opened.ema_averages
    trainable = [r[0] for r in opened.meta["params"] if r[3] is True]
    if not averages:
        raise ValueError(
            f"weights='ema', but {opened.path} holds no EMA average (its optimizer was not "
            "wrapped in ft.optim.ema): export its weights as they are (weights='live')"
        )
    missing = [n for n in trainable if n not in averages]
    if missing:
        covered = len(trainable) - len(missing)
        raise ValueError(
            f"weights='ema', but the EMA averages of {opened.path} cover {covered} of its "
            f"{len(trainable)} trainable parameters (ft.optim.ema inside a partition?), not "
            f"e.g. {missing[:3]}: the export would mix averaged and live weights; export the "
            "live weights (weights='live')"
        )
    return {n: averages[n] for n in trainable}


def read_shards(strategy: Strategy, directory: Path, targets: dict[str, torch.Tensor]) -> None:
    """Fill `targets` (the strategy's tensors) from verified shards, resharded by the strategy;
    collective with several ranks."""
    try:
        strategy.load_shards(directory, targets)
    except Exception as e:  # the files were verified: I/O, or tensors that do not fit
        raise CheckpointError(f"reading the shards in {directory} failed: {e}") from e


def _open_on_every_rank(path: Path, strategy: Strategy, *, verify: bool) -> Opened:
    """Open the checkpoint; with several ranks, make sure every rank opened the same one.

    Ranks can see different files (node-local run folders, a copy lagging behind): each
    would resume from its own step with its own parameters, silently. So every rank takes
    part in one small all-reduce, whether its own open failed or not, and all raise
    `CheckpointError` unless every rank read a checkpoint with the same `state.json` digest
    (which covers the step and every file's digest). A rank's failed background save is
    raised there too: raised before, it left the other ranks waiting in the barrier.
    """
    if strategy.world_size <= 1 and not strategy.checkpoint_sharded:  # one process
        raise_pending_save_error()
        return open_checkpoint(path, verify=verify)
    opened: Opened | None = None
    error: BaseException | None = None
    try:  # with DDP only rank 0 writes: its background save into the folder commits first
        raise_pending_save_error()  # one rank's failed save: it raises after the all-reduce
        wait_for_save_into(path)
    except Exception as e:  # every rank must reach the barrier and the all-reduce below
        error = e
    strategy.barrier()  # then every rank opens what it committed, not the folder before it
    try:
        if error is None:
            opened = open_checkpoint(path, verify=verify)
    except Exception as e:  # every rank must reach the all-reduce below, or the others hang
        error = e
    # 24-bit pieces of (digest, step), and their squares: the values are equal on every rank
    # iff n * sum(x^2) == sum(x)^2 (Cauchy-Schwarz), and int64 sums of them are exact. The
    # ranks count themselves (the leading 1) rather than trusting world_size.
    step = opened.meta["fields"]["step"] if opened else 0
    key = int(opened.digest[:12], 16) if opened else 0
    pieces = [key >> 24, key & 0xFFFFFF, (step >> 24) & 0xFFFFFF, step & 0xFFFFFF]
    flat = [1, int(opened is not None), *pieces, *(x * x for x in pieces)]
    local = torch.tensor(flat, dtype=torch.int64, device=strategy.device)
    total = strategy.sum_over_processes(local).tolist()  # a host sync: once per load
    if error is not None or opened is None:
        raise error or CheckpointError(f"cannot read {path}")
    ranks, readable, sums, squares = total[0], total[1], total[2:6], total[6:10]
    if readable != ranks:
        raise CheckpointError(
            f"{ranks - readable} of {ranks} ranks could not read {path} or raised a failed "
            "background save; see their errors"
        )
    if any(ranks * q != s * s for s, q in zip(sums, squares, strict=True)):
        raise CheckpointError(
            f"the {ranks} ranks opened different checkpoints at {path} (this rank: step "
            f"{step}, state.json {opened.digest[:12]}): with node-local run folders each rank "
            "resumes from its own copy; give every rank the same checkpoint (shared storage)"
        )
    return opened


def _match_model(
    meta: dict[str, Any],
    saved: dict[str, torch.Tensor],
    live: dict[str, torch.Tensor],
    module: torch.nn.Module,
) -> tuple[list[str], list[tuple[str, torch.Tensor, torch.Tensor]]]:
    diffs, pairs = [], []
    for name in sorted(live.keys() - saved.keys()):
        diffs.append(f"missing from checkpoint: {name} {describe(live[name])}")
    for name in sorted(saved.keys() - live.keys()):
        diffs.append(f"unexpected in checkpoint: {name} {describe(saved[name])}")
    for name in sorted(live.keys() & saved.keys()):
        dst, src = live[name], saved[name]
        if dst.shape != src.shape or dst.dtype != src.dtype:
            diffs.append(f"{name}: checkpoint has {describe(src)}, model has {describe(dst)}")
        else:
            pairs.append((name, dst, src))
    return diffs + _match_frozen(meta["params"], module), pairs


def _match_frozen(table: list[list[Any]], module: torch.nn.Module) -> list[str]:
    """The frozen parameters that differ from the checkpoint's parameter table.

    They are not saved (a LoRA checkpoint holds the adapter): they come from the model loaded
    into, so a base with another frozen module, or in another dtype, would silently continue a
    different model. (A parameter trainable on one side only is reported with the tensors.)
    """
    rows = {r[0]: r for r in table}
    diffs, names = [], set()
    for name, p in module.named_parameters():
        names.add(name)
        row = rows.get(name)
        if p.requires_grad or (row is not None and row[3] is True):
            continue
        if row is None:
            diffs.append(f"frozen parameter missing from checkpoint: {name} {describe(p)}")
        elif list(p.shape) != row[2] or str(p.dtype).removeprefix("torch.") != row[1]:
            diffs.append(f"frozen {name}: checkpoint has {row[1]}{row[2]}, model has {describe(p)}")
    for name, dtype, shape, trainable in table:
        if trainable is False and name not in names:
            diffs.append(f"unexpected frozen parameter in checkpoint: {name} {dtype}{shape}")
    return diffs


def _match_optimizer(
    meta: dict[str, Any],
    saved: dict[str, torch.Tensor],
    opt_state: Any,
    live: dict[str, torch.Tensor],
) -> tuple[list[str], dict[str, Any]]:
    entries: dict[str, Any] = meta["optimizer"]
    template = flatten_tree(opt_state)
    diffs: list[tuple[str, str]] = []  # (path, message)
    values: dict[str, Any] = {}
    for p, want in template.items():
        got = entries.get(p)
        if got is None:
            diffs.append((p, f"optimizer state missing from checkpoint: {p or '<root>'}"))
        elif describe(want) != _describe_saved(got, saved.get(p)):
            has = _describe_saved(got, saved.get(p))
            diffs.append(
                (
                    p,
                    f"optimizer state {p or '<root>'}: checkpoint has {has}, state has "
                    f"{describe(want)}" + _OLDER.get((has, describe(want)), ""),
                )
            )
        elif not isinstance(want, Node):
            values[p] = saved[p] if "tensor" in got else got["value"]
    torch_states = _torch_states(opt_state)
    for p in sorted(entries.keys() - template.keys()):
        root = next((r for r in torch_states if _under(p, r)), None)
        if root is None:
            diffs.append((p, f"optimizer state unexpected in checkpoint: {p}"))
            continue
        # A torch optimizer creates its state lazily, so the template has none to compare:
        # each entry is checked against the parameter it belongs to.
        rest = p[len(root) + 1 :] if root else p
        problem = _torch_entry_problem(rest, entries[p], saved.get(p), live, torch_states[root])
        if problem is not None:
            diffs.append((p, f"optimizer state {p}: {problem}"))
        elif "tensor" in entries[p]:
            values[p] = saved[p]
        elif "value" in entries[p]:
            values[p] = entries[p]["value"]
    # Report a container of another type once, not again for everything below it.
    heads = [p for p, _ in diffs if isinstance(template.get(p), Node)]
    report = [m for p, m in diffs if not any(_under(p, h) and p != h for h in heads)]
    # A partial optimizer state is worse than a fresh one: load none of it on a mismatch.
    return report, ({} if report else values)


def _torch_states(tree: Any, prefix: str = "") -> dict[str, TorchOptimizerState]:
    """Path -> live torch optimizer (from `ft.optim.from_torch`) inside an optimizer state."""
    if isinstance(tree, TorchOptimizerState):
        return {prefix: tree}
    if isinstance(tree, (torch.Tensor, bool, int, float, str, type(None))):
        return {}
    out: dict[str, TorchOptimizerState] = {}
    for key, child in children(tree):
        out.update(_torch_states(child, f"{prefix}/{key}" if prefix else key))
    return out


def _torch_entry_problem(
    rest: str,
    entry: dict[str, Any],
    tensor: torch.Tensor | None,
    live: dict[str, torch.Tensor],
    holder: TorchOptimizerState,
) -> str | None:
    """What is wrong with one saved `<param>/<key>` entry of a torch optimizer's state, if any.

    (Where the live optimizer already holds state, the template has it and is compared
    exactly.) The entry must be a number or a tensor that fits the parameter: 0-dim (`step`), of the
    parameter's shape, or, for optimizers that keep factored or quantized state (Adafactor,
    bitsandbytes), a factor broadcasting to it or a 1-D table. A wrong shape would reach the
    fused kernels (out-of-bounds reads), a string would fail at the next step.
    """
    parts = rest.split("/")
    param = live.get(parts[0])
    if param is None:
        return "state for a parameter the model does not have"
    if len(parts) == 1:
        return None if entry == {"node": "dict"} else f"malformed entry {entry!r}"
    if len(parts) != 2:
        return "nested deeper than <parameter>/<key>"
    if "value" in entry:
        value = entry["value"]
        ok = isinstance(value, (bool, int, float, type(None)))
        return None if ok else f"a {type(value).__name__} where a number or tensor belongs"
    if "tensor" not in entry or tensor is None:
        return f"malformed entry {entry!r}"
    has = describe(tensor)
    cls = type(holder.optimizer)
    factored = cls.__name__ == "Adafactor" or not cls.__module__.startswith("torch.optim")
    shape, pshape = list(tensor.shape), list(param.shape)
    if tensor.dim() == 0:
        return None
    if shape == pshape:
        quantized = factored and tensor.dtype in (torch.uint8, torch.int8)
        if param.is_floating_point() and not (tensor.is_floating_point() or quantized):
            return f"checkpoint has {has} for a {describe(param)} parameter"
        return None
    broadcasts = len(shape) == len(pshape) and all(
        a in (1, b) for a, b in zip(shape, pshape, strict=True)
    )
    if factored and (broadcasts or tensor.dim() == 1):
        return None
    return f"checkpoint has {has}, which does not fit the parameter ({describe(param)})"


def _under(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + "/")


def _describe_saved(entry: dict[str, Any], tensor: torch.Tensor | None) -> str:
    if "node" in entry:
        return str(entry["node"])
    if "tensor" in entry:
        return describe(tensor) if tensor is not None else "a tensor missing from the file"
    return type(entry.get("value")).__name__


def _fields(meta: dict[str, Any], state: TrainState) -> tuple[dict[str, Any], list[str]]:
    """The saved counters as `state.replace` keywords, checked against the types the state's
    fields declare; and the 0-dim tensor fields saved in another dtype than the state's (left
    as they are in `state`, like a re-typed parameter).

    `open_checkpoint` has checked them against `TrainState`'s fields; this adds the fields a
    subclass declares and what depends on the live state (a tensor field's dtype and device).
    """
    out: dict[str, Any] = {}
    diffs: list[str] = []
    saved = meta["fields"]
    _check_scaler_pair(saved)
    hints = field_hints(type(state))
    for name, current in L.leaves(state).items():
        if name not in saved:
            continue
        value, hint = saved[name], hints.get(name)
        malformed = CheckpointError(f"state field {name!r} is malformed: {value!r}")
        if hint == "tensor?" and (value is None or current is None):
            # e.g. the float16 loss scale, saved by an fp16 run and resumed in bf16 or the
            # other way round (a documented change of precision, docs/checkpoints.md): the new
            # run keeps its own value, None or a fresh init_scale.
            if value is not None and not is_saved_tensor(value):
                raise malformed
            continue
        tensor = isinstance(current, torch.Tensor)
        if tensor or (hint in (None, "tensor") and isinstance(value, dict)):
            if not is_saved_tensor(value):
                raise malformed
            dtype = dtype_named(value["dtype"])
            if tensor and dtype != current.dtype:  # a cast would round (float64 -> float32)
                has = str(current.dtype).removeprefix("torch.")
                diffs.append(
                    f"state field {name}: checkpoint has {value['dtype']}, state has {has}"
                )
                continue
            device = current.device if tensor else state.strategy.device
            out[name] = torch.tensor(value["value"], dtype=dtype, device=device)
        elif fits(value, hint if isinstance(hint, set) else None):
            out[name] = value
        else:
            raise malformed
    return L.with_leaves(state, out), diffs


def _check_scaler_pair(saved: dict[str, Any]) -> None:
    """Refuse a loss scale saved without its growth tracker or the reverse: a save writes both
    or neither, and half would resume a scale with a fresh tracker (or none at all)."""
    names = ("scaler.scale", "scaler.growth_tracker")
    present = [saved.get(n) is not None for n in names]
    if present[0] != present[1]:
        has, lacks = names if present[0] else names[::-1]
        raise CheckpointError(
            f"state field {has!r} is saved without {lacks!r}: a save writes both or neither "
            "(a forged or edited state.json)"
        )
