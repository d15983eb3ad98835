"""Rotary position embeddings in the Hugging Face "rotate half" layout (so Hugging Face
q/k weights load without permuting), with the rotary scalings transformers computes."""

from __future__ import annotations

import functools
import json
import math

import torch

ROPE_TYPES = ("linear", "dynamic", "llama3", "factors")


@functools.lru_cache(maxsize=16)
def rope_params(scaling: str | None) -> dict | None:
    """The parsed `LlamaConfig.rope_scaling`, checked. Types, as transformers computes them:
    "linear" {factor}; "dynamic" (NTK) {factor, original_max_position_embeddings};
    "llama3" {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings};
    "factors" {factors: one divisor per frequency}, what llama.cpp stores as rope_freqs."""
    if scaling is None:
        return None
    need = {"linear": ("factor",), "dynamic": ("factor", "original_max_position_embeddings"),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "factors": ("factors",)}
    try:
        p = json.loads(scaling)
        missing = [k for k in need[p["rope_type"]] if k not in p]
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"rope scaling {scaling!r} is not one of the types {', '.join(ROPE_TYPES)} "
                         f"written as JSON with a rope_type key") from None
    if missing:
        raise ValueError(f"{p['rope_type']} rope scaling lacks {', '.join(missing)}")
    return p


def rope_inv_freq(head_dim: int, theta: float, scaling: str | None = None, seq_len: int | None = None,
                  device=None) -> torch.Tensor:
    """Rotary inverse frequencies; with `scaling`, rescaled as transformers' Llama does.
    `seq_len` matters only to "dynamic": the length of the longest sequence of the call."""
    p = rope_params(scaling)
    if p is not None and p["rope_type"] == "dynamic" and seq_len is not None:
        orig, factor = p["original_max_position_embeddings"], p["factor"]
        theta = theta * ((factor * max(seq_len, orig) / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if p is None or p["rope_type"] == "dynamic":
        return inv_freq
    if p["rope_type"] == "linear":
        return inv_freq / p["factor"]
    if p["rope_type"] == "factors":
        return inv_freq / torch.tensor(p["factors"], dtype=torch.float32, device=device)
    # llama3: long wavelengths divided by factor, short ones kept, a smooth blend between.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def dynamic_rope_limit(scaling: str | None) -> int | None:
    """For "dynamic" scaling the length up to which plain tables apply, else None."""
    p = rope_params(scaling)
    return p["original_max_position_embeddings"] if p is not None and p["rope_type"] == "dynamic" else None


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None, scaling: str | None = None,
                seq_len: int | None = None):
    inv_freq = rope_inv_freq(head_dim, theta, scaling, seq_len, device)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def model_rope_tables(cfg, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables a `Transformer(cfg)` keeps: [length, head_dim] each, or with
    cfg.rope_local_theta (Gemma 3's sliding layers rotate with a base of their own) the global
    and the local table side by side, [length, 2 * head_dim], so that every caller keeps
    slicing and indexing one table by position."""
    cos, sin = rope_tables(cfg.head_dim, length, cfg.rope_theta, device=device, scaling=cfg.rope_scaling)
    if cfg.rope_local_theta is None:
        return cos, sin
    local_cos, local_sin = rope_tables(cfg.head_dim, length, cfg.rope_local_theta, device=device)
    return torch.cat([cos, local_cos], dim=-1), torch.cat([sin, local_sin], dim=-1)


def rope_table_placeholders(cfg, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised tensors of `model_rope_tables`' shapes, on the default device: what a model
    built on the meta device holds until its weights are loaded."""
    width = cfg.head_dim * (1 if cfg.rope_local_theta is None else 2)
    return torch.empty(length, width), torch.empty(length, width)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_for_heads(cos: torch.Tensor, sin: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables as `apply_rope` broadcasts them over [b, s, heads, head_dim]."""
    if cos.dim() == 2:
        # The caller passes the table from the first position on: under sequence parallel
        # the caller sees only its shard of the sequence, the attention the whole of it.
        return cos[:s][None, :, None, :], sin[:s][None, :, None, :]
    return cos[:, :, None, :], sin[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, head_dim]; cos/sin: [s, head_dim], or [b, s, head_dim] when each
    sequence of the batch is at its own position, or already shaped by `rope_for_heads`."""
    if cos.dim() < 4:
        cos, sin = rope_for_heads(cos, sin, x.shape[1])
    return x * cos.to(x.device, x.dtype) + _rotate_half(x) * sin.to(x.device, x.dtype)
