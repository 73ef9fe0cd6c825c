"""The whole resume conformance matrix: every case of tests/test_resume_conformance.py killed in
every phase, resumed, and compared with its uninterrupted run; prints a table.

    python bench/conformance_matrix.py                      # every case x every phase, seed 0
    python bench/conformance_matrix.py --seed 7 --cases adamw,stream --phases save,bgsave
    python bench/conformance_matrix.py --kills 3             # three kill points per cell

The tests run a seeded sample of this matrix (a few kills of different cases); this runs all of
it, sequentially (a worker run takes 3-10 s), and exits 1 if a cell that is not a known failure
(`Case.known`) fails, or a known failure passes. Each cell kills one run at a point chosen by
`--seed` (`--kills N`: N points, each in a fresh run) and restarts it once.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def load_suite() -> ModuleType:
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "workers"), str(REPO)]
    path = REPO / "tests" / "test_resume_conformance.py"
    spec = importlib.util.spec_from_file_location("test_resume_conformance", path)
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    return suite


class Factory:
    """What `reference()` needs of pytest's tmp_path_factory."""

    def __init__(self, base: Path) -> None:
        self.base, self.n = base, 0

    def mktemp(self, name: str) -> Path:
        self.n += 1
        path = self.base / f"{name}-{self.n}"
        path.mkdir()
        return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kills", type=int, default=1, help="kill points per cell")
    p.add_argument("--cases", default=None, help="comma-separated case names (all by default)")
    p.add_argument("--phases", default=None, help="comma-separated phases (all by default)")
    args = p.parse_args()
    suite = load_suite()
    cases = [c for c in suite.CASES if args.cases is None or c.name in args.cases.split(",")]
    phases = [ph for ph in suite.PHASES if args.phases is None or ph in args.phases.split(",")]
    bad = 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        factory = Factory(Path(tmp))
        print("| case | phase | kill point | result | seconds |")
        print("|---|---|---|---|---|")
        for case in cases:
            for phase in phases:
                for k in range(args.kills):
                    seed = args.seed + k
                    t0, point = time.perf_counter(), "-"
                    try:
                        point = suite.choose_kill(case, phase, seed, suite.reference(case, factory))
                        suite.check_conformance(case, point, factory.mktemp("k"), factory)
                        known = case.xfail(phase) is not None
                        result = "XPASS (a known failure passed)" if known else "ok"
                    except AssertionError as e:
                        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                        known = case.xfail(phase) is not None
                        result = ("xfail: " if known else "FAIL: ") + first[:100]
                        if not known:
                            traceback.print_exc(file=sys.stderr)
                    bad += result.startswith(("FAIL", "XPASS"))
                    secs = time.perf_counter() - t0
                    print(f"| `{case.name}` | `{phase}` | `{point}` | {result} | {secs:.1f} |",
                          flush=True)  # fmt: skip
    print(f"\n{len(cases) * len(phases) * args.kills} kills, {bad} unexpected results, "
          f"{time.perf_counter() - start:.0f} s (seed {args.seed})")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
