"""What the peer training scripts (ds_train.py, accel_train.py) share with `llmsplit train`:
the same model (llmsplit's Llama, sizes from the same `--set` overrides, weights from the
same (seed, name) init), the same batches (llmsplit's sampler over its built-in corpus),
the same loss, AdamW groups and clipping, and the same measures: tokens/s per step and
the peak resident size (VmHWM) reset after setup, as `llmsplit train` records it.

Imported as a sibling module: the peer scripts run as files under a launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from llmsplit.config import load_config, model_config
from llmsplit.data.corpus import load_tokens
from llmsplit.data.loader import BatchSampler
from llmsplit.io.tokenizer import load_tokenizer
from llmsplit.models import Transformer
from llmsplit.train.metrics import peak_memory_bytes, reset_peak_memory
from llmsplit.train.objectives import token_loss
from llmsplit.train.trainer import lr_at


def parse_args(extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    ap.add_argument("--set", action="append", default=[], dest="overrides",
                    help="llmsplit config overrides (model sizes, batch, seq_len, steps)")
    if extra:
        extra(ap)
    return ap.parse_args()


def setup(overrides: list[str]):
    """Config, model config, sampler and thread count, as `llmsplit train` sets them."""
    cfg = load_config(None, overrides)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    mcfg = model_config(cfg, tokenizer.vocab_size)
    sampler = BatchSampler(load_tokens(cfg.data.source, tokenizer), cfg.data.seq_len,
                           cfg.train.global_batch, cfg.train.seed)
    threads = int(os.environ.get("LLMSPLIT_THREADS", "0")) or max(
        1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(threads)
    return cfg, mcfg, sampler


def build_model(mcfg, seed: int) -> Transformer:
    """The full model with llmsplit's weights (identical for every framework)."""
    with torch.device("meta"):
        model = Transformer(mcfg)
    model.to_empty(device="cpu")
    model.init_weights(seed, buffer_device=torch.device("cpu"))
    return model


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def adamw(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr,
                             betas=(0.9, 0.95), eps=1e-8)


def train_loop(cfg, sampler, optimizer, step_fn) -> dict:
    """Run cfg.train.steps steps with llmsplit's learning-rate schedule; step_fn(micro_batches,
    denominator) does forward, backward and the optimizer step and returns this rank's
    loss sum (a tensor). The logged losses then equal `llmsplit train`'s step for step."""
    t = cfg.train
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = t.global_batch // world
    denominator = per_rank * cfg.data.seq_len
    dev = torch.device("cpu")
    times, losses = [], []
    reset_peak_memory(dev)
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sampler.rank_batch(step - 1, rank, world)
        micro = [batch[i:i + t.micro_batch] for i in range(0, per_rank, t.micro_batch)]
        loss_sum = step_fn(micro, denominator).detach().clone()
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / world)
        times.append(time.perf_counter() - t0)
    peak = torch.tensor([peak_memory_bytes(dev)], dtype=torch.int64)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    return {"step_time_s": times, "loss": losses, "peak_mem_bytes_per_rank": [int(p.item()) for p in peaks],
            "tokens_per_step": t.global_batch * cfg.data.seq_len, "world_size": world}


def write(result: dict, out: str) -> None:
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


__all__ = ["parse_args", "setup", "build_model", "param_groups", "adamw", "train_loop", "write", "token_loss"]
