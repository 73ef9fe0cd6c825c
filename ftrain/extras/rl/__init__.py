"""GRPO and its family (Dr. GRPO, DAPO, BNPO, RLOO) as functions you call in your own loop.

`ft.rl` gives every stage of TRL's `GRPOTrainer` as a function: sampling `G` completions per
prompt with a KV cache (`sample`), their per-token log-probs under any model (`token_logps`),
group-normalised and leave-one-out advantages (`group_advantages`, `rloo_advantages`), the
clipped policy loss with TRL's `loss_type`s and the k3 KL penalty (`policy_loss`, an ftrain
`loss_fn` for `accumulate_grads`), and `rollout_batches` to hand a scored rollout to it.
Sampling randomness is a pure function of `(seed, step, completion number)`, so a resumed run
samples the same completions. docs/post_training.md has the formulas and the loop.
"""

from ftrain.extras.rl.objectives import clipped_objective as clipped_objective
from ftrain.extras.rl.objectives import group_advantages as group_advantages
from ftrain.extras.rl.objectives import kl_k3 as kl_k3
from ftrain.extras.rl.objectives import policy_loss as policy_loss
from ftrain.extras.rl.objectives import reduce_loss as reduce_loss
from ftrain.extras.rl.objectives import rloo_advantages as rloo_advantages
from ftrain.extras.rl.rollout import Rollout as Rollout
from ftrain.extras.rl.rollout import rollout_batches as rollout_batches
from ftrain.extras.rl.rollout import sample as sample
from ftrain.extras.rl.rollout import sample_seed as sample_seed
from ftrain.extras.rl.rollout import token_logps as token_logps
from ftrain.extras.rl.rollout import warp_logits as warp_logits

__all__ = [
    "Rollout",
    "clipped_objective",
    "group_advantages",
    "kl_k3",
    "policy_loss",
    "reduce_loss",
    "rloo_advantages",
    "rollout_batches",
    "sample",
    "sample_seed",
    "token_logps",
    "warp_logits",
]
