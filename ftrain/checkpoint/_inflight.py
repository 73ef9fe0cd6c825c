"""The background save in flight (`STATE.save_in_flight`), as the readers of a run folder see
it: waiting for it, and the one error type of every failed save.

Apart from `_save` (which starts background saves) so that `_verify` can wait for one before it
reads a checkpoint that the save may be writing, replacing or rotating away.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ftrain.checkpoint._io import CheckpointError
from ftrain.process_state import STATE

__all__ = ["failure", "in_flight_into", "wait_for_checkpoint", "wait_for_save_into"]


def wait_for_checkpoint() -> Path | None:
    """Block until the background save (if any) is written; return its path.

    An exception while waiting (Ctrl-C) leaves the save in flight: the next checkpoint call
    waits for it again and reports its outcome.

    Raises:
        CheckpointError: if the background save failed (the original error is its cause).
    """
    bg = STATE.save_in_flight
    if bg is None:
        return None
    bg.join()
    with STATE.save_lock:  # only one caller reports the outcome
        mine = STATE.save_in_flight is bg
        if mine:
            STATE.save_in_flight = None
    if mine and bg.error is not None:
        raise failure(f"background save of step {bg.step} failed", bg.error)
    return bg.path


def wait_for_save_into(path: str | os.PathLike[str]) -> None:
    """Wait for this process's background save if it writes into the run folder that holds
    the checkpoint `path`.

    Until it commits, `path` may not exist yet, may still be the older checkpoint of the same
    step that the save replaces (a run that went back and saves that step again), or may be
    rotated away by it: reading it meanwhile raised a misleading error or read the old
    weights without a word. A failed save is raised here only when `path` is the checkpoint it
    was writing, and is left for the next checkpoint call to report too: reading an intact
    older checkpoint raised it and took it, and the next save said nothing of it.
    """
    path = Path(path)
    bg = STATE.save_in_flight  # in flight, or ended and not reported yet
    if bg is None or bg.root is None or not (_same(bg.root, path.parent) or _same(bg.root, path)):
        return
    bg.join()  # at once if it ended
    if bg.error is None:
        wait_for_checkpoint()  # committed: nothing left to report
    elif _same(path, bg.root / f"step-{bg.step}"):
        raise failure(f"background save of step {bg.step} failed", bg.error)


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):  # an unreadable path: not the one being written
        return False


def in_flight_into(root: Path) -> bool:
    """Whether a background save of this process into `root` has not finished yet."""
    bg = STATE.save_in_flight
    if bg is None or bg.root is None or not bg.is_alive():
        return False
    return _same(bg.root, root)


def _forget_in_child() -> None:
    """A forked child (a ProcessPoolExecutor worker forked during a background save) inherits
    the parent's save in flight but not its writer thread: reading a checkpoint (or exiting)
    waited forever for it. The save is the parent's to finish and report; a lock that another
    thread held at the fork stays held in the child, so the child gets a fresh one."""
    STATE.save_in_flight = None
    STATE.save_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def failure(message: str, cause: BaseException | None) -> CheckpointError:
    """One error type for every failed save, blocking or not; an OSError cause keeps its
    errno, and the error is an OSError too (code catching the disk-full OSError still does)."""
    if cause is None:
        return CheckpointError(f"{message} on another rank")
    if not isinstance(cause, OSError):
        error = CheckpointError(f"{message}: {type(cause).__name__}: {cause}")
    else:
        error = _OSCheckpointError(f"{message}: {cause}")
        error.errno, error.strerror, error.filename = cause.errno, cause.strerror, cause.filename
    error.__cause__ = cause
    return error


class _OSCheckpointError(CheckpointError, OSError):
    """A CheckpointError caused by the operating system (disk full, permission denied).

    Named CheckpointError: to its catcher it is one, that is also an OSError.
    """

    def __str__(self) -> str:  # the message, not OSError's "[Errno N] strerror: filename"
        return str(self.args[0])


_OSCheckpointError.__name__ = _OSCheckpointError.__qualname__ = "CheckpointError"
