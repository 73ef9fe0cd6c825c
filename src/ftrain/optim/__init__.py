"""Optimizers (`ft.optim`): optax-shaped pairs on PyTorch's fused kernels, transforms, adapters."""

from ftrain.optim._adapters import TorchOptimizerState as TorchOptimizerState
from ftrain.optim._adapters import from_torch as from_torch
from ftrain.optim._adapters import from_torchopt as from_torchopt
from ftrain.optim._base import AdamState as AdamState
from ftrain.optim._base import ChainState as ChainState
from ftrain.optim._base import Optimizer as Optimizer
from ftrain.optim._base import SGDState as SGDState
from ftrain.optim._base import Transform as Transform
from ftrain.optim._base import adam as adam
from ftrain.optim._base import adamw as adamw
from ftrain.optim._base import chain as chain
from ftrain.optim._base import sgd as sgd
from ftrain.optim._transforms import add_decayed_weights as add_decayed_weights
from ftrain.optim._transforms import clip as clip
from ftrain.optim._transforms import clip_by_global_norm as clip_by_global_norm
from ftrain.optim._transforms import decay_mask as decay_mask
from ftrain.optim._transforms import scale as scale

__all__ = [
    "AdamState",
    "ChainState",
    "Optimizer",
    "SGDState",
    "TorchOptimizerState",
    "Transform",
    "adam",
    "adamw",
    "add_decayed_weights",
    "chain",
    "clip",
    "clip_by_global_norm",
    "decay_mask",
    "from_torch",
    "from_torchopt",
    "scale",
    "sgd",
]
