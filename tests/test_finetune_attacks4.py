"""Silent failures of everyday fine-tuning, fifth pass: multi-task evaluation lists."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(3, 1)


def _task_loss(model, batch):
    # One loss_fn for two tasks, picking the task by the batch's keys.
    if "x_reg" in batch:
        err = model.a(batch["x_reg"]).squeeze(-1) - batch["y_reg"]
        return err.square().sum(), torch.tensor(len(batch["y_reg"]))
    err = model.b(batch["x_cls"]).squeeze(-1) - batch["t_cls"]
    return err.square().sum(), torch.tensor(len(batch["t_cls"]))


def _task_batches(n=2):
    g = torch.Generator().manual_seed(0)
    a = [{"x_reg": torch.randn(2, 4, generator=g), "y_reg": torch.randn(2, generator=g)}]
    b = [{"x_cls": torch.randn(3, 3, generator=g), "t_cls": torch.randn(3, generator=g)}]
    return a * n, b * n


@pytest.mark.parametrize("n", [1, 2])
def test_a_list_of_two_tasks_batches_evaluates_as_an_iterator_of_them(n):
    # Every dict disjoint from the first was refused as "the parts of one batch": a multi-task
    # list of 4 batches raised, saying 4 dicts "share no key" though pairs of them did.
    state = ft.TrainState.create(_TwoHeads(), ft.optim.adamw())
    a, b = _task_batches(n)
    want = ft.evaluate(state, iter(a + b), _task_loss)
    assert want["eval_items"] == 5 * n
    # A flat list, batches and a group, and (of 4) one group; a group of 2 such is refused.
    for batches in (a + b, [*a, [*b]], *([[a + b]] if n == 2 else [])):
        assert ft.evaluate(state, batches, _task_loss) == want
    rows = [r["n"].tolist() for r in ft.predict(state, a + b, lambda m, x: _rows(x))]
    assert rows == [r["n"].tolist() for r in ft.predict(state, iter(a + b), lambda m, x: _rows(x))]


def _rows(batch):
    return {"n": torch.full((len(next(iter(batch.values()))),), float(len(batch)))}


def test_two_dicts_sharing_no_key_in_place_of_a_batch_are_still_refused_by_their_keys():
    # What can only be one batch's parts: a DataLoader's [inputs, labels] where a batch was
    # expected, or one (inputs, labels) tuple given as the batches. The message names both
    # dicts' keys and no longer claims more dicts than two.
    state = ft.TrainState.create(_TwoHeads(), ft.optim.adamw())
    inputs, labels = {"x_reg": torch.zeros(2, 4)}, {"y_reg": torch.zeros(2)}
    nested = r"a batch is a list of 2 dicts that share no key \(\['x_reg'\] and \['y_reg'\]\)"
    with pytest.raises(TypeError, match=nested):
        ft.evaluate(state, [[inputs, labels]], _task_loss)
    with pytest.raises(TypeError, match=r"batches is a tuple of 2 dicts that share no key"):
        ft.evaluate(state, (inputs, labels), _task_loss)
    with pytest.raises(TypeError, match=r"give them in a flat list of batches"):
        list(ft.predict(state, [[inputs, labels]], lambda m, x: _rows(x)))
