"""ftrain.rng: which generators dropout seeds, on devices this CPU machine does not have (their
torch device modules faked)."""

from __future__ import annotations

import types

import pytest
import torch

from ftrain.rng import default_generators, dropout_seed, restored


def _fake_module(monkeypatch, kind, module):
    real = torch.get_device_module

    def get_device_module(device=None):
        name = device.type if isinstance(device, torch.device) else device
        return module if name == kind else real(device)

    monkeypatch.setattr(torch, "get_device_module", get_device_module)


def test_an_xpu_device_gets_its_own_default_generator_seeded_and_restored(monkeypatch):
    # Only CUDA's generators were seeded: on XPU dropout drew from an unseeded generator, so a
    # resumed run's masks were not the uninterrupted run's, silently.
    own = (torch.Generator(), torch.Generator())
    xpu = types.SimpleNamespace(default_generators=own, current_device=lambda: 1)
    _fake_module(monkeypatch, "xpu", xpu)
    assert default_generators(torch.device("xpu")) == [torch.default_generator, own[1]]
    # Device 0 named explicitly: `index or current_device()` took the current one (1).
    assert default_generators(torch.device("xpu", 0)) == [torch.default_generator, own[0]]
    gens = default_generators(torch.device("xpu", 0))
    own[0].manual_seed(123)
    before = own[0].get_state()
    seed = dropout_seed(0, 5, 0, 0)
    with restored(gens):
        for g in gens:
            g.manual_seed(seed)
        assert own[0].initial_seed() == seed
    assert torch.equal(own[0].get_state(), before)  # the caller's stream is back


def test_an_mps_like_device_module_without_generators_is_seeded_through_its_functions(
    monkeypatch,
):
    backing = torch.Generator()
    mps = types.SimpleNamespace(
        manual_seed=backing.manual_seed,
        get_rng_state=backing.get_state,
        set_rng_state=backing.set_state,
    )
    _fake_module(monkeypatch, "mps", mps)
    gens = default_generators(torch.device("mps"))
    assert len(gens) == 2 and gens[0] is torch.default_generator
    backing.manual_seed(7)
    before = torch.rand(3, generator=backing)
    backing.manual_seed(7)
    with restored(gens):
        gens[1].manual_seed(99)
        assert backing.initial_seed() == 99
    assert torch.equal(torch.rand(3, generator=backing), before)


def test_a_device_without_any_generator_warns_that_dropout_is_not_seeded(monkeypatch):
    _fake_module(monkeypatch, "xpu", types.SimpleNamespace())
    with pytest.warns(RuntimeWarning, match=r"device type 'xpu' has no default generator"):
        gens = default_generators(torch.device("xpu"))
    assert gens == [torch.default_generator]
    assert default_generators(torch.device("cpu")) == [torch.default_generator]
