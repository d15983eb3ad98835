"""`validate()`: refuses every mistake a user can make before any worker starts, and fills in
the derived values. The splitting rules are `layout.check`'s; this adds the keys that are not
about splitting.

Every error is a `ConfigError` whose message is one sentence naming the key, the value
and what is allowed; the command line turns it into exit status 2.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from ..layout import PRECISIONS, SPLIT_BACKWARD_SCHEDULES, Layout, Workload, check, resolve_dp
from .data import check_data
from .lora import check_lora, check_lora_base
from .objective import check_objective
from .sections import Config

# The [parallel] and [memory] choices are layout.check's.
CHOICES = {"train.lr_schedule": ("cosine", "linear", "constant"), "train.precision": PRECISIONS}


def resolve_world(cfg: Config, world_size: int) -> None:
    """Fill in `parallel.dp` (and sequence_parallel) from the world size, or refuse the layout."""
    par = cfg.parallel
    par.dp = resolve_dp(par.dp, par.tp, par.pp, world_size, par.cp)
    if par.sequence_parallel is None:
        par.sequence_parallel = par.tp > 1


def layout_of(cfg: Config, world_size: int) -> Layout:
    """The layout a training config runs. Sequence parallel stays at its default (None) when
    the config has the default, so that a planner changing tp keeps the default."""
    par, mem = cfg.parallel, cfg.memory
    dp = par.dp if par.dp > 0 else resolve_dp(-1, par.tp, par.pp, world_size, par.cp)
    sp = None if par.sequence_parallel in (None, par.tp > 1) else par.sequence_parallel
    return Layout(dp=dp, dp_replicate=par.dp_replicate, zero=par.zero, tp=par.tp, sequence_parallel=sp, pp=par.pp,
                  pp_schedule=par.pp_schedule, pp_virtual_stages=par.pp_virtual_stages,
                  pp_microbatches=par.pp_microbatches, micro_batch=cfg.train.micro_batch, ep=par.ep,
                  cp=par.cp, cp_mode=par.cp_mode,
                  activation_checkpoint=mem.activation_checkpoint, offload=mem.offload)


def workload_of(cfg: Config, seq_len: int | None = None, global_batch: int | None = None,
                precision: str | None = None) -> Workload:
    """The training run `cfg` describes, as the layout rules and the planner see it; `llmsplit
    plan`'s --seq-len, --global-batch and --precision in place of the config's values."""
    seq_len = seq_len or cfg.data.seq_len
    global_batch = global_batch or cfg.train.global_batch
    return Workload(seq_len=seq_len, global_batch=global_batch, precision=precision or cfg.train.precision,
                    lora_rank=cfg.lora.rank, lora_targets=cfg.lora.targets, lora_base=cfg.lora.base,
                    rows_per_sample=2 if cfg.train.objective == "dpo" else 1, compile=cfg.train.compile,
                    teacher_params=cfg.train.teacher_params if cfg.train.teacher else 0,
                    **_rollout(cfg, seq_len, global_batch))


def _rollout(cfg: Config, seq_len: int, global_batch: int) -> dict:
    """A GRPO run's engine as the planner counts it: every completion of a step within
    data.seq_len (the worker refuses a longest prompt + grpo.max_completion_tokens beyond it)."""
    if cfg.train.objective != "grpo":
        return {}
    return {"rollout_rows": global_batch, "rollout_context": seq_len,
            "rollout_reference": cfg.grpo.beta > 0 and not cfg.lora.rank}


def validate(cfg: Config, world_size: int, model_cfg=None, tokenizer_vocab: int | None = None) -> None:
    """Refuse what cannot run, before any worker starts. Fills in derived values. The
    splitting rules are `layout.check`'s; this adds the keys that are not about splitting."""
    t, mem = cfg.train, cfg.memory
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(repr, allowed))}")
    for key, low in (("train.steps", 1), ("train.global_batch", 1), ("train.micro_batch", 1), ("train.warmup_steps", 0),
                     ("train.weight_decay", 0), ("train.grad_clip", 0), ("train.log_every", 1), ("train.seed", 0),
                     ("data.seq_len", 2), ("checkpoint.every", 0), ("checkpoint.keep", 1), ("train.profile_steps", 0),
                     ("parallel.dp_replicate", 1), ("parallel.pp_virtual_stages", 1), ("train.moe_aux_loss", 0)):
        _at_least(cfg, key, low)
    if cfg.checkpoint.every_seconds < 0:
        raise ConfigError(f"checkpoint.every_seconds={cfg.checkpoint.every_seconds} must be at least 0 (0 = off)")
    if mem.limit_bytes is not None:
        _at_least(cfg, "memory.limit_bytes", 1)
    if not t.lr > 0:
        raise ConfigError(f"train.lr={t.lr} must be greater than 0")
    if not t.timeout_s > 0:
        raise ConfigError(f"train.timeout_s={t.timeout_s} must be greater than 0 (seconds)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be between 0 and 1")
    check_objective(cfg)
    check_data(cfg.data, t.eval_every)
    if t.eval_every and cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(f"train.eval_every with parallel.pp_schedule={cfg.parallel.pp_schedule!r}: torch cannot run "
                          f"that schedule forward-only; evaluate with \"1f1b\", \"gpipe\" or \"interleaved_1f1b\"")
    if t.objective == "dpo" and cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(f"train.objective=\"dpo\" with parallel.pp_schedule={cfg.parallel.pp_schedule!r}: the reference "
                          f"log-probs need a forward-only pass, which torch cannot run with that schedule; use "
                          f"\"1f1b\", \"gpipe\" or \"interleaved_1f1b\"")
    check_lora(cfg.lora)
    resolve_world(cfg, world_size)
    check(model_cfg, layout_of(cfg, world_size), workload_of(cfg), world_size)
    if model_cfg is not None:
        check_lora_base(cfg.lora, model_cfg)
    if mem.offload == "nvme":
        _check_offload_dir(mem.offload_dir)
    _check_precision_supported(t.precision)
    if model_cfg is not None and tokenizer_vocab is not None and model_cfg.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer_vocab} tokens; raise model.vocab_size or remove it")


def _check_offload_dir(path: str | None) -> None:
    if not path:
        raise ConfigError("memory.offload=\"nvme\" needs memory.offload_dir set to a writable folder")
    if not Path(path).is_dir():
        raise ConfigError(f"memory.offload_dir={path!r} is not an existing folder; create it or point it at one")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"memory.offload_dir={path!r} is not writable; choose a folder you can write to")


def _check_precision_supported(precision: str) -> None:
    """bf16/fp16 need a device that computes in them: the training device is the GPU when
    there is one, else the CPU."""
    if precision == "fp32":
        return
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if torch.cuda.is_available():
        ok = torch.cuda.is_bf16_supported() if precision == "bf16" else torch.cuda.get_device_capability() >= (5, 3)
    else:
        ok = _autocast_supports("cpu", dtype)
    if not ok:
        raise ConfigError(f"train.precision={precision!r} is not supported on this device; "
                          f"use train.precision=\"fp32\"")


def _autocast_supports(device_type: str, dtype) -> bool:
    # torch's own rule: autocast disables itself (with a warning) for a dtype the device lacks.
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device_type, dtype=dtype):
            return torch.is_autocast_enabled(device_type)


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _at_least(cfg: Config, dotted: str, low) -> None:
    value = _get(cfg, dotted)
    if value < low:
        raise ConfigError(f"{dotted}={value} must be at least {low}")
