"""The [data] section of the run configuration and its checks (checks.py calls `check_data`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

FORMATS = ("text", "chat")
LOSS_ON = ("assistant", "all")


@dataclass
class DataSection:
    source: str = "builtin"
    seq_len: int = 256
    tokenizer: str = "byte"
    # "chat": JSONL rows with "messages" or "prompt"/"completion", rendered with the model's chat
    # template and packed whole into sequences (data/chat.py, data/packing.py).
    format: str = "text"
    loss_on: str | None = None  # None: "assistant" for chat, "all" for text
    eval_source: str | None = None  # held-out data in the same form as `source`
    eval_fraction: float = 0.0  # or: this share of the source's documents held out (the last ones)


def check_data(data: DataSection, eval_every: int) -> None:
    """Refuse impossible [data] keys and fill in `loss_on`."""
    if data.format not in FORMATS:
        raise ConfigError(f"data.format={data.format!r} is not one of: {', '.join(map(repr, FORMATS))}")
    if data.loss_on is None:
        data.loss_on = "assistant" if data.format == "chat" else "all"
    if data.loss_on not in LOSS_ON:
        raise ConfigError(f"data.loss_on={data.loss_on!r} is not one of: {', '.join(map(repr, LOSS_ON))}")
    if data.loss_on == "assistant" and data.format != "chat":
        raise ConfigError("data.loss_on=\"assistant\" needs data.format=\"chat\" (plain text has no assistant "
                          "turns); set data.format=\"chat\" or data.loss_on=\"all\"")
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={data.eval_fraction} must be at least 0 and below 1")
    if data.eval_fraction > 0 and data.eval_source:
        raise ConfigError("data.eval_source and data.eval_fraction are both set; hold out data one way: "
                          "remove one of them")
    if eval_every < 0:
        raise ConfigError(f"train.eval_every={eval_every} must be at least 0 (0 = never)")
    if eval_every > 0 and not (data.eval_source or data.eval_fraction > 0):
        raise ConfigError(f"train.eval_every={eval_every} needs held-out data: set data.eval_source or "
                          f"data.eval_fraction")
