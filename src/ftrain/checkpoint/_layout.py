"""The on-disk layout of one checkpoint and what goes into its JSON (see docs/checkpoints.md).

```
root/step-<N>/
  model.safetensors      trainable parameters and persistent buffers, by module name
  optimizer.safetensors  optimizer-state tensors, by path (`mu/lm_head.weight`)
  state.json             counters, metrics, versions, fingerprint, file checksums
  config.json            the model's HF config, when it has one (for export)
  COMMITTED              written last: the digest of state.json
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ftrain.checkpoint._io import CheckpointError

__all__ = [
    "COMMIT_FILE",
    "CONFIG_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "MODEL_FILE",
    "OPTIM_FILE",
    "STATE_FILE",
    "STEP_DIR",
    "TMP_PREFIX",
    "fingerprint",
    "is_committed",
    "model_tensors",
    "param_table",
    "plain_fields",
    "step_dir",
]

FORMAT = "ftrain.checkpoint"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
CONFIG_FILE = "config.json"
COMMIT_FILE = "COMMITTED"
STEP_DIR = re.compile(r"step-(\d+)")
TMP_PREFIX = ".tmp-"

# TrainState fields that are not plain values: handled as tensors/objects, or not saved at all.
NOT_PLAIN = {"model_", "optimizer", "opt_state_", "strategy", "params_", "lease_"}


def model_tensors(module: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trainable parameters plus persistent buffers (e.g. BatchNorm statistics) by name.

    Frozen parameters are not saved: they come from the model the state is loaded into.
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


def plain_fields(state: Any) -> dict[str, Any]:
    """The state's counters as JSON: plain values as they are, 0-dim tensors with their dtype.

    Works for subclasses of TrainState too: every extra dataclass field is saved the same way.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(state):
        if f.name in NOT_PLAIN:
            continue
        v = getattr(state, f.name)
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            # .item() is a host sync; saving is the place for it.
            out[f.name] = {"dtype": str(v.dtype).removeprefix("torch."), "value": v.item()}
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[f.name] = v
        else:
            raise CheckpointError(
                f"TrainState field {f.name!r} holds a {type(v).__name__}, which a checkpoint "
                "cannot store: use plain numbers, strings or 0-dim tensors"
            )
    return out


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def is_committed(path: Path) -> bool:
    return (path / COMMIT_FILE).is_file()
