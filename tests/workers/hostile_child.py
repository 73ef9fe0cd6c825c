"""Child process of test_checkpoint_hostile.py: the cases a regression would answer by eating
the machine's memory (reading /dev/zero to its end) run here under a 6 GB address-space cap,
each within an alarm. Prints {case: outcome} as JSON on its last line."""

from __future__ import annotations

import contextlib
import io
import json
import resource
import shutil
import signal
import sys
from pathlib import Path

import torch

import ftrain as ft
from ftrain.extras.cli import inspect


def outcome(fn) -> str:
    def expire(*_):
        raise TimeoutError

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = fn()
        return "CheckpointError" if rc == 1 else f"returned {rc!r}"
    except ft.CheckpointError:
        return "CheckpointError"
    except BaseException as e:  # any other outcome is what the test reports
        return type(e).__name__
    finally:
        signal.alarm(0)


def template():
    return ft.TrainState.create(torch.nn.Linear(4, 2), ft.optim.adamw())


def main(tmp: Path) -> None:
    good = ft.save_checkpoint(template(), tmp / "run")
    cap = 6 * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    results = {}
    for name in ["model.safetensors", "state.json", "COMMITTED", "config.json"]:
        path = tmp / f"zero-{name}"
        shutil.copytree(good, path)
        (path / name).unlink(missing_ok=True)  # config.json: not recorded, still parsed
        (path / name).symlink_to("/dev/zero")
        for verify in (True, False):
            results[f"load {name} -> /dev/zero, verify={verify}"] = outcome(
                lambda p=path, v=verify: ft.load_checkpoint(p, template(), verify=v) and 0
            )
            results[f"inspect {name} -> /dev/zero, verify={verify}"] = outcome(
                lambda p=path, v=verify: inspect(p, verify=v)
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
