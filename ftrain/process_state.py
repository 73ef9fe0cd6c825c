"""Every piece of process-wide state ftrain keeps: who owns it, and how long it lives.

ftrain's functions are pure over a `TrainState`; the few things that belong to the process
instead live in `STATE`, and no other module of ftrain keeps module-level mutable state
(tests/test_process_state.py reads every module to check).

Session state, set and cleared by the user's calls. `snapshot()` returns it, and the test
suite fails any test that leaves it changed:

    `save_in_flight`  the background save (`save_checkpoint(..., blocking=False)`) whose outcome
        nobody has reported yet: written by a thread, finished when its writer says so (an
        Event, not `Thread.is_alive`, which an interrupted join falsifies). Owner:
        `ftrain.checkpoint`. From the background save until the next `save_checkpoint`,
        `wait_for_checkpoint`, `latest_checkpoint` or `load_checkpoint` reports it (a failed
        save raises there; a sharded state's `strategy.close()` waits for it too), else until
        interpreter exit (a failed save then exits with status 1). At most one.
    `save_lock`  makes reporting `save_in_flight` happen once when threads race. Owner:
        `ftrain.checkpoint`; for the life of the process.
    `preemption`  the `Preemption` whose signal handlers `ft.strategies.on_preemption()`
        installed. Owner: `ftrain.strategies`; from `on_preemption()` to its `close()`. At most
        one.
    `ema_swapped`  the EMA averages (`EmaState.ema` dicts) that `ft.optim.swap_ema` swapped
        into their models: inside the block the parameters hold the average and these dicts
        the live weights, so `save_checkpoint` saves each where it belongs. Owner:
        `ftrain.optim`; for the `with` block. One per swapped state.

Caches of pure lookups: they never change a result, so `snapshot()` leaves them out.

    `optimizer_twins`  an optimizer's `update` function -> its traceable twin. Owner:
        `ftrain.optim` (`adamw`, `adam`, `sgd` register), read by `clip_and_step(compile=True)`.
        Weak keys: an entry goes with its optimizer.
    `compiled_steps`  an optimizer's `update` function -> its `torch.compile`d step. Owner:
        `clip_and_step(compile=True)`. Weak keys: an entry goes with its optimizer.
    `forward_inputs`  a model -> a weak reference to its innermost model, the `forward` read
        (read again once patched), and the keyword arguments it names (None when it takes
        any: `**kwargs` only) and those it requires. Owner: `ftrain.losses`
        (`model_inputs`). Weak keys: an entry goes with its model.
    `model_calls`  a model -> for each tuple of batch keys it was called with (up to 64), the
        keys `model_inputs` passed on and whether `use_cache=False` was added. Filled only
        where nothing was dropped and no `position_ids` were read. Owner: `ftrain.losses`
        (`_call`). Weak keys: an entry goes with its model.
    `default_losses`  a model -> `loss_for(model)` and the loss `accumulate_grads` runs for it
        under the default loss (the same, its item count left in the loss's dtype; for a causal LM's
        first step, one that also checks the labels are not shifted already). Owner:
        `ftrain.losses`. Weak keys: an entry goes with its model.
    `model_configs`  a model -> its innermost model's `config` (None without one), looked up
        through the wrappers once. Owner: `ftrain.losses` (`classification_loss`). Weak keys.
    `no_grad_pending`  a model -> [the names of its trainable parameters that have received no
        gradient since step `since`, `since`, the last step seen]: `accumulate_grads` names
        those still without one `NO_GRAD_STEPS` steps later (once; the set is then emptied).
        Filled only on steps that left some parameter without a gradient (a gap between them
        starts over). Owner: `ftrain.grads`. Weak keys.
    `seq2seq_labels_checked`  a model -> how many batches' seq2seq labels were checked for
        left padding (the first few their decoder inputs are built from, until one held
        -100). Owner: `ftrain.losses` (`seq2seq_loss`). Weak keys.
    `left_padding_checked`  a model of BART's family's decoders or RWKV -> how many batches
        were checked for left padding (until one with padding passed). Owner: `ftrain.losses`
        (`_refuse_left_padding`). Weak keys.
    `kernel_import_errors`  a fused-loss kernel -> why its library does not import (None: it
        does). Owner: `ftrain.extras.chunked_loss`; for the life of the process (each import
        is tried once).

A record, kept for a later call:

    `micro_groups`  the id of each micro-batch `make_batches` yielded -> a weak reference to
        the group (`MicroBatches`) that holds it, so that `accumulate_grads` knows where the
        data stands after a plain list, tuple or slice of a group's micro-batches
        (`list(micro)`, `micro[:2]`) as it knows it after the group. Owner: `ftrain.data`. An
        entry goes with its group (the reference's callback; the group holds its batches, so
        an id is never reused while its entry lives).

    `resumed_iterators`  each iterator a `make_batches(data, state, ...)` call returned that
        starts past its epoch's first micro-batch (the state's cursor) -> that micro-batch, so
        that `evaluate` and `predict` refuse it (evaluation data given the training state would
        be read from the training cursor on) and nothing else. Owner: `ftrain.data`. Weak keys:
        an entry goes with its iterator.

    `ray_reported`  the run (`ftrain.extras.ray._this_run`), its token (the staging
        folder's, where Ray's run id is not found) and the folder of the last checkpoint
        `ftrain.extras.ray.save_and_report` reported from this process (None before), which
        `wait_for_reports(timeout_s=...)` checks that Ray registered (Ray returns quietly when
        its wait times out) and `save_and_report` reports no step at or below again in that
        run. Owner: `ftrain.extras.ray`; for the life of the worker process (a restarted
        worker starts without one; Ray's local mode runs every fit in the driver process, and
        a fit compares only its own run's record).

A secret, drawn once:

    `dp_noise_key`  32 bytes from the OS (`secrets.token_bytes`) that key DP-SGD noise when
        the user passes no `noise_key` (`ft.func.private_grads`), so that no checkpoint holds
        what rebuilds the noise. Owner: `ftrain.extras.func`; drawn on first use, for the life
        of the process, never written anywhere.

Outside ftrain, ftrain changes torch.distributed's default process group (a strategy built by
`from_env` creates it, its `close()` destroys it) and, while a `Preemption` is active, the
handlers of its signals.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

__all__ = ["STATE", "BackgroundSave", "Closable", "ProcessState", "Snapshot", "snapshot"]


class BackgroundSave(Protocol):
    """A save running in a thread into the run folder `root`: its checkpoint's `path` once
    written, or its `error`."""

    step: int
    root: Path | None
    path: Path | None
    error: BaseException | None

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...


class Closable(Protocol):
    """What can be closed: an active `Preemption` restores its signal handlers."""

    def close(self) -> None: ...


_Weak = weakref.WeakKeyDictionary
# `forward_inputs`' values: (weak reference to the innermost model, its forward,
# (names, required, whether other tensor keys go through its **kwargs)).
_ForwardRead = tuple[Any, Any, tuple[frozenset[str] | None, frozenset[str], bool]]


@dataclass
class ProcessState:
    """The items the module docstring lists; the process has one, `STATE`."""

    save_in_flight: BackgroundSave | None = None
    save_lock: threading.Lock = field(default_factory=threading.Lock)
    preemption: Closable | None = None
    ema_swapped: list[Any] = field(default_factory=list)
    optimizer_twins: _Weak[Callable[..., Any], Any] = field(default_factory=_Weak)
    compiled_steps: _Weak[Callable[..., Any], Any] = field(default_factory=_Weak)
    forward_inputs: _Weak[Any, _ForwardRead] = field(default_factory=_Weak)
    model_calls: _Weak[Any, dict[tuple[str, ...], tuple[tuple[str, ...], bool]]] = field(
        default_factory=_Weak
    )
    default_losses: _Weak[Any, tuple[Any, Any]] = field(default_factory=_Weak)
    model_configs: _Weak[Any, Any] = field(default_factory=_Weak)
    no_grad_pending: _Weak[Any, list[Any]] = field(default_factory=_Weak)
    seq2seq_labels_checked: _Weak[Any, int] = field(default_factory=_Weak)
    left_padding_checked: _Weak[Any, int] = field(default_factory=_Weak)
    kernel_import_errors: dict[str, str | None] = field(default_factory=dict)
    dp_noise_key: bytes | None = None
    ray_reported: tuple[Any, int, str | None] | None = None
    micro_groups: dict[int, weakref.ref[Any]] = field(default_factory=dict)
    resumed_iterators: _Weak[Any, int] = field(default_factory=_Weak)


STATE = ProcessState()


class Snapshot(NamedTuple):
    """The session state at one moment; equal snapshots hold the very same objects."""

    save_in_flight: BackgroundSave | None
    preemption: Closable | None
    ema_swapped: tuple[Any, ...]


def snapshot() -> Snapshot:
    """Return the session state (not the caches), to compare before and after some code.

    Example:
        >>> from ftrain import process_state
        >>> process_state.snapshot()
        Snapshot(save_in_flight=None, preemption=None, ema_swapped=())
    """
    return Snapshot(STATE.save_in_flight, STATE.preemption, tuple(STATE.ema_swapped))
