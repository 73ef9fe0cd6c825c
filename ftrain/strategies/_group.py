"""What the process-group strategies (DDP, FSDP) share: joining the group, this rank's device,
collectives on device tensors. One place, imported by each strategy module; they never import
each other.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ftrain.precision import Precision
from ftrain.process_state import STATE
from ftrain.strategies import _dcp, _placement
from ftrain.strategies._base import _precision_repr, host_copies, move_to

__all__ = [
    "ProcessGroupStrategy",
    "collective_timeout",
    "group_timeout",
    "join_group",
    "local_device",
    "refuse_one_node_torchrun_per_srun_task",
    "refuse_pod_short_of_processes",
]

TIMEOUT_ENV = "FTRAIN_COLLECTIVE_TIMEOUT"
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_S = TypeVar("_S", bound="ProcessGroupStrategy")
_POLL_S = 0.5  # how often close() looks whether a background save it waits for was abandoned


def local_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


# torch counts a timeout in milliseconds (int64) and adds it to the clock: far beyond this it
# overflows (timedelta.max failed to connect "after -5833720368547758ms"). A year is ample.
MAX_TIMEOUT_S = 365 * 24 * 3600


def collective_timeout(timeout: timedelta | None = None) -> timedelta:
    """How long a collective may wait for a peer: `timeout`, else FTRAIN_COLLECTIVE_TIMEOUT
    (seconds), else 10 minutes. A dead peer then ends the survivors instead of hanging them
    (gloo's own default is 30 minutes; an elastic restart waits for every survivor to exit).

    Raises:
        ValueError: unless the timeout is a number of seconds in (0, 31536000] (one year).
    """
    if timeout is not None:
        if not isinstance(timeout, timedelta) or not 0 < timeout.total_seconds() <= MAX_TIMEOUT_S:
            raise ValueError(
                f"timeout must be a positive datetime.timedelta of at most 365 days, got "
                f"{timeout!r}"
            )
        return timeout
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return timedelta(minutes=10)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_TIMEOUT_S:  # also refuses nan and inf
        raise ValueError(
            f"{TIMEOUT_ENV} must be a number of seconds in (0, {MAX_TIMEOUT_S}] (at most a "
            f"year), got {raw!r}"
        )
    return timedelta(seconds=seconds)


def group_timeout() -> timedelta | None:
    """The collective timeout of the initialised default group, or None where torch does not
    say."""
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def collective_seconds() -> float:
    """How long a collective of the default process group may wait for a peer, in seconds:
    its timeout, else ftrain's default (`FTRAIN_COLLECTIVE_TIMEOUT`, 10 minutes)."""
    timeout = group_timeout()
    if timeout is None:
        try:
            timeout = collective_timeout()
        except ValueError:  # a malformed FTRAIN_COLLECTIVE_TIMEOUT: from_env names it
            timeout = timedelta(minutes=10)
    return timeout.total_seconds()


def await_collective(
    device: torch.device, seconds: float, done: Callable[[], bool] | None = None
) -> None:
    """Wait until the collective just enqueued on `device` completes, raising `TimeoutError`
    after 90% of `seconds` (`collective_seconds()`): an NCCL collective no peer joins is
    otherwise ended by torch's watchdog at the timeout, which aborts the process with NCCL's
    message (a gloo one raises on its own, in the call). `done` (tests) stands for the CUDA
    event's query."""
    if done is None:
        if device.type != "cuda":
            return  # gloo waits in the call itself, and raises at its timeout
        event = torch.cuda.Event()
        event.record()
        done = event.query
    deadline = time.monotonic() + 0.9 * seconds
    pause = 1e-4
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {0.9 * seconds:.3g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def join_group(name: str, *, timeout: timedelta | None = None) -> bool:
    """Initialise the default process group from the launcher's environment unless one exists.

    torchrun and `accelerate launch` set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the
    backend is NCCL with CUDA and gloo on the CPU. Returns True when this call created the
    group (the strategy then destroys it in `close()`).

    Raises:
        RuntimeError: outside a launcher, naming the missing variables and how to launch.
        ValueError: for a MASTER_PORT that is not an integer in 1..65535, a torchrun of a
            one-node group of its own in each task of a srun step of several, or a pod whose
            job counts PET_NPROC_PER_NODE processes a pod, started without torchrun.
    """
    if dist.is_initialized():
        return False
    refuse_one_node_torchrun_per_srun_task()  # DDP() built by hand, too
    refuse_pod_short_of_processes()
    missing = [k for k in _LAUNCHER_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"{name}() needs a process group, and none is initialised nor described by the "
            f"environment (unset: {', '.join(missing)}). Launch the script with "
            f"`torchrun --nproc_per_node N script.py` or `accelerate launch --num_processes N "
            f"script.py`; in one process use ft.strategies.from_env(), which returns SingleDevice"
        )
    _check_master_port()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = collective_timeout(timeout)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True


def refuse_pod_short_of_processes() -> None:
    """A pod whose job asks for PET_NPROC_PER_NODE processes (above 1) in each pod, started
    with `python` (one process), not torchrun (which reads PET_* and starts them). Without
    WORLD_SIZE (a Trainer TrainJob's pod) it trained as one process of the N the job asked for,
    with 1/N of the global batch; with the WORLD_SIZE and RANK a PyTorchJob operator sets
    (PET_NNODES x PET_NPROC_PER_NODE processes, RANK the pod's index) rank 0 waited for
    processes that never start until the timeout. Processes that a launcher started (torchrun,
    Ray, Python's multiprocessing, one that sets LOCAL_RANK) are not asked."""
    env = os.environ
    per_pod = env.get("PET_NPROC_PER_NODE", "")
    if not (per_pod.isascii() and per_pod.isdigit() and int(per_pod) > 1):
        return  # "auto" is one process per pod in the operator's WORLD_SIZE
    if "TORCHELASTIC_RUN_ID" in env or "RAY_RAYLET_PID" in env:
        return
    # mp.spawn's workers, or a launcher's that sets LOCAL_RANK (the operator sets none)
    if multiprocessing.parent_process() is not None or "LOCAL_RANK" in env:
        return
    if "WORLD_SIZE" in env:
        pods, rank, world = env.get("PET_NNODES", ""), env.get("RANK", ""), env["WORLD_SIZE"]
        if not (pods.isascii() and pods.isdigit() and world.isascii() and world.isdigit()):
            return  # elastic ("MIN:MAX"), or not numbers: from_env names a bad WORLD_SIZE
        operators = int(world) == int(pods) * int(per_pod)
        if not operators or rank != env.get("PET_NODE_RANK", rank):
            return  # per-process values set by some other launcher
        what = (
            f"WORLD_SIZE={env['WORLD_SIZE']} counts PET_NPROC_PER_NODE={per_pod} processes in "
            f"each of PET_NNODES={pods} pods, but this pod's command started one: the process "
            "group would wait for the others until the timeout"
        )
    else:
        what = (
            f"this pod's job asks for PET_NPROC_PER_NODE={per_pod} processes in it, but its "
            f"command started one and WORLD_SIZE is unset: it would train alone, with 1/{per_pod} "
            "of the global batch"
        )
    raise ValueError(
        f"{what}; start the command with torchrun (`torchrun train.py` reads PET_* as its "
        "arguments), or set the job's nprocPerNode / numProcPerNode to 1"
    )


# The rendezvous id torchrun draws for a one-node group of its own (--standalone, or --nnodes 1
# without --rdzv-endpoint): a uuid4. A rendezvous the user set up has the --rdzv-id given.
_OWN_RDZV_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def interactive_srun_shell() -> bool:
    """Whether this process runs in the shell of `srun --pty bash` (or of `salloc` where the
    cluster starts it so: `use_interactive_step`): srun starts that one shell, not its step's
    SLURM_STEP_NUM_TASKS tasks, whose count the shell's processes inherit nonetheless. srun
    sets SLURM_PTY_PORT for a pseudo-terminal only, but a srun started from that shell passes
    it on to its tasks: their standard input is no terminal, the shell's is."""
    return "SLURM_PTY_PORT" in os.environ and os.isatty(0)


def refuse_one_node_torchrun_per_srun_task() -> None:
    """`srun -N 2 torchrun --standalone ...` (or `--nnodes 1`): each srun task's torchrun made
    a one-node group of its own, so the step's SLURM_STEP_NUM_TASKS nodes trained the same run
    independently, each into the run folder. Its group is known by GROUP_WORLD_SIZE=1 with the
    rendezvous id torchrun drew itself (a uuid4), or the static rendezvous' default
    MASTER_ADDR=127.0.0.1 (`--nnodes 1 --master-port P`). A rendezvous across the nodes (one
    shrunk to one node by an elastic restart too: MASTER_ADDR=localhost) has its --rdzv-id."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "SLURM_PROCID" not in env:
        return
    if interactive_srun_shell():  # one torchrun, typed in the step's one shell
        return
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if not (tasks.isascii() and tasks.isdigit() and int(tasks) > 1):
        return
    own = _OWN_RDZV_ID.fullmatch(env["TORCHELASTIC_RUN_ID"]) is not None
    host = env.get("MASTER_ADDR", "")
    if env.get("GROUP_WORLD_SIZE") != "1" or not (own or host.startswith("127.")):
        return
    raise ValueError(
        f"this torchrun is one of SLURM_STEP_NUM_TASKS={tasks} that srun started, but its "
        "group is a one-node group of its own (GROUP_WORLD_SIZE=1, torchrun's own rendezvous: "
        f"--standalone, or --nnodes 1): the {tasks} tasks would each train the run alone, into "
        "the same run folder; give torchrun --nnodes $SLURM_NNODES --rdzv-backend c10d "
        "--rdzv-endpoint <first host>:29500 --rdzv-id $SLURM_JOB_ID (docs/strategies.md, Many "
        "nodes), or start one task (srun --ntasks 1)"
    )


def _check_master_port() -> None:
    port = os.environ["MASTER_PORT"]
    # torch takes "0" as any free port (rank 0's own, which no other rank can know: they wait
    # out the timeout) and refuses "70000" or "29500.0" without naming the variable.
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(
            f"MASTER_PORT={port!r} in the environment is not a port: set it to an integer in "
            "1..65535 (the same on every rank)"
        )


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """A fresh key space in torchrun's store for this restart attempt, or None outside one.

    torchrun's agent hosts one TCPStore for the whole job and every restart attempt's workers
    join it (TORCHELASTIC_USE_AGENT_STORE). The keys in which a dead attempt's ranks published
    their gloo/NCCL addresses are still there, so a restarted rank may connect to a dead peer
    ("connectFullMesh failed: Connection refused") before the live one overwrote its key.
    Prefixing by TORCHELASTIC_RESTART_COUNT gives each attempt its own keys. With several
    agents (nodes) the agents' restart counts can differ, so there the fix is torch's own
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per round), and this warns without it.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
            warnings.warn(
                "torchrun restarts across several nodes share one store in which a dead "
                "attempt's addresses survive; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (with "
                "--rdzv-backend c10d) so that each restart gets a fresh one (docs/strategies.md)",
                stacklevel=4,
            )
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ftrain/attempt-{attempt}", store)  # keys: ftrain/attempt-N/...


class ProcessGroupStrategy:
    """What DDP and FSDP share: a process group, this rank's device, collectives on tensors."""

    micro_counts_must_match = True  # FSDP gathers in every forward, TP reduces in it
    forward_collectives = True  # (DDP's are in the backward: it sets False)

    def __init__(
        self,
        name: str,
        device: str | torch.device | None,
        group: Any,
        precision: str | Precision | None,
    ) -> None:
        # Arguments that need no group are checked before joining it (a raise leaves no group).
        self.precision = Precision.of(precision)
        explicit = torch.device(device) if device is not None else None
        owns = join_group(name)
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:  # torch answers -1 (and a world of -1) outside the group
            # (a group given here was made in the default group: nothing was joined above)
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the "
                f"process_group given to {name}(): it would train as rank -1 of -1 (and "
                "grad_reduce_factor -1 would flip its gradients); build the strategy only on "
                "the group's members"
            )
        self.world_size = dist.get_world_size(group)
        self.process_rank = self.rank  # each process is a data-parallel rank (not under TP)
        self.grad_reduce_factor = 1.0 / self.world_size  # both average over ranks
        self.device = explicit if explicit is not None else local_device()
        self.owns_group = owns  # close() destroys the group only if ftrain created it
        self.closed = False
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # Background (sharded) saves talk over gloo groups of their own, made at the first.
        self._checkpoint_groups: list[Any] = []
        self._save_done: threading.Event | None = None  # set once the last one has finished
        self._save_started = threading.Event()  # set once its write began

    def __repr__(self) -> str:
        name = type(self).__name__
        return (
            f"{name}(rank={self.rank}, world_size={self.world_size}, device='{self.device}'"
            f"{_precision_repr(self.precision)})"
        )

    def to_device(self, batch: Any) -> Any:
        return move_to(batch, self.device)

    # --- lifetime ------------------------------------------------------------------------------

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def close(self) -> None:
        """Leave the process group together; safe on every rank, and idempotent.

        In this order: release what the set-up models hold of the group (a DDP model freed
        after `destroy_process_group` drops the last reference to a gloo group, whose
        destructor then deadlocks at exit, see docs/strategies.md), wait for every rank
        (a rank leaving while a peer still uses the group makes gloo abort the peer), and
        destroy the group if `from_env` created it. Models set up by this strategy cannot
        train afterwards: save and export before.
        """
        if self.closed:
            return
        self._finish_saves()
        self.closed = True
        self._release()
        if not dist.is_initialized():
            return
        try:
            self.barrier()
        finally:
            if self.owns_group:
                dist.destroy_process_group()

    def abort(self) -> None:
        """Leave after an error, without waiting for the other ranks (idempotent).

        A barrier here could wait forever on a peer that is itself stuck in a collective; this
        rank releases its models and destroys the group it created, so that the peers' next
        collective fails at once instead of after the timeout.
        """
        if self.closed:
            return
        self.closed = True
        self._release()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    @contextlib.contextmanager
    def _leaving_on_error(self) -> Iterator[None]:
        """Around a constructor's checks that need the group (the world size): a strategy that
        raises is never returned to be closed, so it leaves the group it joined first."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def _track(self, model: nn.Module) -> nn.Module:
        self._models.add(model)
        return model

    def _release(self) -> None:
        for model in list(self._models):
            self.release_model(model)
        gc.collect()  # models the caller dropped go now, before the group does

    def release_model(self, model: nn.Module) -> None:
        """Drop what `model` (set up by this strategy) holds of the process group; a no-op
        unless the backend's wrapper keeps the group alive."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.precision.autocast(self.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(tensor)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        # Shapes first (one small all-gather and a host sync), then rows padded to the largest.
        # A rank without rows does not widen the other axes.
        dims = list(tensor.shape) if tensor.shape[0] else [0] * tensor.dim()
        shape = torch.tensor(dims, dtype=torch.int64, device=tensor.device)
        shapes = [torch.empty_like(shape) for _ in range(self.world_size)]
        dist.all_gather(shapes, shape, group=self.group)
        sizes = [s.tolist() for s in shapes]
        largest = [max(d) for d in zip(*sizes, strict=True)]
        padded = tensor.new_full(largest, 0 if tensor.dtype in (torch.bool, torch.uint8) else -100)
        padded[tuple(slice(0, d) for d in tensor.shape)] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        rest = tuple(slice(0, d) for d in largest[1:])
        return torch.cat([p[(slice(0, s[0]), *rest)] for p, s in zip(parts, sizes, strict=True)])

    # Placement: FSDP and TP hold DTensors, DDP whole tensors; each tensor says which.
    def local_view(self, tensor: torch.Tensor) -> torch.Tensor:
        return _placement.local_view(tensor)

    def is_distributed(self, tensor: torch.Tensor) -> bool:
        return _placement.is_distributed(tensor)

    # Checkpoint layout: whole tensors on every rank (DDP); FSDP overrides what shards change.
    checkpoint_sharded = False

    def save_shards(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        _dcp.save_shards(tensors, directory, group=self.group, local=False)

    def save_shards_async(
        self, parts: Mapping[Path, dict[str, torch.Tensor]], *, commit: Callable[[], None]
    ) -> Callable[[], None]:
        # Over every process, as the shards are (TP's too); each is here, in this order.
        while len(self._checkpoint_groups) < len(parts):
            group = dist.new_group(backend="gloo", timeout=self._timeout())
            self._checkpoint_groups.append(group)
        groups, rank = self._checkpoint_groups, self.process_rank
        write = _dcp.save_shards_async(parts, commit, groups=groups, rank=rank)
        done = self._save_done = threading.Event()
        started = self._save_started = threading.Event()

        def write_and_signal() -> None:  # ft.checkpoint runs it, in its background thread
            started.set()
            try:
                write()
            finally:
                done.set()

        return write_and_signal

    def load_shards(self, directory: Path, targets: dict[str, torch.Tensor]) -> None:
        _dcp.load_shards(directory, targets, group=self.group, local=False)

    def to_host(
        self, tensors: Sequence[torch.Tensor], *, copy: bool
    ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        return host_copies(tensors, copy=copy)

    def _finish_saves(self) -> None:
        """Wait for the background save that writes over this strategy's checkpoint groups:
        its collectives must end before the groups go. The strategy started it, so it knows of
        it without asking `ft.checkpoint` (which imports the strategies, not the other way);
        its outcome is reported by the next checkpoint call, or at exit.

        A write that never began and is no longer in flight (its thread could not start:
        `save_checkpoint` raised and forgot it) never finishes: close() waited for it forever.
        """
        done = self._save_done
        if done is None:
            return
        while not done.wait(_POLL_S):
            if not self._save_started.is_set() and STATE.save_in_flight is None:
                return  # never run, never will be

    def _timeout(self) -> Any:
        """The training group's collective timeout (a dead peer fails a background save as
        soon as it fails a step), or None (torch's default) where torch does not say."""
        try:
            group = dist.distributed_c10d._get_default_group()
            return group._get_backend(self.device).options._timeout
        except (AttributeError, RuntimeError):
            return None

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return module.state_dict()

    def copy_whole(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
