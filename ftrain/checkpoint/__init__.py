"""Checkpoints (`ft.checkpoint`): atomic, pickle-free saves, exact resume.

HF export (`ft.export_pretrained`, `ft.export_checkpoint`) is an extra:
`ftrain/extras/hf_export.py`.
"""

from ftrain.checkpoint._io import CheckpointError as CheckpointError
from ftrain.checkpoint._load import CheckpointMismatchError as CheckpointMismatchError
from ftrain.checkpoint._load import CheckpointMismatchWarning as CheckpointMismatchWarning
from ftrain.checkpoint._load import load_checkpoint as load_checkpoint
from ftrain.checkpoint._load import read_meta as read_meta
from ftrain.checkpoint._save import latest_checkpoint as latest_checkpoint
from ftrain.checkpoint._save import retained as retained
from ftrain.checkpoint._save import save_checkpoint as save_checkpoint
from ftrain.checkpoint._save import wait_for_checkpoint as wait_for_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointMismatchWarning",
    "latest_checkpoint",
    "load_checkpoint",
    "read_meta",
    "retained",
    "save_checkpoint",
    "wait_for_checkpoint",
]
