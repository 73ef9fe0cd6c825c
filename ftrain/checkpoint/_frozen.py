"""The frozen weights' record: a checkpoint loads only onto the base model it was trained on.

Frozen parameters are not saved (a LoRA checkpoint holds the adapters): they come from the
model loaded into. A base of the same names, shapes and dtypes but other weights (the chat
variant, a random init) would otherwise resume silently. So a save records, per frozen
parameter, the sum and the sum of squares of its values (`state.json` under `frozen_sums`),
and a load compares them with the model's (docs/checkpoints.md, "The base model").

Sums, not a hash of the bytes in order: a sum over a parameter is the sum of its shards' sums,
so a sharded parameter (FSDP, TP) needs no gather and the record does not depend on the layout.
Floating parameters are summed in float64 and compared with a relative tolerance far above
float64's rounding and far below what another checkpoint of a model differs by; integer ones
(bitsandbytes' uint8/int8 weights) in int64, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ftrain.strategies import Strategy

KEY = "frozen_sums"  # state.json: parameter name -> [sum, sum of squares]
PREFIX = "frozen weights "  # how each line of `base_diffs` opens
RTOL = 1e-9  # float64 rounding of these sums in any order: ~1e-13 relative
# Elements cast to 64 bits at a time: a bounded temporary that stays in a CPU's cache
# (measured 4x faster than 32 MiB pieces); on an accelerator, fewer kernel launches.
_CHUNK = 1 << 16
_DEVICE_CHUNK = 1 << 24


def exact(dtype: torch.dtype) -> bool:
    """Whether a parameter of `dtype` is summed exactly (int64): bool and integers of up to 16
    bits, whose squares int64 sums hold for any tensor below 2**31 elements."""
    return not (dtype.is_floating_point or dtype.is_complex) and dtype.itemsize <= 2


def frozen_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The frozen parameters a save records, by name (tied ones once). A parameter on the meta
    device (offloaded by accelerate) has no values here, and a modules-to-save wrapper's original
    copy is not the base (`unread_originals`): both are left out."""
    unread = unread_originals(module)
    return [
        (n, p)
        for n, p in module.named_parameters()
        if not p.requires_grad and not p.is_meta and n not in unread
    ]


def unread_originals(module: nn.Module) -> set[str]:
    """The names of the parameters held only under a modules-to-save wrapper's `original_module`.

    PEFT's `ModulesToSaveWrapper` (`modules_to_save`, the head `ft.lora.apply` adds to a
    classifier) trains a copy and keeps the module it copied, frozen, for the adapter-disabled
    forward. For a new head that original is drawn at random by every `from_pretrained`, so it
    is no part of the base; the trained copy is saved. Duck-typed (the core does not import
    peft): a module with `original_module` and `modules_to_save` attributes. A tensor also
    reachable by another name (tied to a weight the forward reads) is kept.
    """
    heads = [
        f"{n}.original_module." if n else "original_module."
        for n, m in module.named_modules()
        if hasattr(m, "original_module") and hasattr(m, "modules_to_save")
    ]
    if not heads:
        return set()
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    prefixes = tuple(heads)
    return {
        n for group in names.values() if all(x.startswith(prefixes) for x in group) for n in group
    }


class Sums:
    """Device tensors of [sum, sum of squares] per parameter: one float64 row per floating
    parameter, one int64 row per integer one; `as_json` reads them (a host sync)."""

    def __init__(self, names: list[str], exacts: list[bool], floats: Any, ints: Any) -> None:
        self.names, self.exacts = names, exacts
        self.floats, self.ints = floats, ints  # tensors, or what `map` made of them

    def map(self, fn: Callable[[torch.Tensor], Any]) -> Sums:
        """These sums with `fn` applied to both tables (staged to the host, then read)."""
        return Sums(self.names, self.exacts, fn(self.floats), fn(self.ints))

    def as_json(self) -> dict[str, list[Any]]:
        rows = {True: iter(_rows(self.ints)), False: iter(_rows(self.floats))}
        return {n: next(rows[e]) for n, e in zip(self.names, self.exacts, strict=True)}


def _rows(table: Any) -> list[list[Any]]:
    return table.tolist() if isinstance(table, torch.Tensor) else list(table)


def frozen_sums(params: Sequence[tuple[str, torch.Tensor]], strategy: Strategy) -> Sums:
    """The sums of `params` as device tensors, without a host sync.

    With a sharded layout (`strategy.checkpoint_sharded`) each process sums its part and one
    `sum_over_processes` per table adds them: collective, so every process passes the same
    parameters in the same order. A part held by r processes (replicated over tensor- or
    data-parallel ranks) is counted r times: each row carries the number of elements summed,
    and is divided by how many times that is the parameter's size.
    """
    exacts = [exact(p.dtype) for _, p in params]
    tables = []
    for want in (False, True):
        group = [p for (_, p), e in zip(params, exacts, strict=True) if e is want]
        dtype = torch.int64 if want else torch.float64
        table = torch.zeros(0, 3, dtype=dtype, device=strategy.device)
        if group:
            table = torch.stack([_local_row(p, strategy, want) for p in group])
        if strategy.checkpoint_sharded and group:  # the same groups on every process
            table = _whole(table, group, strategy)
        tables.append(table[:, :2].contiguous())
    return Sums([n for n, _ in params], exacts, tables[0], tables[1])


def _whole(table: torch.Tensor, params: list[torch.Tensor], strategy: Strategy) -> torch.Tensor:
    """Each process's part summed over processes, a part held r times divided by r."""
    table = strategy.sum_over_processes(table)
    sizes = torch.stack([_filled(max(p.numel(), 1), table) for p in params])
    copies = (table[:, 2] // sizes).clamp_min(1).unsqueeze(1)  # exact: whole copies of each
    return table // copies if table.dtype == torch.int64 else table / copies


def _local_row(p: torch.Tensor, strategy: Strategy, want_exact: bool) -> torch.Tensor:
    """[sum, sum of squares, elements] of this process's part of `p`, on the strategy's device."""
    part = strategy.local_view(p.detach())
    dtype = torch.int64 if want_exact else torch.float64
    total = torch.zeros((), dtype=dtype, device=part.device)
    squares = torch.zeros((), dtype=dtype, device=part.device)
    for chunk in _chunks(part):
        x = chunk.to(dtype)
        total += x.sum()
        squares += (x * x).sum() if want_exact else torch.dot(x, x)  # no integer dot on CUDA
    return torch.stack([total, squares, _filled(part.numel(), total)]).to(strategy.device)


def _filled(n: int, like: torch.Tensor) -> torch.Tensor:
    """`n` as a 0-dim tensor like `like`, filled on its device: `torch.tensor(n, device=...)`
    copies from the host, which waits for the device (a background save must not)."""
    return torch.full((), n, dtype=like.dtype, device=like.device)


def _chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = torch.view_as_real(t).reshape(-1) if t.is_complex() else t.reshape(-1)
    return iter(flat.split(_CHUNK if flat.device.type == "cpu" else _DEVICE_CHUNK))


def base_diffs(
    saved: Any, table: list[list[Any]], module: nn.Module, strategy: Strategy
) -> list[str]:
    """One line per frozen parameter whose weights differ from the checkpoint's record.

    `saved`: the checkpoint's `frozen_sums` (validated by `open_checkpoint`), None for a
    checkpoint written before they were recorded (nothing to compare). Compares the model's
    parameters that the record names, frozen or not now (one unfrozen since still holds the
    base's values), where the dtype and shape are the table's (other ones are reported with the
    table). Collective under a sharded layout: every process compares the same parameters.
    """
    if not isinstance(saved, dict):
        return []
    rows = {r[0]: r for r in table}
    unread = unread_originals(module)  # recorded by a save before they were left out
    params = [
        (n, p)
        for n, p in module.named_parameters()
        if n in saved and n not in unread and not p.is_meta and _as_recorded(rows[n], p)
    ]
    ours = frozen_sums(params, strategy).as_json()  # host sync: once per load
    sizes = {n: p.numel() for n, p in params}
    return [
        f"{PREFIX}{n}: checkpoint has sum {_num(saved[n][0])} and sum of squares "
        f"{_num(saved[n][1])}, model has {_num(s)} and {_num(q)}"
        for n, (s, q) in ours.items()
        if _differs(saved[n], [s, q], sizes[n])
    ]


def _as_recorded(row: list[Any], p: torch.Tensor) -> bool:
    return row[1] == str(p.dtype).removeprefix("torch.") and row[2] == list(p.shape)


def _differs(saved: list[Any], ours: list[Any], size: int) -> bool:
    """Whether two [sum, sum of squares] records differ beyond rounding: exactly for integers;
    relative to the sum of squares for floats (a sum near 0 is compared against
    sqrt(size * sum of squares), which bounds the sum of magnitudes)."""
    (s0, q0), (s1, q1) = saved, ours
    if isinstance(s1, int):
        return bool(s0 != s1 or q0 != q1)
    if not all(math.isfinite(v) for v in (s0, q0, s1, q1)):  # NaN matches NaN
        return any(repr(float(a)) != repr(float(b)) for a, b in ((s0, s1), (q0, q1)))
    scale = max(abs(q0), abs(q1))
    return abs(q0 - q1) > RTOL * scale or abs(s0 - s1) > RTOL * math.sqrt(size) * math.sqrt(scale)


def _num(v: Any) -> str:
    return str(v) if isinstance(v, int) else f"{v:.10g}"


def base_cause(diffs: list[str]) -> str | None:
    """The first line of a load refused for other frozen weights, or None without any."""
    if not diffs:
        return None
    names = [d.removeprefix(PREFIX).split(":", 1)[0] for d in diffs]
    more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
    return (
        f"the model's frozen weights differ from the checkpoint's ({len(names)} parameter(s): "
        f"{', '.join(names[:3])}{more}), which it does not hold: load into the base model it "
        "was trained on (the same pretrained weights). If it is that base, its weights changed "
        "in memory before the save or this load: in place, by merging and unmerging adapters "
        "(merge_adapter/unmerge_adapter round them) or by resize_token_embeddings (random new "
        "rows); or drawn at random when the model was built (a new head or layer, another "
        "adapter: seed both runs alike before building). Pass allow_other_base=True to load "
        "onto this one on purpose"
    )


def check_record(saved: Any, table: list[list[Any]]) -> str | None:
    """What is malformed in a `frozen_sums` record read from a file, or None: an object whose
    keys are frozen parameters of the table and whose values are [sum, sum of squares], ints
    for integer dtypes."""
    if not isinstance(saved, dict):
        return f"{KEY!r} is not a dict"
    frozen = {r[0]: r[1] for r in table if r[3] is False}
    for name, value in saved.items():
        if name not in frozen:
            return f"{KEY!r} names {_short(name)}, no frozen parameter of 'params'"
        if not _is_record(value, exact(getattr(torch, frozen[name]))):
            return f"{KEY!r} of {_short(name)} is malformed: {_short(value)}"
    return None


def _is_record(value: Any, want_exact: bool) -> bool:
    if not (isinstance(value, list) and len(value) == 2):
        return False
    if want_exact:
        return all(type(v) is int and -(2**63) <= v < 2**63 for v in value) and value[1] >= 0
    return all(type(v) is float or (type(v) is int and abs(v) < 2**1023) for v in value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
