"""The [lora] section of the run configuration and its checks (config.py calls `check_lora`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

TARGET_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class LoraSection:
    rank: int = 0  # 0 = off: every parameter trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    targets: str = "q,k,v,o,gate,up,down"
    base: str = "none"  # "nf4" | "int8" (QLoRA) are reserved names, not yet available
    init: str | None = None  # a PEFT adapter folder, or a LoRA run (or checkpoint), to start the adapters from


def check_lora(lora: LoraSection) -> None:
    if lora.rank < 0:
        raise ConfigError(f"lora.rank={lora.rank} must be at least 0 (0 = no LoRA, every parameter trains)")
    if lora.rank == 0:
        return
    if not lora.alpha > 0:
        raise ConfigError(f"lora.alpha={lora.alpha} must be greater than 0")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout={lora.dropout} must be at least 0 and below 1")
    targets = [t.strip() for t in lora.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGET_NAMES]
    if unknown or not targets:
        raise ConfigError(f"lora.targets={lora.targets!r} must be a comma-separated list of: {', '.join(TARGET_NAMES)}")
    if lora.base != "none":
        raise ConfigError(f"lora.base={lora.base!r}: a quantized base (QLoRA) is not available in this version; "
                          f"remove lora.base")
    if lora.init is not None and not Path(lora.init).exists():
        raise ConfigError(f"lora.init={lora.init!r} does not exist; pass a PEFT adapter folder (adapter_config.json) "
                          f"or a LoRA run folder or checkpoint")
