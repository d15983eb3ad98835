"""Starting from pretrained weights (`model.hf` / `model.gguf`): the model's sizes and tokenizer
come from them (`use_pretrained_sizes`), and the keys the user did not set take values meant for
adapting a trained model instead of those for training one from random weights.

With the from-scratch defaults (lr 3e-3, 10 warmup steps, weight decay 0.1) three steps on
SmolLM2-135M-Instruct turned "The capital of France is Paris." into nonsense. The fine-tuning
values are those the common fine-tuning tools use for full fine-tuning of small models:
  - lr 2e-5: TRL's `SFTConfig.learning_rate` default ("2e-5 instead of 5e-5", trl/trainer/
    sft_config.py), and torchtune's full fine-tune configs (recipes/configs/llama3_2/
    1B_full_single_device.yaml: `lr: 2e-5`, no warmup);
  - no warmup and no weight decay: transformers' `TrainingArguments` defaults
    (`warmup_steps=0`, `weight_decay=0.0`), which TRL's SFTConfig keeps.
With [lora] on, lr 2e-4 instead: LoRA recipes use 1e-4 to 3e-4 (PEFT's examples, TRL's LoRA
scripts, torchtune's lora configs: `lr: 3e-4`), since B starts at zero and alpha / rank scales the
update; at 2e-5, 20 steps on SmolLM2-135M moved the loss 2.52 -> 2.33, at 5e-4 to 0.003 (issue 51).
"""

from __future__ import annotations

import sys
from dataclasses import fields

from ..config import FINETUNE_DEFAULTS, LORA_LR, Config, record_model_sizes
from ..errors import ConfigError

FROM_SCRATCH_LR = 1e-3  # at or above it, a learning rate is one for training from random weights
# LoRA's usual lr is 1e-4 to 3e-4; a tenth of the one or ten times the other is far outside it.
LORA_USUAL, LORA_FAR = (1e-4, 3e-4), (1e-5, 3e-3)


def finetune_defaults(cfg: Config) -> dict:
    """The fine-tuning values of the keys in FINETUNE_DEFAULTS for this run: LoRA's lr with [lora] on."""
    return {**FINETUNE_DEFAULTS, "train.lr": LORA_LR} if cfg.lora.rank else dict(FINETUNE_DEFAULTS)


def apply_finetune_defaults(cfg: Config, warn: bool = True) -> None:
    """With `model.hf` (or `model.gguf`): give each key of `finetune_defaults` that the user did
    not set its fine-tuning value and say which (on stderr, when `warn`), and warn about an lr
    they did set far outside the usual range for the run (full fine-tuning, or LoRA).
    A key counts as set when a file or --set named it, or when its value is not the default
    (a Config built in Python and changed by attribute)."""
    if not (cfg.model.hf or cfg.model.gguf):
        return
    scratch = Config()
    applied = {}
    for dotted, value in finetune_defaults(cfg).items():
        section, key = dotted.split(".")
        if dotted not in cfg.explicit and getattr(getattr(cfg, section), key) == getattr(getattr(scratch, section), key):
            setattr(getattr(cfg, section), key, value)
            applied[dotted] = value
    weights = "model.hf" if cfg.model.hf else "model.gguf"
    if warn and applied:
        why = {"train.lr": f" (LoRA's: PEFT, TRL and torchtune recipes use {_usual()})" if cfg.lora.rank
               else " (full fine-tuning's: TRL's default, torchtune's recipes)"}
        keys = ", ".join(f"{k}={v:g}{why.get(k, '')}" for k, v in applied.items())
        print(f"llmsplit: {weights} holds trained weights, so the keys not set take fine-tuning values: {keys}",
              file=sys.stderr, flush=True)
    problem = _lr_problem(cfg, weights)
    if warn and problem:
        print(f"llmsplit: warning: {problem}", file=sys.stderr, flush=True)


def _lr_problem(cfg: Config, weights: str) -> str | None:
    """What is wrong with an lr far outside the usual range of the run's kind, or None."""
    lr = cfg.train.lr
    if not cfg.lora.rank:
        if lr < FROM_SCRATCH_LR:
            return None
        return (f"train.lr={lr:g} is a learning rate for training from random weights; fine-tuning the weights of "
                f"{weights} with it can destroy what they learned (leave train.lr unset for the fine-tuning default "
                f"{FINETUNE_DEFAULTS['train.lr']:g})")
    if LORA_FAR[0] <= lr < LORA_FAR[1]:
        return None
    high = lr >= LORA_FAR[1]
    side, effect = ("above", "the adapters can diverge") if high else ("below", "the adapters barely learn")
    return (f"train.lr={lr:g} is far {side} LoRA's usual {_usual()} (PEFT, TRL and torchtune recipes): {effect} "
            f"(leave train.lr unset for the LoRA default {LORA_LR:g})")


def _usual() -> str:
    return " to ".join(f"{x:.0e}".replace("e-0", "e-") for x in LORA_USUAL)  # "1e-4 to 3e-4"


def use_pretrained_sizes(cfg: Config) -> None:
    """`model.hf` / `model.gguf`: the model's sizes come from the folder's config.json or the
    file's metadata (explicit size keys would contradict the weights) and, unless one is
    named, its tokenizer is the folder's (the file's)."""
    from ..io.weights import pretrained_weights

    source = pretrained_weights(cfg)  # reads only the metadata and tensor headers
    key = "model.hf" if cfg.model.hf else "model.gguf"
    for f in fields(cfg.model):
        if f.name not in ("preset", "hf", "gguf") and getattr(cfg.model, f.name) is not None \
                and getattr(cfg.model, f.name) != getattr(source.config, f.name):
            raise ConfigError(f"model.{f.name} cannot be set together with {key} (its config says "
                              f"{getattr(source.config, f.name)}); remove model.{f.name}")
    record_model_sizes(cfg, source.config)
    if cfg.data.tokenizer == "byte":
        cfg.data.tokenizer = str(cfg.model.hf or cfg.model.gguf)
