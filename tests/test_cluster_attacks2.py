"""The cluster engines read wrong, third round (examples/cluster, ftrain.extras.ray): a world
size that does not divide the example's global batch."""

from __future__ import annotations

import pytest

import ftrain as ft
from cluster_launch import load_example

train = load_example("train")


class ThreeRanks(ft.strategies.SingleDevice):
    """A strategy that says it is rank 0 of 3 (nothing runs a collective before the check)."""

    world_size = 3


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_by_name():
    """GLOBAL_BATCH=4 on 3 ranks gave each rank 4 // 3 = 1 row: a global batch of 3, not 4,
    without a word (and another data order than the run it resumes)."""
    state = train.build(ThreeRanks("cpu"))
    with pytest.raises(ValueError, match=r"GLOBAL_BATCH=4 .* 3 ranks"):
        train.loop(state, 2, save=lambda s: None, save_every=1)
    assert state.step == 0  # refused before any step


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_world_size_that_divides_the_global_batch_gives_each_rank_its_share(world):
    assert train.per_rank_batch(world) * world == train.GLOBAL_BATCH
