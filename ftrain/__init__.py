"""ftrain: a functional training-step toolkit for PyTorch.

Small pure functions over an immutable `TrainState`; you write the loop.

This file only re-exports. The core (what the README loop, checkpoints and strategies need) is
imported eagerly; the extras in `ftrain/extras/` (fine-tuning recipes, `func`, logging, the
guard, testing helpers, the CLI) load when first used, so `import ftrain` stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ftrain import checkpoint as checkpoint
from ftrain import data as data
from ftrain import losses as losses
from ftrain import optim as optim
from ftrain import precision as precision
from ftrain import schedules as schedules
from ftrain import strategies as strategies
from ftrain.checkpoint import CheckpointError as CheckpointError
from ftrain.checkpoint import latest_checkpoint as latest_checkpoint
from ftrain.checkpoint import load_checkpoint as load_checkpoint
from ftrain.checkpoint import save_checkpoint as save_checkpoint
from ftrain.checkpoint import wait_for_checkpoint as wait_for_checkpoint
from ftrain.data import make_batches as make_batches
from ftrain.data import pad_collate as pad_collate
from ftrain.eval import classification_metrics as classification_metrics
from ftrain.eval import evaluate as evaluate
from ftrain.eval import predict as predict
from ftrain.grads import Grads as Grads
from ftrain.grads import Stats as Stats
from ftrain.grads import accumulate_grads as accumulate_grads
from ftrain.predicates import should_eval as should_eval
from ftrain.predicates import should_log as should_log
from ftrain.predicates import should_save as should_save
from ftrain.predicates import should_stop as should_stop
from ftrain.predicates import track_best as track_best
from ftrain.schedules import schedule_lr as schedule_lr
from ftrain.state import ConsumedStateError as ConsumedStateError
from ftrain.state import TrainState as TrainState
from ftrain.state import next_epoch as next_epoch
from ftrain.state import snapshot as snapshot
from ftrain.step import StepInfo as StepInfo
from ftrain.step import clip_and_step as clip_and_step
from ftrain.version import __version__ as __version__

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from ftrain.extras import func as func
    from ftrain.extras import generation as generation
    from ftrain.extras import guard as guard
    from ftrain.extras import logging as logging
    from ftrain.extras import lora as lora
    from ftrain.extras import preference as preference
    from ftrain.extras import rl as rl
    from ftrain.extras import sft as sft
    from ftrain.extras import testing as testing
    from ftrain.extras.chunked_loss import chunked_causal_lm_loss as chunked_causal_lm_loss
    from ftrain.extras.generation import generate as generate
    from ftrain.extras.generation import multiple_choice_metrics as multiple_choice_metrics
    from ftrain.extras.hf_export import export_checkpoint as export_checkpoint
    from ftrain.extras.hf_export import export_pretrained as export_pretrained

# name -> (module, attribute or None for the module itself): imported on first access.
_LAZY: Mapping[str, tuple[str, str | None]] = MappingProxyType(
    {
        "func": ("ftrain.extras.func", None),
        "generation": ("ftrain.extras.generation", None),
        "guard": ("ftrain.extras.guard", None),
        "logging": ("ftrain.extras.logging", None),
        "lora": ("ftrain.extras.lora", None),
        "preference": ("ftrain.extras.preference", None),
        "rl": ("ftrain.extras.rl", None),
        "sft": ("ftrain.extras.sft", None),
        "testing": ("ftrain.extras.testing", None),
        "chunked_causal_lm_loss": ("ftrain.extras.chunked_loss", "chunked_causal_lm_loss"),
        "generate": ("ftrain.extras.generation", "generate"),
        "multiple_choice_metrics": ("ftrain.extras.generation", "multiple_choice_metrics"),
        "export_checkpoint": ("ftrain.extras.hf_export", "export_checkpoint"),
        "export_pretrained": ("ftrain.extras.hf_export", "export_pretrained"),
    }
)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ftrain' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    # state
    "TrainState",
    "ConsumedStateError",
    "snapshot",
    "next_epoch",
    # the step
    "make_batches",
    "pad_collate",
    "accumulate_grads",
    "Grads",
    "Stats",
    "clip_and_step",
    "StepInfo",
    "schedule_lr",
    # cadence
    "should_log",
    "should_eval",
    "should_save",
    "should_stop",
    "track_best",
    "evaluate",
    "predict",
    "classification_metrics",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "wait_for_checkpoint",
    "CheckpointError",
    # core namespaces
    "checkpoint",
    "data",
    "losses",
    "optim",
    "precision",
    "schedules",
    "strategies",
    # extras (loaded on first use)
    "chunked_causal_lm_loss",
    "export_checkpoint",
    "export_pretrained",
    "generate",
    "multiple_choice_metrics",
    "func",
    "generation",
    "guard",
    "logging",
    "lora",
    "preference",
    "rl",
    "sft",
    "testing",
]
