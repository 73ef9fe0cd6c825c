"""Vectorized ensembles and sweeps: K copies of one model trained in one pass over the batches."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from ftrain.extras.func._common import check_model, check_number, is_number
from ftrain.losses import LossFn
from ftrain.optim import Optimizer, describe, described, self_skipping

__all__ = ["Ensemble", "clip_members", "ensemble_loss", "sweep"]


class Ensemble(nn.Module):
    """K copies of one architecture as one module, parameters stacked on a leading member dim.

    Every parameter and buffer of the members becomes one tensor of shape `(K, *shape)`, owned
    by this module (so `TrainState`, `accumulate_grads`, `clip_and_step` and checkpoints treat
    the ensemble like any model). `forward` runs every member on the same inputs with `vmap`
    and stacks the outputs; `ensemble_loss` wraps a per-member loss. Since the members share no
    parameter, the gradient of the summed loss is each member's own gradient, and an
    elementwise optimizer (`ft.optim.adamw`, `sgd`) updates each member exactly as K separate
    runs would. Members with requires_grad=False parameters keep them frozen.

    Only member 0's modules run (on every member's weights), so the members must be alike:
    the same module classes at the same names, the same settings (plain attributes such as
    `p`, `eps`, `negative_slope`, `training`; a function attribute by its qualified name), the
    same parameter and buffer names, shapes, dtypes, devices and `requires_grad`, and equal
    tensor attributes that are not buffers (`self.scale = torch.tensor(s)`: member 0's would
    run for all). Hooks and values captured in closures are not compared.

    Args:
        members: K >= 1 modules of identical structure (e.g. built with different seeds).

    Raises:
        ValueError: for no members, or a member unlike member 0, naming its index, what
            differs and where.

    Example:
        >>> import torch, ftrain as ft
        >>> members = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> ens = ft.func.Ensemble(members)
        >>> tuple(ens(torch.randn(5, 3)).shape), ens.num_members
        ((4, 5, 2), 4)
    """

    # Read by `clip_and_step`, which refuses `max_norm` for such a model: one norm over every
    # member's gradient would couple the members (`clip_members` clips each by its own).
    per_member_gradients: ClassVar[bool] = True

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(members) == 0 or not all(isinstance(m, nn.Module) for m in members):
            raise ValueError("members must be a non-empty sequence of nn.Module of one structure")
        _check_alike(members)
        check_model(members[0])
        params, buffers = stack_module_state(list(members))
        # The skeleton holds the stacked tensors under the members' own names; the base, on the
        # meta device (no memory), is the function `functional_call` runs per member.
        self.stacked = copy.deepcopy(members[0])
        for name, p in list(self.stacked.named_parameters()):  # listed before any is replaced
            stacked = MemberStacked(params[name].detach(), p.requires_grad)
            for alias in _aliases(self.stacked, name):
                _set(self.stacked, alias, stacked)
        for name in buffers:
            for alias in _aliases(self.stacked, name, buffers=True):
                _set(self.stacked, alias, buffers[name], buffer=True)
        self.num_members = len(members)
        self.__dict__["base"] = _meta_copy(members[0])
        # The members' mode, not nn.Module's default (training): `accumulate_grads` reads the
        # root's flag, so an ensemble of eval-mode members (HF `from_pretrained`) would train
        # with dropout off and BatchNorm's running statistics frozen, unlike separate runs.
        self.training = members[0].training
        # torch replaces parameters with plain ones where it loads or converts them in place
        # of the old (load_state_dict(assign=True), the meta-device init; .to() with
        # torch.__future__.set_swap_module_params_on_conversion): they are marked again, or
        # sweep refused the ensemble and clip_by_global_norm clipped all members by one norm.
        self.register_load_state_dict_post_hook(_mark_after_load)  # (a module's: pickles)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # Converted as plain parameters: with swap-on-conversion torch wraps each converted
        # tensor in nn.Parameter(...), which refuses a subclass (ens.to(its own dtype) raised).
        for p in self.stacked.parameters():
            if type(p) is MemberStacked:
                p.__class__ = nn.Parameter  # type: ignore[assignment]  # (narrowed by `is`)
        try:
            return super()._apply(fn, recurse)
        finally:
            self._mark()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        # TrainState.create reads them here: marked first, whatever replaced them (FSDP2's
        # sharding too, whose sharded parameters are of another tensor type).
        self._mark()
        return super().named_parameters(*args, **kwargs)

    def _mark(self) -> None:
        """Mark each stacked parameter again where torch replaced it: a plain `nn.Parameter`
        becomes a `MemberStacked` in place (its class), so a state holding it sees the mark; a
        parameter of another tensor type (FSDP2's sharded one) gets `stacked_members` of its own,
        which `ft.optim` reads as it reads the class's."""
        for p in self.stacked.parameters():  # (a plain module: no recursion)
            if getattr(p, "stacked_members", False) is True:
                continue
            if p.dim() == 0 or p.shape[0] != self.num_members:
                continue
            if type(p) is nn.Parameter:
                p.__class__ = MemberStacked
            else:
                setattr(p, "stacked_members", True)  # noqa: B010

    def _weights(self) -> dict[str, torch.Tensor]:
        named: dict[str, torch.Tensor] = dict(self.stacked.named_parameters())
        named.update(dict(self.stacked.named_buffers()))
        return named

    def map(self, fn: Callable[[nn.Module], Any]) -> Any:
        """Run `fn(member)` for every member with `vmap`; results stacked on dim 0."""
        base = self.__dict__["base"]
        # The base is no submodule (it must not be saved), so `train()`/`eval()` reach only the
        # skeleton: copy its modes, or `ensemble.eval()` would leave dropout on.
        for b, m in zip(base.modules(), self.stacked.modules(), strict=True):
            b.training = m.training
        lm = _Apply(base, fn)
        weights = {f"model.{n}": t for n, t in self._weights().items()}
        return vmap(lambda w: functional_call(lm, w, ()), randomness="different")(weights)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Every member's output on the same inputs, stacked: shape `(K, *output.shape)`."""
        return self.map(lambda member: member(*args, **kwargs))

    def member(self, k: int) -> nn.Module:
        """An independent copy of member `k` as a plain module (tied weights stay tied)."""
        module = copy.deepcopy(self.stacked)
        for name, t in self._weights().items():
            param = isinstance(t, nn.Parameter)
            value = nn.Parameter(t[k].detach().clone(), t.requires_grad) if param else t[k].clone()
            for alias in _aliases(module, name, buffers=not param):
                _set(module, alias, value, buffer=not param)
        return module


def _mark_after_load(module: Ensemble, incompatible_keys: Any) -> None:
    module._mark()


class MemberStacked(nn.Parameter):
    """A parameter of an `Ensemble`: dim 0 is the member. `ft.optim` reads `stacked_members`
    (it does not import `ft.func`): `clip_by_global_norm` then clips each member by its own
    norm, as K separate runs do, and `muon` refuses it (use `sweep`)."""

    stacked_members: ClassVar[bool] = True

    def __reduce_ex__(self, proto: Any) -> Any:
        # nn.Parameter's rebuilds a plain Parameter: a pickled ensemble (sent to a Ray worker,
        # torch.save of the module) would lose what says its parameters stack members.
        return (MemberStacked, (self.data, self.requires_grad))


# torch.load's default (weights_only=True) refused a saved MemberStacked. Safe to allow: its
# `__reduce_ex__` rebuilds it from a tensor and a bool, as nn.Parameter's own rebuild does.
torch.serialization.add_safe_globals([MemberStacked])

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _check_alike(members: Sequence[nn.Module]) -> None:
    """Raise `ValueError` naming the first member that differs from member 0, and how."""
    ref = _describe(members[0])
    for k, member in enumerate(members[1:], start=1):
        got = _describe(member)
        for what, want in ref.items():
            problem = _first_difference(want, got[what], k)
            if problem is not None:
                raise ValueError(
                    f"Ensemble member {k} differs from member 0 in {what}: {problem}. Every "
                    "member runs member 0's modules, so build them alike (same classes, "
                    "settings, dtype and device)"
                )


def _describe(model: nn.Module) -> dict[str, dict[str, Any]]:
    """What must agree across members, by category (in the order they are reported)."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    modules = {name or "<root>": m for name, m in model.named_modules()}
    return {
        "module types": {n: type(m) for n, m in modules.items()},
        "parameter names or shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
        "buffer names or shapes": {n: tuple(b.shape) for n, b in model.named_buffers()},
        "dtype": {n: t.dtype for n, t in tensors.items()},
        "device": {n: t.device for n, t in tensors.items()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "module settings": {
            f"{n}.{a}": v for n, m in modules.items() for a, v in _settings(m).items()
        },
    }


def _settings(module: nn.Module) -> dict[str, Any]:
    # Public plain attributes (torch keeps its machinery under `_` names); a function by name,
    # so that lambdas built by one line of an __init__ agree across members.
    out: dict[str, Any] = {}
    for a, v in vars(module).items():
        if a.startswith("_"):
            continue
        if isinstance(v, _PLAIN) or (
            isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v)
        ):
            out[a] = v
        elif isinstance(v, torch.Tensor):  # a tensor attribute that is no buffer: member 0's ran
            out[a] = _Value(v)
        elif callable(v) and not isinstance(v, nn.Module) and hasattr(v, "__qualname__"):
            out[a] = f"{getattr(v, '__module__', '?')}.{v.__qualname__}"
    return out


class _Value:
    """A tensor attribute compared by value (NaN equal to NaN); a large one shown by its shape."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t.detach()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Value)
            and (self.t.dtype, self.t.shape, self.t.device)
            == (other.t.dtype, other.t.shape, other.t.device)
            and torch.equal(self.t.isnan(), other.t.isnan())
            and torch.equal(self.t.nan_to_num(0.0), other.t.nan_to_num(0.0))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.t) if self.t.numel() <= 4 else f"a tensor of shape {list(self.t.shape)}"


def _first_difference(want: dict[str, Any], got: dict[str, Any], k: int) -> str | None:
    for name in want:
        if name not in got:
            return f"{name!r} is missing from member {k}"
    for name in got:
        if name not in want:
            return f"{name!r} is in member {k} only"
    for name, value in want.items():
        if got[name] != value and not (value != value and got[name] != got[name]):  # NaN
            return f"{name!r} is {_show(got[name])} in member {k}, {_show(value)} in member 0"
    return None


def _show(value: Any) -> str:
    return value.__name__ if isinstance(value, type) else repr(value)


class _Apply(nn.Module):
    def __init__(self, model: nn.Module, fn: Callable[[nn.Module], Any]) -> None:
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self) -> Any:
        return self.fn(self.model)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device with its tied weights still tied.

    `.to("meta")` gives every module its own new tensor, so an output layer tied to the
    embedding would keep a meta tensor that `functional_call` does not replace (it ties the
    names it is given to the names the module shares): the forward read uninitialized memory.
    """
    base = copy.deepcopy(module).to("meta")
    for buffers, named in ((False, module.named_parameters), (True, module.named_buffers)):
        for name, _ in named():
            shared = base.get_buffer(name) if buffers else base.get_parameter(name)
            for alias in _aliases(module, name, buffers=buffers):
                _set(base, alias, shared, buffer=buffers)
    return base


def _aliases(root: nn.Module, name: str, *, buffers: bool = False) -> list[str]:
    """Every name under which `root` holds the tensor named `name`: a tied weight (an embedding
    and its output layer) has several, and each must get the stacked tensor, or the skeleton
    would keep member 0's own tensor under the others (unstacked, untied and trainable)."""
    named = root.named_buffers if buffers else root.named_parameters
    target = dict(named())[name]
    return [n for n, t in named(remove_duplicate=False) if t is target]


def _set(root: nn.Module, name: str, value: torch.Tensor, *, buffer: bool = False) -> None:
    owner, _, leaf = name.rpartition(".")
    module = root.get_submodule(owner)
    if buffer:
        module.register_buffer(leaf, value)
    else:
        setattr(module, leaf, value)


def ensemble_loss(loss_fn: LossFn) -> LossFn:
    """Turn a per-member `loss_fn(model, batch)` into the loss of an `Ensemble`.

    Returns the members' loss sums added up, and one member's item count (the batch is
    shared): `accumulate_grads` then gives each member the gradient it would get alone.
    `stats.loss` is the sum of the members' mean losses.
    """

    def fn(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(model, Ensemble):
            raise TypeError(f"ensemble_loss needs an ft.func.Ensemble, got {type(model).__name__}")
        losses, items = model.map(lambda member: _pair(loss_fn(member, batch)))
        return losses.sum(), items[0]

    return fn


def _pair(out: tuple[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    loss, n = out
    return loss, torch.as_tensor(n, device=loss.device)


def clip_members(grads: Mapping[str, torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Clip each member's gradient to its own global norm `max_norm`, in place.

    `clip_and_step(max_norm=...)` would clip the whole ensemble by one norm (it raises for an
    `Ensemble`); call this instead, and no `max_norm` there. Same coefficient as
    `torch.nn.utils.clip_grad_norm_`. None measures the norms without clipping. A member whose
    norm is not finite is the one a `sweep` skips (`clip_and_step`'s `info.skipped` says only
    that some member did).

    Returns:
        The members' pre-clip norms, shape `(K,)` (a device tensor).
    """
    if max_norm is not None:
        check_number("max_norm", max_norm, positive=True)
    norms = _member_norms(grads)
    if max_norm is not None:
        factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for t in grads.values():
            t.mul_(factor.view(-1, *([1] * (t.dim() - 1))))
    return norms


def _member_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Each member's global gradient norm (dim 0 is the member), shape `(K,)`."""
    # reshape, not flatten(1): a member's 0-dim parameter is stacked to shape (K,).
    norms = [t.reshape(t.shape[0], -1).norm(dim=1) for t in grads.values()]
    return torch.stack(norms, dim=1).norm(dim=1)


def sweep(
    optimizers: Sequence[Optimizer], *, lr_factors: Sequence[float] | None = None
) -> Optimizer:
    """An optimizer for an `Ensemble` whose members have their own hyperparameters.

    Member k is updated by `optimizers[k]` (e.g. `adamw(weight_decay=wd[k])`) at learning rate
    `lr * lr_factors[k]`, in place on its slice of every stacked parameter, with that
    optimizer's own kernel: the result equals K separate runs. A member whose gradient norm is
    inf or NaN skips its update alone (its parameters, optimizer state and step count stay as
    they were), as its separate run would; the others step. (Members that share one optimizer
    and lr need no sweep: `ft.optim.adamw()` updates the stacked tensors in one call, but then
    share its step count, so one non-finite member skips the step of all.)

    Args:
        optimizers: one `ft.optim.Optimizer` per member.
        lr_factors: per-member multipliers of the step's `lr`; all 1 if None.

    Example:
        >>> import torch, ftrain as ft
        >>> ens = ft.func.Ensemble([torch.nn.Linear(2, 1) for _ in range(3)])
        >>> opt = ft.func.sweep([ft.optim.adamw(weight_decay=wd) for wd in (0.0, 0.1, 0.2)],
        ...                     lr_factors=[1e-3, 3e-3, 1e-2])
        >>> state = ft.TrainState.create(ens, opt)
        >>> len(state.opt_state)
        3
    """
    k = len(optimizers)
    if k == 0 or not all(isinstance(o, Optimizer) for o in optimizers):
        raise TypeError("optimizers must be a non-empty sequence of ft.optim.Optimizer")
    given = [1.0] * k if lr_factors is None else list(lr_factors)
    if len(given) != k or not all(is_number(f) and f >= 0 for f in given):  # no bool, inf, NaN
        raise ValueError(f"lr_factors must be {k} finite numbers >= 0, got {lr_factors!r}")
    factors = [float(f) for f in given]

    def init(params: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
        _check_members(params, k)
        return tuple(
            opt.init({n: p[i] for n, p in params.items()}) for i, opt in enumerate(optimizers)
        )

    def update(
        grads: Mapping[str, torch.Tensor],
        state: tuple[Any, ...],
        params: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        found_inf: torch.Tensor | None = None,
    ) -> tuple[Any, ...]:
        skips = _member_skips(grads, found_inf, k)
        return tuple(
            opt.update(
                {n: g[i] for n, g in grads.items()},
                state[i],
                {n: p[i] for n, p in params.items()},  # all, as clip_and_step gives them
                lr=lr * factors[i],
                step=step,
                found_inf=skips[i],
            )
            for i, opt in enumerate(optimizers)
        )

    def settings(names: list[str]) -> dict[str, Any]:  # a checkpoint refuses other settings
        members = [describe(opt, names) for opt in optimizers]
        return {"kind": "sweep", "lr_factors": factors, "members": members}

    # partition and ema refuse to wrap it
    return described(self_skipping(Optimizer(init, update)), settings)


def _member_skips(
    grads: Mapping[str, torch.Tensor], found_inf: torch.Tensor | None, k: int
) -> list[torch.Tensor | None]:
    """Each member's `found_inf`: the step's skip, narrowed to the non-finite members.

    `clip_and_step` skips on the ensemble's one norm, which a single member's inf or NaN makes
    non-finite: applied to all, it would stop every member of a learning-rate sweep once one
    diverged. A separate run skips its own step only, so a member with a finite norm steps,
    unless no member's norm is inf or NaN (then the skip had another cause, a step that counted
    no item, and holds for all). `found_inf` does not say its cause, but a step that counted
    no item has gradients of exactly zero (sums over no item): when every finite member's is,
    every member skips, as each separate run does (so does, beside a non-finite member, a
    finite one whose gradient is exactly zero in a step that counted items, which its separate
    run would have stepped: momentum, decay). On the device, no host sync.
    """
    if found_inf is None or not grads:
        return [found_inf] * k
    norms = _member_norms(grads)
    bad = ~torch.isfinite(norms)
    # Every finite member's gradient exactly zero: the step counted no item (its gradients are
    # sums over no item), which skips every member as it skips each separate run.
    none_counted = torch.logical_or(bad, norms == 0).all()
    return list((found_inf * (bad | ~bad.any() | none_counted)).unbind())


def _check_members(params: Mapping[str, torch.Tensor], k: int) -> None:
    sharded = [n for n, p in params.items() if not isinstance(p, MemberStacked)
               and getattr(p, "stacked_members", False) is True]  # fmt: skip
    if sharded:  # each member's slice of a sharded tensor is no tensor to update in place
        raise ValueError(
            f"sweep got an ft.func.Ensemble whose parameters are sharded {sharded[:3]} (FSDP): "
            "not supported; train it without sharding, or with one optimizer for all members"
        )
    for n, p in params.items():
        # A plain model whose parameters all happen to lead with k (Linear(3, 3) for k=3) was
        # taken, each "member" training a row of every tensor.
        if p.dim() == 0 or p.shape[0] != k or not isinstance(p, MemberStacked):
            raise ValueError(
                f"sweep of {k} optimizers got parameter {n!r} of shape {list(p.shape)}: train "
                f"an ft.func.Ensemble of {k} members"
            )
