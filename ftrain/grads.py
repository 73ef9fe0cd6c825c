"""accumulate_grads: forward/backward over micro-batches, gradients of one big batch."""

from __future__ import annotations

import math
import warnings
from _collections_abc import dict_items, dict_keys, dict_values
from collections.abc import Iterator, Mapping, Sequence
from operator import attrgetter, methodcaller
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ftrain.data import MicroBatches, StepData, StepSpan, ZeroWeight, step_span, weighted
from ftrain.losses import Counted, LossFn, _defaults, _items_before_forward, default_loss
from ftrain.optim import ema_swapped
from ftrain.process_state import STATE
from ftrain.rng import default_generators, dropout_seeds
from ftrain.state import TrainState, _Lease, unfrozen
from ftrain.strategies import Strategy, active_preemption

__all__ = ["Grads", "Stats", "accumulate_grads", "batch_counts", "step_consumed"]


class Stats(NamedTuple):
    """What `accumulate_grads` measured, global over ranks.

    `loss` (mean per item), `num_items` (items the loss counts, e.g. label tokens: float64, as
    a weighted loss may count fractional items), `num_tokens` (non-padding input tokens) and
    `num_samples` (int64) are device tensors; reading them
    is a host sync. `num_micro` is the micro-batches of the epoch this step consumed, what
    `clip_and_step` advances `state.data.cursor` by, a host int: the step's micro-batch count,
    less batches built by hand mixed with a `make_batches(data, state, ...)` group's (a replay
    buffer's, which are not the epoch's). `position` is
    where the data stands after these micro-batches (JSON, `ft.data.MicroBatches.position`; for
    a list or slice of a group, the position after its last micro-batch; None for batches
    built by hand), which `clip_and_step` keeps in the state. `loss_fn` is the loss these
    gradients are of, which `clip_and_step` records as `state.loss_fn` (so `evaluate` reports
    that loss by default).
    `skip_empty` False makes `clip_and_step` apply a step that counted no item (the noise-only
    step of an empty Poisson batch in `ft.func.private_grads`, as Opacus applies it); by
    default such a step is skipped, its gradient being 0/0.
    """

    loss: torch.Tensor
    num_items: torch.Tensor
    num_tokens: torch.Tensor
    num_samples: torch.Tensor
    num_micro: int
    position: str | None = None
    loss_fn: LossFn | None = None
    skip_empty: bool = True


class Grads(dict[str, torch.Tensor]):
    """The gradients `accumulate_grads` returns: a dict name -> tensor that can be donated.

    `clip_and_step` consumes it (unless `donate=False`): it empties the dict and releases the
    parameters' `.grad`, so a `grads` variable that outlives the step holds no gradient memory,
    like a raw loop with `zero_grad(set_to_none=True)`. Reading a consumed `Grads` raises
    `ConsumedStateError` naming the function and step: the same donation mark (a lease) as a
    consumed `TrainState`.

    Example:
        >>> import torch, ftrain as ft
        >>> state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
        >>> loss_fn = lambda m, x: (m(x).sum(), torch.tensor(x.shape[0]))
        >>> grads, stats = ft.accumulate_grads(state, [torch.ones(3, 2)], loss_fn)
        >>> sorted(grads)
        ['bias', 'weight']
        >>> state, info = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
        >>> grads.consumed, state.params["weight"].grad is None
        (True, True)
    """

    __slots__ = ("lease", "of_ema_average")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease = _Lease("these gradients were")
        # Taken inside `ft.optim.swap_ema`: the gradient of the average, which `clip_and_step`
        # refuses to apply to the live weights.
        self.of_ema_average = False

    @property
    def consumed(self) -> bool:
        """Whether a step function has consumed (and released) these gradients."""
        return self.lease.consumed_by is not None

    def consume(self, by: str, step: int) -> None:
        """Release the tensors and mark the mapping consumed by `by` at `step`."""
        self.lease.consume(by, step)
        self.clear()

    def check(self) -> None:
        """Raise `ConsumedStateError` if the gradients were consumed."""
        self.lease.check(_RELEASED)

    # Reading goes through dict's C fast path while live; a consumed (emptied) mapping lands in
    # __missing__ or in these checks, so every read of it raises instead of looking empty.
    def __missing__(self, key: str) -> torch.Tensor:
        self.check()
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        self.check()
        return super().__iter__()

    def __len__(self) -> int:
        self.check()
        return super().__len__()

    def __contains__(self, key: object) -> bool:
        self.check()
        return super().__contains__(key)

    def keys(self) -> dict_keys[str, torch.Tensor]:
        self.check()
        return super().keys()

    def values(self) -> dict_values[str, torch.Tensor]:
        self.check()
        return super().values()

    def items(self) -> dict_items[str, torch.Tensor]:
        self.check()
        return super().items()

    def get(self, key: str, default: Any = None) -> Any:
        self.check()
        return super().get(key, default)

    def __repr__(self) -> str:
        used = self.lease.consumed_by
        if used is not None:
            return f"Grads(<consumed by {used[0]} at step {used[1]}>)"
        return f"Grads({super().__repr__()})"


_RELEASED = "(released to free their memory); read them before the step, or pass donate=False"


def batch_counts(batch: Any) -> tuple[torch.Tensor | int, int]:
    """(non-padding tokens, samples) of one micro-batch, as `Stats` counts them: the sum of a
    2-D `attention_mask`, else every input id.

    Tokens is a device tensor only when an attention mask must be summed (a host int costs no
    device op).
    """
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        # Only a 2-D padding mask counts tokens: a 4-D attention mask (a packed row's
        # block-diagonal one, additive 0 / -inf) summed to pairs of positions, or to -inf.
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            return mask.sum(), mask.shape[0]
        if "input_ids" in batch:
            ids = batch["input_ids"]
            return ids.numel(), ids.shape[0]
        sides = _sides(batch)  # a preference pair's chosen_/rejected_ sequences
        if sides is not None:
            return sides
        first = next(iter(batch.values()))
    else:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
    # A nested batch ({"features": {"num": ..., "cat": ...}, "y": ...}) counts the rows of its
    # first field's first value, not the keys of its first field. (A list or tuple is one row
    # per element: per-sample tensors, as detection and ragged batches hold them.)
    while isinstance(first, Mapping) and first:
        first = next(iter(first.values()))
    n = first.shape[0] if isinstance(first, torch.Tensor) else len(first)
    # An integer tensor of rank >= 2 first in the batch is token ids (e.g. an (x, y) pair of
    # windows); anything else counts one token per sample.
    return (first.numel() if isinstance(first, torch.Tensor) and _is_ids(first) else n), n


def _sides(batch: Mapping[str, Any]) -> tuple[torch.Tensor | int, int] | None:
    """(tokens, rows) of a batch of several sequences per row (`chosen_input_ids` and
    `rejected_input_ids`, with their `*_attention_mask`): every side's tokens, each row once.
    None for any other batch."""
    ids = [v for k, v in batch.items() if k.endswith("_input_ids") and isinstance(v, torch.Tensor)]
    if not ids:
        return None
    masks = [
        m
        for k, v in batch.items()
        if k.endswith("_input_ids")
        and isinstance(v, torch.Tensor)
        and isinstance(m := batch.get(k.removesuffix("input_ids") + "attention_mask"), torch.Tensor)
    ]
    if len(masks) == len(ids):  # every side has its mask: the tokens without padding
        return sum(m.sum() for m in masks), ids[0].shape[0]
    return sum(t.numel() for t in ids), ids[0].shape[0]


def _is_ids(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def accumulate_grads(
    state: TrainState,
    micro: Sequence[Any],
    loss_fn: LossFn | None = None,
    *,
    strategy: Strategy | None = None,
) -> tuple[dict[str, torch.Tensor], Stats]:
    """Run forward/backward over `micro` and return the gradients of one batch holding them all.

    Each `loss_fn` returns a *sum* and an item count; the gradient is divided by the item count
    summed over every micro-batch and rank, so ragged padding and uneven ranks do not change
    it. With float16 loss scaling the loss is multiplied by `state.scaler.scale` before backward
    and the gradients are divided by it. Non-final micro-batches skip the strategy's gradient
    sync. Dropout randomness is
    `dropout_seed(state.seed, state.step, i, rank)` for micro-batch i. No host sync (but one
    under FSDP, TP or DDP with `sync_every_micro` for micro-batches other than a whole
    `make_batches` group, whose count every process must agree on: see Raises).
    With the default loss on causal-LM batches, or a loss that counts from the batch alone
    (`ft.losses.counted`), and at least `COUNT_FIRST_NUMEL` (2**20) parameters, the items
    (label tokens) are counted before any forward and each loss is divided
    before backward, as a raw loop does: no extra pass over the gradients, the same result to
    float rounding.

    The returned gradients are the parameters' `.grad` tensors (not copies), in a `Grads`
    mapping that `clip_and_step` consumes; the model is put in training mode. A step that
    counts no item reports a NaN loss (a mean over nothing).

    Args:
        state: the current state (not consumed).
        micro: the micro-batches of one optimizer step, as yielded by `make_batches` (or a
            list, tuple or slice of such a group: consecutive micro-batches in their order
            carry the data position on, `ft.data.MicroBatches`).
        loss_fn: `(model, batch) -> (loss_sum, num_items)`; if None, `state.loss_fn`, else
            `ft.losses.default_loss`.
        strategy: overrides `state.strategy`.

    Returns:
        `(grads, stats)`: name -> gradient for trainable parameters that received one, and
        `Stats` with the global mean loss and counts.

    Raises:
        TypeError: if `micro` is a single batch (a dict, a tensor), or a list or tuple of
            tensors of different dtypes: a DataLoader's `[x, y]` batch passed without its
            wrapping list (each tensor would be taken for a micro-batch).
        ValueError: for micro-batches of a `make_batches(data, state, ...)` call that are not
            where the state stands (`state.epoch`, `state.data.cursor`: a group cut short or
            left out before), not consecutive in their order, or mixed with batches of other
            origin (the cursor would count other micro-batches than the data went over); and
            under FSDP, TP or DDP with `sync_every_micro`, on every process, when the processes
            were given different numbers of micro-batches (checked with one small all-reduce and
            a host sync for micro-batches that are not a whole `make_batches` group: unlike
            collectives would pair up and hang).
        ValueError: if `micro` is empty, `strategy` is not laid out like `state.strategy`
            (another type, device, rank, world size or reduction: the model was set up by
            the state's strategy, whose backward reduces the gradients), or a parameter frozen
            when the state was created now requires a gradient (re-create the state).
    """
    _check_args(state, micro, loss_fn, strategy)
    if late := unfrozen(state):
        raise ValueError(
            f"{_preview(late)} was frozen when the TrainState was created and now requires a "
            "gradient: state.params and the optimizer state were taken at create, so it would "
            "get gradients that are never applied. Re-create the state after unfreezing "
            "(ft.TrainState.create(model, optimizer, ...), then load or carry over what to keep)"
        )
    strategy = state.strategy if strategy is None else strategy
    held = state.tensors_  # one lease check for the model and parameters (issue 30)
    held.lease.check()
    data, consumed = step_consumed(state, micro)
    if not (data.whole and data.made_by.strategy is strategy):  # type: ignore[union-attr]
        _check_micro_count(strategy, len(micro))
    model, params = held.model, held.params
    if not model.training:
        model.train()
    for p in params.values():
        p.grad = None
    if loss_fn is None:
        loss_fn = default_loss if state.loss_fn is None else state.loss_fn
    # float16 training scales the loss up so small gradients survive backward (ft.precision).
    sums, divided = _forward_backward(state, micro, loss_fn, strategy)
    # Views of the sums in one op, and one cast for the token and sample counts (each 0-dim op
    # or view is thousands of instructions: a small step notices every one, issue 30). The
    # item count stays the float64 sum: a weighted loss may count fractional items (0.8 in all
    # truncated to 0 made clip_and_step skip a step that counted some).
    loss_sum, num_items, _, _ = sums.unbind()
    _, _, num_tokens, num_samples = sums.long().unbind()
    got = {n: p.grad for n, p in params.items() if p.grad is not None}
    if len(got) != len(params):  # (a length compare a step; the names only when it differs)
        _warn_no_grad(model, params, got, state.step)
    if got and not divided:
        # Backends that average over ranks (DDP) have multiplied by grad_reduce_factor; undo it,
        # and the loss scale. A step without items keeps its (zero) gradient as it is. (No
        # multiply by a factor of 1.) The divisor is the float64 sum, not the int64 count: a
        # weighted loss may count fractional items, also fewer than 1 in all (not clamped to 1).
        # ftrain's own losses count whole items: clamping to 1 only touches a count of 0 (one
        # op); a loss of yours may count fractional ones, fewer than 1 in all.
        # (A `counted` loss is an object of ftrain.losses, but its count is the user's.)
        whole = loss_fn is default_loss or (
            type(loss_fn) is not Counted and getattr(loss_fn, "__module__", None) == _OWN_LOSSES
        )
        norm = num_items.clamp_min(1) if whole else torch.where(num_items > 0, num_items, 1.0)
        factor, scale = strategy.grad_reduce_factor, state.scaler.scale
        norm = norm if factor == 1 else norm * factor
        norm = norm if scale is None else norm * scale
        divided_grads = list(got.values())
        if _SINGLE_OR_HALF.issuperset(map(_DTYPE, divided_grads)):
            # The kernels divide by the count cast to float32 (these dtypes' compute type)
            # either way: cast once, and each tensor's division skips its mixed-dtype set-up
            # (5 float32 tensors on the CPU: 11 -> 6 us, issue 30). Bit-identical results.
            norm = norm.float()
        torch._foreach_div_(divided_grads, norm)
    grads = Grads(got)
    grads.of_ema_average = ema_swapped(state)
    # The mean over zero items is undefined: NaN, and clip_and_step skips such a step.
    stats = Stats(
        loss=(loss_sum / num_items).float(),
        num_items=num_items,
        num_tokens=num_tokens,
        num_samples=num_samples,
        num_micro=consumed,
        position=data.position,
        loss_fn=loss_fn,
    )
    return grads, stats


_SINGLE_OR_HALF = frozenset({torch.float32, torch.bfloat16, torch.float16})
_OWN_LOSSES = default_loss.__module__  # "ftrain.losses": whole item counts


# Steps over which a trainable parameter may go without a gradient before it is named (a
# multi-task head trained every other step, an expert no token was routed to, gets one).
NO_GRAD_STEPS = 32


def _warn_no_grad(
    model: torch.nn.Module, params: Mapping[str, torch.Tensor], got: Mapping[str, Any], step: int
) -> None:
    """Warn, once per model, naming the trainable parameters that received no gradient in
    any of the first `NO_GRAD_STEPS` steps that left some without one: a parameter the forward
    never uses is silently never trained (a LoRA adapter on a tied embedding module the
    forward does not call, such as T5's `shared` in transformers 5). Only steps where some
    parameter got none come here (a length compare a step); the names are set operations."""
    pending = STATE.no_grad_pending.get(model)
    if pending is None or step > pending[2] + 1:
        # First sight, or a step between gave every parameter a gradient (it did not come
        # here): start over. Frozen again since create (gradual freezing) is wanted.
        names = {n for n, p in params.items() if n not in got and p.requires_grad}
        STATE.no_grad_pending[model] = pending = [names, step, step]
    names, since = pending[0], pending[1]
    names.difference_update(got)
    pending[2] = step
    if not names or step - since + 1 < NO_GRAD_STEPS:
        return
    missing = [n for n, p in params.items() if n in names and p.requires_grad]
    names.clear()
    pending[2] = math.inf  # named once per model: never starts over
    if not missing:  # frozen since (gradual freezing)
        return
    warnings.warn(
        f"{_preview(missing)} of the TrainState received no gradient in steps {since} to "
        f"{step} ({NO_GRAD_STEPS} steps in a row), so none of them trained them: an adapter on "
        "a module the forward does not call (a tied embedding's other handle)? Also a head "
        f"trained less often than every {NO_GRAD_STEPS} steps, or an expert no token reached. "
        "Freeze them before TrainState.create if they are not to train",
        UserWarning,
        stacklevel=3,
    )


def _preview(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return (
        f"parameter {shown}"
        if len(names) == 1
        else f"parameters {shown}" + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    )


def _check_args(state: Any, micro: Any, loss_fn: Any, strategy: Any) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    if type(micro) not in _SEQUENCES and (
        isinstance(micro, (Mapping, str, bytes, torch.Tensor)) or not isinstance(micro, Sequence)
    ):
        raise TypeError(
            f"micro must be the micro-batches of one step (what make_batches yields, or a list "
            f"of batches), got {type(micro).__name__}; wrap a single batch: [batch]"
        )
    if len(micro) == 0:
        raise ValueError("micro is empty: pass the list of micro-batches yielded by make_batches")
    if type(micro) in (list, tuple) and len(micro) > 1:
        _check_plain_micro(micro)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (model, batch) or None, got {loss_fn!r}")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an ft.strategies.Strategy, got {strategy!r}")
    if strategy is not None and strategy is not state.strategy:
        _check_override(state.strategy, strategy)


_SEQUENCES = frozenset({list, tuple, MicroBatches})  # the usual micro: no ABC checks (issue 30)


def _is_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor)


def _check_plain_micro(micro: Sequence[Any]) -> None:
    """Refuse a plain list or tuple of tensors that cannot be micro-batches of one step: a
    DataLoader's `[x, y]` batch passed without its wrapping list. Dicts are not judged by
    their keys: micro-batches of several tasks may share none (a multi-task step), and a
    `[inputs, labels]` pair of dicts fails in the loss that reads labels from each."""
    if type(micro[0]) is not dict and all(map(_is_tensor, micro)):
        _check_tensor_micro(micro)


def _refuse_split(micro: Sequence[Any], what: str) -> None:
    raise TypeError(
        f"micro is a {type(micro).__name__} of {len(micro)} items that cannot be micro-batches "
        f"of one step, {what}: a DataLoader's [inputs, labels] batch passed as micro-batches? "
        "Wrap one batch as [batch] (each micro-batch is one whole batch), with a loss_fn that "
        "reads inputs and labels from it"
    )


def _check_tensor_micro(micro: Sequence[torch.Tensor]) -> None:
    """Refuse single-tensor micro-batches of different dtypes or ranks: that is a DataLoader's
    batch of a TensorDataset, `[x, y]` (features and labels), passed without its wrapping list:
    each tensor was taken for a micro-batch, indexed or unpacked by a loss_fn into rows of x,
    then of y (a wrong gradient, no error). Tensors of one dtype and rank may be micro-batches
    of one step (chunks of a batch) and pass: a float regression's `[x, y]` with targets of
    shape (n, 1) stays ambiguous."""
    dtypes = {t.dtype for t in micro}
    if len(dtypes) > 1:
        raise TypeError(
            f"micro is a {type(micro).__name__} of {len(micro)} tensors of different dtypes "
            f"({', '.join(sorted(str(d) for d in dtypes))}): a DataLoader's [x, y] batch passed "
            "as micro-batches? Wrap one batch as [batch] (each micro-batch is one whole batch)"
        )
    shapes = [tuple(t.shape) for t in micro]
    if len({len(s) for s in shapes}) > 1:
        _refuse_split(micro, f"tensors of different ranks (shapes {shapes[:4]})")


_LAYOUT = attrgetter("device", "rank", "world_size", "grad_reduce_factor", "precision")


def _check_override(own: Strategy, other: Strategy) -> None:
    """`strategy=` must reduce as the one that set the model up: the model's backward reduces
    (DDP averages, FSDP reduce-scatters) by the state's strategy, and the item count and its
    undoing would come from the other, so a SingleDevice override of a DDP state divides by this
    rank's count, and a DDP override of a SingleDevice state scales unreduced gradients. The
    precision too: an fp16 override of an fp32 state ran the forward in float16 without the
    state's loss scale (small gradients flushed to zero)."""
    if type(other) is not type(own) or _LAYOUT(other) != _LAYOUT(own):
        raise ValueError(
            f"strategy={other!r} differs from the strategy that set the model up, "
            f"{own!r}: its gradients are reduced (and its loss scaled) by the latter, so the "
            "counts, reduction or precision would not match; drop strategy= (the state's is "
            "used), or create the state with it"
        )


def step_consumed(state: TrainState, micro: Sequence[Any]) -> tuple[StepData, int]:
    """Return where the data stands after `micro` (`ft.data.step_data`) and the micro-batches of
    the epoch a step over them consumes: `Stats.num_micro`, what `clip_and_step` advances
    `state.data.cursor` by. A function that produces `Stats` in `accumulate_grads`' place
    (`ft.func.private_grads`) counts with it, so the cursor counts the same micro-batches.

    The count is `micro`'s, less batches of other origin mixed with a `make_batches(data,
    state, ...)` group's (a replay buffer's, which are not the epoch's): see `ft.data.step_span`.

    Raises:
        ValueError: as `accumulate_grads`, for micro-batches of a `make_batches(data, state,
            ...)` call that are not where the state stands, not consecutive in their order, or
            of two calls.
    """
    # Where the data stands after micro (a list of a group's too); batches of earlier steps
    # (a replay buffer holding groups) are not the epoch's.
    span = step_span(micro, since=(state.epoch, state.data.cursor))
    data, consumed = span.data, len(micro) - span.replay
    if data.made_by is not None and data.made_by.stateful:
        consumed = _check_cursor(state, span)
    elif data.made_by is not None:  # make_batches(data, start=state.data.cursor, ...)
        consumed = _consumed(state, span) or consumed
    return data, consumed


def _check_cursor(state: TrainState, span: StepSpan) -> int:
    """Refuse micro-batches that a `make_batches(data, state)` call yielded other than the ones
    `state` stands at: the cursor `clip_and_step` records would not say where the data is.
    Return the micro-batches of the epoch the step consumes (what the cursor advances by):
    the call's own, and batches of other origin before them only where they fill the gap from
    the cursor (a step gathered from several groups, of which only the last lives); others
    (a replay buffer's) are not the epoch's."""
    data = span.data
    assert data.made_by is not None
    if (consumed := _consumed(state, span)) is not None:
        return consumed
    (epoch, cursor), first = (state.epoch, state.data.cursor), data.first
    last = first + span.made - 1
    held = f"micro-batch {last}" if span.made == 1 else f"micro-batches {first} to {last}"
    if epoch != data.made_by.epoch:
        why = "the state is in another epoch than make_batches was called for"
        fix = "call make_batches(data, state, ...) again for the state's epoch"
    elif first > cursor:
        why = (
            f"micro-batch(es) {cursor} to {first - 1} were not stepped on (a group cut short, "
            "micro[:k] without micro[k:], or one left out), or clip_and_step was given no "
            "stats=stats (the cursor advances by the stats it gets)"
        )
        fix = (
            "step on every micro-batch in order; to pass over them untrained, move the cursor "
            f"past them: state.replace(data=state.data.replace(cursor={first}))"
        )
    else:
        why = (
            "the cursor is past them (a group trained on again with its stats, or a state "
            "loaded or changed after make_batches was called)"
        )
        fix = (
            "give clip_and_step the stats of each micro-batch once, and call "
            "make_batches(data, state, ...) again after loading a checkpoint or moving the cursor"
        )
    raise ValueError(
        f"micro holds {held} of epoch {data.made_by.epoch} as make_batches(data, state, ...) "
        f"yielded them, but the state stands at micro-batch {cursor} of epoch {epoch} "
        f"(state.data.cursor, state.epoch): {why}. The cursor clip_and_step records would not "
        f"say where the data is, so a resume would repeat or skip rows; {fix}"
    )


def _consumed(state: TrainState, span: StepSpan) -> int | None:
    """The micro-batches of the epoch a step over `span` consumes, where the state's epoch and
    cursor show which they are: `make_batches`' own from the cursor on, after batches of other
    origin that fill the gap from the cursor (earlier groups already freed); else None."""
    assert span.data.made_by is not None
    cursor, first = state.data.cursor, span.data.first
    if state.epoch == span.data.made_by.epoch and cursor <= first <= cursor + span.lead:
        return first + span.made - cursor
    return None


def _check_micro_count(
    strategy: Strategy, n: int, caller: str = "accumulate_grads", *, paired: bool | None = None
) -> None:
    """Raise on every process unless each one runs `n` micro-batches this step, where another
    count would pair unlike collectives: FSDP gathers parameters in every forward and reduces
    in the final backward only, TP's processes reduce inside every forward, DDP with
    `sync_every_micro` reduces in every backward. (DDP otherwise reduces once, in the final
    backward: uneven counts give the gradient of every rank's micro-batches, as they should.)

    One small all-reduce over every process and a host sync, before the first forward: only
    for micro-batches that are not a whole group of a `make_batches` call with this strategy
    (whose counts every process agreed on). Without it, the processes hung in unlike
    collectives until the backend's timeout (FSDP), or gloo aborted on a size mismatch (TP).
    `paired`: whether each micro-batch runs collectives on every process (`predict` gathering
    its outputs); by default the strategy's `micro_counts_must_match`.
    """
    if not (getattr(strategy, "micro_counts_must_match", False) if paired is None else paired):
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = torch.tensor([1, n, n * n], dtype=torch.int64).to(strategy.device)
    processes, total, squares = strategy.sum_over_processes(mine).tolist()  # host sync
    if processes * squares == total * total:  # (sum n)^2 == P sum n^2 iff every n is equal
        return
    raise ValueError(
        f"{caller} got {n} micro-batch(es) on this process and {total / processes:.3g} "
        f"on average over the {processes} processes of {type(strategy).__name__}: every "
        "process must run as many micro-batches a call, or their collectives (parameter "
        "gathers, gradient reductions) pair up unlike and hang until the backend's timeout. "
        "Give every rank the same number of micro-batches (make_batches(data, state, ...), or "
        "make_batches(data, ..., strategy=state.strategy) for evaluation, does: a rank "
        "without rows for the last one gets an ft.data.ZeroWeight stand-in, which runs and "
        "counts nothing)"
    )


def _forward_backward(
    state: TrainState, micro: Sequence[Any], loss_fn: LossFn, strategy: Strategy
) -> tuple[torch.Tensor, bool]:
    """Backward over every micro-batch; returns the global float64 (loss, items, tokens,
    samples) sums, and whether the losses were already divided by the item count.

    Each micro-batch's device values (its loss, a device item count, an attention mask's token
    count) are kept as they come and summed once after the last backward, in float64 (exact far
    beyond 2**24); counts known on the host stay host ints. Each small device op and Python
    call is microseconds of a small model's step (issues 12 and 30).
    """
    model, device, scale = state.tensors_.model, strategy.device, state.scaler.scale
    inv = _inverse_count(state, micro, loss_fn, strategy) if scale is None else None
    if loss_fn is default_loss:
        loss_fn = _defaults(model)[1]
    values: list[torch.Tensor] = []  # per counted micro-batch: loss, then the device counts
    slots: list[tuple[int, ...]] = []  # which of (loss, items, tokens) each one's values are
    host: list[Any] = [0, 0, 0, 0]  # items, tokens, samples known on the host (slots 1-3)
    last = len(micro) - 1
    seeds = dropout_seeds(state.seed, state.step, strategy.rank, len(micro))
    gens = default_generators(device)
    saved = [g.get_state() for g in gens]  # the caller's random stream, put back below
    try:
        for i, batch in enumerate(micro):
            # A ZeroWeight stand-in runs so that this rank joins the collectives, and counts 0.
            weight = type(batch) is not ZeroWeight
            batch = strategy.to_device(batch if weight else batch.batch)
            # (Seeding the generators directly, not torch.manual_seed, avoids its lazy-CUDA
            # bookkeeping, which captures a stack trace per call: 0.1 ms a micro-batch.)
            for g in gens:
                g.manual_seed(seeds[i])
            with strategy.grad_sync(model, final=i == last):
                with strategy.autocast():
                    loss_sum, num_items = loss_fn(model, batch)
                if not weight:
                    loss_sum = loss_sum * 0.0
                if inv is not None:  # the global count is known: divide now, as a raw loop does
                    (loss_sum * inv).backward()
                else:
                    (loss_sum if scale is None else loss_sum * scale).backward()
            if weight:
                slots.append(_keep(values, host, loss_sum, num_items, batch, device))
            del loss_sum, num_items  # this micro-batch's graph goes before the next forward
    finally:
        for g, s in zip(gens, saved, strict=True):
            g.set_state(s)
    with torch.no_grad():
        totals = _totals(values, slots, host, device)
    return _reduce(totals, strategy), inv is not None


def _keep(
    values: list[torch.Tensor],
    host: list[Any],
    loss_sum: torch.Tensor,
    num_items: Any,
    batch: Any,
    device: torch.device,
) -> tuple[int, ...]:
    """Keep one micro-batch's loss and counts: device ones in `values`, host ones added into
    `host`; returns the slots (0 loss, 1 items, 2 tokens) it put in `values`."""
    # Detached: a kept loss would keep its micro-batch's graph, and whatever custom autograd
    # functions hold on their ctx (bitsandbytes' 8-bit matmul keeps its input), until the step
    # ends. Compare device types below: "cuda" and "cuda:0" name one device.
    values.append((loss_sum if loss_sum.ndim == 0 else loss_sum.reshape(())).detach())
    if isinstance(num_items, torch.Tensor) and num_items.device.type == device.type:
        values.append(num_items if num_items.ndim == 0 else num_items.reshape(()))
        slot: tuple[int, ...] = (0, 1)
    else:  # a Python number, or a CPU tensor (reading it is no device sync); a weighted
        # count may be fractional, as on the device: not truncated
        host[1] += num_items.item() if isinstance(num_items, torch.Tensor) else num_items
        slot = (0,)
    mask = batch.get("attention_mask") if type(batch) is dict else None
    if mask is not None and mask.ndim == 2:  # a padding mask (a 4-D one masks attention)
        dtype = loss_sum.dtype
        # The mask's sum in the loss's dtype where that is exact: it stacks without a cast.
        if dtype == torch.float64 or (dtype == torch.float32 and mask.numel() < 2**24):
            values.append(mask.sum(dtype=dtype))
            host[3] += mask.shape[0]
            return (*slot, 2)
    n_tok, n_samples = batch_counts(batch)
    if isinstance(n_tok, torch.Tensor):
        values.append(n_tok if n_tok.ndim == 0 else n_tok.reshape(()))
        slot += (2,)
    else:
        host[2] += n_tok
    host[3] += n_samples
    return slot


_LEADING = ((), (0,), (0, 1), (0, 1, 2))  # slot patterns that the host counts can follow
_DTYPE = attrgetter("dtype")


def _totals(
    values: list[torch.Tensor], slots: list[tuple[int, ...]], host: list[int], device: torch.device
) -> torch.Tensor:
    """The float64 (loss, items, tokens, samples) sums of the kept values and host counts.

    One stack and one sum when every micro-batch kept the same leading slots (the default and
    built-in losses: loss, device item count, mask tokens), then the host counts appended:
    three to five ops a step. Other patterns (a loss counting on the host with a mask in the
    batch, or counting on the device for some micro-batches only) go value by value.
    """
    pattern = slots[0] if slots else ()
    if not slots or slots.count(pattern) != len(slots) or pattern != _LEADING[len(pattern)]:
        return _totals_each(values, slots, host, device)
    dtypes = set(map(_DTYPE, values))
    if len(dtypes) == 1 and values[0].dtype.is_floating_point:
        stacked = torch.stack(values)
    else:  # integer counts: float64 holds them exactly (a float32 stack would not)
        stacked = torch.stack([v.to(torch.float64) for v in values])
    sums = stacked.view(len(slots), len(pattern)).sum(0, dtype=torch.float64)
    for slot in range(len(pattern), 4):
        sums = F.pad(sums, (0, 1), value=host[slot])
    return sums


def _totals_each(
    values: list[torch.Tensor], slots: list[tuple[int, ...]], host: list[int], device: torch.device
) -> torch.Tensor:
    """`_totals` one value at a time (no micro-batch counted, or a loss whose counts are on
    the device for some micro-batches and on the host for others)."""
    # A non-blocking host-to-device copy is no sync (a no-op on the CPU).
    sums = torch.tensor(host, dtype=torch.float64).to(device, non_blocking=True)
    left = iter(values)
    for pattern in slots:
        for slot in pattern:
            sums[slot] += next(left).to(torch.float64)
    return sums


# Dividing the gradients by the item count after backward is one pass over them; counting the
# items first costs a few small ops per micro-batch. Count first from this many gradient
# elements on (a 33M-parameter model: 5% of its CPU step; a 20k one: +1% of ops).
COUNT_FIRST_NUMEL = 1 << 20


def _inverse_count(
    state: TrainState, micro: Sequence[Any], loss_fn: LossFn, strategy: Strategy
) -> torch.Tensor | None:
    """1 / (global item count x the backend's reduce factor) as a device scalar, when the loss
    can count its items from the batches before any forward and the model is large enough for
    that to pay (`COUNT_FIRST_NUMEL`); None otherwise. The same decision on every rank: it
    depends on the model and the batches' structure only (a ZeroWeight stand-in counts 0)."""
    if not _at_least(state.tensors_.params, COUNT_FIRST_NUMEL):
        return None
    counts, host = [], 0.0
    for batch in micro:
        batch, weight = weighted(batch)
        n = _items_before_forward(loss_fn, batch, state.tensors_.model)
        if n is None:
            return None
        if isinstance(n, torch.Tensor):
            counts.append(n if weight else n * 0)
        elif weight:  # a number (a `counted` loss's): summed on the host, exactly
            host += n
    if not counts:
        total = torch.tensor(host, dtype=torch.float64).to(strategy.device, non_blocking=True)
    else:
        total = torch.stack(counts).sum().to(strategy.device, torch.float64, non_blocking=True)
        total = total + host if host else total
    # As after backward: a count of 0 divides by 1; a weighted one below 1 by itself.
    total = strategy.all_reduce_sum(total)
    total = torch.where(total > 0, total, 1.0)
    if strategy.grad_reduce_factor != 1:
        total = total * strategy.grad_reduce_factor
    return total.reciprocal()


def _at_least(params: Mapping[str, torch.Tensor], numel: int) -> bool:
    """Whether the parameters hold at least `numel` elements (summed in C: a loop stopping
    there was 80 bytecodes of a small model's step, issue 30)."""
    return sum(map(_NUMEL, params.values())) >= numel


_NUMEL = methodcaller("numel")


def _reduce(totals: torch.Tensor, strategy: Strategy) -> torch.Tensor:
    """All-reduce the step's totals; with a preemption handler installed, its flag too.

    The flag is summed over every process (`sum_over_processes`): under tensor parallelism
    several processes share a data-parallel rank, and each may have been signalled alone.
    That is a second small collective per step, only with the opt-in handler, never a sync.
    """
    preempt = active_preemption()
    if preempt is not None:
        preempt.observe(strategy.sum_over_processes(preempt.local_flag(totals.device))[0])
    return strategy.all_reduce_sum(totals)
