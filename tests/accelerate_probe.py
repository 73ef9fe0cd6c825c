"""Run by `accelerate launch` in tests/test_distributed.py: from_env joins accelerate's group."""

import torch

import ftrain as ft

strategy = ft.strategies.from_env()
total = strategy.all_reduce_sum(torch.tensor(float(strategy.rank + 1)))
print(f"probe {type(strategy).__name__} {strategy.rank}/{strategy.world_size} {float(total)}")
strategy.barrier()
torch.distributed.destroy_process_group()
