"""Defaults for fine-tuning: when `model.hf` loads pretrained weights, the keys the user did
not set take values meant for adapting a trained model instead of those for training one
from random weights.

With the from-scratch defaults (lr 3e-3, 10 warmup steps, weight decay 0.1) three steps on
SmolLM2-135M-Instruct turned "The capital of France is Paris." into nonsense. The fine-tuning
values are those the common fine-tuning tools use for full fine-tuning of small models:
  - lr 2e-5: TRL's `SFTConfig.learning_rate` default ("2e-5 instead of 5e-5", trl/trainer/
    sft_config.py), and torchtune's full fine-tune configs (recipes/configs/llama3_2/
    1B_full_single_device.yaml: `lr: 2e-5`, no warmup);
  - no warmup and no weight decay: transformers' `TrainingArguments` defaults
    (`warmup_steps=0`, `weight_decay=0.0`), which TRL's SFTConfig keeps.
"""

from __future__ import annotations

import sys

from ..config import Config

FINETUNE_DEFAULTS = {"train.lr": 2e-5, "train.warmup_steps": 0, "train.weight_decay": 0.0}
FROM_SCRATCH_LR = 1e-3  # at or above it, a learning rate is one for training from random weights


def apply_finetune_defaults(cfg: Config, warn: bool = True) -> None:
    """With `model.hf`: give each key of FINETUNE_DEFAULTS that the user did not set its
    fine-tuning value, and warn (on stderr, when `warn`) about a from-scratch lr they did set.
    A key counts as set when a file or --set named it, or when its value is not the default
    (a Config built in Python and changed by attribute)."""
    if not (cfg.model.hf or cfg.model.gguf):
        return
    scratch = Config()
    for dotted, value in FINETUNE_DEFAULTS.items():
        section, key = dotted.split(".")
        if dotted not in cfg.explicit and getattr(getattr(cfg, section), key) == getattr(getattr(scratch, section), key):
            setattr(getattr(cfg, section), key, value)
    if warn and cfg.train.lr >= FROM_SCRATCH_LR:
        print(f"llmsplit: warning: train.lr={cfg.train.lr:g} is a learning rate for training from random weights; "
              f"fine-tuning the weights of model.hf with it can destroy what they learned (leave train.lr unset "
              f"for the fine-tuning default {FINETUNE_DEFAULTS['train.lr']:g})", file=sys.stderr, flush=True)
