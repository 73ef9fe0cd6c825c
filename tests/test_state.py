import dataclasses

import pytest
import torch

import ftrain as ft


def _state(**kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return ft.TrainState.create(model, ft.optim.adamw(), **kw)


def _step(state, donate=True):
    x = torch.randn(5, 3)
    loss_fn = lambda m, b: (m(b).pow(2).sum(), torch.tensor(b.shape[0]))  # noqa: E731
    grads, stats = ft.accumulate_grads(state, [x], loss_fn)
    return ft.clip_and_step(state, grads, lr=0.1, stats=stats, donate=donate)


def test_frozen_and_replace():
    s = _state(seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.step = 5  # type: ignore[misc]
    t = s.replace(step=5, epoch=2)
    assert (t.step, t.epoch, t.seed, s.step) == (5, 2, 3, 0)
    with pytest.raises(TypeError, match="no settable field"):
        s.replace(stepz=1)


def test_params_are_module_owned_and_exclude_frozen():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    s = ft.TrainState.create(model, ft.optim.sgd())
    assert sorted(s.params) == ["0.bias", "1.bias", "1.weight"]
    assert s.params["1.weight"] is model[1].weight
    with pytest.raises(TypeError):
        s.params["x"] = torch.zeros(1)  # type: ignore[index]
    before = model[0].weight.detach().clone()
    s, _ = _step(s)
    assert torch.equal(model[0].weight, before), "frozen parameter changed"


def test_create_validates():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        ft.TrainState.create("model", ft.optim.sgd())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="from_torch"):
        ft.TrainState.create(torch.nn.Linear(1, 1), torch.optim.SGD)  # type: ignore[arg-type]
    frozen = torch.nn.Linear(1, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        ft.TrainState.create(frozen, ft.optim.sgd())


def test_donation_consumes_input_and_names_function_and_step():
    s0 = _state()
    alias = s0.replace(epoch=1)  # shares tensors with s0
    s1, _ = _step(s0)
    for stale in (s0, alias):
        for attr in ("params", "model", "opt_state"):
            with pytest.raises(ft.ConsumedStateError, match="consumed by clip_and_step at step 0"):
                getattr(stale, attr)
    assert s0.consumed and not s1.consumed
    assert s0.step == 0 and s1.step == 1  # plain values stay readable
    with pytest.raises(ft.ConsumedStateError):
        _step(s0)


def test_donate_false_leaves_old_state_valid_and_unchanged():
    s0 = _state()
    before = {k: v.detach().clone() for k, v in s0.params.items()}
    s1, _ = _step(s0, donate=False)
    assert not s0.consumed
    for k, v in s0.params.items():
        assert torch.equal(v, before[k])
        assert not torch.equal(s1.params[k], before[k])


def test_snapshot_is_independent():
    s0 = _state()
    copy = ft.snapshot(s0)
    before = {k: v.detach().clone() for k, v in copy.params.items()}
    _step(s0)
    for k, v in copy.params.items():
        assert torch.equal(v, before[k])
        assert v.data_ptr() != s0.tensors_.model.state_dict()[k].data_ptr()
    _step(copy)  # the copy trains on its own


def test_next_epoch_resets_cursor():
    s = _state().replace(data=_state().data.replace(cursor=7), epoch=1)
    t = ft.next_epoch(s)
    assert (t.epoch, t.data.cursor) == (2, 0)


def test_create_without_a_strategy_in_a_job_of_several_processes_raises(monkeypatch):
    """torchrun without `strategy=`: the default SingleDevice() trained every process alone
    on every row (no gradient sync, make_batches sharding nothing), without a word."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="got no strategy in a job of 2 processes"):
        ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    # Saying so trains this process alone; one process, or a malformed variable, is no job.
    ft.TrainState.create(
        torch.nn.Linear(2, 1), ft.optim.sgd(), strategy=ft.strategies.SingleDevice()
    )
    for world in ("1", "x"):
        monkeypatch.setenv("WORLD_SIZE", world)
        ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())


def test_create_refuses_a_lazy_module_before_its_first_forward():
    """A `LazyLinear` has no shape until its first forward: the optimizer state and params are
    taken at create, so create refuses, naming the parameter (AdamW failed inside torch's
    `zeros_like`; SGD, once the model was large, at the first step)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LazyLinear(3))
    for optimizer in (ft.optim.sgd(), ft.optim.adamw()):
        with pytest.raises(ValueError, match=r"'1\.weight', '1\.bias' is not initialised yet"):
            ft.TrainState.create(model, optimizer)
    model(torch.zeros(2, 4))  # shaped now
    state = ft.TrainState.create(model, ft.optim.adamw())
    loss_fn = lambda m, x: (m(x).sum(), torch.tensor(x.shape[0]))  # noqa: E731
    grads, stats = ft.accumulate_grads(state, [torch.ones(2, 4)], loss_fn)
    state, _ = ft.clip_and_step(state, grads, stats=stats, lr=0.1)
    assert state.step == 1


def test_replace_keeps_every_field_of_a_slotted_subclass():
    """A `slots=True` dataclass subclass holds its fields in slots, not in `__dict__`: replace
    copies it through `dataclasses.replace` (the `__dict__` copy lost every field)."""

    @dataclasses.dataclass(frozen=True, slots=True, eq=False)
    class Slotted(ft.TrainState):
        tag: str = "a"

    state = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.sgd())
    slotted = Slotted(**{f.name: getattr(state, f.name) for f in dataclasses.fields(state)})
    moved = slotted.replace(epoch=3)
    assert (moved.epoch, moved.step, moved.tag, type(moved)) == (3, 0, "a", Slotted)
    assert moved.data is slotted.data
