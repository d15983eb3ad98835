"""Packed int8/int4 weights: GGUF blocks repacked once at load, or float weights quantized at
load, kept packed up to PyTorch's own weight-only matmuls (`packed.PackedWeight`)."""

from __future__ import annotations

import torch

from .formats import KERNEL_GROUPS, PACKED_GGUF_TYPES, Groups, from_float, from_gguf_blocks, int8_per_row
from .sizes import INT4_GROUP, MODES, is_matmul_weight, kind_for, packed_nbytes
from .packed import PackedWeight, held_bytes

__all__ = ["KERNEL_GROUPS", "MODES", "PACKED_GGUF_TYPES", "PackedWeight", "held_bytes", "is_matmul_weight",
           "kind_for", "packed_nbytes",
           "pack_groups", "quantize", "from_gguf_blocks"]


def pack_groups(g: Groups) -> PackedWeight:
    return PackedWeight.from_groups(g)


def quantize(w: torch.Tensor, mode: str, group: int = INT4_GROUP) -> PackedWeight:
    """A float weight [out, in] quantized at load: int8 with one scale per output row, or
    int4 with a scale and zero per `group` inputs."""
    if mode == "int8":
        return PackedWeight.int8(*int8_per_row(w))
    assert mode == "int4", mode
    if group not in KERNEL_GROUPS:
        raise ValueError(f"an int4 group of {group} is not one the CPU kernel takes ({KERNEL_GROUPS})")
    return PackedWeight.from_groups(from_float(w, group))
