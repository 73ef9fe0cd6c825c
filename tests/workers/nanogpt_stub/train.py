"""A stand-in for nanoGPT's train.py, for bench/bench_gpu.py's CPU test: nanoGPT's globals and
command line (configurator.py, read from the working directory), its data files
(data/<dataset>/train.bin, uint16; meta.pkl's vocab_size), its vocabulary and per-iteration
lines; the model is a bigram table."""

import os
import pickle
import time

import numpy as np
import torch

out_dir = "out"
eval_interval = 2000
log_interval = 1
eval_iters = 200
eval_only = False
always_save_checkpoint = True
init_from = "scratch"
wandb_log = False
dataset = "openwebtext"
gradient_accumulation_steps = 5 * 8
batch_size = 12
block_size = 1024
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
learning_rate = 6e-4
max_iters = 600000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
device = "cuda"
dtype = "bfloat16"
compile = True

if __name__ == "__main__":
    with open("configurator.py") as f:  # nanoGPT reads it from the working directory
        exec(f.read())
    data_dir = os.path.join("data", dataset)
    data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    vocab_size = 50304  # nanoGPT's default, unless the dataset's meta.pkl names one
    meta_path = os.path.join(data_dir, "meta.pkl")
    if os.path.exists(meta_path):
        with open(meta_path, "rb") as f:
            vocab_size = pickle.load(f)["vocab_size"]  # nanoGPT's own format
        print(f"found vocab_size = {vocab_size} (inside {meta_path})")
    table = torch.nn.Embedding(vocab_size, 16)
    opt = torch.optim.AdamW(table.parameters(), lr=learning_rate, betas=(beta1, beta2))
    t0 = time.time()
    for iter_num in range(max_iters + 1):
        if iter_num % eval_interval == 0:
            print(f"step {iter_num}: train loss 0.0000, val loss 0.0000")
        for _ in range(gradient_accumulation_steps):
            ix = torch.randint(len(data) - block_size, (batch_size,))
            rows = [data[i : i + block_size].astype(np.int64) for i in ix]
            x = torch.stack([torch.from_numpy(r) for r in rows])
            logits = table(x % table.num_embeddings)
            loss = logits.logsumexp(-1).mean() / gradient_accumulation_steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(table.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % log_interval == 0:
            lossf = loss.item() * gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu -100.00%")
