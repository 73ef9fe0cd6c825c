"""Workers' own generators and resume (docs/data.md, "A generator of the dataset's own is not
resumable"): a generator kept per worker draws from where that worker's earlier micro-batches
left it, which a resume never reads, so no assignment of micro-batches to workers makes it
exact; the documented ways (the global generators, or a generator seeded per row from them)
give the uninterrupted run's rows for any worker count and on resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ftrain as ft
from helpers import WorkerSeeded


class PerRow(torch.utils.data.Dataset):
    """The documented way: a generator of its own, seeded per row from torch's global one."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        rng = np.random.default_rng(int(torch.randint(2**62, ())))
        return {"x": float(rng.random()), "y": float(np.random.random())}


def _rows(data, **kw):
    groups = ft.make_batches(data, batch_size=2, seed=3, epoch=1, **kw)
    return [b["x"].tolist() + b.get("y", torch.zeros(0)).tolist() for g in groups for b in g]


@pytest.mark.parametrize("start", [1, 2, 5])
def test_a_generator_seeded_per_row_from_the_global_ones_resumes_exactly(start):
    full = _rows(PerRow())
    assert _rows(PerRow(), num_workers=1) == full
    assert _rows(PerRow(), num_workers=2, start=start) == full[start:]


def test_a_generator_kept_per_worker_differs_on_resume_even_on_the_same_worker():
    """Resumed at micro-batch 2 with 2 workers, micro-batch b lands on worker b % 2 as in the
    uninterrupted run (the rotation a resumed loader could do), and still draws otherwise:
    why ftrain documents the limit rather than rotating workers."""
    full = _rows(WorkerSeeded(16), num_workers=2)
    resumed = _rows(WorkerSeeded(16), num_workers=2, start=2)
    assert all(a != b for a, b in zip(resumed, full[2:], strict=True))
