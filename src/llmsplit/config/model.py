"""The model's sizes a run config names: its preset with every explicit [model] size on top,
and the resolved sizes written back so that a run's config.toml rebuilds the same model."""

from __future__ import annotations

from dataclasses import fields

from ..errors import ConfigError
from ..models.llama import LlamaConfig
from .sections import Config


def model_config(cfg: Config, tokenizer_vocab: int | None = None):
    """The model's sizes: the preset, with every explicitly set size on top.

    Without an explicit `model.vocab_size` the embedding grows to cover the tokenizer
    (rounded up to a multiple of 8, which tensor parallel splits evenly).
    """
    from ..models.presets import PRESETS

    m = cfg.model
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset={m.preset!r} is not one of: {', '.join(map(repr, PRESETS))}")
    sizes = dict(PRESETS[m.preset])
    explicit = {f.name: getattr(m, f.name) for f in fields(m)
                if f.name not in ("preset", "hf", "gguf") and getattr(m, f.name) is not None}
    for key, value in explicit.items():
        if key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len",
                   "head_dim") and value < 1:
            raise ConfigError(f"model.{key}={value} must be at least 1")
        if key in ("rope_theta", "norm_eps") and not value > 0:
            raise ConfigError(f"model.{key}={value} must be greater than 0")
        if key == "rope_scaling":
            from ..models.rope import rope_params

            try:
                rope_params(value)
            except ValueError as e:
                raise ConfigError(f"model.rope_scaling: {e}") from None
    if "n_heads" in explicit and "n_kv_heads" not in explicit:
        sizes["n_kv_heads"] = explicit["n_heads"]
    sizes.update(explicit)
    if tokenizer_vocab is not None and "vocab_size" not in explicit:
        sizes["vocab_size"] = max(sizes["vocab_size"], -(-tokenizer_vocab // 8) * 8)
    return LlamaConfig(**sizes)


def record_model_sizes(cfg: Config, model_cfg) -> None:
    """Write the resolved sizes into the config, so the run's config.toml says exactly
    what was built (and rebuilds the same model when read back). A head_dim that is just
    dim // n_heads stays derived, so a copy of the file edited to other dim or n_heads
    builds heads of the new size, not the old one's."""
    for f in fields(cfg.model):
        if f.name not in ("preset", "hf", "gguf") and hasattr(model_cfg, f.name):
            setattr(cfg.model, f.name, getattr(model_cfg, f.name))
    if model_cfg.head_dim == model_cfg.dim // model_cfg.n_heads:
        cfg.model.head_dim = None
