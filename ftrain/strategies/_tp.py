"""TP: tensor parallelism with DTensor `parallelize_module`, alone or inside FSDP (a 2-D mesh).

Every rank of a tensor-parallel group holds a slice of each planned layer (Megatron-style:
`q/k/v/gate/up` split by output features, `o/down` by input features, one all-reduce after
each block half) and reads the same global batch; the other parameters (embeddings, norms, the
head) are whole on every rank, and their gradients come out whole and equal on every rank
(the column-parallel layers' backward all-reduces the gradient of their input). With `dp > 1`
the tensor-parallel model is sharded again with FSDP2 over the data-parallel mesh dimension.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftrain.precision import NO_CONTEXT, Precision
from ftrain.strategies import _dcp
from ftrain.strategies._base import uncompiled
from ftrain.strategies._fsdp import (
    copy_whole,
    drop_gathered,
    from_rank0,
    full_state_dict,
    gradient_sync,
    hf_blocks,
    local_shard,
    reduce_unused,
)
from ftrain.strategies._group import ProcessGroupStrategy

__all__ = ["TP", "hf_plan"]


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # HF's two layouts with a torch equivalent. The outputs stay local tensors: a column-split
    # q_proj gives this rank's heads, and HF's attention reshapes with -1 heads, so it runs on
    # the local heads unchanged; the row-split o_proj all-reduces back to a whole tensor.
    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def hf_plan(model: nn.Module) -> dict[str, Any]:
    """Translate an HF model's `base_model_tp_plan` into torch parallel styles.

    The keys gain the base model's prefix (`model.` in `LlamaForCausalLM`), so the plan
    applies to the whole model.

    Args:
        model: an HF `PreTrainedModel` whose config has a `base_model_tp_plan`.

    Returns:
        `{module pattern: ColwiseParallel() | RowwiseParallel()}`.

    Raises:
        ValueError: when the model has no `base_model_tp_plan`, or the plan uses a layout
            other than "colwise"/"rowwise" (pass `plan=` to `TP` then).
    """
    raw = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not raw:
        raise ValueError(
            f"{type(model).__name__} has no config.base_model_tp_plan to shard it by: pass "
            "plan={module pattern: ColwiseParallel() | RowwiseParallel(), ...} to TP"
        )
    base = getattr(model, "base_model", model)
    prefix = next((f"{n}." for n, m in model.named_modules() if m is base and n), "")
    styles, plan = _styles(), {}
    for pattern, layout in raw.items():
        if layout not in styles:
            raise ValueError(
                f"{type(model).__name__}'s base_model_tp_plan shards {pattern!r} as {layout!r}, "
                f"which TP does not translate (only {sorted(styles)}): pass plan= to TP"
            )
        plan[prefix + pattern] = styles[layout]()
    return plan


def resolve(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """`{module name: style}` for every module a pattern of `plan` names.

    A pattern matches a module name atom by atom (`*` stands for one atom, as in torch's
    `parallelize_module`); one that matches nothing raises instead of being skipped.
    """
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        atoms = pattern.split(".")
        hits = [n for n in names if _matches(n.split("."), atoms)]
        if not hits:
            raise ValueError(
                f"plan pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(names look like {names[-1] if names else None!r}); fix or remove it"
            )
        out.update(dict.fromkeys(hits, style))
    return out


def _check_plan(plan: Mapping[str, Any] | None) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    if plan is None:
        return
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"plan must be a non-empty {{pattern: ParallelStyle}} dict, got {plan!r}")
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"plan[{pattern!r}] must be a ParallelStyle such as ColwiseParallel(), got "
                f"{style!r}; HF's strings ('colwise', ...) are translated only for the default plan"
            )


def _refuse_partial(grads: Sequence[torch.Tensor]) -> None:
    """A gradient left as a pending sum over tp (e.g. of a `SequenceParallel` norm's weight)
    holds only this rank's part: training on it would let the replicas drift apart."""
    from torch.distributed.tensor import DTensor

    for g in grads:
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            raise ValueError(
                f"a gradient of shape {tuple(g.shape)} is Partial over the tensor-parallel "
                "ranks (a SequenceParallel layer's parameters?): TP does not reduce those yet; "
                "leave such layers out of the plan"
            )


def _matches(name: list[str], atoms: list[str]) -> bool:
    return len(name) == len(atoms) and all(map(fnmatchcase, name, atoms))


class TP(ProcessGroupStrategy):
    """Tensor parallelism (DTensor): each planned layer is split across the ranks, which all
    read the same global batch; with `dp > 1`, FSDP x TP on a 2-D `(dp, tp)` mesh.

    `rank` and `world_size` are data-parallel, as everywhere in ftrain: with `dp=1` every
    process is rank 0 of 1 (`make_batches` gives it the whole global batch, and dropout draws
    the same masks), and losses and counts are summed over the data-parallel ranks only. The
    gradient norm for clipping covers each whole parameter once, equal on every rank.

    Args:
        plan: `{module pattern: ParallelStyle}` (torch's `ColwiseParallel()`,
            `RowwiseParallel()`, `PrepareModuleInput(...)`, ...); a pattern's `*` matches one
            name atom (`model.layers.*.mlp.up_proj`). By default the model's HF
            `base_model_tp_plan` (`hf_plan`).
        dp: data-parallel degree: `world_size // dp` ranks form each tensor-parallel group
            (consecutive ranks: keep them on one node), and FSDP2 shards across the `dp`
            groups (HSDP's `replicate=` counts groups the same way). 1 (default): every rank
            holds one tensor-parallel slice, no data parallelism.
        device: this rank's device; `cuda:LOCAL_RANK` when CUDA is available, else the CPU.
        precision: "fp32" (default), "bf16" or "fp16", or an `ft.precision.Precision`.
        shard: with `dp > 1`, which submodules FSDP shards separately; HF's
            `_no_split_modules` by default.

    Raises:
        RuntimeError: outside a launcher (no process group initialised, and no RANK,
            WORLD_SIZE, MASTER_ADDR, MASTER_PORT to join one from).
        TypeError: for a `plan` that is empty or maps a pattern to something other than a
            `ParallelStyle`.
        ValueError: for `shard` with `dp=1` (there is no FSDP to shard with); in
            `grad_norm`, for a gradient left Partial over tp (`SequenceParallel`).
        ValueError: for a `dp` that does not divide the world size; in `setup`, for a plan
            pattern matching no module, a model without a plan, a layer whose split
            dimension the tensor-parallel degree does not divide, or a plan splitting a
            parameter that several modules share (tied embeddings and LM head).
    """

    def __init__(
        self,
        *,
        plan: Mapping[str, Any] | None = None,
        dp: int = 1,
        device: str | torch.device | None = None,
        precision: str | Precision | None = None,
        shard: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        super().__init__("TP", device, None, precision)
        with self._leaving_on_error():
            self._layout(plan, dp, shard)

    def _layout(self, plan: Mapping[str, Any] | None, dp: int, shard: Any) -> None:
        """Check the arguments against the world size; build the (dp, tp) mesh."""
        _check_plan(plan)
        if shard is not None and dp == 1:
            raise ValueError("shard= chooses FSDP's units, which only exist with dp > 1; drop it")
        processes = self.world_size
        if not (type(dp) is int and dp >= 1 and processes % dp == 0):
            raise ValueError(f"dp must be an int dividing the world size {processes}, got {dp!r}")
        from torch.distributed.device_mesh import init_device_mesh

        self.plan, self.dp, self.tp, self._shard = plan, dp, processes // dp, shard
        self.process_rank = dist.get_rank()
        if dp == 1:
            self.mesh = init_device_mesh(self.device.type, (self.tp,), mesh_dim_names=("tp",))
        else:
            shape = (dp, self.tp)
            self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("dp", "tp"))
            self.group = self.mesh.get_group("dp")  # the data-parallel collectives
        self.rank = self.process_rank // self.tp
        self.world_size = dp
        self.grad_reduce_factor = 1.0 / dp  # FSDP averages over dp; TP reduces nothing

    def __repr__(self) -> str:
        return super().__repr__().replace("world_size=", f"tp={self.tp}, dp_size=")

    def setup(self, model: nn.Module) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        model = model.to(self.device)
        styles = resolve(model, self.plan if self.plan is not None else hf_plan(model))
        if self.plan is None:  # HF's plan splits attention by heads
            _check_heads(model, self.tp)
        _check_divisible(model, styles, self.tp)
        _refuse_split_ties(model, styles)
        if self.dp > 1:  # the tp ranks broadcast from their group's first; FSDP never does
            from_rank0(model)
        parallelize_module(model, self.mesh["tp"], styles)
        _replicate_rest(model, self.mesh["tp"])
        if self.dp > 1:
            from torch.distributed.fsdp import fully_shard

            is_block = self._shard or hf_blocks(model)
            for module in list(model.modules())[1:]:
                if is_block(module):
                    fully_shard(module, mesh=self.mesh["dp"])
            fully_shard(model, mesh=self.mesh["dp"])
            reduce_unused(model)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return uncompiled(model)  # parallelize_module changes the modules in place

    def clone_model(self, model: nn.Module) -> nn.Module:
        raise TypeError(
            "TP states cannot be snapshotted (ft.snapshot, donate=False): the parameters are "
            "split across processes; save a checkpoint instead"
        )

    def grad_sync(self, model: nn.Module, *, final: bool) -> contextlib.AbstractContextManager[Any]:
        return gradient_sync(model, final) if self.dp > 1 else NO_CONTEXT

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        # Over the data-parallel ranks only: the tensor-parallel ones hold the same values.
        return tensor.clone() if self.dp == 1 else super().all_reduce_sum(tensor)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dp == 1 else super().gather_rows(tensor)

    def barrier(self) -> None:
        dist.barrier()  # every process, not only the data-parallel ranks

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        # Squared norms of the slices split over "tp" are summed over the tp ranks; whole
        # (replicated) ones count once; then the sum over "dp", where FSDP splits everything.
        _refuse_partial(grads)
        split = _sum_of_squares([g for g in grads if _split_over_tp(g)], self.device)
        whole = _sum_of_squares([g for g in grads if not _split_over_tp(g)], self.device)
        dist.all_reduce(split, op=dist.ReduceOp.SUM, group=self.mesh.get_group("tp"))
        return self.all_reduce_sum(split + whole).sqrt()

    # Checkpoint layout: DTensor slices (and shards with dp > 1), written by every process.
    checkpoint_sharded = True

    def save_shards(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        _dcp.save_shards(tensors, directory, group=None, local=False)

    def load_shards(self, directory: Path, targets: dict[str, torch.Tensor]) -> None:
        _dcp.load_shards(directory, targets, group=None, local=False)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return full_state_dict(module)

    def copy_whole(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy_whole(dst, src)

    def drop_gathered(self, model: nn.Module) -> None:
        drop_gathered(model)  # FSDP's units with dp > 1; TP's slices are never gathered


def _split_over_tp(t: torch.Tensor) -> bool:
    """Whether `t` (a DTensor, or a plain whole tensor) is split over the "tp" dimension."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return False
    # FSDP over "dp" turns a whole parameter into a DTensor on the "dp" dimension alone.
    names = t.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(t.placements[names.index("tp")], Shard)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([local_shard(t) for t in tensors], 2.0)
    return torch.stack([n.float() for n in norms]).square().sum()


def _check_divisible(model: nn.Module, styles: Mapping[str, Any], tp: int) -> None:
    """A split dimension must divide evenly: HF attention counts local heads from the slice."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for name, style in styles.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            continue
        dim = {ColwiseParallel: 0, RowwiseParallel: 1}.get(type(style))
        if dim is not None and module.weight.shape[dim] % tp:
            raise ValueError(
                f"{name}: {type(style).__name__} splits {module.weight.shape[dim]} features "
                f"over {tp} tensor-parallel ranks unevenly; choose a tp degree (world_size // "
                "dp) dividing the head and feature counts"
            )


def _refuse_split_ties(model: nn.Module, styles: Mapping[str, Any]) -> None:
    """Refuse a plan that splits a parameter several modules share (tied embeddings and LM
    head): `parallelize_module` gives the planned module a new parameter and leaves the others
    the old one, so the tie broke without a word and each copy trained on its own part of the
    gradient (a model one process never trains, exported with two different matrices)."""
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
    )

    # Styles that only lay out a module's inputs or outputs leave its parameters alone.
    layout_only = (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)
    split = [n for n, s in styles.items() if not isinstance(s, layout_only)]
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for names in owners.values():
        planned = [n for n in names if any(n.startswith(f"{m}.") for m in split)]
        if len(names) > 1 and planned:
            raise ValueError(
                f"the plan splits {planned[0]!r}, which is tied to {names!r} (one parameter): "
                "tensor parallelism would give the planned module a parameter of its own and "
                "break the tie; leave the tied modules out of the plan (they stay whole on "
                "every rank, and tied), or untie them first (tie_word_embeddings=False)"
            )


def _check_heads(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"{key}={heads} cannot be split over {tp} tensor-parallel ranks (HF's "
                "base_model_tp_plan gives each rank whole heads): choose a tp degree "
                "(world_size // dp) that divides it"
            )


def _replicate_rest(model: nn.Module, mesh: Any) -> None:
    """Make the parameters no plan split (embeddings, norms, the head) DTensors replicated
    over "tp", in modules that take and return plain tensors: the optimizer and the
    gradient arithmetic then see one kind of tensor (torch's foreach kernels refuse a mix)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    made: dict[int, nn.Parameter] = {}  # tied weights (embeddings = head) stay one parameter

    def replicate(name: str, module: nn.Module, mesh: Any) -> None:
        for key, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                # tp rank 0's values (a broadcast), as parallelize_module scatters its slices.
                dt = distribute_tensor(p.detach(), mesh, [Replicate()])
                made[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            module.register_parameter(key, made[id(p)])

    def inputs(module: nn.Module, args: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(_as_replicated(a, mesh) for a in args)

    def outputs(module: nn.Module, out: Any, mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            hooks: dict[str, Any] = {"input_fn": inputs, "output_fn": outputs}
            distribute_module(module, mesh, replicate, **hooks)


def _as_replicated(x: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x
