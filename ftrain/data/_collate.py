"""Collation: padding rows into a batch, and packing encoded examples into rows."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ftrain.data._common import Batch, Collate

__all__ = ["pack_examples", "pad_collate"]

# The label value HF losses ignore (ft.losses.IGNORE_INDEX; repeated here so data needs no loss).
IGNORE_INDEX = -100


def pad_collate(
    *,
    pad_id: int = 0,
    label_pad_id: int = -100,
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
    attention_mask: bool = True,
) -> Collate:
    """Return a collate function for rows that are dicts of token lists/tensors or scalars.

    Sequence fields are padded to the longest row: `input_ids` with `pad_id`, `labels` with
    `label_pad_id`, `attention_mask` (created from the row lengths when missing, unless
    `attention_mask=False`) with 0, and any other sequence (e.g. `position_ids`) with 0. A
    side's sequences (a preference pair's `chosen_input_ids`, `rejected_labels`, ...: a name
    ending in `_input_ids` or `_labels`) pad as `input_ids` and `labels` do, and each
    `<side>_input_ids` gets its `<side>_attention_mask` when missing (not `decoder_input_ids`).
    Scalars (e.g. a class `label`) are stacked. Fields that hold text (or None) stay lists of
    their values: the model never gets them (`ft.losses.model_inputs`), a `loss_fn` of your own
    can read them. Rows that are not dicts use torch's default collate.

    Args:
        pad_id: padding token id for `input_ids`.
        label_pad_id: padding for `labels`; -100 is ignored by the losses.
        padding_side: "right" or "left"; left raises for `labels` that are not one per input
            token (a seq2seq target: its decoder would read the padding).
        pad_to_multiple_of: round the padded length of the token sequences up to a multiple
            of this; a field holding one vector per row (the same length in every row, not
            its number of input tokens: multi-hot labels) is left as it is.
        attention_mask: create a mask for rows without one (off for packed rows, whose
            example boundaries HF models read from `position_ids`: rows whose `position_ids`
            restart at 0 raise `ValueError` with it on, as their examples would see each other;
            so do such rows that carry an `attention_mask` of their own, on or off).

    Example:
        >>> from ftrain.data import pad_collate
        >>> rows = [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3], "labels": [3]}]
        >>> b = pad_collate(pad_id=9)(rows)
        >>> b["input_ids"].tolist(), b["labels"].tolist(), b["attention_mask"].tolist()
        ([[1, 2], [3, 9]], [[1, 2], [3, -100]], [[1, 1], [1, 0]])
    """
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    # A float pad is cast to the ids' integer dtype (0.5 pads with 0), True pads with 1, a
    # truthy string turns the mask on: each would act as another value than the one given.
    for name, value in (("pad_id", pad_id), ("label_pad_id", label_pad_id)):
        if not _is_int(value):
            hint = " (a tokenizer without a pad token?)" if value is None else ""
            raise TypeError(f"{name} must be an int, got {value!r}{hint}")
    if pad_to_multiple_of is not None and not (
        _is_int(pad_to_multiple_of) and pad_to_multiple_of >= 1
    ):
        raise ValueError(f"pad_to_multiple_of must be an int >= 1, got {pad_to_multiple_of!r}")
    if not isinstance(attention_mask, bool):
        raise TypeError(f"attention_mask must be True or False, got {attention_mask!r}")
    pads = {"input_ids": pad_id, "labels": label_pad_id, "attention_mask": 0}

    def collate(rows: list[Any]) -> Batch:
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        if not isinstance(rows[0], Mapping):
            return torch.utils.data.default_collate(rows)
        if padding_side == "left":
            _refuse_left_padded_targets(rows)
        out: dict[str, Any] = {}
        for key in rows[0]:
            multiple = None if _row_vectors(rows, key, pad_to_multiple_of) else pad_to_multiple_of
            out[key] = _column(rows, key, _pad_of(key), padding_side, multiple)
        for i, row in enumerate(rows):  # a field row 0 lacks would be dropped unseen
            extra = [k for k in row if k not in out] if isinstance(row, Mapping) else []
            if extra:
                raise KeyError(
                    f"collate: row {i} of the batch has field {extra[0]!r}, which row 0 has "
                    f"not (row 0 has {', '.join(map(repr, rows[0]))}); every row needs the "
                    "same fields"
                )
        if "input_ids" in out and "attention_mask" in out:
            _refuse_unequal_masks(rows)
            _refuse_masked_packed(rows)
        if attention_mask and "input_ids" in out and "attention_mask" not in out:
            _refuse_packed(rows)
            masks = [torch.ones(len(r["input_ids"]), dtype=torch.long) for r in rows]
            out["attention_mask"] = _pad(masks, 0, padding_side, pad_to_multiple_of)
        for key in _sides(out) if attention_mask else ():
            masks = [torch.ones(len(r[key]), dtype=torch.long) for r in rows]
            mask_key = key.removesuffix("input_ids") + "attention_mask"
            out[mask_key] = _pad(masks, 0, padding_side, pad_to_multiple_of)
        return out

    def _pad_of(key: str) -> int:
        # A side's sequences (a preference pair's chosen_/rejected_) pad as their kind: 0 in
        # `chosen_labels` was a label token, counted in the row's log-prob.
        if key in pads:
            return pads[key]
        if key.endswith("_labels"):
            return label_pad_id
        return pad_id if key.endswith("_input_ids") else 0

    return collate


def _sides(out: Mapping[str, Any]) -> list[str]:
    """The `<side>_input_ids` token sequences of a batch (a preference pair's `chosen_` and
    `rejected_`) that have no `<side>_attention_mask`: each gets one, as `input_ids` does.
    Not `decoder_input_ids`: a decoder masks its future itself, and its padding follows its
    tokens."""
    return [
        k
        for k, v in out.items()
        if k.endswith("_input_ids")
        and k != "decoder_input_ids"
        and isinstance(v, torch.Tensor)
        and v.dim() == 2
        and k.removesuffix("input_ids") + "attention_mask" not in out
    ]


def _row_vectors(rows: list[Any], key: str, multiple: int | None) -> bool:
    """Whether `key` holds one vector per row rather than a sequence, so that
    `pad_to_multiple_of` leaves it alone: the same length in every row, which is not the row's
    number of input tokens (multi-hot labels, several regression targets). Rounded up, a
    multi-label batch's labels were padded with -100 past the model's outputs, and refused."""
    if not multiple or key == "input_ids":
        return False
    if not all(isinstance(r, Mapping) and "input_ids" in r for r in rows):
        return False
    lengths = {_size(r.get(key)) for r in rows}
    if len(lengths) != 1 or None in lengths:
        return False
    return any(_size(r["input_ids"]) not in lengths for r in rows)


def _size(value: Any) -> int | None:
    """`_length` without building a tensor (None for a scalar, text or a missing field)."""
    if value is None or _is_text(value):
        return None
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    return len(value) if isinstance(value, (list, tuple)) else None


def _is_int(value: Any) -> bool:
    return hasattr(value, "__index__") and not isinstance(value, (bool, torch.Tensor))


def _refuse_unequal_masks(rows: list[Any]) -> None:
    """Refuse a row whose attention_mask has another length than its input_ids (truncated
    apart?): each is padded on its own, and models take the mismatched mask without a word."""
    for i, row in enumerate(rows):
        ids, mask = row["input_ids"], row["attention_mask"]
        if not (_is_text(mask) or _is_text(ids)) and len(ids) != len(mask):
            raise ValueError(
                f"collate: row {i} has {len(ids)} input_ids but an attention_mask of {len(mask)} "
                "(truncated apart?): the mask would cover other tokens. Cut or build both "
                "together, or drop attention_mask and let pad_collate make it"
            )


def _refuse_left_padded_targets(rows: list[Any]) -> None:
    """Refuse to left-pad `labels` that are a sequence of their own (a seq2seq target, not one
    label per input token): the decoder would read padding before its start token, and the
    loss of a row would depend on the rows padded with it."""
    lengths = [_length(r.get("labels")) if isinstance(r, Mapping) else None for r in rows]
    if None in lengths or len(set(lengths)) < 2:
        return  # no sequence labels, or none padded
    for i, row in enumerate(rows):
        if lengths[i] != _length(row.get("input_ids")):
            raise ValueError(
                f"collate: padding_side='left', but row {i}'s labels ({lengths[i]} tokens) are "
                f"not one per input token ({_length(row.get('input_ids'))}): a decoder's "
                "target, which left padding would start with padding the decoder reads. Pad "
                "seq2seq batches with padding_side='right' (the encoder's padding is masked)"
            )


def _length(value: Any) -> int | None:
    """The length of a sequence field (None for a scalar or a missing one)."""
    if value is None or _is_text(value):
        return None
    t = torch.as_tensor(value)
    return int(t.shape[0]) if t.dim() > 0 else None


def _refuse_packed(rows: list[Any]) -> None:
    """Refuse rows packed from several examples (`position_ids` restarting at 0 inside a row)
    to be given an attention mask: HF models find the boundaries in `position_ids` only without
    one, so the examples of a row would attend to each other."""
    for i, row in enumerate(rows):
        positions = row.get("position_ids")
        if positions is not None and bool(torch.as_tensor(positions)[1:].eq(0).any()):
            raise ValueError(
                f"collate: row {i} holds packed examples (its position_ids restart at 0), and an "
                "attention_mask made for it would let them attend to each other (HF models "
                "read the boundaries from position_ids only without a mask): collate packed "
                "rows with ft.sft.packed_collate(pad_id), or pad_collate(attention_mask=False)"
            )


def _refuse_masked_packed(rows: list[Any]) -> None:
    """Refuse packed rows that carry an attention mask of their own (examples concatenated with
    their tokenizer's masks): as with a mask made for them (`_refuse_packed`), the examples
    would attend to each other. A restart counts only between two unmasked tokens, so the
    position_ids of a left-padded row (0 at its first real token) are no packing."""
    for i, row in enumerate(rows):
        positions, mask = row.get("position_ids"), row["attention_mask"]
        if positions is None or _is_text(positions) or _is_text(mask):
            continue
        p, m = torch.as_tensor(positions), torch.as_tensor(mask).bool()
        if p.dim() != 1 or p.shape != m.shape:  # multimodal (3, L) positions: not packing
            continue
        restarts = (p[1:].eq(0) & m[1:] & m[:-1]).nonzero()
        if len(restarts):
            raise ValueError(
                f"collate: row {i} holds packed examples (its position_ids restart at 0 at token "
                f"{int(restarts[0]) + 1}) and an attention_mask over them, which lets them attend "
                "to each other (HF models read the boundaries from position_ids only without a "
                "mask): remove attention_mask from packed rows and collate them with "
                "ft.sft.packed_collate(pad_id), or pad_collate(attention_mask=False)"
            )


def _column(rows: list[Any], key: str, pad: int, side: str, multiple: int | None) -> Any:
    """One field of the rows as a batch: stacked scalars, padded sequences, or, for text and
    other values that are not numbers (a raw `text`, a string `id`), the list of values."""
    try:
        raw = [r[key] for r in rows]
    except (KeyError, TypeError):
        lacking = next(i for i, r in enumerate(rows) if not isinstance(r, Mapping) or key not in r)
        raise KeyError(
            f"collate: row {lacking} of the batch has no field {key!r} (row 0 has "
            f"{', '.join(map(repr, rows[0]))}); every row needs the same fields"
        ) from None
    if any(_is_text(v) for v in raw):
        return raw  # kept for a loss_fn of your own; the model never sees it (model_inputs)
    try:
        values = [torch.as_tensor(v) for v in raw]
        if values[0].dim() == 0:
            return torch.stack(values)
        return _pad(values, pad, side, multiple)
    except (TypeError, ValueError, RuntimeError, IndexError) as e:  # IndexError: a scalar
        kinds = sorted({type(v).__name__ for v in raw})
        raise TypeError(
            f"collate: cannot make a tensor of field {key!r} ({'/'.join(kinds)} values): {e}. "
            "Remove the field from the data (dataset.remove_columns), or pass collate_fn="
        ) from e


def _is_text(value: Any) -> bool:
    """A string, bytes or None, or a list of them (a field no tensor can hold)."""
    if value is None or isinstance(value, (str, bytes)):
        return True
    if isinstance(value, (list, tuple)) and value:
        return _is_text(value[0])
    return False


def _pad(values: list[torch.Tensor], pad: int, side: str, multiple: int | None) -> torch.Tensor:
    length = max(v.shape[0] for v in values)
    if multiple:
        length = -(-length // multiple) * multiple
    # The rows' common dtype, as torch.stack gives scalars: row 0's alone truncated a later
    # row's floats (labels [1, 0] then [0.5, 1.5] became [0, 1]).
    # An empty row ([] is float32 to torch) says nothing of the dtype: it made input_ids float.
    typed = [v for v in values if v.numel()] or values
    dtype = functools.reduce(torch.promote_types, (v.dtype for v in typed))
    if pad < 0 and not (dtype.is_floating_point or dtype.is_complex or dtype.is_signed):
        # An unsigned dtype cannot hold the -100 of label padding: uint8 tags (numpy's compact
        # dtype) were padded with 156, read as a class, not as "ignore".
        dtype = torch.int64
    out = values[0].new_full((len(values), length, *values[0].shape[1:]), pad, dtype=dtype)
    for i, v in enumerate(values):
        if side == "right":
            out[i, : v.shape[0]] = v
        else:
            out[i, length - v.shape[0] :] = v
    return out


# Messages of out-of-memory errors raised as plain RuntimeErrors (accelerate's list).


def pack_examples(
    rows: Iterable[Mapping[str, Sequence[int]]], max_length: int
) -> list[dict[str, list[int]]]:
    """Concatenate encoded rows, in order, into rows of at most `max_length` tokens.

    Rows are unpadded examples: one whose `attention_mask` marks padding raises (its padding
    would be packed as tokens); the fields other than `input_ids` and `labels` are not kept.
    An example is never split across packed rows: one that does not fit in the current row
    starts the next; one longer than `max_length` is cut to `max_length` (the end is lost), and
    a `UserWarning` says how many of how many examples were cut (never silently).
    `position_ids` restart at 0 for every example, which HF models read as packed sequences
    (attention stays within each example when no `attention_mask` is passed; see
    `packed_collate`), and the first label of every example is -100, so no token is predicted
    from the previous example.

    Example:
        >>> rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5],
        ...          "labels": [4, 5]}, {"input_ids": [6, 7, 8], "labels": [6, 7, 8]}]
        >>> [r["position_ids"] for r in pack_examples(rows, max_length=5)]
        [[0, 1, 2, 0, 1], [0, 1, 2]]
        >>> pack_examples(rows, max_length=5)[0]["labels"]
        [-100, 2, 3, -100, 5]
    """
    if not (_is_int(max_length) and max_length >= 1):  # True would pack 1-token rows
        raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
    packed: list[dict[str, list[int]]] = []
    current: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    seen = cut = 0
    for row in rows:
        seen, cut = seen + 1, cut + (len(row["input_ids"]) > max_length)
        if len(row["input_ids"]) != len(row["labels"]):  # before the cut, which hides it
            raise ValueError(
                f"row {seen - 1}: input_ids ({len(row['input_ids'])} tokens) and labels "
                f"({len(row['labels'])}) differ in length"
            )
        mask = row.get("attention_mask")
        if mask is not None and 0 in list(mask):  # packed, its padding would be content
            raise ValueError(
                f"row {seen - 1}: its attention_mask marks padding, which pack_examples would "
                "pack as tokens (it keeps input_ids and labels only): encode the examples "
                "unpadded (tokenizer(..., padding=False)) before packing"
            )
        ids, labels = list(row["input_ids"])[:max_length], list(row["labels"])[:max_length]
        if not ids:
            continue
        if len(current["input_ids"]) + len(ids) > max_length:
            packed.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += ids
        current["labels"] += [IGNORE_INDEX, *labels[1:]]
        current["position_ids"] += list(range(len(ids)))
    if current["input_ids"]:
        packed.append(current)
    if cut:
        warnings.warn(
            f"pack_examples cut {cut} of {seen} examples longer than max_length={max_length} "
            "to max_length tokens (their ends are lost); raise max_length or split them",
            UserWarning,
            stacklevel=2,
        )
    return packed
