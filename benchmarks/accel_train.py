"""Hugging Face Accelerate training on the same model, batch and optimizer as `llmsplit train`.

Run by `python -m benchmarks peers` under `accelerate launch --multi_gpu --num_processes N`
(torchrun workers; on a CPU-only machine `Accelerator(cpu=True)` selects MULTI_CPU: gloo and
DDP), or with `--use_fsdp --fsdp_version 2` for its FSDP2 path (full sharding).
"""

import torch
import torch.distributed as dist
from accelerate import Accelerator

from peer_common import adamw, build_model, parse_args, setup, token_loss, train_loop, write


def main():
    args = parse_args()
    cfg, mcfg, sampler = setup(args.overrides)
    t = cfg.train
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    # Without cpu=True a CPU-only machine gets DistributedType.NO: no DDP, no gradient sync.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              gradient_accumulation_steps=(t.global_batch // world) // t.micro_batch)
    model = build_model(mcfg, t.seed)
    optimizer = adamw(model, cfg)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(micro, denominator):
        loss_sum = 0.0
        for mb in micro:
            with accelerator.accumulate(model):
                loss = token_loss(model(mb[:, :-1]), mb[:, 1:], denominator)
                # Accelerate divides by the accumulation steps; token_loss already divides
                # by the rank's whole batch, so undo it to keep the same gradients.
                accelerator.backward(loss * accelerator.gradient_accumulation_steps)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), t.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum = loss_sum + loss.detach()
        return loss_sum

    result = train_loop(cfg, sampler, optimizer, step)
    result["wrapper"] = type(model).__name__
    write(result, args.out)
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
