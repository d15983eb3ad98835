"""Plain PyTorch models. Nothing here imports the rest of llmsplit."""

from .llama import LlamaConfig, Transformer
from .presets import PRESETS, preset_config

__all__ = ["LlamaConfig", "Transformer", "PRESETS", "preset_config"]
