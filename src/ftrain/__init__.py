"""ftrain: a functional training-step toolkit for PyTorch.

Small pure functions over an immutable `TrainState`; you write the loop.
"""

from ftrain import checkpoint as checkpoint
from ftrain import func as func
from ftrain import generation as generation
from ftrain import guard as guard
from ftrain import logging as logging
from ftrain import lora as lora
from ftrain import losses as losses
from ftrain import optim as optim
from ftrain import precision as precision
from ftrain import preference as preference
from ftrain import schedules as schedules
from ftrain import sft as sft
from ftrain import strategies as strategies
from ftrain import testing as testing
from ftrain.checkpoint import CheckpointError as CheckpointError
from ftrain.checkpoint import export_pretrained as export_pretrained
from ftrain.checkpoint import latest_checkpoint as latest_checkpoint
from ftrain.checkpoint import load_checkpoint as load_checkpoint
from ftrain.checkpoint import save_checkpoint as save_checkpoint
from ftrain.checkpoint import wait_for_checkpoint as wait_for_checkpoint
from ftrain.data import make_batches as make_batches
from ftrain.data import pad_collate as pad_collate
from ftrain.eval import classification_metrics as classification_metrics
from ftrain.eval import evaluate as evaluate
from ftrain.eval import predict as predict
from ftrain.generation import generate as generate
from ftrain.generation import multiple_choice_metrics as multiple_choice_metrics
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

__version__ = "0.1.0"

__all__ = [
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
    "generate",
    "multiple_choice_metrics",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "wait_for_checkpoint",
    "export_pretrained",
    "CheckpointError",
    # namespaces
    "checkpoint",
    "func",
    "generation",
    "guard",
    "logging",
    "lora",
    "losses",
    "optim",
    "precision",
    "preference",
    "schedules",
    "sft",
    "strategies",
    "testing",
]
