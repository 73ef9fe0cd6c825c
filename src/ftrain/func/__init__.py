"""`ft.func`: the opt-in `torch.func` path beside the core.

Per-example gradients, DP-SGD gradients and a privacy accountant, vectorized ensembles, and
differentiable optimizer steps. The core (`accumulate_grads`, `clip_and_step`) keeps
module-owned parameters and plain autograd; nothing here changes it. See docs/research.md.
"""

from ftrain.func._grads import FuncError as FuncError
from ftrain.func._grads import per_sample_grads as per_sample_grads
from ftrain.func._grads import private_grads as private_grads
from ftrain.func._privacy import epsilon as epsilon
from ftrain.func._privacy import rdp as rdp

__all__ = [
    "FuncError",
    "per_sample_grads",
    "private_grads",
    "epsilon",
    "rdp",
]
