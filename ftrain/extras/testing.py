"""`ft.testing`: assertions for unit-testing your own training steps.

Each is a plain function that raises `AssertionError` with a message naming what differs, so it
works in pytest, unittest or a script. docs/testing.md shows them on a training step.
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ftrain.checkpoint import flatten_tree, latest_checkpoint, load_checkpoint, save_checkpoint
from ftrain.data import Collate, make_batches
from ftrain.grads import accumulate_grads
from ftrain.losses import LossFn
from ftrain.state import TrainState, plain_values, snapshot

__all__ = [
    "assert_accumulation_exact",
    "assert_no_host_sync",
    "assert_pure",
    "assert_resume_exact",
]


def _first_difference(
    got: Mapping[str, Any], want: Mapping[str, Any], *, rtol: float, atol: float
) -> str | None:
    """A description of the first entry that differs (missing, shape, or value), else None."""
    if set(got) != set(want):
        return f"different entries: only in the first {sorted(set(got) - set(want))[:5]}, " \
            f"only in the second {sorted(set(want) - set(got))[:5]}"  # fmt: skip
    for name, a in got.items():
        b = want[name]
        if not isinstance(a, torch.Tensor):
            if a != b:
                return f"{name}: {a!r} != {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
        if not torch.allclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True):
            diff = (a64 - b64).abs().nan_to_num(nan=float("inf")).max().item()
            return f"{name}: max abs difference {diff:.3g} (rtol={rtol}, atol={atol})"
    return None


def assert_accumulation_exact(
    state: TrainState,
    data: Any,
    loss_fn: LossFn | None = None,
    *,
    batch_size: int,
    accum: int,
    collate_fn: Collate | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-7,
) -> None:
    """Assert that `accum` micro-batches give the gradient of one batch holding them all.

    Takes the first `batch_size * accum` rows of `data` (in order), collates them once as
    `accum` micro-batches of `batch_size` and once as one batch, and compares the gradients of
    `accumulate_grads` with your `loss_fn` and `collate_fn`. Each micro-batch is padded to its
    own longest row, the big batch to the longest of all, so a loss that averages per batch
    (the 2024 HF gradient-accumulation bug) fails. `state` is not changed (copies are used).
    Models with dropout draw different masks per micro-batch: set dropout to 0 for the check.

    Args:
        state: a state of the model under test.
        data: rows, as `make_batches` accepts them; at least `batch_size * accum`.
        loss_fn: `(model, batch) -> (loss_sum, num_items)`; if None, `state.loss_fn`, else
            `ft.losses.default_loss`.
        batch_size: rows per micro-batch.
        accum: micro-batches (at least 2 for the check to mean anything).
        collate_fn: your collate; `make_batches`' default if None.
        rtol: relative tolerance of the float comparison.
        atol: absolute tolerance of the float comparison.

    Raises:
        AssertionError: naming the first parameter whose gradient differs, and by how much.
        ValueError: for `accum < 2` or too few rows.
    """
    if not (isinstance(accum, int) and accum >= 2):
        raise ValueError(f"accum must be an int >= 2 to compare accumulation, got {accum!r}")
    n = batch_size * accum
    if len(data) < n:
        raise ValueError(f"data has {len(data)} rows; batch_size * accum = {n} are needed")
    rows = [data[i] for i in range(n)]
    kw: dict[str, Any] = {"shuffle": False, "collate_fn": collate_fn}
    micro = next(make_batches(rows, batch_size=batch_size, accum=accum, **kw))
    whole = next(make_batches(rows, batch_size=n, accum=1, **kw))
    got, _ = accumulate_grads(snapshot(state), micro, loss_fn)
    want, _ = accumulate_grads(snapshot(state), whole, loss_fn)
    problem = _first_difference(got, want, rtol=rtol, atol=atol)
    if problem is not None:
        raise AssertionError(
            f"gradient accumulation is not exact: {accum} micro-batches of {batch_size} rows "
            f"differ from one batch of {n} rows at {problem}. Return the loss summed over "
            "items and the item count from loss_fn, not a mean, and make padding count as 0"
        )


def _state_tensors(state: TrainState) -> dict[str, Any]:
    """Parameters, buffers, optimizer state and counters of a state, by name."""
    held = state.tensors_  # read even when consumed: the check is about values, not donation
    out: dict[str, Any] = {f"model/{k}": v for k, v in held.model.state_dict().items()}
    out.update({f"opt_state/{k}": v for k, v in flatten_tree(held.opt_state).items()})
    out.update(plain_values(state))
    return out


def assert_resume_exact(
    make_state: Callable[[], TrainState],
    train: Callable[[TrainState, int], TrainState],
    *,
    steps: int,
    stop_at: int,
    directory: str | Path | None = None,
) -> None:
    """Assert that stopping, saving, loading and continuing equals training without a stop.

    Runs `train(make_state(), steps)` once; then `train(make_state(), stop_at)`, saves with
    `ft.save_checkpoint`, loads into a fresh `make_state()` with `ft.load_checkpoint`, and
    continues with `train(loaded, steps)`. Parameters, buffers, optimizer state and every
    counter (step, epoch, cursor, tokens and samples seen, ...) must agree bit for bit.

    Args:
        make_state: builds the initial state (same seed every call).
        train: your loop: `train(state, until) -> state` with `state.step == until`; it must
            take the data position from the state (`make_batches(data, state, ...)`).
        steps: total optimizer steps.
        stop_at: where the interrupted run stops (0 < stop_at < steps).
        directory: where to save; a temporary directory if None.

    Raises:
        AssertionError: naming the first tensor or counter that differs.
    """
    if not 0 < stop_at < steps:
        raise ValueError(f"stop_at must be in (0, steps={steps}), got {stop_at!r}")
    whole = train(make_state(), steps)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp if directory is None else directory)
        save_checkpoint(train(make_state(), stop_at), root)
        path = latest_checkpoint(root)
        if path is None:
            raise AssertionError(f"save_checkpoint committed no checkpoint under {root}")
        resumed = train(load_checkpoint(path, make_state()), steps)
    problem = _first_difference(_state_tensors(resumed), _state_tensors(whole), rtol=0.0, atol=0.0)
    if problem is not None:
        raise AssertionError(
            f"resume is not exact: stopping at step {stop_at} and resuming to step {steps} "
            f"differs from an uninterrupted run at {problem}. Give make_batches the state "
            "(make_batches(data, state, ...)), and keep every random draw a function of the state"
        )


class _SyncDetector(TorchDispatchMode):
    """Records the ops that copy a device value to the host."""

    def __init__(self, allow: Collection[str] = ()) -> None:
        super().__init__()
        self.found: list[str] = []
        self.allow = tuple(allow)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        what = _sync_kind(func, args, kwargs)
        if what is not None and not _inside(self.allow):
            self.found.append(f"{what} at {_user_frame()}")
        return func(*args, **kwargs)


# Tensor methods that read every value on the host without an aten op (so the dispatch mode
# above never sees them on a CPU tensor): the `.item()` of many values.
_READS = frozenset({"tolist", "numpy", "__array__"})
# ftrain's data path: host tensors by construction (the epoch order, a collate's rows), never a
# device value, even on a GPU.
_HOST_SIDE = ("ftrain.data",)


class _ValueReadDetector(TorchFunctionMode):
    """Records `.tolist()`, `.numpy()` and `np.asarray(t)` of CPU tensors: on a GPU the same
    line reads a device value (device tensors are caught as copies by `_SyncDetector`)."""

    def __init__(self, found: list[str], allow: Collection[str] = ()) -> None:
        super().__init__()
        self.found = found
        self.allow = tuple(allow)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        t = args[0] if name in _READS and args else None
        on_host = isinstance(t, torch.Tensor) and t.device.type == "cpu"
        if on_host and not _inside((*self.allow, *_HOST_SIDE)):
            self.found.append(f"Tensor.{name} (reads every value on the host) at {_user_frame()}")
        return func(*args, **(kwargs or {}))


def _inside(modules: tuple[str, ...]) -> bool:
    """Whether a frame of the current Python stack runs code of one of `modules` (a module or
    package name: "transformers.masking_utils", "transformers")."""
    if not modules:
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if any(name == m or name.startswith(m + ".") for m in modules):
            return True
        frame = frame.f_back
    return False


_SCALAR_OPS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item"})


def _sync_kind(func: Any, args: Any, kwargs: Any) -> str | None:
    name = func._schema.name
    if name in _SCALAR_OPS:
        # .item(), float(t), int(t), bool(t), `if t:`: the host waits for the value.
        return f"{name} (.item()/float()/bool() of a tensor)"
    if name in ("aten::_to_copy", "aten::copy_"):
        src = args[1] if name == "aten::copy_" else args[0]
        dst = kwargs.get("device") if name == "aten::_to_copy" else args[0].device
        leaves_device = isinstance(src, torch.Tensor) and src.device.type != "cpu"
        if leaves_device and dst is not None and torch.device(dst).type == "cpu":
            return f"{name} from {src.device} to the host (.cpu()/.to('cpu')/.tolist())"
    return None


def _user_frame() -> str:
    """file:line of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if "torch" not in Path(f).parts and f != __file__:
            return f"{f}:{frame.lineno} ({frame.line})"
    return "unknown"


def assert_no_host_sync(
    fn: Callable[..., Any], *args: Any, allow: Collection[str] = (), **kwargs: Any
) -> Any:
    """Run `fn(*args, **kwargs)` and assert it never made the host wait for the device.

    Flags, wherever they happen (your loss, your loop, ftrain): reading a tensor's value on
    the host (`.item()`, `float(t)`, `int(t)`, `bool(t)`, `if t:`, `.tolist()`, `.numpy()`,
    `np.asarray(t)`) and copies from a device to the host (`.cpu()`, `.to("cpu")` of a device
    tensor). Reading a CPU tensor's value is flagged too, so a CPU test catches what would
    stall a GPU; only inside `make_batches` (`ftrain.data`, your collate included), whose
    tensors are host data on any machine, are `.tolist()` and `.numpy()` let through. On CUDA,
    `torch.cuda.set_sync_debug_mode("error")` also catches syncs inside kernels' launchers.

    Syncs you cannot remove, made inside a third-party module, are let through by naming it in
    `allow`: a sync is allowed when any frame of its Python stack runs code of a listed module
    (or a submodule of a listed package). Padded HF models read the padding mask on the host
    in `transformers.masking_utils`, so test a step on one with
    `assert_no_host_sync(step, state, micro, allow=("transformers.masking_utils",))`: every
    other sync still fails. On CUDA the driver-level check cannot tell where a sync came from,
    so with `allow` it is off.

    Args:
        fn: the function under test.
        *args: its positional arguments.
        allow: module or package names (`"transformers.masking_utils"`) whose syncs pass.
        **kwargs: its keyword arguments.

    Returns:
        What `fn` returned.

    Raises:
        AssertionError: listing each sync with the source line that made it.
    """
    if isinstance(allow, str):
        raise TypeError(f"allow takes a collection of module names, e.g. ({allow!r},)")
    detector = _SyncDetector(allow)
    cuda = torch.cuda.is_available() and not allow
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    try:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        with detector, _ValueReadDetector(detector.found, allow):
            out = fn(*args, **kwargs)
    except RuntimeError as e:
        if "synchroniz" in str(e):
            raise AssertionError(f"host-device sync inside {_name(fn)}: {e}") from e
        raise
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
    if detector.found:
        listed = "\n  ".join(detector.found[:10])
        raise AssertionError(
            f"{len(detector.found)} host-device sync(s) inside {_name(fn)}:\n  {listed}\n"
            "Keep values as device tensors (stats.loss, info.grad_norm) and read them only "
            "when logging"
        )
    return out


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _tensors(obj: Any, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor an argument holds, by path: states, modules, and pytrees of tensors."""
    if isinstance(obj, TrainState):
        named = {k: v for k, v in _state_tensors(obj).items() if isinstance(v, torch.Tensor)}
    elif isinstance(obj, nn.Module):
        named = dict(obj.state_dict())
    else:
        leaves, _ = tree_flatten(_plain(obj))
        named = {str(i): v for i, v in enumerate(leaves)}
    return {f"{prefix}/{k}": v for k, v in named.items() if isinstance(v, torch.Tensor)}


def _plain(obj: Any, depth: int = 0) -> Any:
    """`obj` with every mapping as a dict and every sequence as a list, recursively: pytrees
    see only their registered types, and the containers ftrain hands around (`Grads`,
    `MicroBatches`, an HF `BatchEncoding`) would otherwise be opaque leaves, unwatched."""
    if depth > 32 or isinstance(obj, (torch.Tensor, str, bytes, TrainState, nn.Module)):
        return obj
    if isinstance(obj, Mapping):
        return {k: _plain(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, Sequence):
        return [_plain(v, depth + 1) for v in obj]
    return obj


def assert_pure(
    fn: Callable[..., Any],
    *args: Any,
    donated: Collection[int | str] = (),
    **kwargs: Any,
) -> Any:
    """Run `fn(*args, **kwargs)` and assert it left its inputs unchanged, except donated ones.

    Every tensor reachable from an argument is compared bit for bit before and after: a
    `TrainState`'s parameters, buffers, optimizer state and counters, a module's state dict,
    and the tensors in lists/tuples/dicts (batches, gradients).

    Args:
        fn: the function under test.
        *args: its positional arguments.
        **kwargs: its keyword arguments.
        donated: positions (int) or keyword names (str) of arguments `fn` may change.

    Returns:
        What `fn` returned.

    Raises:
        AssertionError: naming the argument and tensor that changed, and by how much.
    """
    watched: dict[str, torch.Tensor] = {}
    for where, value in [*enumerate(args), *kwargs.items()]:
        if where not in donated:
            label = f"argument {where}" if isinstance(where, int) else str(where)
            watched.update(_tensors(value, label))
    before = {k: v.detach().clone() for k, v in watched.items()}
    out = fn(*args, **kwargs)
    after = {k: v.detach() for k, v in watched.items()}
    problem = _first_difference(after, before, rtol=0.0, atol=0.0)
    if problem is not None:
        raise AssertionError(
            f"{_name(fn)} changed an input it does not own: {problem}. Copy before updating in "
            "place, or pass the argument in donated=[...] if the change is intended"
        )
    return out
