"""Attacks on ft.optim (fourth session): each case was silently wrong before its fix."""

import pytest
import torch

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
