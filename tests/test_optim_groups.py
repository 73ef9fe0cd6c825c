"""Partitions, layer-wise lr decay, Muon and EMA against torch.optim with param groups, step for
step, and through save_checkpoint/load_checkpoint."""

import copy

import pytest
import torch

import ftrain as ft
from helpers import opt_state_tensors, ragged_rows, tiny_llama, train_steps
from test_optim import _data, _loss, _lr  # the data and lr of the single-optimizer tests


class Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(5, 8, dtype=dtype)
        self.hidden = torch.nn.Linear(8, 12, dtype=dtype)
        self.head = torch.nn.Linear(12, 3, dtype=dtype)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(torch.tanh(self.embed(x)))))


def _run_ft(opt, model, data):
    state = ft.TrainState.create(model, opt)
    for batch in data:
        grads, stats = ft.accumulate_grads(state, [batch], _loss)
        state, _ = ft.clip_and_step(state, grads, lr=_lr(state.step), stats=stats)
    return state


def _run_torch(opts_and_factors, model, data):
    for step, batch in enumerate(data):
        for opt, _ in opts_and_factors:
            opt.zero_grad()
        loss, n = _loss(model, batch)
        (loss / n).backward()
        for opt, factors in opts_and_factors:
            for group, f in zip(opt.param_groups, factors, strict=True):
                group["lr"] = _lr(step) * f
            opt.step()


def _assert_same_deltas(base, ours, theirs, tol):
    for (n, b), p, q in zip(
        base.named_parameters(), ours.parameters(), theirs.parameters(), strict=True
    ):
        assert (q - b).abs().max() > 0, n
        torch.testing.assert_close(p - b, q - b, rtol=tol, atol=tol, msg=n)


def test_partition_equals_torch_adamw_with_param_groups():
    base = Net(torch.float64)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    label = {"embed": "low", "hidden": "mid", "head": "top"}
    opt = ft.optim.partition(
        {
            "low": ft.optim.adamw(weight_decay=0.0, betas=(0.8, 0.99)),
            "mid": ft.optim.adamw(weight_decay=0.3, mask={"hidden.weight"}),
            "top": ft.optim.adamw(weight_decay=0.1, eps=1e-6),
        },
        lambda name: label[name.split(".")[0]],
        lr_factors={"low": 0.25, "mid": 0.5},
    )
    _run_ft(opt, ours, _data(torch.float64))
    m = theirs
    groups = [
        {"params": list(m.embed.parameters()), "weight_decay": 0.0, "betas": (0.8, 0.99)},
        {"params": [m.hidden.weight], "weight_decay": 0.3},
        {"params": [m.hidden.bias], "weight_decay": 0.0},
        {"params": list(m.head.parameters()), "weight_decay": 0.1, "eps": 1e-6},
    ]
    torch_opt = torch.optim.AdamW(groups, lr=0)
    _run_torch([(torch_opt, [0.25, 0.5, 0.5, 1.0])], theirs, _data(torch.float64))
    _assert_same_deltas(base, ours, theirs, 1e-12)


@pytest.mark.parametrize("nesterov,adjust", [(True, "original"), (False, "match_rms_adamw")])
def test_muon_in_a_partition_equals_torch_muon_plus_adamw(nesterov, adjust):
    base = Net(torch.float32)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    opt = ft.optim.partition(
        {
            "muon": ft.optim.muon(momentum=0.9, nesterov=nesterov, adjust_lr=adjust),
            "adamw": ft.optim.adamw(weight_decay=0.01),
        },
        {n: "muon" if n == "hidden.weight" else "adamw" for n, _ in base.named_parameters()},
        lr_factors={"adamw": 0.1},
    )
    state = _run_ft(opt, ours, _data(torch.float32))
    assert set(state.opt_state.groups["muon"].momentum) == {"hidden.weight"}
    m = theirs
    muon = torch.optim.Muon(
        [m.hidden.weight], lr=0, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust
    )
    rest = [p for n, p in m.named_parameters() if n != "hidden.weight"]
    adamw = torch.optim.AdamW(rest, lr=0, weight_decay=0.01)
    _run_torch([(muon, [1.0]), (adamw, [0.1])], theirs, _data(torch.float32))
    _assert_same_deltas(base, ours, theirs, 1e-6)


def test_muon_skips_nonfinite_steps_and_rejects_non_matrices():
    opt = ft.optim.muon()
    p = {"w": torch.randn(3, 4)}
    s = opt.init(p)
    before = p["w"].clone()
    opt.update({"w": torch.randn(3, 4)}, s, p, lr=0.1, step=0, found_inf=torch.ones(()))
    assert torch.equal(p["w"], before) and not s.momentum["w"].any()
    opt.update({"w": torch.randn(3, 4)}, s, p, lr=0.1, step=0, found_inf=torch.zeros(()))
    assert not torch.equal(p["w"], before) and s.momentum["w"].any()
    with pytest.raises(ValueError, match=r"2-D matrices only.*'b': \(4,\)"):
        opt.init({"b": torch.zeros(4)})
    for bad, match in [
        (dict(momentum=1.0), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(adjust_lr="rms"), "adjust_lr"),
    ]:
        with pytest.raises(ValueError, match=match):
            ft.optim.muon(**bad)


def test_partition_errors_name_the_label_or_parameter():
    p = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"'c'.*not one of"):
        ft.optim.partition({"x": ft.optim.sgd()}, lambda n: "c").init(p)
    with pytest.raises(ValueError, match=r"\['y'\] have no trainable"):
        ft.optim.partition({"x": ft.optim.sgd(), "y": ft.optim.sgd()}, lambda n: "x").init(p)
    with pytest.raises(KeyError, match="no entry for parameter 'b'"):
        ft.optim.partition({"x": ft.optim.sgd()}, {"a": "x"}).init(p)
    with pytest.raises(ValueError, match="lr_factors has label 'z'"):
        ft.optim.partition({"x": ft.optim.sgd()}, {"a": "x"}, lr_factors={"z": 1.0})
    with pytest.raises(ValueError, match=r"lr_factors\['x'\]"):
        ft.optim.partition({"x": ft.optim.sgd()}, {"a": "x"}, lr_factors={"x": -1.0})
    with pytest.raises(TypeError, match="label 'x'"):
        ft.optim.partition({"x": torch.optim.SGD}, {"a": "x"})


def test_layerwise_lr_decay_labels_an_hf_model():
    model = tiny_llama()  # 2 layers: embeddings depth 0, layers 1-2, norm + head depth 3
    labels, factors = ft.optim.layerwise_lr_decay(model, decay=0.5)
    assert labels["model.embed_tokens.weight"] == "depth_0"
    assert labels["model.layers.0.self_attn.q_proj.weight"] == "depth_1"
    assert labels["model.layers.1.mlp.up_proj.weight"] == "depth_2"
    assert labels["model.norm.weight"] == labels["lm_head.weight"] == "depth_3"
    assert factors == {"depth_0": 0.125, "depth_1": 0.25, "depth_2": 0.5, "depth_3": 1.0}
    opt = ft.optim.partition({k: ft.optim.sgd() for k in factors}, labels, lr_factors=factors)
    state = ft.TrainState.create(model, opt)
    before = {n: p.detach().clone() for n, p in state.params.items()}
    grads = {n: torch.ones_like(p) for n, p in state.params.items()}
    state, _ = ft.clip_and_step(state, grads, lr=1.0)
    for n, p in state.params.items():  # plain SGD: the step is exactly lr * factor
        torch.testing.assert_close(before[n] - p.detach(), torch.full_like(p, factors[labels[n]]))
    with pytest.raises(ValueError, match="decay"):
        ft.optim.layerwise_lr_decay(model, decay=0.0)
    with pytest.raises(ValueError, match="no transformer block"):
        ft.optim.layerwise_lr_decay(torch.nn.Linear(2, 2), decay=0.9)


def _recipe(model):
    hidden = {
        n for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n
    }  # hidden matrices to Muon, embeddings/head/norms to AdamW, and an EMA of everything
    part = ft.optim.partition(
        {"muon": ft.optim.muon(), "adamw": ft.optim.adamw(mask=ft.optim.decay_mask(model))},
        lambda n: "muon" if n in hidden else "adamw",
        lr_factors={"adamw": 0.2},
    )
    return ft.optim.ema(part, decay=0.9)


def test_partition_muon_ema_resume_exactly_through_checkpoints(tmp_path):
    rows = ragged_rows(24, seed=2)
    whole = ft.TrainState.create(tiny_llama(), _recipe(tiny_llama()), seed=1)
    whole = train_steps(whole, rows, 6)
    half = ft.TrainState.create(tiny_llama(), _recipe(tiny_llama()), seed=1)
    half = train_steps(half, rows, 3)
    ft.save_checkpoint(half, tmp_path)
    resumed = ft.TrainState.create(tiny_llama(seed=5), _recipe(tiny_llama(seed=5)), seed=1)
    resumed = ft.load_checkpoint(ft.latest_checkpoint(tmp_path), resumed)
    resumed = train_steps(resumed, rows, 6)
    got, want = opt_state_tensors(resumed.opt_state), opt_state_tensors(whole.opt_state)
    assert any(k.startswith("inner/groups/muon/momentum/") for k in want)
    assert any(k.startswith("ema/model.layers.0") for k in want)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for n, p in whole.params.items():
        assert torch.equal(resumed.params[n], p), n


def test_ema_follows_timm_formula_and_skips_nonfinite_steps():
    opt = ft.optim.ema(ft.optim.sgd(), decay=0.9)
    p = {"w": torch.zeros(2)}
    s = opt.init(p)
    ref = torch.zeros(2)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        opt.update({"w": torch.randn(2, generator=g)}, s, p, lr=0.1, step=step)
        # timm ModelEmaV3.get_decay(step + 1) with update_after_step=0, warmup_gamma=1,
        # warmup_power=2/3, clipped at decay.
        d = min(0.9, 1 - (1 + step) ** (-2 / 3))
        ref = d * ref + (1 - d) * p["w"]
        torch.testing.assert_close(s.ema["w"], ref)
    before = s.ema["w"].clone()
    opt.update({"w": torch.ones(2)}, s, p, lr=0.1, step=6, found_inf=torch.ones(()))
    assert torch.equal(s.ema["w"], before)
    assert ft.optim.ema_decay(0, decay=0.9) == 0.0  # the first update copies the weights
    assert ft.optim.ema_decay(5, decay=0.9, warmup=False) == 0.9
    with pytest.raises(ValueError, match="decay"):
        ft.optim.ema(ft.optim.sgd(), decay=1.0)
    with pytest.raises(TypeError, match="ema wraps"):
        ft.optim.ema(torch.optim.SGD)


def test_swap_ema_evaluates_and_exports_the_average_then_restores(tmp_path):
    from transformers import LlamaForCausalLM

    rows = ragged_rows(16, seed=3)
    state = ft.TrainState.create(tiny_llama(), ft.optim.ema(ft.optim.adamw(), decay=0.8))
    state = train_steps(state, rows, 4)
    live = {n: p.detach().clone() for n, p in state.params.items()}
    average = {n: t.clone() for n, t in state.opt_state.ema.items()}
    assert any(not torch.equal(live[n], average[n]) for n in live)
    val = lambda: ft.make_batches(rows, batch_size=8, shuffle=False)  # noqa: E731
    live_loss = ft.evaluate(state, val())["eval_loss"]
    with ft.optim.swap_ema(state) as swapped:
        ema_loss = ft.evaluate(swapped, val())["eval_loss"]
        out = ft.export_pretrained(swapped, tmp_path / "ema")
    for n, p in state.params.items():  # the live weights and the average are back in place
        assert torch.equal(p, live[n]) and torch.equal(state.opt_state.ema[n], average[n]), n
    ref = tiny_llama()
    ref.load_state_dict({**ref.state_dict(), **average})
    want = ft.evaluate(ft.TrainState.create(ref, ft.optim.sgd()), val())["eval_loss"]
    assert ema_loss == pytest.approx(want, rel=1e-6) and ema_loss != live_loss
    loaded = LlamaForCausalLM.from_pretrained(out)
    for n, t in average.items():
        torch.testing.assert_close(loaded.get_parameter(n), t, rtol=0, atol=0, msg=n)
    with pytest.raises(RuntimeError, match="boom"), ft.optim.swap_ema(state):
        raise RuntimeError("boom")
    assert all(torch.equal(p, live[n]) for n, p in state.params.items())
    plain = ft.TrainState.create(tiny_llama(), ft.optim.adamw())
    with pytest.raises(TypeError, match=r"ft\.optim\.ema"), ft.optim.swap_ema(plain):
        pass


@pytest.mark.parametrize("blocking", [True, False])
def test_a_checkpoint_saved_inside_swap_ema_holds_the_live_weights(tmp_path, blocking):
    """Saving inside the swap saved the average as the live weights (issue 27): a resume then
    trained on from the average. Saved from the swapped state, or from a state made from it
    (`replace`), a blocking or a background save (written after the block ends) holds the live
    weights and the average, each in its place."""
    rows = ragged_rows(16, seed=3)
    state = ft.TrainState.create(tiny_llama(), ft.optim.ema(ft.optim.adamw(), decay=0.8))
    state = train_steps(state, rows, 3)
    live = {n: p.detach().clone() for n, p in state.params.items()}
    average = {n: t.clone() for n, t in state.opt_state.ema.items()}
    with ft.optim.swap_ema(state) as swapped:
        ft.save_checkpoint(swapped, tmp_path / "a", blocking=blocking)
        ft.save_checkpoint(swapped.replace(step=9), tmp_path / "b", blocking=blocking)
    ft.wait_for_checkpoint()
    for path in (tmp_path / "a" / "step-3", tmp_path / "b" / "step-9"):
        fresh = ft.TrainState.create(tiny_llama(), ft.optim.ema(ft.optim.adamw(), decay=0.8))
        loaded = ft.load_checkpoint(path, fresh)
        for n, p in loaded.params.items():
            assert torch.equal(p, live[n]), n
            assert torch.equal(loaded.opt_state.ema[n], average[n]), n
    for n, p in state.params.items():  # and the model has its live weights back
        assert torch.equal(p, live[n]) and torch.equal(state.opt_state.ema[n], average[n]), n
    nested = ft.optim.swap_ema(state.replace(step=9))  # would swap the live weights back
    with ft.optim.swap_ema(state), pytest.raises(ValueError, match="already active"), nested:
        pass
    assert all(torch.equal(p, live[n]) for n, p in state.params.items())
    with ft.optim.swap_ema(state), pytest.raises(ValueError, match=r"inside ft\.optim\.swap_ema"):
        ft.load_checkpoint(tmp_path / "a" / "step-3", state)  # the swap back would undo it
    assert all(torch.equal(p, live[n]) for n, p in state.params.items())
    assert not state.consumed


def test_a_decay_mask_taken_before_lora_wrapped_the_model_is_refused():
    """`decay_mask(model)` taken before `ft.lora.apply` (`get_peft_model`) names the base's
    parameters, none of which is trainable under the adapters: weight decay applied to none,
    silently. Refused at create, naming both sides; the mask taken after applies, and with
    `weight_decay=0` the mask does nothing either way."""
    pytest.importorskip("peft")
    model = tiny_llama(torch.float32)
    early = ft.optim.decay_mask(model)
    model = ft.lora.apply(model, r=4, targets=["q_proj", "v_proj"])
    for optimizer in (ft.optim.adamw(weight_decay=0.1, mask=early),
                      ft.optim.sgd(weight_decay=0.1, mask=early)):  # fmt: skip
        with pytest.raises(ValueError, match=r"mask names none of the trainable parameters"):
            ft.TrainState.create(model, optimizer)
    ft.TrainState.create(model, ft.optim.adamw(weight_decay=0.0, mask=early))
    state = ft.TrainState.create(
        model, ft.optim.adamw(weight_decay=0.1, mask=ft.optim.decay_mask(model))
    )
    assert ft.optim.describe(state.optimizer, list(state.params))["weight_decay"] == 0.1
    assert not ft.optim.describe(state.optimizer, list(state.params)).get("no_decay")


def test_lora_apply_names_its_own_argument_for_a_loraconfig_keyword():
    """`target_modules=` (PEFT's name of `targets=`) reached PEFT twice: its TypeError named
    neither this function nor the argument to use."""
    pytest.importorskip("peft")
    model = tiny_llama(torch.float32)
    with pytest.raises(TypeError, match=r"takes alpha=, targets= as its own argument"):
        ft.lora.apply(model, target_modules=["q_proj"], lora_alpha=8)


def test_a_partition_group_whose_parameters_the_mask_leaves_out_is_not_refused():
    """Under `partition`, a group's optimizer sees its parameters only: a decay mask of the
    whole model that names none of them (a group of biases and norm weights) means no decay
    there, as meant; the mask is checked against every trainable parameter of the state."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    mask = ft.optim.decay_mask(model)  # {"0.weight"}
    opt = ft.optim.partition(
        {"matrices": ft.optim.sgd(), "rest": ft.optim.adamw(weight_decay=0.1, mask=mask)},
        lambda name: "matrices" if name == "0.weight" else "rest",
    )
    state = ft.TrainState.create(model, opt)
    assert set(state.opt_state.groups) == {"matrices", "rest"}
    wrong = ft.optim.partition(
        {"matrices": ft.optim.sgd(), "rest": ft.optim.adamw(weight_decay=0.1, mask=["x.weight"])},
        lambda name: "matrices" if name == "0.weight" else "rest",
    )
    with pytest.raises(ValueError, match="mask names none of the trainable parameters"):
        ft.TrainState.create(model, wrong)
