import itertools
import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import get_scheduler

import ftrain as ft

SETTINGS = [(0, 10), (3, 10), (10, 50), (7, 7), (1, 1), (100, 2000)]
SPECIFIC = {
    "constant": [{}],
    "constant_with_warmup": [{}],
    "linear": [{}],
    "cosine": [{}, {"num_cycles": 1.5}],
    "cosine_with_restarts": [{}, {"num_cycles": 3}],
    "polynomial": [{}, {"lr_end": 1e-4, "power": 2.0}],
    "inverse_sqrt": [{}, {"timescale": 5}],
    "cosine_with_min_lr": [{"min_lr": 1e-4}, {"min_lr_rate": 0.1, "num_cycles": 0.25}],
    "cosine_warmup_with_min_lr": [{"min_lr_rate": 0.1}, {"min_lr": 1e-4, "warmup_lr_rate": 0.05}],
    "warmup_stable_decay": [
        {"num_decay_steps": 3},
        {
            "num_decay_steps": 4,
            "decay_type": "linear",
            "warmup_type": "cosine",
            "min_lr_ratio": 0.1,
        },
        {
            "num_decay_steps": 2,
            "num_stable_steps": 1,
            "decay_type": "1-sqrt",
            "warmup_type": "1-sqrt",
        },
    ],
}


def _hf_lrs(name, warmup, total, kw, peak, n):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    with warnings.catch_warnings():
        # HF warns whenever WSD gets both num_training_steps and num_stable_steps, even when they
        # agree (the latter wins); ftrain raises when they disagree, so CASES make them agree.
        warnings.filterwarnings("ignore", "Both num_training_steps", UserWarning)
        sched = get_scheduler(
            name,
            opt,
            num_warmup_steps=warmup,
            num_training_steps=total,
            scheduler_specific_kwargs=dict(kw),
        )
    out = []
    for _ in range(n):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def _defined(name, kw, warmup, total):
    """Settings HF itself handles: WSD needs room for its phases; polynomial divides by
    total - warmup."""
    if name == "warmup_stable_decay" and "num_stable_steps" not in kw:
        return warmup + kw["num_decay_steps"] <= total
    if name == "constant" and warmup:  # HF ignores the warmup; ftrain raises (below)
        return False
    return not (name == "polynomial" and warmup == total)


def _total(kw, warmup, total):
    """WSD with num_stable_steps fixes the total: warmup + stable + decay (a disagreeing
    total_steps raises, test_wsd_total_and_stable_steps_must_agree)."""
    if "num_stable_steps" in kw:
        return warmup + kw["num_stable_steps"] + kw["num_decay_steps"]
    return total


CASES = [
    (n, k, w, _total(k, w, t))
    for n, ks in SPECIFIC.items()
    for k in ks
    for w, t in SETTINGS
    if _defined(n, k, w, t)
]


@pytest.mark.parametrize(
    "name,kw,warmup,total", CASES, ids=[f"{n}-{sorted(k)}-{w}-{t}" for n, k, w, t in CASES]
)
def test_equals_transformers_get_scheduler_at_every_step(name, kw, warmup, total):
    peak = 3e-3
    n = total + 15  # well past the end
    hf = _hf_lrs(name, warmup, total, kw, peak, n)
    sched = ft.schedules.from_name(name, peak_lr=peak, warmup_steps=warmup, total_steps=total, **kw)
    ours = [sched(s) for s in range(n)]
    assert ours == pytest.approx(hf, rel=1e-12, abs=1e-18)
    assert ft.schedule_lr(
        n - 1, name=name, peak_lr=peak, warmup_steps=warmup, total_steps=total, **kw
    ) == pytest.approx(hf[-1], rel=1e-12, abs=1e-18)


def test_wsd_total_and_stable_steps_must_agree():
    # HF only warns and keeps num_stable_steps, so a disagreeing total_steps was ignored.
    wsd = ft.schedules.warmup_stable_decay
    for name in ("total_steps", "num_stable_steps"):
        with pytest.raises(ValueError, match=name):
            wsd(1.0, 2, 10, num_decay_steps=3, num_stable_steps=4)
    with pytest.raises(ValueError, match=r"total_steps \(10\) != .* num_stable_steps \(6\)"):
        ft.schedules.from_name(
            "warmup_stable_decay",
            peak_lr=1.0,
            warmup_steps=2,
            total_steps=10,
            num_decay_steps=3,
            num_stable_steps=6,
        )
    both = wsd(1.0, 2, 10, num_decay_steps=3, num_stable_steps=5)
    only_total = wsd(1.0, 2, 10, num_decay_steps=3)
    only_stable = wsd(1.0, 2, num_decay_steps=3, num_stable_steps=5)
    for s in range(14):
        assert both(s) == only_total(s) == only_stable(s)


def test_named_factories_and_step_zero():
    lr = ft.schedules.warmup_cosine(peak_lr=1.0, warmup_steps=10, total_steps=100)
    assert lr(0) == 0.0 and lr(10) == 1.0 and lr(100) == pytest.approx(0.0, abs=1e-12)
    assert "warmup_cosine" in repr(lr)
    with pytest.raises(ValueError, match="step"):
        lr(-1)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: ft.schedules.warmup_linear(-1.0, 0, 10), "peak_lr"),
        (lambda: ft.schedules.warmup_linear(1.0, -1, 10), "warmup_steps"),
        (lambda: ft.schedules.warmup_linear(1.0, 0, 0), "total_steps"),
        (lambda: ft.schedules.warmup_polynomial(1e-8, 0, 10), "lr_end"),
        (lambda: ft.schedules.cosine_with_min_lr(1.0, 0, 10), "min_lr"),
        (lambda: ft.schedules.from_name("reduce_lr_on_plateau", peak_lr=1.0), "Plateau"),
        (lambda: ft.schedules.from_name("nope", peak_lr=1.0), "known"),
        # Issue 20 item 19: each of these failed later (ZeroDivisionError, negative lr,
        # TypeError mid-run) instead of at construction.
        (lambda: ft.schedules.warmup_polynomial(1.0, 10, 10), "total_steps"),
        (lambda: ft.schedules.warmup_polynomial(1.0, 0, 10, power=-1.0), "power"),
        (lambda: ft.schedules.warmup_polynomial(1.0, 0, 10, lr_end=-0.1), "lr_end"),
        (
            lambda: ft.schedules.warmup_stable_decay(
                1.0, 0, 10, num_decay_steps=2, min_lr_ratio=-1
            ),
            "min_lr_ratio",
        ),
        (lambda: ft.schedules.warmup_stable_decay(1.0, 5, 10, num_decay_steps=6), "room"),
        (
            lambda: ft.schedules.warmup_stable_decay(1.0, 0, 10, num_decay_steps=-1),
            "num_decay_steps",
        ),
        (lambda: ft.schedules.cosine_with_min_lr(0.0, 0, 10, min_lr=0.1), "min_lr"),
        (lambda: ft.schedules.cosine_with_min_lr(1.0, 0, 10, min_lr_rate=-0.5), "min_lr_rate"),
        (lambda: ft.schedules.from_name("linear", peak_lr=1), r"from_name\('linear'\).*total"),
        (lambda: ft.schedules.warmup_cosine(1.0, 0, None), "total_steps"),
        (lambda: ft.schedules.from_name("constant", peak_lr=1.0, warmup_steps=5), "warmup"),
        (lambda: ft.schedules.from_name("linear", peak_lr=1.0, warmup_steps=0.1), "total_steps"),
        (
            lambda: ft.schedules.from_name("linear", peak_lr=1.0, warmup_steps=1.5, total_steps=9),
            "warmup_steps",
        ),
    ],
)
def test_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_unknown_keywords_name_from_name_and_what_it_takes():
    with pytest.raises(TypeError, match=r"from_name\('cosine'\).*'warmup_ratio'.*ratio"):
        ft.schedules.from_name("cosine", peak_lr=1.0, total_steps=10, warmup_ratio=0.1)
    with pytest.raises(TypeError, match=r"'power'.*\['num_cycles'\]"):
        ft.schedules.from_name("cosine", peak_lr=1.0, total_steps=10, power=2.0)
    with pytest.raises(TypeError, match=r"^schedule_lr\(name='linear'\).*warmup_ratio"):
        ft.schedule_lr(3, name="linear", peak_lr=1.0, total_steps=10, warmup_ratio=0.1)


@pytest.mark.parametrize("name,ratio,total", [("linear", 0.1, 95), ("cosine", 0.03, 1000)])
def test_warmup_ratio_equals_transformers_5(name, ratio, total):
    from transformers import TrainingArguments

    # transformers 5 reads warmup_steps < 1 as a ratio of the training steps, rounded up.
    warmup = TrainingArguments("unused", warmup_steps=ratio).get_warmup_steps(total)
    hf = _hf_lrs(name, warmup, total, {}, 1e-3, total + 2)
    lr = ft.schedules.from_name(name, peak_lr=1e-3, warmup_steps=ratio, total_steps=total)
    assert [lr(s) for s in range(total + 2)] == pytest.approx(hf, rel=1e-12, abs=1e-18)
    assert ft.schedule_lr(3, name=name, peak_lr=1e-3, warmup_steps=ratio, total_steps=total) == (
        pytest.approx(hf[3], rel=1e-12)
    )


@given(
    warmup=st.integers(0, 50),
    extra=st.integers(1, 200),
    name=st.sampled_from(["linear", "cosine", "polynomial"]),
)
def test_property_warmup_rises_then_decay_falls(warmup, extra, name):
    total = warmup + extra
    lr = ft.schedules.from_name(name, peak_lr=1.0, warmup_steps=warmup, total_steps=total)
    values = [lr(s) for s in range(total + 1)]  # (HF cosine rises again past the end)
    assert all(a <= b for a, b in itertools.pairwise(values[: warmup + 1]))
    assert all(a >= b - 1e-15 for a, b in itertools.pairwise(values[warmup:]))
    assert max(values) <= 1.0 and min(values) >= 0.0


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"mode": "max"},
        {"patience": 1, "cooldown": 2, "factor": 0.5},
        {"threshold_mode": "abs", "threshold": 0.05, "patience": 0, "min_lr": 0.02},
    ],
)
def test_plateau_equals_torch_reduce_lr_on_plateau(kw):
    metrics = [
        1.0,
        0.9,
        0.95,
        0.93,
        0.92,
        0.91,
        0.95,
        0.97,
        0.99,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        1.0,
        1.1,
    ]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    torch_rule = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kw)
    rule = ft.schedules.Plateau(**kw)
    state = rule.init(0.1)
    for m in metrics:
        torch_rule.step(m)
        state = rule.update(state, m)
        assert state.lr == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
    assert not math.isinf(state.best)
