"""The plain torchrun + DDP loop a user would write by hand (the baseline llmsplit must match).

Run by `python -m benchmarks ddp` under torchrun; the same model, batch and optimizer as
`llmsplit train`, nothing else: random tokens (compute does not depend on their values).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from llmsplit.models import Transformer, preset_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Transformer(preset_config("tiny"))
    model.init_weights(0)
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    per_rank = args.global_batch // world
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = torch.randint(0, 258, (per_rank, args.seq_len + 1))
        n_micro = per_rank // args.micro_batch
        for i in range(n_micro):
            mb = batch[i * args.micro_batch:(i + 1) * args.micro_batch]
            ctx = model.no_sync() if i < n_micro - 1 else torch.enable_grad()
            with ctx:
                logits = model(mb[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten()) / n_micro
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_t = loss.detach().clone()
        dist.all_reduce(loss_t)
        loss_t.item()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_time_s": times, "tokens_per_step": args.global_batch * args.seq_len}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
