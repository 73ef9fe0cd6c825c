"""`ft.func`: the opt-in `torch.func` path beside the core.

Per-example gradients, DP-SGD gradients and a privacy accountant, vectorized ensembles, and
differentiable optimizer steps. The core (`accumulate_grads`, `clip_and_step`) keeps
module-owned parameters and plain autograd; nothing here changes it. See docs/research.md.
"""

from ftrain.extras.func._ensemble import Ensemble as Ensemble
from ftrain.extras.func._ensemble import MemberStacked as MemberStacked
from ftrain.extras.func._ensemble import clip_members as clip_members
from ftrain.extras.func._ensemble import ensemble_loss as ensemble_loss
from ftrain.extras.func._ensemble import sweep as sweep
from ftrain.extras.func._grads import FuncError as FuncError
from ftrain.extras.func._grads import per_sample_grads as per_sample_grads
from ftrain.extras.func._grads import private_grads as private_grads
from ftrain.extras.func._meta import InnerOptimizer as InnerOptimizer
from ftrain.extras.func._meta import functional_loss as functional_loss
from ftrain.extras.func._meta import inner_adam as inner_adam
from ftrain.extras.func._meta import inner_loop as inner_loop
from ftrain.extras.func._meta import inner_sgd as inner_sgd
from ftrain.extras.func._meta import maml_loss as maml_loss
from ftrain.extras.func._privacy import epsilon as epsilon
from ftrain.extras.func._privacy import rdp as rdp

__all__ = [
    "FuncError",
    "per_sample_grads",
    "private_grads",
    "epsilon",
    "rdp",
    # ensembles and sweeps
    "Ensemble",
    "MemberStacked",
    "ensemble_loss",
    "clip_members",
    "sweep",
    # differentiable optimization
    "InnerOptimizer",
    "inner_sgd",
    "inner_adam",
    "inner_loop",
    "functional_loss",
    "maml_loss",
]
