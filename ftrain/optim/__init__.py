"""Optimizers (`ft.optim`): optax-shaped pairs on PyTorch's fused kernels, transforms, adapters."""

from ftrain.optim._adapters import TorchOptimizerState as TorchOptimizerState
from ftrain.optim._adapters import from_torch as from_torch
from ftrain.optim._adapters import from_torchopt as from_torchopt
from ftrain.optim._base import AdamState as AdamState
from ftrain.optim._base import ChainState as ChainState
from ftrain.optim._base import DampedSGDState as DampedSGDState
from ftrain.optim._base import Optimizer as Optimizer
from ftrain.optim._base import SGDState as SGDState
from ftrain.optim._base import Transform as Transform
from ftrain.optim._base import adam as adam
from ftrain.optim._base import adamw as adamw
from ftrain.optim._base import chain as chain
from ftrain.optim._base import describe as describe
from ftrain.optim._base import described as described
from ftrain.optim._base import self_skipping as self_skipping
from ftrain.optim._base import sgd as sgd
from ftrain.optim._ema import EmaState as EmaState
from ftrain.optim._ema import ema as ema
from ftrain.optim._ema import ema_decay as ema_decay
from ftrain.optim._ema import ema_swapped as ema_swapped
from ftrain.optim._ema import live_tensors as live_tensors
from ftrain.optim._ema import swap_ema as swap_ema
from ftrain.optim._muon import MuonState as MuonState
from ftrain.optim._muon import muon as muon
from ftrain.optim._partition import PartitionState as PartitionState
from ftrain.optim._partition import layerwise_lr_decay as layerwise_lr_decay
from ftrain.optim._partition import partition as partition
from ftrain.optim._traceable import TraceableUpdate as TraceableUpdate
from ftrain.optim._traceable import twin_of as twin_of
from ftrain.optim._transforms import add_decayed_weights as add_decayed_weights
from ftrain.optim._transforms import clip as clip
from ftrain.optim._transforms import clip_by_global_norm as clip_by_global_norm
from ftrain.optim._transforms import decay_mask as decay_mask
from ftrain.optim._transforms import scale as scale

__all__ = [
    "AdamState",
    "ChainState",
    "DampedSGDState",
    "EmaState",
    "MuonState",
    "Optimizer",
    "PartitionState",
    "SGDState",
    "TorchOptimizerState",
    "TraceableUpdate",
    "Transform",
    "adam",
    "adamw",
    "add_decayed_weights",
    "chain",
    "clip",
    "clip_by_global_norm",
    "decay_mask",
    "describe",
    "described",
    "ema",
    "ema_decay",
    "ema_swapped",
    "from_torch",
    "from_torchopt",
    "layerwise_lr_decay",
    "live_tensors",
    "muon",
    "partition",
    "scale",
    "self_skipping",
    "sgd",
    "swap_ema",
    "twin_of",
]
