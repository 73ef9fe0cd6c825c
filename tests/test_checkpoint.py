"""save_checkpoint / load_checkpoint / latest_checkpoint: exact resume, strictness, retention."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ftrain as ft
from ftrain.checkpoint import CheckpointMismatchError, CheckpointMismatchWarning, retained
from helpers import FakeRank, opt_state_tensors, ragged_rows, tiny_gpt2

ROWS = ragged_rows(37, seed=3)  # 10 micro-batches of 4 per epoch: 5 steps with accum=2
LR = ft.schedules.warmup_cosine(peak_lr=3e-3, warmup_steps=3, total_steps=13)
TOTAL = 13  # 2.6 epochs


def fresh(optimizer=None):
    model = tiny_gpt2(seed=0, dropout=0.1)
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    return ft.TrainState.create(model, optimizer or ft.optim.adamw(weight_decay=0.1), seed=7)


def train(state, *, root=None, save_every=0, total=TOTAL):
    """The DESIGN loop; returns the final state and {step: loss} for every step it ran."""
    losses = {}
    while state.step < total:
        for micro in ft.make_batches(ROWS, state, batch_size=4, accum=2):
            grads, stats = ft.accumulate_grads(state, micro)
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=LR(state.step), max_norm=1.0)
            losses[state.step] = float(stats.loss)
            if save_every and state.step % save_every == 0:
                ft.save_checkpoint(state, root, metrics={"loss": losses[state.step]})
            if state.step >= total:
                break
        else:
            state = ft.next_epoch(state)
    return state, losses


def assert_same_state(a, b):
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n]), n
    ta, tb = opt_state_tensors(a.opt_state), opt_state_tensors(b.opt_state)
    assert ta.keys() == tb.keys()
    for p in ta:
        assert torch.equal(ta[p], tb[p]), p
    for f in ("step", "epoch", "seed"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.data.cursor == b.data.cursor
    assert int(a.data.tokens_seen) == int(b.data.tokens_seen)
    assert int(a.data.samples_seen) == int(b.data.samples_seen)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run that saves a checkpoint after every step."""
    root = tmp_path_factory.mktemp("run")
    state, losses = train(fresh(), root=root, save_every=1)
    return root, state, losses


def test_resume_from_every_checkpoint_is_bitwise_exact(reference):
    root, final, losses = reference
    wpe = fresh().model.transformer.wpe.weight.clone()
    saved = sorted(int(p.name.split("-")[1]) for p in root.iterdir())
    assert saved == list(range(1, TOTAL + 1))
    positions = set()
    for step in saved[:-1]:
        state = ft.load_checkpoint(root / f"step-{step}", fresh())
        positions.add((state.epoch, state.data.cursor))
        resumed, later = train(state)
        assert later == {s: losses[s] for s in range(step + 1, TOTAL + 1)}, step
        assert_same_state(resumed, final)
        frozen = resumed.model.transformer.wpe.weight
        assert not frozen.requires_grad and torch.equal(frozen, wpe)
        assert "transformer.wpe.weight" not in resumed.params
    # The run covered a mid-epoch checkpoint and one exactly at the end of an epoch.
    assert (0, 4) in positions and (0, 10) in positions and (1, 10) in positions


def test_checkpoint_holds_no_frozen_parameter_and_no_pickle(reference):
    root, _, _ = reference
    path = root / "step-3"
    assert sorted(os.listdir(path)) == [
        "COMMITTED",
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "transformer.wpe.weight" not in keys and "transformer.wte.weight" in keys
    for f in path.iterdir():
        assert not f.read_bytes().startswith(b"\x80"), f"{f} looks like a pickle"
    meta = json.loads((path / "state.json").read_text())
    assert meta["fields"]["step"] == 3 and meta["metrics"]["loss"] > 0
    assert meta["world_size"] == 1 and len(meta["fingerprint"]) == 16


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: ft.optim.adamw(weight_decay=0.1),
        lambda: ft.optim.sgd(momentum=0.9, nesterov=True),
        lambda: ft.optim.chain(ft.optim.clip(0.5), ft.optim.adam()),
        lambda: ft.optim.from_torch(torch.optim.RMSprop, alpha=0.9, momentum=0.5),
        lambda: ft.optim.from_torch(torch.optim.AdamW, weight_decay=0.1),
        lambda: ft.optim.from_torchopt(__import__("torchopt").adam(lr=1.0)),
    ],
    ids=["adamw", "sgd", "chain", "torch-rmsprop", "torch-adamw", "torchopt-adam"],
)
def test_resume_is_exact_for_every_optimizer(make_opt, tmp_path):
    final, losses = train(fresh(make_opt()), total=6)
    mid, _ = train(fresh(make_opt()), total=3)
    ft.save_checkpoint(mid, tmp_path)
    resumed, later = train(
        ft.load_checkpoint(ft.latest_checkpoint(tmp_path), fresh(make_opt())), total=6
    )
    assert later == {s: losses[s] for s in (4, 5, 6)}
    for n in final.params:
        assert torch.equal(final.params[n], resumed.params[n]), n


@settings(max_examples=25, deadline=None)
@given(
    step=st.integers(0, 2**40),
    epoch=st.integers(0, 1000),
    cursor=st.integers(0, 10**9),
    tokens=st.integers(0, 2**62),
    best=st.none() | st.floats(allow_nan=False),
    metric=st.floats(allow_nan=True, allow_infinity=True),
)
def test_counters_and_metrics_round_trip(
    tmp_path_factory, step, epoch, cursor, tokens, best, metric
):
    root = tmp_path_factory.mktemp("rt")
    model = torch.nn.Linear(3, 2)
    state = ft.TrainState.create(model, ft.optim.adamw())
    state = state.replace(
        step=step,
        epoch=epoch,
        data=state.data.replace(cursor=cursor, tokens_seen=torch.tensor(tokens)),
        early_stopping=state.early_stopping.replace(
            best_metric=best, best_step=None if best is None else step
        ),
    )
    path = ft.save_checkpoint(state, root, metrics={"m": metric})
    out = ft.load_checkpoint(path, ft.TrainState.create(torch.nn.Linear(3, 2), ft.optim.adamw()))
    assert (out.step, out.epoch, out.data.cursor, int(out.data.tokens_seen)) == (
        step,
        epoch,
        cursor,
        tokens,
    )
    assert out.early_stopping.best_metric == best and out.data.tokens_seen.dtype == torch.int64
    saved = ft.checkpoint.read_meta(path)["metrics"]["m"]
    assert saved == metric or (saved != saved and metric != metric)


def test_load_consumes_the_template_and_copies_into_its_tensors(tmp_path):
    state, _ = train(fresh(), total=2)
    path = ft.save_checkpoint(state, tmp_path)
    template = fresh()
    weight = template.params["transformer.wte.weight"]
    out = ft.load_checkpoint(path, template)
    assert out.params["transformer.wte.weight"] is weight  # in place: DDP/FSDP hooks stay bound
    with pytest.raises(ft.ConsumedStateError, match="load_checkpoint"):
        _ = template.params


# --- strict loading -------------------------------------------------------------------------


def _mlp(hidden=4, extra=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.Linear(hidden, 1)]
    if extra:
        layers.append(torch.nn.Linear(1, 1))
    return torch.nn.Sequential(*layers)


def test_strict_mismatch_lists_every_difference_in_one_error(tmp_path):
    path = ft.save_checkpoint(ft.TrainState.create(_mlp(), ft.optim.adamw()), tmp_path)
    with pytest.raises(CheckpointMismatchError) as info:
        ft.load_checkpoint(path, ft.TrainState.create(_mlp(hidden=5, extra=True), ft.optim.adamw()))
    diffs = info.value.differences
    assert "missing from checkpoint: 3.weight float32[1, 1]" in diffs
    assert "0.weight: checkpoint has float32[4, 3], model has float32[5, 3]" in diffs
    assert "1.running_mean: checkpoint has float32[4], model has float32[5]" in diffs
    assert any(d.startswith("optimizer state mu/0.weight") for d in diffs)
    assert str(len(diffs)) in str(info.value)

    with pytest.raises(CheckpointMismatchError) as info:
        ft.load_checkpoint(path, ft.TrainState.create(_mlp(), ft.optim.sgd(momentum=0.9)))
    assert info.value.differences == [
        "optimizer state <root>: checkpoint has tuple:AdamState, state has tuple:SGDState"
    ]

    smaller = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(CheckpointMismatchError, match=r"unexpected in checkpoint: 2\.weight"):
        ft.load_checkpoint(path, ft.TrainState.create(smaller, ft.optim.adamw()))


def test_a_checkpoint_loads_with_another_data_parallel_size(tmp_path):
    # Tensors are whole (replicated data parallelism), so only the global batch must stay fixed.
    path = ft.save_checkpoint(
        ft.TrainState.create(_mlp(), ft.optim.adamw()).replace(step=2), tmp_path
    )
    state = ft.TrainState.create(_mlp(), ft.optim.adamw(), strategy=FakeRank(0, 2))
    assert ft.load_checkpoint(path, state).step == 2
    assert ft.checkpoint.read_meta(path)["world_size"] == 1


def test_only_rank_0_writes(tmp_path):
    state = ft.TrainState.create(_mlp(), ft.optim.adamw(), strategy=FakeRank(1, 2))
    assert ft.save_checkpoint(state.replace(step=3), tmp_path).name == "step-3"
    assert not list(tmp_path.iterdir())


def test_non_strict_loads_what_matches_and_warns_about_the_rest(tmp_path):
    src = ft.TrainState.create(_mlp(), ft.optim.adamw())
    with torch.no_grad():
        for p in src.params.values():
            p.fill_(0.5)
    path = ft.save_checkpoint(src.replace(step=4), tmp_path)
    target = ft.TrainState.create(_mlp(hidden=5, extra=True), ft.optim.adamw())
    with pytest.warns(CheckpointMismatchWarning, match="skipped") as rec:
        out = ft.load_checkpoint(path, target, strict=False)
    assert "0.weight" in str(rec[0].message)
    assert torch.equal(out.params["2.bias"], torch.full((1,), 0.5))  # matched: loaded
    assert not torch.equal(out.params["0.weight"], torch.full((5, 3), 0.5))  # reshaped: kept
    assert out.step == 4
    # A mismatched optimizer state is not loaded piecemeal: it stays fresh.
    assert torch.equal(out.opt_state.steps, torch.zeros(()))


# --- retention --------------------------------------------------------------------------------


def kept(ckpts, **kw):
    return sorted(retained(ckpts, **{"keep_best": None, "best_metric": None, "mode": "min", **kw}))


def test_retention_follows_hf_examples():
    ckpts = [(s, {"eval_loss": {200: 0.1}.get(s, 1.0)}) for s in (100, 200, 300, 400, 500)]
    # HF save_total_limit=2 without a best checkpoint: the two newest.
    assert kept(ckpts, keep_last=2) == [400, 500]
    # HF save_total_limit=2 with load_best_model_at_end (best at 200): {200, 500}.
    assert kept(ckpts, keep_last=1, keep_best=1, best_metric="eval_loss") == [200, 500]
    # HF save_total_limit=1 with the best elsewhere still keeps the newest for resuming.
    assert kept(ckpts, keep_last=0, keep_best=1, best_metric="eval_loss") == [200, 500]
    # mode="max" ranks the other way; checkpoints without the metric are not ranked.
    scored = [(1, {"acc": 0.5}), (2, {"acc": 0.9}), (3, {}), (4, {"acc": float("nan")}), (5, {})]
    assert kept(scored, keep_last=1, keep_best=1, best_metric="acc", mode="max") == [2, 5]
    assert kept(scored, keep_last=1, keep_best=2, best_metric="acc", mode="max") == [1, 2, 5]


def test_rotation_on_disk_keeps_newest_and_best(tmp_path):
    state = ft.TrainState.create(_mlp(), ft.optim.adamw())
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.6}
    for step, loss in losses.items():
        ft.save_checkpoint(
            state.replace(step=step),
            tmp_path,
            metrics={"eval_loss": loss},
            keep_last=2,
            best_metric="eval_loss",
        )
        names = sorted(p.name for p in tmp_path.iterdir())
        assert f"step-{step}" in names and ("step-2" in names or step < 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4", "step-5"]


def test_a_failed_save_deletes_nothing(tmp_path, monkeypatch):
    state = ft.TrainState.create(_mlp(), ft.optim.adamw())
    for step in (1, 2):
        ft.save_checkpoint(state.replace(step=step), tmp_path, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-2"]

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ft.checkpoint._save, "write_json", disk_full)
    with pytest.raises(OSError, match="No space"):
        ft.save_checkpoint(state.replace(step=3), tmp_path, keep_last=1)
    assert ft.latest_checkpoint(tmp_path).name == "step-2"
    ft.load_checkpoint(
        ft.latest_checkpoint(tmp_path), ft.TrainState.create(_mlp(), ft.optim.adamw())
    )


def test_retention_arguments_are_validated(tmp_path):
    state = ft.TrainState.create(_mlp(), ft.optim.adamw())
    with pytest.raises(ValueError, match="keep_last"):
        ft.save_checkpoint(state, tmp_path, keep_last=-1)
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        ft.save_checkpoint(state, tmp_path, keep_best=2)
    # keep_last=None keeps every checkpoint: keep_best=2 was accepted and deleted nothing
    with pytest.raises(ValueError, match=r"keep_best=2 with keep_last=None deletes nothing"):
        ft.save_checkpoint(state, tmp_path, metrics={"loss": 1.0}, keep_best=2, best_metric="loss")
    assert not list(tmp_path.iterdir())  # refused before anything was written
    with pytest.raises(ValueError, match="mode"):
        ft.save_checkpoint(state, tmp_path, best_metric="x", mode="lowest")
    with pytest.raises(TypeError, match="metrics must map names to numbers"):
        ft.save_checkpoint(state, tmp_path, metrics={"x": [1, 2]})  # refused before staging
    assert not list(tmp_path.iterdir())


# --- latest_checkpoint and crash leftovers ------------------------------------------------------


def test_latest_ignores_uncommitted_and_temporary_dirs_and_save_cleans_them(tmp_path):
    state = ft.TrainState.create(_mlp(), ft.optim.adamw())
    assert ft.latest_checkpoint(tmp_path) is None
    ft.save_checkpoint(state.replace(step=5), tmp_path)
    shutil.copytree(tmp_path / "step-5", tmp_path / "step-9")
    (tmp_path / "step-9" / "COMMITTED").unlink()  # a copy that never committed
    shutil.copytree(tmp_path / "step-5", tmp_path / ".tmp-step-12-deadbeef")  # a crashed save
    (tmp_path / "notes-step-20").mkdir()
    assert ft.latest_checkpoint(tmp_path).name == "step-5"
    with pytest.raises(ft.CheckpointError, match="incomplete"):
        ft.load_checkpoint(tmp_path / "step-9", ft.TrainState.create(_mlp(), ft.optim.adamw()))
    ft.save_checkpoint(state.replace(step=6), tmp_path)
    assert not (tmp_path / ".tmp-step-12-deadbeef").exists()
    assert ft.latest_checkpoint(tmp_path).name == "step-6"


def test_saving_the_same_step_twice_replaces_it(tmp_path):
    state = ft.TrainState.create(_mlp(), ft.optim.adamw())
    ft.save_checkpoint(state.replace(step=3), tmp_path, metrics={"v": 1})
    ft.save_checkpoint(state.replace(step=3), tmp_path, metrics={"v": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["step-3"]
    assert ft.checkpoint.read_meta(tmp_path / "step-3")["metrics"] == {"v": 2}


def test_subclass_fields_are_checkpointed(tmp_path):
    import dataclasses

    @dataclasses.dataclass(frozen=True, eq=False)
    class MyState(ft.TrainState):
        temperature: float = 1.0
        scale: torch.Tensor = dataclasses.field(default_factory=lambda: torch.tensor(2.0**16))

    state = MyState.create(_mlp(), ft.optim.sgd()).replace(
        temperature=0.25, scale=torch.tensor(8.0)
    )
    path = ft.save_checkpoint(state, tmp_path)
    out = ft.load_checkpoint(path, MyState.create(_mlp(), ft.optim.sgd()))
    assert out.temperature == 0.25 and out.scale.item() == 8.0

    @dataclasses.dataclass(frozen=True, eq=False)
    class Bad(ft.TrainState):
        extra: object = None

    bad = Bad.create(_mlp(), ft.optim.sgd()).replace(extra=object())
    with pytest.raises(ft.CheckpointError, match="extra"):
        ft.save_checkpoint(bad, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.latest_checkpoint(tmp_path)


# --- background saves ---------------------------------------------------------------------------


def test_async_save_writes_the_state_as_it_was_when_called(tmp_path):
    state, _ = train(fresh(), total=3)
    expected = ft.snapshot(state)
    path = ft.save_checkpoint(state, tmp_path, blocking=False)
    state, _ = train(state, total=6)  # donated steps mutate the tensors while the save runs
    assert ft.wait_for_checkpoint() == path
    assert_same_state(ft.load_checkpoint(path, fresh()), expected)
    assert ft.wait_for_checkpoint() is None  # nothing in flight any more


def test_at_most_one_save_in_flight(tmp_path, monkeypatch):
    import threading

    from ftrain.checkpoint import _save

    release, events = threading.Event(), []
    real = _save._commit

    def slow_commit(staged, root, **kw):
        events.append(("start", staged.step))
        release.wait(10)
        out = real(staged, root, **kw)
        events.append(("end", staged.step))
        return out

    monkeypatch.setattr(_save, "_commit", slow_commit)
    state = ft.TrainState.create(_mlp(), ft.optim.adamw())
    ft.save_checkpoint(state.replace(step=1), tmp_path, blocking=False)
    second = threading.Thread(
        target=ft.save_checkpoint,
        args=(state.replace(step=2), tmp_path),
        kwargs={"blocking": False},
    )
    second.start()
    second.join(0.3)
    assert second.is_alive() and events == [("start", 1)]  # the second save waits
    release.set()
    second.join(10)
    ft.wait_for_checkpoint()
    assert events == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]


@pytest.mark.parametrize(
    "call", ["save_checkpoint", "wait_for_checkpoint", "latest_checkpoint", "load_checkpoint"]
)
def test_async_save_error_is_raised_by_the_next_checkpoint_call(tmp_path, monkeypatch, call):
    from ftrain import process_state
    from ftrain.checkpoint import _save

    def broken(tensors, path):
        raise OSError(28, "No space left on device")

    good = ft.save_checkpoint(fresh(), tmp_path)
    monkeypatch.setattr(_save, "write_safetensors", broken)
    state, _ = train(fresh(), total=1)
    ft.save_checkpoint(state, tmp_path, blocking=False)
    process_state.STATE.save_in_flight.join()  # failed before the next steps
    state, _ = train(state, total=3)  # the steps never look at checkpoints
    monkeypatch.undo()
    run = {
        "save_checkpoint": lambda: ft.save_checkpoint(state, tmp_path),
        "wait_for_checkpoint": ft.wait_for_checkpoint,
        "latest_checkpoint": lambda: ft.latest_checkpoint(tmp_path),
        "load_checkpoint": lambda: ft.load_checkpoint(good, fresh()),
    }[call]
    with pytest.raises(ft.CheckpointError, match="background save of step 1 failed") as info:
        run()
    assert isinstance(info.value.__cause__, OSError)
    run()  # reported once: the call then does its work
    latest = tmp_path / "step-3" if call == "save_checkpoint" else good
    assert ft.latest_checkpoint(tmp_path) == latest


def test_tensors_sharing_memory_are_saved_and_restored(tmp_path):
    class Views(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.Parameter(torch.arange(6.0))
            self.register_buffer("head", self.base.data[:3])  # a buffer viewing a parameter

    path = ft.save_checkpoint(ft.TrainState.create(Views(), ft.optim.sgd()), tmp_path)
    target = Views()
    with torch.no_grad():
        target.base.zero_()
    out = ft.load_checkpoint(path, ft.TrainState.create(target, ft.optim.sgd()))
    assert out.model.base.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert out.model.head.tolist() == [0.0, 1.0, 2.0]


def test_interpreter_exit_waits_for_the_background_save(tmp_path):
    import subprocess
    import sys

    script = (
        "import torch, ftrain as ft\n"
        "state = ft.TrainState.create(torch.nn.Linear(512, 512), ft.optim.adamw())\n"
        f"ft.save_checkpoint(state.replace(step=7), {str(tmp_path)!r}, blocking=False)\n"
    )  # the script ends while the save is (very likely) still being written
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    ft.load_checkpoint(
        ft.latest_checkpoint(tmp_path),
        ft.TrainState.create(torch.nn.Linear(512, 512), ft.optim.adamw()),
    )


def test_a_crash_mid_rotation_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    from ftrain.checkpoint import _save

    state = ft.TrainState.create(_mlp(), ft.optim.adamw())
    ft.save_checkpoint(state.replace(step=1), tmp_path)
    real = _save.shutil.rmtree
    monkeypatch.setattr(_save.shutil, "rmtree", lambda *a, **k: None)  # "crash" mid-delete
    ft.save_checkpoint(state.replace(step=2), tmp_path, keep_last=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith(".tmp-deleting-step-1") and names[1:] == ["step-2"]
    monkeypatch.setattr(_save.shutil, "rmtree", real)
    assert ft.latest_checkpoint(tmp_path).name == "step-2"
    ft.save_checkpoint(state.replace(step=3), tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


def test_retention_refuses_to_rank_two_different_losses(tmp_path):
    # Issue 26: checkpoints ranked by eval_loss must all be ranked by the same loss function;
    # evaluate records it as eval_loss_fn and save_checkpoint compares it with the committed.
    state = ft.TrainState.create(_mlp(), ft.optim.adamw())
    focal = {"eval_loss": 0.4, "eval_loss_fn": "mine.focal_loss"}
    kw = {"keep_last": 1, "best_metric": "eval_loss"}
    ft.save_checkpoint(state.replace(step=1), tmp_path, metrics=focal, **kw)
    ft.save_checkpoint(state.replace(step=2), tmp_path, metrics={**focal, "eval_loss": 0.3}, **kw)
    ce = {"eval_loss": 0.1, "eval_loss_fn": "ftrain.losses.default_loss"}
    with pytest.raises(ValueError, match=r"best_metric='eval_loss'.*default_loss.*focal_loss"):
        ft.save_checkpoint(state.replace(step=3), tmp_path, metrics=ce, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]  # nothing written
    ft.save_checkpoint(state.replace(step=3), tmp_path, metrics=ce)  # not ranked: saved
    ft.save_checkpoint(state.replace(step=4), tmp_path / "ce", metrics=ce, **kw)  # a new root
    # Unnamed values (metrics written by hand, older checkpoints) are ranked as before.
    ft.save_checkpoint(state.replace(step=5), tmp_path, metrics={"eval_loss": 0.2}, **kw)
