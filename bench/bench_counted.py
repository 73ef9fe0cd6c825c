"""A loss of one's own counted from the batch (`ft.losses.counted`) against the same loss returning
its count beside its sum, in the README loop, one process, interleaved.

    python bench/bench_counted.py [--n-layer 6 --n-embd 384 --block 64 --batch 4 --accum 4]

The model is the main example's `CharGPT` (examples/shakespeare_char.py) at the given shapes
(the defaults: 10.7M parameters, above `ft.grads.COUNT_FIRST_NUMEL`), its loss `next_char_sum`.
`plain` returns `(sum, count)`: `accumulate_grads` divides every gradient by the step's count
after the last backward. `counted` declares the count (`targets_in`): each micro-batch's loss is
divided before backward, no pass over the gradients. Both train the same model from the same
state on the same batches (checked to float rounding at the end); each turn runs `--steps`
steps of one loop, turns alternate, `--rounds` turns each; reported: median ms a step and the
paired ratio (each counted turn against the plain turns next to it).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from shakespeare_char import CharGPT, CharGPTConfig, next_char_sum, targets_in  # noqa: E402

import ftrain as ft  # noqa: E402


def plain(model: torch.nn.Module, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return next_char_sum(model, batch), batch[1].new_tensor(batch[1].numel())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("n-layer", 6), ("n-head", 6), ("n-embd", 384), ("block", 64),
                          ("batch", 4), ("accum", 4), ("steps", 3), ("rounds", 7)]:  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--count-first-numel", type=int, default=ft.grads.COUNT_FIRST_NUMEL,
                   help="parameters from which a loss is counted first")  # fmt: skip
    a = p.parse_args()
    ft.grads.COUNT_FIRST_NUMEL = a.count_first_numel
    torch.manual_seed(0)
    config = CharGPTConfig(vocab_size=65, block_size=a.block, n_layer=a.n_layer,
                           n_head=a.n_head, n_embd=a.n_embd)  # fmt: skip
    model = CharGPT(config)
    n = sum(q.numel() for q in model.parameters())
    if n < a.count_first_numel:
        raise SystemExit(f"{n} parameters, below {a.count_first_numel}: both loops would divide "
                         "the gradients after backward; pass larger shapes")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    micro = [[torch.randint(0, 65, (a.batch, a.block), generator=g) for _ in range(2)]
             for _ in range(a.accum)]  # fmt: skip
    loops = {"plain": plain, "counted": ft.losses.counted(next_char_sum, items=targets_in)}
    states = {
        k: ft.TrainState.create(copy.deepcopy(model), ft.optim.adamw(), seed=0) for k in loops
    }
    times: dict[str, list[float]] = {k: [] for k in loops}

    def turn(k: str) -> None:
        state = states[k]
        t0 = time.perf_counter()
        for _ in range(a.steps):  # the README loop; grads and stats live across iterations
            grads, stats = ft.accumulate_grads(state, micro, loops[k])
            state, _ = ft.clip_and_step(state, grads, stats=stats, lr=1e-4, max_norm=1.0)
        float(stats.loss)
        times[k].append((time.perf_counter() - t0) / a.steps * 1e3)
        states[k] = state

    turn("plain"), turn("counted")  # warm-up, not kept
    times = {k: [] for k in loops}
    for r in range(a.rounds):
        for k in ("plain", "counted") if r % 2 == 0 else ("counted", "plain"):
            turn(k)
    pl, co = times["plain"], times["counted"]
    paired = [c / ((pl[max(i - 1, 0)] + pl[i]) / 2) for i, c in enumerate(co)]
    print(f"CharGPT {a.n_layer} layers x {a.n_embd}, block {a.block}, batch {a.batch} x accum "
          f"{a.accum}: {n / 1e6:.1f}M parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print("| loop | ms/step (median) | paired ratio |\n|---|---|---|")
    print(f"| plain (sum, count): gradients divided after | {statistics.median(pl):.1f} | 1.000 |")
    print(f"| counted: each loss divided before backward | {statistics.median(co):.1f} | "
          f"{statistics.median(paired):.3f} |")  # fmt: skip
    for k, q in states["counted"].params.items():  # the same training, to float rounding
        torch.testing.assert_close(q, states["plain"].params[k], rtol=1e-4, atol=1e-5, msg=k)


if __name__ == "__main__":
    main()
