"""ft.testing: each assertion passes on a correct step and fails, precisely, on a broken one."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import ftrain as ft
from helpers import ragged_rows, train_steps


class TinyLM(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.head = nn.Embedding(61, 8), nn.Linear(8, 61)

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.emb(input_ids)))


# TinyLM is a plain module, so the default loss asks for a loss_fn (issue 26): name the LM loss.
LM = ft.losses.causal_lm_loss()


def mean_loss(model, batch):
    """The 2024 bug: a per-batch mean returned as if it were a sum over one item."""
    loss, n = ft.losses.causal_lm_loss()(model, batch)
    return loss / n, torch.ones((), dtype=torch.long)


def pad_labels_with_zero(rows):
    """A collate that pads labels with a real token id instead of -100."""
    return ft.pad_collate(label_pad_id=0)(rows)


def lm_state():
    return ft.TrainState.create(TinyLM(), ft.optim.adamw())


def test_accumulation_exact_passes_for_a_summed_loss_on_ragged_rows():
    rows = ragged_rows(12, seed=1)
    ft.testing.assert_accumulation_exact(
        lm_state(), rows, ft.losses.causal_lm_loss(), batch_size=3, accum=4
    )


def test_accumulation_exact_fails_on_a_mean_loss_and_on_a_bad_collate():
    rows = ragged_rows(12, seed=1)
    with pytest.raises(AssertionError, match=r"4 micro-batches of 3 rows differ.*max abs diff"):
        ft.testing.assert_accumulation_exact(lm_state(), rows, mean_loss, batch_size=3, accum=4)
    with pytest.raises(AssertionError, match="accumulation is not exact"):
        ft.testing.assert_accumulation_exact(
            lm_state(), rows, LM, batch_size=3, accum=4, collate_fn=pad_labels_with_zero
        )
    with pytest.raises(ValueError, match="accum must be"):
        ft.testing.assert_accumulation_exact(lm_state(), rows, batch_size=3, accum=1)
    with pytest.raises(ValueError, match="12 rows"):
        ft.testing.assert_accumulation_exact(lm_state(), rows, batch_size=5, accum=3)


REG = [{"x": torch.randn(3, generator=torch.Generator().manual_seed(i)), "y": float(i % 3)}
       for i in range(10)]  # fmt: skip


def reg_loss(model, batch):
    return ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).sum(), len(batch["y"])


def reg_state():
    torch.manual_seed(0)
    return ft.TrainState.create(nn.Linear(3, 1), ft.optim.adamw(), seed=0)


def good_loop(state, until):
    return train_steps(state, REG, until, loss_fn=reg_loss, batch_size=2, accum=2)


def loop_ignoring_the_cursor(state, until):
    """Restarts the epoch from its first batch after a resume: sees some batches twice."""
    while state.step < until:
        for micro in ft.make_batches(REG, batch_size=2, accum=2, epoch=state.epoch):
            grads, stats = ft.accumulate_grads(state, micro, reg_loss)
            state, _ = ft.clip_and_step(state, grads, lr=1e-2, stats=stats)
            if state.step >= until:
                break
        else:
            state = ft.next_epoch(state)
    return state


def test_resume_exact_passes_for_the_readme_loop(tmp_path):
    ft.testing.assert_resume_exact(reg_state, good_loop, steps=7, stop_at=2, directory=tmp_path)


def test_resume_exact_fails_for_a_loop_that_ignores_the_cursor():
    with pytest.raises(AssertionError, match=r"resume is not exact.*(model|opt_state)/"):
        ft.testing.assert_resume_exact(reg_state, loop_ignoring_the_cursor, steps=7, stop_at=2)
    with pytest.raises(ValueError, match="stop_at"):
        ft.testing.assert_resume_exact(reg_state, good_loop, steps=3, stop_at=3)


def one_step(state, micro):
    grads, stats = ft.accumulate_grads(state, micro, LM)
    state, info = ft.clip_and_step(state, grads, lr=1e-3, max_norm=1.0, stats=stats)
    return state, stats, info


def lm_micro():
    return next(ft.make_batches(ragged_rows(8), batch_size=2, accum=2, shuffle=False))


def test_no_host_sync_passes_for_the_ftrain_step():
    state, stats, _ = ft.testing.assert_no_host_sync(one_step, lm_state(), lm_micro())
    assert state.step == 1 and float(stats.loss) > 0  # reading afterwards is fine


def test_no_host_sync_flags_item_bool_and_device_to_host_copies():
    def logging_every_step(state, micro):
        state, stats, _ = one_step(state, micro)
        print(float(stats.loss))  # the broken line: a sync every step
        return state

    where = r"(?s)1 host-device sync.*test_testing.py:\d+ \(print"
    with pytest.raises(AssertionError, match=where):
        ft.testing.assert_no_host_sync(logging_every_step, lm_state(), lm_micro())

    def skip_if_nonfinite(t):
        return t * 2 if torch.isfinite(t).all() else t  # bool() of a tensor

    with pytest.raises(AssertionError, match=r"is_nonzero|_local_scalar_dense"):
        ft.testing.assert_no_host_sync(skip_if_nonfinite, torch.ones(3))

    def to_host(t):
        try:
            return t.cpu()
        except NotImplementedError:  # a meta tensor has no data; the copy was still asked for
            return None

    # A device -> host copy (the meta device stands in for an accelerator on this CPU machine).
    with pytest.raises(AssertionError, match=r"_to_copy from meta to the host"):
        ft.testing.assert_no_host_sync(to_host, torch.ones(3, device="meta"))


def test_pure_passes_without_donation_and_fails_with_it():
    state, micro = lm_state(), lm_micro()
    grads, _ = ft.accumulate_grads(state, micro, LM)
    new, _ = ft.testing.assert_pure(ft.clip_and_step, state, grads, lr=0.1, donate=False)
    assert new.step == 1 and state.step == 0
    with pytest.raises(AssertionError, match=r"clip_and_step changed an input.*argument 0/model/"):
        ft.testing.assert_pure(ft.clip_and_step, state, grads, lr=0.1, max_norm=1e-3)
    grads, _ = ft.accumulate_grads(new, micro, LM)
    ft.testing.assert_pure(ft.clip_and_step, new, grads, lr=0.1, donated=[0, 1])


def test_pure_flags_a_loss_that_edits_the_batch():
    def scaling_loss(model, batch):
        batch["x"].mul_(0.5)  # the broken line: normalises the caller's batch in place
        return reg_loss(model, batch)

    state = reg_state()
    batch = {"x": torch.randn(4, 3), "y": torch.zeros(4)}
    with pytest.raises(AssertionError, match=r"argument 1/0: max abs difference"):
        ft.testing.assert_pure(scaling_loss, state.model, batch)
    ft.testing.assert_pure(reg_loss, state.model, batch)


def test_the_docs_example_runs():
    """docs/testing.md's test file runs as written (its last lines call every test)."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "testing.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(code, "docs/testing.md", "exec"), {})


def test_no_host_sync_allows_syncs_inside_named_modules_only():
    """A padded HF model reads its padding mask on the host (transformers.masking_utils):
    naming that module lets those syncs through, a wrong name does not, and a sync of your
    own still fails."""
    from helpers import tiny_llama

    def hf_state():
        return ft.TrainState.create(tiny_llama(), ft.optim.sgd())

    micro = next(ft.make_batches(ragged_rows(8), batch_size=4, accum=2, shuffle=False))
    assert any(bool((b["attention_mask"] == 0).any()) for b in micro)  # padded rows
    with pytest.raises(AssertionError, match=r"masking_utils\.py"):
        ft.testing.assert_no_host_sync(one_step, hf_state(), micro)
    elsewhere = ("transformers.generation",)  # a real module, but not where the sync is
    with pytest.raises(AssertionError, match=r"masking_utils\.py"):
        ft.testing.assert_no_host_sync(one_step, hf_state(), micro, allow=elsewhere)
    allow = ("transformers.masking_utils",)
    state, _, _ = ft.testing.assert_no_host_sync(one_step, hf_state(), micro, allow=allow)
    assert state.step == 1

    def logging_every_step(state, micro):
        state, stats, _ = one_step(state, micro)
        print(float(stats.loss))  # still flagged: not inside an allowed module
        return state

    with pytest.raises(AssertionError, match=r"(?s)1 host-device sync.*test_testing.py"):
        ft.testing.assert_no_host_sync(logging_every_step, hf_state(), micro, allow=allow)
    with pytest.raises(TypeError, match="collection of module names"):
        ft.testing.assert_no_host_sync(one_step, hf_state(), micro, allow="transformers")
