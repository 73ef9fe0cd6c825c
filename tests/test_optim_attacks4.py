"""Attacks on ft.optim (fourth session): each case was silently wrong before its fix."""

import pytest
import torch
import torchopt

import ftrain as ft


def _bn_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    return ft.TrainState.create(model, ft.optim.ema(ft.optim.sgd(), decay=0.5), seed=0)


def test_swap_ema_refuses_a_model_whose_running_statistics_it_does_not_average():
    # The average of the parameters was evaluated with BatchNorm's live running statistics,
    # without a word (timm's ModelEmaV2 averages them).
    state = _bn_state()
    want = r"swap_ema: ft\.optim\.ema averages the parameters, not the buffers.*1\.running_var"
    with pytest.raises(ValueError, match=want), ft.optim.swap_ema(state):
        pass
    assert not ft.optim.ema_swapped(state)


def test_swap_ema_with_live_buffers_swaps_the_parameters_and_leaves_the_buffers():
    state = _bn_state()
    model = state.model
    model[1].running_mean.fill_(3.0)
    with torch.no_grad():
        state.opt_state.ema["0.weight"].fill_(7.0)
    with ft.optim.swap_ema(state, live_buffers=True):
        assert torch.all(model[0].weight == 7.0)
        assert torch.all(model[1].running_mean == 3.0)
    assert not torch.all(model[0].weight == 7.0)
    bad: object = "yes"
    with (
        pytest.raises(TypeError, match="live_buffers must"),
        ft.optim.swap_ema(state, live_buffers=bad),
    ):
        pass


def test_swap_ema_takes_a_model_without_running_statistics_as_before():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, affine=True,
                                track_running_stats=False))  # fmt: skip
    state = ft.TrainState.create(model, ft.optim.ema(ft.optim.sgd()))
    with ft.optim.swap_ema(state):
        assert ft.optim.ema_swapped(state)


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (lambda t: t.adam(lr=1e-3), r"tx scales its updates by 0\.001 \(its own lr\)"),
        (lambda t: t.chain(t.clip_grad_norm(1.0), t.sgd(lr=0.5)), r"tx scales its updates by 0\.5"),
        (lambda t: t.adamw(lr=lambda count: 1.0), r"tx has an lr schedule of its own"),
    ],
)
def test_from_torchopt_refuses_a_transformation_with_an_lr_of_its_own(make, want):
    # torchopt.adam(lr=1e-3) stepped by 1e-3 * clip_and_step's lr: 1e-6 at lr=1e-3, silently.
    with pytest.raises(ValueError, match=rf"from_torchopt: {want}"):
        ft.optim.from_torchopt(make(torchopt))


def test_from_torchopt_applies_the_step_lr_once_and_keeps_adagrads_own_decay():
    opt = ft.optim.from_torchopt(torchopt.sgd(lr=1.0))
    p = {"w": torch.ones(2)}
    opt.update({"w": torch.full((2,), 2.0)}, opt.init(p), p, lr=0.1, step=0)
    torch.testing.assert_close(p["w"], torch.full((2,), 0.8))
    ft.optim.from_torchopt(torchopt.adagrad(lr=1.0, lr_decay=0.1))  # a factor, not an lr


def _two_heads():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"a": torch.nn.Linear(2, 1), "b": torch.nn.Linear(2, 1)})


def _step_on(state, head):
    def loss_fn(model, batch):
        return model[head](batch["x"]).sum(), 1

    grads, stats = ft.accumulate_grads(state, [{"x": torch.ones(3, 2)}], loss_fn)
    return ft.clip_and_step(state, grads, lr=0.1, stats=stats)[0]


def test_a_partition_group_gets_all_its_parameters_so_ema_averages_one_without_a_gradient():
    # The group's optimizer got only the parameters with a gradient: ema raised KeyError on
    # the head this step did not use.
    opt = ft.optim.ema(ft.optim.sgd(), decay=0.5, warmup=False)
    state = ft.TrainState.create(_two_heads(), ft.optim.partition({"x": opt}, lambda n: "x"))
    a, b = (state.params[f"{h}.weight"].detach().clone() for h in "ab")
    state = _step_on(state, "b")
    average = state.opt_state.groups["x"].ema
    assert torch.equal(average["a.weight"], a)
    torch.testing.assert_close(average["b.weight"], (b + state.params["b.weight"]) / 2)


def test_from_torchopt_in_a_partition_refuses_a_parameter_without_a_gradient():
    # It matched the gradients it got to the first parameters' state: "b"'s momentum became
    # "a"'s, and a later step of "a" moved it by "b"'s history, without an error.
    opt = ft.optim.from_torchopt(torchopt.sgd(lr=1.0, momentum=0.9))
    state = ft.TrainState.create(_two_heads(), ft.optim.partition({"x": opt}, lambda n: "x"))
    with pytest.raises(
        ValueError, match=r"from_torchopt: no gradient for \['a\.weight', 'a\.bias'\]"
    ):
        _step_on(state, "b")


def _ema_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = ft.TrainState.create(model, ft.optim.ema(ft.optim.sgd(), decay=0.5))
    with torch.no_grad():
        for a in state.opt_state.ema.values():
            a.copy_(torch.full_like(a, 7.0))
    live = {n: p.detach().clone() for n, p in state.params.items()}
    return state, live


def _assert_unswapped(state, live):
    assert not ft.optim.ema_swapped(state)
    for n, p in state.params.items():
        assert torch.equal(p, live[n]), n
    for n, a in state.opt_state.ema.items():
        if not a.is_inference():
            assert torch.all(a == 7.0), n


def test_a_swap_that_fails_midway_puts_back_the_pairs_it_had_exchanged():
    # The first pairs stayed exchanged when a later one failed (out of memory, an interrupt,
    # an average that cannot be written): the model mixed averaged and live tensors, and the
    # average held live weights, with ema_swapped False.
    state, live = _ema_mlp()
    with torch.inference_mode():
        frozen = torch.full((2,), 7.0)  # an in-place write outside inference mode fails
    state.opt_state.ema["1.bias"] = frozen
    with pytest.raises(RuntimeError), ft.optim.swap_ema(state):
        pass
    _assert_unswapped(state, live)


def test_swap_ema_refuses_an_average_of_another_shape_before_swapping_anything():
    state, live = _ema_mlp()
    state.opt_state.ema["1.bias"] = torch.full((5,), 7.0)
    want = r"swap_ema: an EMA average's shape differs"
    with pytest.raises(ValueError, match=want), ft.optim.swap_ema(state):
        pass
    _assert_unswapped(state, live)


@pytest.mark.parametrize("given", [{"gamma": 10.0}, {"power": 0.75}])
def test_ema_without_warmup_refuses_the_warmups_gamma_and_power(given):
    # They were accepted and ignored: ema(warmup=False, power=0.75) averaged at `decay` alone.
    with pytest.raises(ValueError, match=r"shape the warmup, which warmup=False turns off"):
        ft.optim.ema(ft.optim.sgd(), warmup=False, **given)
    ft.optim.ema(ft.optim.sgd(), warmup=True, **given)
    ft.optim.ema(ft.optim.sgd(), warmup=False, gamma=1.0, power=2 / 3)  # the defaults, said


def test_reading_a_checkpoints_ema_weights_refuses_the_live_running_statistics(tmp_path):
    # export_checkpoint(weights="ema") wrote the averaged parameters beside BatchNorm's live
    # running statistics without a word, where swap_ema (and so export_pretrained) refuses.
    state = _bn_state()
    grads, stats = ft.accumulate_grads(state, [torch.randn(5, 3)], lambda m, x: (m(x).sum(),
                                       torch.tensor(5.0)))  # fmt: skip
    state, _ = ft.clip_and_step(state, grads, lr=0.1, stats=stats)
    path = ft.save_checkpoint(state, tmp_path)
    opened = ft.checkpoint.open_checkpoint(path, keep=["model", "optimizer"])
    want = r"weights='ema', but .* holds running statistics \['1\.running_mean', '1\.running_var'\]"
    with pytest.raises(ValueError, match=want):
        ft.checkpoint.read_model_tensors(opened, weights="ema")
    got = ft.checkpoint.read_model_tensors(opened, weights="ema", live_buffers=True)
    assert torch.equal(got["0.weight"], state.opt_state.ema["0.weight"])
    assert torch.equal(got["1.running_mean"], state.model[1].running_mean)
    live = ft.checkpoint.read_model_tensors(opened)  # the live weights: nothing to refuse
    assert torch.equal(live["0.weight"], state.params["0.weight"])
    with pytest.raises(TypeError, match="live_buffers must be True or False"):
        ft.checkpoint.read_model_tensors(opened, weights="ema", live_buffers=1)  # type: ignore[arg-type]


def test_a_checkpoint_of_ema_without_warmup_that_recorded_power_loads(tmp_path):
    # ema(warmup=False, power=0.75) was accepted (and the power ignored) before it was refused:
    # its checkpoints record power 0.75, and the resume with ema(warmup=False), the only
    # spelling now taken, was refused ("power: checkpoint has 0.75, state has 0.667").
    def make(**kw):
        torch.manual_seed(0)
        return ft.TrainState.create(torch.nn.Linear(3, 1), ft.optim.ema(ft.optim.sgd(), **kw))

    old = make(warmup=False)
    recorded = {"kind": "ema", "decay": 0.9999, "warmup": False, "gamma": 1.0, "power": 0.75}
    inner = ft.optim.sgd()
    ft.optim.described(
        old.optimizer, lambda names: {**recorded, "inner": ft.optim.describe(inner, names)}
    )
    path = ft.save_checkpoint(old, tmp_path)
    ft.load_checkpoint(path, make(warmup=False))
    mismatch = ft.checkpoint.CheckpointMismatchError
    with pytest.raises(mismatch, match=r"optimizer setting warmup: checkpoint has False"):
        ft.load_checkpoint(path, make(power=0.75))  # the warmup is still compared


def test_a_swap_back_that_fails_leaves_the_state_swapped_so_steps_refuse_it(tmp_path, monkeypatch):
    # The swap back at the block's end failed (out of memory for its temporary) and the model
    # kept the average, but the state was deregistered: clip_and_step trained from the average
    # and save_checkpoint saved the average as the live weights.
    from ftrain.process_state import STATE

    state, live = _ema_mlp()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("forged: no room for the temporary")

    with pytest.raises(torch.OutOfMemoryError) as raised, ft.optim.swap_ema(state):
        monkeypatch.setattr(torch, "empty", out_of_memory)  # the swap back's allocation fails
    monkeypatch.undo()
    try:
        notes = "".join(getattr(raised.value, "__notes__", []))
        assert "swap_ema could not put the live weights back" in notes
        assert ft.optim.ema_swapped(state)
        assert all(torch.all(p == 7.0) for p in state.params.values())  # the average
        grads = {n: torch.ones_like(p) for n, p in state.params.items()}
        with pytest.raises(ValueError, match=r"clip_and_step\(state\) inside ft\.optim\.swap_ema"):
            ft.clip_and_step(state, grads, lr=0.1)
        path = ft.save_checkpoint(state, tmp_path)  # saves the live weights, from the EmaState
        fresh = ft.TrainState.create(state.model, ft.optim.ema(ft.optim.sgd(), decay=0.5))
        fresh = ft.load_checkpoint(path, fresh)
        for n, p in fresh.params.items():
            assert torch.equal(p, live[n]), n
            assert torch.all(fresh.opt_state.ema[n] == 7.0), n
    finally:
        STATE.ema_swapped[:] = [a for a in STATE.ema_swapped if a is not state.opt_state.ema]


def _scale_if(flag):
    if flag:
        extra = 0.5

    def update_fn(updates, state, *, params=None, inplace=True):
        return (tuple(u * extra for u in updates) if flag else updates), state

    return torchopt.base.GradientTransformation(lambda params: (), update_fn)


def test_from_torchopt_takes_a_transformation_whose_closure_has_an_empty_cell():
    # A variable assigned in one branch only leaves its cell empty: reading every closure
    # cell for a scale of its own raised a bare "ValueError: Cell is empty".
    opt = ft.optim.from_torchopt(torchopt.chain(_scale_if(False), torchopt.adam(lr=1.0)))
    ft.TrainState.create(torch.nn.Linear(3, 1), opt)
    with pytest.raises(ValueError, match=r"from_torchopt: tx scales its updates by 0\.001"):
        ft.optim.from_torchopt(torchopt.chain(_scale_if(False), torchopt.adam(lr=1e-3)))
