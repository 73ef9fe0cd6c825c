"""Per-example gradients and DP-SGD gradients through `torch.func` (grad + vmap)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_map

from ftrain.data import weighted
from ftrain.extras.func._common import (
    FuncError,
    _LossModule,
    check_int,
    check_model,
    check_number,
    check_per_example,
)
from ftrain.extras.func._ensemble import Ensemble
from ftrain.grads import Stats, batch_counts, step_consumed
from ftrain.losses import LossFn, default_loss
from ftrain.optim import ema_swapped
from ftrain.process_state import STATE
from ftrain.rng import default_generators, dropout_seed, restored
from ftrain.state import TrainState, unfrozen

__all__ = ["FuncError", "check_model", "per_sample_grads", "private_grads"]

_MIN_KEY_BYTES = 16


def _resolved(state: TrainState, loss_fn: LossFn | None) -> LossFn:
    """The loss to use, as `accumulate_grads` picks it: the given one, else the state's, else
    the default loss."""
    if loss_fn is not None:
        return loss_fn
    return default_loss if state.loss_fn is None else state.loss_fn


def _example_fn(state: TrainState, loss_fn: LossFn | None, *, vectorize: bool) -> Any:
    """`f(params, examples) -> (grads, (loss_sums, num_items))`, each with a leading example dim.

    Vectorized: `vmap` over the examples. Otherwise `examples` holds one example, run as it is,
    so that data-dependent Python control flow in the model works.
    """
    model = state.strategy.unwrap(state.model)
    check_per_example(model)
    lm = _LossModule(model, _resolved(state, loss_fn))

    def loss(params: dict[str, torch.Tensor], batch: Any) -> Any:
        loss_sum, n = functional_call(lm, params, (batch,))
        return loss_sum, (loss_sum.detach(), torch.as_tensor(n))

    if not vectorize:
        one = grad(loss, has_aux=True)
        return lambda params, batch: tree_map(lambda t: t.unsqueeze(0), one(params, batch))

    def loss_of_example(params: dict[str, torch.Tensor], example: Any) -> Any:
        return loss(params, tree_map(lambda t: t.unsqueeze(0), example))  # a batch of one

    return vmap(grad(loss_of_example, has_aux=True), in_dims=(None, 0), randomness="different")


def _trainable(state: TrainState) -> dict[str, torch.Tensor]:
    """The parameters to differentiate, as `accumulate_grads` picks them: `state.params` that
    still require a gradient (one frozen after create gets none, so no step trains it)."""
    if late := unfrozen(state):
        # accumulate_grads' rule: state.params and the optimizer state were taken at create,
        # so a gradient for it would never be applied.
        raise ValueError(
            f"parameter {late[0]!r} was frozen when the TrainState was created and now requires "
            "a gradient: ft.func differentiates state.params only, so it would never train. "
            "Re-create the state after unfreezing (ft.TrainState.create(model, optimizer, ...))"
        )
    out = {n: p for n, p in state.params.items() if p.requires_grad}
    for n, p in out.items():
        if state.strategy.is_distributed(p):
            raise FuncError(
                f"parameter {n!r} is distributed over processes (FSDP, TP): ft.func needs "
                "whole parameters; use SingleDevice or DDP"
            )
    return out


def _params(trainable: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"model.{n}": p.detach() for n, p in trainable.items()}


def _num_examples(batch: Any) -> int:
    leaves, _ = tree_flatten(batch)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
    if bad or not leaves:
        raise TypeError(
            f"ft.func needs a batch whose leaves are all tensors with a leading example "
            f"dimension, got leaves of type {bad or 'none'}; convert them in the collate_fn"
        )
    sizes = {x.shape[0] if x.dim() else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"batch tensors disagree on the example dimension: sizes {sizes}")
    return int(next(iter(sizes)))  # type: ignore[arg-type]


def _chunks(batch: Any, chunk_size: int | None) -> Iterator[Any]:
    n = _num_examples(batch)  # 0 (an empty batch, e.g. drawn by Poisson sampling): no chunk
    step = max(n, 1) if chunk_size is None else chunk_size
    for start in range(0, n, step):
        yield tree_map(lambda t, s=start: t[s : s + step], batch)


def _validate_chunk(chunk_size: int | None) -> None:
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, low=1)  # True is not 1: a bool is refused


def _run(state: TrainState, fn: Any, params: dict[str, torch.Tensor], chunk: Any) -> Any:
    leaves, _ = tree_flatten(chunk)
    versions = [t._version for t in leaves]
    model = state.strategy.unwrap(state.model)
    owned = [*model.named_parameters(), *model.named_buffers()]
    owned_versions = [t._version for _, t in owned]
    try:
        with state.strategy.autocast():
            out = fn(params, chunk)
    except RuntimeError as e:
        if any(k in str(e) for k in ("vmap", "transform", "functorch", "Batched")):
            raise FuncError(
                f"torch.func could not vectorize the loss over examples: {e}. Common causes: "
                "in-place writes of an example's value into a shared tensor (a buffer updated "
                "in forward), .item() or data-dependent Python control flow, batch-coupled "
                "layers. chunk_size=1 runs one example at a time without vmap, which allows "
                "data-dependent control flow (e.g. HF models with an attention_mask); see "
                "docs/research.md"
            ) from e
        raise
    # vmap lets an in-place op on an input through, and it would change the caller's batch.
    if [t._version for t in leaves] != versions:
        raise FuncError(
            "the loss modified the batch in place (e.g. x.mul_(...) on an input): the caller's "
            "batch would change; use out-of-place ops on inputs"
        )
    # vmap refuses such a write; one example at a time (chunk_size=1) it went through: the
    # model's state changed by each example alone (not private, and not the batch's update).
    for (name, t), v in zip(owned, owned_versions, strict=True):
        if t._version != v:
            raise FuncError(
                f"the model wrote {name!r} in place during forward (a running statistic, an "
                "Embedding's max_norm renorm): per-example gradients must not change the "
                "model. Keep state out of forward (track_running_stats=False, max_norm=None)"
            )
    return out


def per_sample_grads(
    state: TrainState,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    chunk_size: int | None = None,
    micro_index: int = 0,
) -> dict[str, torch.Tensor]:
    """Return each example's gradient: name -> tensor of shape `(num_examples, *param.shape)`.

    Row i is the gradient of `loss_fn(model, example_i)[0]`, the *summed* loss of a batch
    holding example i alone (not divided by its item count), over the trainable parameters
    (`state.params`, frozen ones excluded). It is computed with `torch.func` (`grad` of
    `functional_call`, `vmap` over examples); `.grad` is not touched. The model runs in its
    current mode (`accumulate_grads` sets train mode; this does not), under the strategy's
    autocast; on a data-parallel rank it covers that rank's examples. Dropout draws are a pure
    function of `(state.seed, state.step, micro_index)` and differ between examples.

    Args:
        state: the current state (not consumed).
        batch: one micro-batch; every leaf a tensor with a leading example dimension.
        loss_fn: `(model, batch) -> (loss_sum, num_items)`; if None, `state.loss_fn`, else
            `ft.losses.default_loss`.
        chunk_size: vectorize over at most this many examples at once (bounds the memory of
            the intermediate activations and gradients); all at once if None. 1 runs one
            example at a time without `vmap`: slower, but data-dependent control flow works
            (HF models given an `attention_mask` need it).
        micro_index: the micro-batch's index in the step, for the dropout seed.

    Returns:
        name -> per-example gradients, for every trainable parameter.

    Raises:
        FuncError: for modules torch.func cannot handle (batch norm in training mode, in-place
            writes of example values into shared tensors, sharded parameters).
        TypeError, ValueError: for a batch that is not tensors with one example dimension, or
            a bad `chunk_size`.

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(3, 1), ft.optim.sgd())
        >>> def loss_fn(model, batch):
        ...     return ((model(batch["x"]) - batch["y"]) ** 2).sum(), batch["y"].numel()
        >>> batch = {"x": torch.randn(5, 3), "y": torch.randn(5, 1)}
        >>> g = ft.func.per_sample_grads(state, batch, loss_fn)
        >>> tuple(g["weight"].shape)
        (5, 1, 3)
    """
    _validate_chunk(chunk_size)
    check_int("micro_index", micro_index, low=0)
    fn = _example_fn(state, loss_fn, vectorize=chunk_size != 1)
    trainable = _trainable(state)
    params = _params(trainable)
    # A rank's ZeroWeight stand-in holds another rank's row: this rank has no example.
    batch, weight = weighted(batch)
    parts = [{k: p.new_zeros((0, *p.shape)) for k, p in params.items()}]
    with _Seeded(state, micro_index):
        for chunk in _chunks(state.strategy.to_device(batch), chunk_size) if weight else ():
            parts.append(_run(state, fn, params, chunk)[0])
    return {n: torch.cat([p[f"model.{n}"] for p in parts]) for n in trainable}


class _Seeded:
    """Seed the default generators for one micro-batch, restoring them afterwards."""

    def __init__(self, state: TrainState, micro_index: int) -> None:
        self._gens = default_generators(state.strategy.device)
        self._seed = dropout_seed(state.seed, state.step, micro_index, state.strategy.rank)
        self._scope = restored(self._gens)

    def __enter__(self) -> None:
        self._scope.__enter__()
        for g in self._gens:
            g.manual_seed(self._seed)

    def __exit__(self, *exc: Any) -> None:
        self._scope.__exit__(*exc)


def _check_single_process(state: TrainState) -> None:
    if state.strategy.world_size > 1:
        raise FuncError(
            f"private_grads runs in one process; this strategy has world_size="
            f"{state.strategy.world_size}. Noise and clipping across ranks are not implemented"
        )
    if state.scaler.scale is not None:
        raise FuncError(
            "private_grads does not scale the loss: float16 per-example gradients would "
            "underflow. Use precision='bf16' or 'fp32'"
        )


def _validate_private(
    max_norm: float, noise_multiplier: float, expected_batch_size: int | None
) -> None:
    # A bool is refused: expected_batch_size=True would divide the summed gradient by 1.
    check_number("max_norm", max_norm, positive=True)
    check_number("noise_multiplier", noise_multiplier)
    if expected_batch_size is not None:
        check_int("expected_batch_size", expected_batch_size, low=1)


def clip_examples(
    per_example: Mapping[str, torch.Tensor], max_norm: float, *, members: bool = False
) -> dict[str, torch.Tensor]:
    """Sum of the per-example gradients, each scaled to global norm at most `max_norm`.

    The factor is `min(1, max_norm / (norm_i + 1e-6))`, as in Opacus' `DPOptimizer`. With
    `members` (an `Ensemble`: dim 1 is the member) each member's part of an example's gradient
    is clipped to its own norm, as K separate DP-SGD runs clip; one norm over all members would
    shrink every member's gradient by the others'.
    """
    d = 2 if members else 1
    grads = list(per_example.values())
    # reshape, not flatten(d): a 0-dim parameter (a learnable temperature) has no dim d.
    norms = torch.stack([g.reshape(*g.shape[:d], -1).norm(dim=d) for g in grads], dim=-1)
    norms = norms.norm(dim=-1)
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    spec = "ik,ik...->k..." if members else "i,i...->..."
    return {n: torch.einsum(spec, factor, g) for n, g in per_example.items()}


def noise_key_bytes(noise_key: bytes | bytearray | int | None) -> bytes:
    """The secret that keys DP-SGD noise: `noise_key` validated, or the process's secret.

    Raises:
        TypeError: for a key that is not bytes, an int or None.
        ValueError: for a guessable key (under 16 bytes, an int below 2**64, a negative int).
            Messages never show the key.
    """
    if noise_key is None:  # the process's secret (ftrain/process_state.py), drawn once
        if STATE.dp_noise_key is None:
            STATE.dp_noise_key = secrets.token_bytes(32)
        return STATE.dp_noise_key
    fix = "use secrets.token_bytes(32) (or secrets.randbits(256)), kept outside the run folder"
    if isinstance(noise_key, (bytes, bytearray)):
        if len(noise_key) < _MIN_KEY_BYTES:
            raise ValueError(
                f"noise_key of {len(noise_key)} bytes is guessable, so the noise could be "
                f"rebuilt: {fix}"
            )
        return bytes(noise_key)
    if isinstance(noise_key, int) and not isinstance(noise_key, bool):
        if noise_key < 2**64:
            raise ValueError(
                f"noise_key must be an int >= 2**64 (a smaller or negative one is guessable, so "
                f"the noise could be rebuilt): {fix}"
            )
        return noise_key.to_bytes((noise_key.bit_length() + 7) // 8, "big")
    raise TypeError(
        f"noise_key must be bytes (>= {_MIN_KEY_BYTES}), an int >= 2**64, or None (a fresh "
        f"secret per process), got {type(noise_key).__name__}: {fix}"
        + (" (a hex string: bytes.fromhex(...))" if isinstance(noise_key, str) else "")
    )


def noise_seed(key: bytes, state: TrainState, mechanism: str = "") -> int:
    """The noise generator's seed for `state`'s step: HMAC-SHA256 under `key` of where the run
    stands (seed, step, epoch, data cursor) and of the `mechanism` (noise multiplier, max norm,
    denominator), cut to 63 bits.

    Without the key nobody can compute it, though `state` is saved in plain text. The data
    cursor is in it, so a step redone on other data (a guard rollback moves the cursor) draws
    new noise instead of reusing the old; an exact resume is at the same cursor. The mechanism
    is in it so that runs of a sweep over noise_multiplier or max_norm draw independent noise:
    with shared draws, two released models give the noiseless gradient back
    (`2 g(sigma=1) - g(sigma=2)`).
    """
    where = f"ftrain.dp_noise:{state.seed}:{state.step}:{state.epoch}:{state.data.cursor}"
    where += f":{mechanism}" if mechanism else ""
    digest = hmac.new(key, where.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch wants a non-negative int64


def noise_like(
    params: Mapping[str, torch.Tensor], *, std: float, seed: int
) -> dict[str, torch.Tensor]:
    """Gaussian noise N(0, std^2) per coordinate, from one generator seeded with `seed` that
    draws the parameters in order."""
    first = next(iter(params.values()))
    gen = torch.Generator(device=first.device)
    gen.manual_seed(seed)
    return {
        n: torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * std
        for n, p in params.items()
    }


def private_grads(
    state: TrainState,
    micro: Sequence[Any],
    loss_fn: LossFn | None = None,
    *,
    max_norm: float,
    noise_multiplier: float,
    expected_batch_size: int | None = None,
    chunk_size: int | None = None,
    noise_key: bytes | int | None = None,
) -> tuple[dict[str, torch.Tensor], Stats]:
    """Return DP-SGD gradients (Abadi et al. 2016) for `clip_and_step` to apply.

    `g = (sum_i clip(g_i) + N(0, (noise_multiplier * max_norm)^2 I)) / B`, where `g_i` is
    example i's gradient (`per_sample_grads`), `clip` scales it to global norm at most
    `max_norm`, the sum runs over every example of every micro-batch, and B is the number of
    examples (or `expected_batch_size`, the fixed denominator Poisson sampling needs). For an
    `ft.func.Ensemble` each member's part of `g_i` is clipped to its own norm, so member k gets
    what its own DP-SGD run would (the noise is independent across members). A step that drew
    no example (Poisson sampling can) returns the noise alone over `expected_batch_size`, with
    `num_items` 0, and `clip_and_step` applies it, as Opacus does (its `Stats` has
    `skip_empty=False`).

    The noise is keyed by a secret that no state or checkpoint holds (`noise_seed`): by
    default one drawn from the OS once per process, so a checkpoint never lets anyone rebuild
    the noise, and a run resumed in a new process draws other noise (still private, not
    bit-exact). Pass your own `noise_key` (`secrets.token_bytes(32)`, kept outside the run
    folder) to resume bit-exactly: the noise is then a pure function of the key and where the
    run stands (seed, step, epoch, data cursor) and of the mechanism (`noise_multiplier`,
    `max_norm`, `expected_batch_size`), so the runs of a sweep over them draw independent
    noise. Like `accumulate_grads` (in whose place it goes), it puts a model in eval mode in
    training mode first (dropout on; a BatchNorm in training mode is then refused). Apply it with
    `clip_and_step(state, grads, lr=..., stats=stats)` and no `max_norm`
    there (clipping is done per example here). Memory: per-example gradients of `chunk_size`
    examples at a time.

    Args:
        state: the current state (not consumed).
        micro: the micro-batches of one optimizer step.
        loss_fn: `(model, batch) -> (loss_sum, num_items)`; if None, `state.loss_fn`, else
            `ft.losses.default_loss`.
        max_norm: per-example clipping threshold C.
        noise_multiplier: sigma; the noise std is `sigma * C`. 0 gives clipped gradients only.
        expected_batch_size: the denominator B; the number of examples if None (then a step
            with no example raises: give it with Poisson sampling, which can draw one).
        chunk_size: examples per vectorized pass; the whole micro-batch if None.
        noise_key: the secret keying the noise: bytes (at least 16) or an int >= 2**64;
            None draws one per process. Never saved; pass the same key after a restart.

    Returns:
        `(grads, stats)` like `accumulate_grads` (`stats.loss` is the mean unclipped loss).

    Raises:
        ValueError: for a bad hyperparameter or an empty `micro`, a guessable `noise_key`, or
            a step with no example and no `expected_batch_size` (B would be 0); for
            micro-batches of a `make_batches(data, state, ...)` call that `accumulate_grads`
            refuses (not where the state stands, or not consecutive: `ft.grads.step_consumed`,
            which counts what the cursor advances by, as there).
        TypeError: for a `noise_key` that is not bytes, an int or None.
        FuncError: as `per_sample_grads`; for several ranks or float16 loss scaling (not
            supported).
        ValueError: inside `ft.optim.swap_ema(state)` (the model holds the EMA average).
    """
    _validate_private(max_norm, noise_multiplier, expected_batch_size)
    key = noise_key_bytes(noise_key)
    _validate_chunk(chunk_size)
    _check_single_process(state)
    if ema_swapped(state):  # a plain dict, which clip_and_step cannot tell from live gradients
        raise ValueError(
            "private_grads(state) inside ft.optim.swap_ema(state): the model holds the EMA "
            "average until the block ends, and the step would apply its gradients to the live "
            "weights; compute them outside the block"
        )
    if len(micro) == 0:
        raise ValueError("micro is empty: pass the list of micro-batches yielded by make_batches")
    # What the cursor advances by, as accumulate_grads counts it (a replay batch mixed in is not
    # the epoch's); refuses what it refuses, before any forward.
    data, consumed = step_consumed(state, micro)
    # In place of accumulate_grads, so in its mode: an eval-mode model (HF from_pretrained)
    # trained with dropout off, unlike the same run without DP.
    if not state.model.training:
        state.model.train()
    fn = _example_fn(state, loss_fn, vectorize=chunk_size != 1)
    trainable, device = _trainable(state), state.strategy.device
    params = _params(trainable)
    members = isinstance(state.strategy.unwrap(state.model), Ensemble)
    total = {n: torch.zeros_like(p) for n, p in trainable.items()}
    zero = torch.zeros((), device=device)
    losses, items, tokens, examples = [zero], [zero.double()], [zero.long()], 0
    for i, batch in enumerate(micro):
        batch, weight = weighted(batch)
        if not weight:  # a ZeroWeight stand-in: no example of this step, nothing to count
            continue
        batch = state.strategy.to_device(batch)
        with _Seeded(state, i):
            for chunk in _chunks(batch, chunk_size):
                g, (loss, n) = _run(state, fn, params, chunk)
                per_example = {k: g[f"model.{k}"] for k in total}
                clipped = clip_examples(per_example, max_norm, members=members)
                torch._foreach_add_(list(total.values()), list(clipped.values()))
                losses.append(loss.sum())
                items.append(n.sum().double())
        tokens.append(torch.as_tensor(batch_counts(batch)[0], device=device).long())
        # The examples clipped, as `_chunks` splits them (a nested batch's first field is no count).
        examples += _num_examples(batch)
    if examples == 0 and expected_batch_size is None:
        raise ValueError(
            f"private_grads got no example in this step ({len(micro)} micro-batch(es), all "
            "empty or ZeroWeight stand-ins) and no expected_batch_size: the DP-SGD gradient "
            "(clipped sum + noise) / B has no denominator B. With Poisson sampling, which can "
            "draw an empty step, pass expected_batch_size=<sample rate * dataset size> (the "
            "fixed denominator the privacy analysis needs, as Opacus requires)"
        )
    if noise_multiplier > 0:
        mechanism = f"{float(noise_multiplier).hex()}:{float(max_norm).hex()}:{expected_batch_size}"
        seed = noise_seed(key, state, mechanism)
        noise = noise_like(total, std=noise_multiplier * max_norm, seed=seed)
        torch._foreach_add_(list(total.values()), list(noise.values()))
    denom = examples if expected_batch_size is None else expected_batch_size
    grads = {n: t / denom for n, t in total.items()}
    # float64, as accumulate_grads counts: a weighted loss may count fractional items (0.5 in
    # all was 0 as an int, and clip_and_step skipped the step as one that counted nothing).
    num_items = torch.stack(items).sum()
    stats = Stats(
        loss=(torch.stack(losses).sum() / num_items).float(),  # NaN over no item, as the core's
        num_items=num_items,
        num_tokens=torch.stack(tokens).sum().long(),
        num_samples=torch.tensor(examples, device=device),
        num_micro=consumed,
        position=data.position,  # a list or slice of a group has it too
        loss_fn=_resolved(state, loss_fn),
        skip_empty=False,  # an empty Poisson batch's step applies its noise, as Opacus does
    )
    return grads, stats
