"""The on-disk layout of one checkpoint and what goes into its JSON (see docs/checkpoints.md).

```
root/step-<N>/
  model.safetensors      trainable parameters and persistent buffers, by module name
  optimizer.safetensors  optimizer-state tensors, by path (`mu/lm_head.weight`)
  state.json             counters, metrics, versions, fingerprint, file checksums, the
                         frozen weights' sums (`_frozen`)
  config.json            the model's HF config, when it has one (for export; generation
                         config, class and adapters are in state.json)
  COMMITTED              written last: the digest of state.json
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ftrain.checkpoint import _frozen
from ftrain.checkpoint._io import CheckpointError
from ftrain.checkpoint._tree import Node, flatten_tree
from ftrain.optim import describe, live_tensors
from ftrain.state import plain_values
from ftrain.version import __version__

FORMAT = "ftrain.checkpoint"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
CONFIG_FILE = "config.json"
COMMIT_FILE = "COMMITTED"
STEP_DIR = re.compile(r"step-(\d+)")
TMP_PREFIX = ".tmp-"
RANKING = "ranking"  # state.json: how a save with best_metric ranked checkpoints (rotation)
# state.json: the optimizer as `ft.optim.describe` gives it (recorded since 2026-11-26)
SETTINGS = "optimizer_settings"
# state.json: true for a save that `should_save` asked for only because of a preemption (a step
# its cadence skips); the guard's rollback passes over it. Absent (older ones too): a cadence save.
PREEMPTION_ONLY = "preemption_only"

MODEL_DIR = "model"  # sharded layout: one shard file per rank in each of these
OPTIM_DIR = "optimizer"
SHARDED_CONFIG = "config_file"  # sharded layout: config.json's size and digest ("files": shards)
# state.json, each optional on read (absent in older checkpoints; covered by COMMITTED's digest):
GENERATION = "generation_config"  # the model's GenerationConfig as `save_pretrained` writes it
MODEL_CLASS = "model_class"  # the HF model's class name (a classifier's config may not say)
ADAPTERS = "peft_adapters"  # every PEFT adapter's config by name ("peft": the active one's)
FROZEN = _frozen.KEY  # each frozen parameter's [sum, sum of squares] (since 2026-11-27)

PLAIN = (bool, int, float, str)  # JSON values
# TrainState fields that are not plain values: handled as tensors/objects, or not saved at all.
NOT_PLAIN = frozenset({"tensors_", "optimizer", "strategy"})


def model_tensors(module: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trainable parameters plus persistent buffers (e.g. BatchNorm statistics) by name.

    Frozen parameters are not saved: they come from the model the state is loaded into (their
    sums are recorded, `_frozen`).
    """
    persistent = module.state_dict(keep_vars=True).keys()
    buffers = {n: b for n, b in module.named_buffers() if n in persistent}
    return {**params, **buffers}


def param_table(module: nn.Module) -> list[list[Any]]:
    """[name, dtype, shape, trainable] for every parameter, frozen ones included."""
    return [
        [n, str(p.dtype).removeprefix("torch."), list(p.shape), p.requires_grad]
        for n, p in module.named_parameters()
    ]


def fingerprint(table: list[list[Any]]) -> str:
    """A short digest of a parameter table: equal models have equal fingerprints."""
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16]


def leaves(state: Any) -> dict[str, Any]:
    """The state's plain values by dotted name (`ftrain.state.plain_values`)."""
    return plain_values(state)


def with_leaves(state: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """`state.replace` keywords that set the dotted `values` (sub-states rebuilt)."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for name, v in values.items():
        head, _, rest = name.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = v
        else:
            top[head] = v
    for head, sub in nested.items():
        inner = getattr(state, head)
        top[head] = dataclasses.replace(inner, **with_leaves(inner, sub))
    return top


def plain_fields(state: Any) -> dict[str, Any]:
    """The state's counters as JSON: plain values as they are, 0-dim tensors with their dtype.

    Works for subclasses of TrainState too: every extra dataclass field is saved the same way.
    """
    out: dict[str, Any] = {}
    for name, v in leaves(state).items():
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            # Read by `_save._ready` once staged: a background save never syncs here.
            out[name] = {"dtype": str(v.dtype).removeprefix("torch."), "value": v.detach()}
        elif v is None or isinstance(v, PLAIN):
            out[name] = v
        else:
            raise CheckpointError(
                f"TrainState field {name!r} holds a {type(v).__name__}, which a checkpoint "
                "cannot store: use plain numbers, strings or 0-dim tensors"
            )
    return out


@dataclasses.dataclass
class Contents:
    """Everything one checkpoint holds, collected from a state before anything is written."""

    step: int
    model: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]
    meta: dict[str, Any]  # state.json without "files" (added once the files are written)
    config: str | None  # the model's HF config.json
    ready: Callable[[], None] | None = None  # waits for staging copies still in flight


def collect(state: Any, metrics: Mapping[str, Any] | None, *, sharded: bool) -> Contents:
    """The tensors (live, not copied) and the JSON of a checkpoint of `state`.

    Counters, metrics and the frozen weights' sums that are tensors stay tensors (no host
    sync): `_save._ready` reads them. Collective under a sharded layout (the frozen sums).
    """

    module = state.strategy.unwrap(state.model)
    # First, before anything that may fail on one process only: collective when sharded.
    frozen = _frozen.frozen_sums(_frozen.frozen_parameters(module), state.strategy)
    params, opt_state = live_tensors(state)  # the live weights, inside `swap_ema` too
    opt_flat = flatten_tree(opt_state)
    model = {n: t.detach() for n, t in model_tensors(module, dict(params)).items()}
    optim = {p: v.detach() for p, v in opt_flat.items() if isinstance(v, torch.Tensor)}
    table = param_table(module)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ftrain_version": __version__,
        "torch_version": torch.__version__,
        "fields": plain_fields(state),
        "metrics": _metrics(metrics),
        "world_size": state.strategy.world_size,
        "params": table,
        "fingerprint": fingerprint(table),
        "optimizer": {p: _entry(v) for p, v in opt_flat.items()},
        FROZEN: frozen,  # a `_frozen.Sums` of device tensors until `_save._ready` reads it
    }
    settings = describe(state.optimizer, list(params))
    if settings is not None:  # compared by load_checkpoint (None: one ftrain cannot describe)
        meta[SETTINGS] = settings
    if sharded:  # the shards' headers hold pieces: record each whole tensor
        meta.update(sharded=True, tensors={n: _entry(t) for n, t in model.items()})
    meta.update(_export_records(module))
    to_json = getattr(getattr(module, "config", None), "to_json_string", None)
    return Contents(state.step, model, optim, meta, to_json() if callable(to_json) else None)


def _export_records(module: Any) -> dict[str, Any]:
    """What `export_checkpoint` needs besides config.json: the adapters, the class, the
    generation settings (each key only when the model has it)."""
    out: dict[str, Any] = {}
    adapters = peft_configs(module)
    if adapters:
        out[ADAPTERS] = adapters
        active = peft_config(module, adapters)
        if active is not None:
            out["peft"] = active
    unwrap = getattr(module, "get_base_model", None)  # a PeftModel: the HF model inside
    inner = unwrap() if callable(unwrap) else module
    if callable(getattr(getattr(inner, "config", None), "to_json_string", None)):
        out[MODEL_CLASS] = type(inner).__name__
    generation = getattr(inner, "generation_config", None)
    to_json = getattr(generation, "to_json_string", None)
    if callable(to_json):  # as `save_pretrained` writes generation_config.json
        out[GENERATION] = dict(json.loads(to_json(use_diff=True)))
    return out


def _entry(leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, Node):
        return {"node": str(leaf)}
    if isinstance(leaf, torch.Tensor):
        return {"tensor": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape)}
    return {"value": leaf}


def _metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        scalar = isinstance(v, torch.Tensor) and v.numel() == 1
        if not isinstance(k, str) or not (scalar or v is None or isinstance(v, PLAIN)):
            raise CheckpointError(f"metric {k!r}={v!r} is not a string key with a plain value")
        if scalar:
            v = v.detach().reshape(())  # read by `_save._ready`, once staged
        out[k] = v
    return out


def peft_config(
    module: Any, configs: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any] | None:
    """The config of a PEFT model's active adapter as JSON, whatever its name (compared by
    `load_checkpoint`: only the active adapter trains, so only its tensors are saved), or None.
    `configs`: `peft_configs(module)` when the caller has it already.
    """
    configs = peft_configs(module) if configs is None else configs
    if not configs:
        return None
    if len(configs) == 1:
        return next(iter(configs.values()))
    try:
        active = module.active_adapter
    except (AttributeError, ValueError):  # several active adapters: none is "the" adapter
        return None
    return configs.get(active) if isinstance(active, str) else None


def peft_configs(module: Any) -> dict[str, dict[str, Any]] | None:
    """Every adapter config of a PEFT model as JSON, by adapter name, or None."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    return {str(name): _adapter_json(c) for name, c in configs.items()}


def _adapter_json(config: Any) -> dict[str, Any]:
    as_json = json.dumps(
        config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)
    )
    return dict(json.loads(as_json))
