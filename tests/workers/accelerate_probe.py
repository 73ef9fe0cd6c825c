"""Run by `accelerate launch` in tests/test_distributed.py: from_env joins accelerate's group."""

import sys

import torch

import ftrain as ft


def main() -> None:
    strategy = ft.strategies.from_env()
    total = strategy.all_reduce_sum(torch.tensor(float(strategy.rank + 1)))
    line = f"probe {type(strategy).__name__} {strategy.rank}/{strategy.world_size} {float(total)}"
    sys.stdout.write(line + "\n")  # one write: lines of the two ranks cannot interleave
    sys.stdout.flush()
    strategy.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
