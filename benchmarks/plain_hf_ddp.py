"""The plain torchrun + DDP + transformers fine-tuning loop a user would write by hand: the
baseline for `python -m benchmarks finetune`.

Same folder, tokens, batch, micro-batch, sequence length, AdamW (no decay on 1-D tensors,
betas 0.9/0.95), gradient clipping and fp32 as `llmsplit train --set model.hf=FOLDER`.
The batches are llmsplit's (the same windows of the same corpus), so only the model code
and the training loop differ.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaForCausalLM

from llmsplit.data.corpus import load_tokens
from llmsplit.data.loader import BatchSampler
from llmsplit.io.tokenizer import load_tokenizer
from llmsplit.train.metrics import peak_memory_bytes, reset_peak_memory


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="Hugging Face Llama folder")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--lora-rank", type=int, default=0, help="train PEFT LoRA adapters of this rank on every "
                    "linear layer (alpha 16), the base frozen (needs peft importable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile-dir", help="write a torch.profiler trace of step 3 (after the warm-up) per rank here")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)  # sdpa attention by default
    model.train()
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=16, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model = DDP(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    sampler = BatchSampler(load_tokens("builtin", load_tokenizer(args.model)), args.seq_len, args.global_batch, 0)
    per_rank = args.global_batch // world
    n_micro = per_rank // args.micro_batch
    times, losses = [], []
    # The peak is measured from here, as `llmsplit train` measures it (reset before step 1, after
    # the load, the adapters, the DDP wrap and the optimizer): both exclude loading and setup.
    reset_peak_memory(torch.device("cpu"))
    for step in range(args.steps):
        prof = None
        if args.profile_dir and step == 2:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.start()
        t0 = time.perf_counter()
        batch = sampler.rank_batch(step, rank, world)
        loss_sum = torch.zeros(())
        for i in range(n_micro):
            mb = batch[i * args.micro_batch:(i + 1) * args.micro_batch]
            ctx = model.no_sync() if i < n_micro - 1 else torch.enable_grad()
            with ctx:
                logits = model(input_ids=mb[:, :-1]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten()) / n_micro
                loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / world)
        times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.stop()
            os.makedirs(args.profile_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.profile_dir, f"rank{rank}.pt.trace.json"))
    peak = peak_memory_bytes(torch.device("cpu"))  # VmHWM since the reset: the training steps' peak
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_time_s": times, "loss": losses, "peak_mem_bytes": peaks,
                       "tokens_per_step": args.global_batch * args.seq_len}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
