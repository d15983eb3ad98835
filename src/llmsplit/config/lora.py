"""The [lora] section of the run configuration and its checks (checks.py calls them)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

TARGET_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class LoraSection:
    rank: int = 0  # 0 = off: every parameter trains
    alpha: float | None = None  # the update is scaled by alpha / rank; None: 2 x rank (a scale of 2)
    dropout: float = 0.0
    targets: str = "q,k,v,o,gate,up,down"
    base: str = "none"  # "nf4" | "int8": the frozen base stored 4-bit / 8-bit (QLoRA, adapters/qlora.py)
    init: str | None = None  # a PEFT adapter folder, or a LoRA run (or checkpoint), to start the adapters from


BASES = ("none", "nf4", "int8")


def check_lora(lora: LoraSection) -> None:
    if lora.rank < 0:
        raise ConfigError(f"lora.rank={lora.rank} must be at least 0 (0 = no LoRA, every parameter trains)")
    if lora.base not in BASES:
        raise ConfigError(f"lora.base={lora.base!r} is not one of: {', '.join(map(repr, BASES))}")
    if lora.rank == 0:
        if lora.base != "none":
            raise ConfigError(f"lora.base={lora.base!r} quantizes the frozen base of LoRA; set lora.rank (e.g. 16) "
                              f"or remove lora.base")
        return
    if lora.alpha is None:
        # A scale of 2 whatever the rank (torchtune's and TRL's recipes: alpha 16 at rank 8, 32 at
        # 16): at the LoRA lr 2e-4, guide §12's 40 steps on SmolLM2 reach a loss of 0.31 (0.99 at
        # the scale of 1 the fixed alpha 16 gave rank 16).
        lora.alpha = 2.0 * lora.rank
    if not lora.alpha > 0:
        raise ConfigError(f"lora.alpha={lora.alpha} must be greater than 0")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout={lora.dropout} must be at least 0 and below 1")
    targets = [t.strip() for t in lora.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGET_NAMES]
    if unknown or not targets:
        raise ConfigError(f"lora.targets={lora.targets!r} must be a comma-separated list of: {', '.join(TARGET_NAMES)}")
    if lora.base != "none" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"lora.base={lora.base!r} stores the base with torchao, which is not installed; "
                          f"pip install 'llmsplit[qlora]' or remove lora.base")
    if lora.init is not None and not Path(lora.init).exists():
        raise ConfigError(f"lora.init={lora.init!r} does not exist; pass a PEFT adapter folder (adapter_config.json) "
                          f"or a LoRA run folder or checkpoint")


def check_lora_base(lora: LoraSection, model_cfg) -> None:
    """Refuse a quantized base that cannot store this model's layer weights (NF4 packs whole
    blocks), before any worker starts: otherwise torchao's assertion stops every worker at its
    first layer. The rule is adapters/qlora.py's own, asked of the model built on the meta
    device (no memory), so the check and the quantizer see the same weights."""
    if lora.rank == 0 or lora.base == "none":
        return
    import torch

    from ..adapters.qlora import check_base_shapes
    from ..models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    problem = check_base_shapes(model, lora.base)
    if problem is not None:
        raise ConfigError(f"lora.base={lora.base!r} cannot store this model: {problem}; use lora.base=\"int8\" "
                          f"or lora.base=\"none\"")
