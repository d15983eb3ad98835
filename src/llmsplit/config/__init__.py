"""The run configuration: one dataclass per TOML section (sections.py, data.py, lora.py), read
from TOML with `--set` overrides (toml.py), and `validate()` (checks.py), which refuses every
mistake a user can make before any worker starts; model.py turns [model] into the model's sizes;
keys.py says what each key means (`--help-config`, and the closest key to a mistyped one).

Callers import from here, not from the modules.
"""

from ..errors import ConfigError  # for users who catch it as llmsplit.config.ConfigError
from .checks import CHOICES, layout_of, resolve_world, validate, workload_of
from .data import DataSection, check_data
from .keys import config_keys_text
from .lora import LoraSection, check_lora, check_lora_base
from .model import model_config, record_model_sizes
from .sections import (FINETUNE_DEFAULTS, LORA_LR, CheckpointSection, Config, MemorySection, ModelSection,
                       ParallelSection, TrainSection)
from .toml import config_from_dict, config_from_toml, load_config, set_key, to_toml

__all__ = [
    "CHOICES", "FINETUNE_DEFAULTS", "LORA_LR", "CheckpointSection", "Config", "ConfigError", "DataSection",
    "LoraSection", "MemorySection", "ModelSection", "ParallelSection", "TrainSection", "check_data", "check_lora",
    "check_lora_base", "config_from_dict", "config_from_toml", "config_keys_text", "layout_of", "load_config",
    "model_config", "record_model_sizes", "resolve_world", "set_key", "to_toml", "validate", "workload_of",
]
