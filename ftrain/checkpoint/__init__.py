"""Checkpoints (`ft.checkpoint`): atomic, pickle-free saves, exact resume.

The loop needs `save_checkpoint`, `load_checkpoint`, `latest_checkpoint` (also at the top level,
`ft.save_checkpoint`, ...). Tools that read checkpoints without a `TrainState` (the CLI, HF
export) use `open_checkpoint`, `read_model_tensors`, `base_differences`, `step_dirs` and
`write_atomically`. A rollback to the newest checkpoint (the spike guard's) uses
`latest_cadence_checkpoint`.

HF export (`ft.export_pretrained`, `ft.export_checkpoint`) is an extra:
`ftrain/extras/hf_export.py`.
"""

from ftrain.checkpoint._io import CheckpointError as CheckpointError
from ftrain.checkpoint._io import write_atomically as write_atomically
from ftrain.checkpoint._load import CheckpointMismatchError as CheckpointMismatchError
from ftrain.checkpoint._load import CheckpointMismatchWarning as CheckpointMismatchWarning
from ftrain.checkpoint._load import base_differences as base_differences
from ftrain.checkpoint._load import load_checkpoint as load_checkpoint
from ftrain.checkpoint._load import read_model_tensors as read_model_tensors
from ftrain.checkpoint._save import check_retention as check_retention
from ftrain.checkpoint._save import latest_cadence_checkpoint as latest_cadence_checkpoint
from ftrain.checkpoint._save import latest_checkpoint as latest_checkpoint
from ftrain.checkpoint._save import raise_pending_save_error as raise_pending_save_error
from ftrain.checkpoint._save import retained as retained
from ftrain.checkpoint._save import save_checkpoint as save_checkpoint
from ftrain.checkpoint._save import step_dirs as step_dirs
from ftrain.checkpoint._save import wait_for_checkpoint as wait_for_checkpoint
from ftrain.checkpoint._tree import flatten_tree as flatten_tree
from ftrain.checkpoint._verify import Opened as Opened
from ftrain.checkpoint._verify import open_checkpoint as open_checkpoint
from ftrain.checkpoint._verify import read_meta as read_meta

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointMismatchWarning",
    "Opened",
    "base_differences",
    "check_retention",
    "flatten_tree",
    "latest_cadence_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "open_checkpoint",
    "raise_pending_save_error",
    "read_meta",
    "read_model_tensors",
    "retained",
    "save_checkpoint",
    "step_dirs",
    "wait_for_checkpoint",
    "write_atomically",
]
