"""DeepSpeed ZeRO-2/3 training on the same model, batch and optimizer as `llmsplit train`.

Run by `python -m benchmarks peers` under torchrun, on CPU: DS_ACCELERATOR=cpu, gloo,
fp32, the client's torch AdamW (DeepSpeed's fused CPU Adam is not used: `torch_adam`).
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from peer_common import adamw, build_model, parse_args, setup, token_loss, train_loop, write  # noqa: E402


def main():
    args = parse_args(lambda ap: ap.add_argument("--stage", type=int, choices=(1, 2, 3), required=True))
    deepspeed.init_distributed(dist_backend="gloo")
    cfg, mcfg, sampler = setup(args.overrides)
    t = cfg.train
    world = dist.get_world_size()
    per_rank = t.global_batch // world
    ds_config = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": per_rank // t.micro_batch,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": args.stage},
        "torch_adam": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    model = build_model(mcfg, t.seed)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model, cfg), config=ds_config)
    del model

    def step(micro, denominator):
        loss_sum = 0.0
        for mb in micro:
            loss = token_loss(engine(mb[:, :-1]), mb[:, 1:], denominator)
            # DeepSpeed divides the loss by the accumulation steps; token_loss already
            # divides by the rank's whole batch, so undo it to keep the same gradients.
            engine.backward(loss * engine.gradient_accumulation_steps(), scale_wrt_gas=True)
            engine.step()
            loss_sum = loss_sum + loss.detach()
        return loss_sum

    write(train_loop(cfg, sampler, engine.optimizer, step), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
