"""`ft.losses.counted`: the names of two counts of one sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft


def _sum(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


def per_example(batch):
    return len(batch[1])


def per_two(batch):  # a different mean of the same sum
    return len(batch[1]) / 2


def _batches(n: int):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(n)
    ]


def test_two_counts_of_one_sum_are_named_apart_and_not_ranked_together(tmp_path):
    """Two counted losses over one sum function had one loss_name, so evaluate recorded the
    same eval_loss_fn for means of different counts and save_checkpoint ranked them together.
    A named items function is now part of the name; a lambda keeps the sum's name (as before)."""
    tokens, rows = ft.losses.counted(_sum, per_example), ft.losses.counted(_sum, per_two)
    assert ft.losses.loss_name(tokens) == f"{__name__}._sum[items={__name__}.per_example]"
    assert ft.losses.loss_name(rows) == f"{__name__}._sum[items={__name__}.per_two]"
    assert ft.losses.loss_name(ft.losses.counted(_sum, lambda b: 4)) == f"{__name__}._sum"
    state = ft.TrainState.create(torch.nn.Linear(3, 2), ft.optim.sgd())
    first = ft.evaluate(state, _batches(2), tokens)
    ft.save_checkpoint(
        state, tmp_path, metrics=first, best_metric="eval_loss", keep_best=1, keep_last=1
    )
    state = state.replace(step=1)
    second = ft.evaluate(state, _batches(2), rows)
    assert second["eval_loss"] == pytest.approx(2 * first["eval_loss"])
    with pytest.raises(ValueError, match=r"would rank step 1's .*per_two.* against step 0's"):
        ft.save_checkpoint(
            state, tmp_path, metrics=second, best_metric="eval_loss", keep_best=1, keep_last=1
        )
