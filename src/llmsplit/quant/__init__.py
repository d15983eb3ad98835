"""Packed int8/int4 weights: GGUF blocks repacked once at load, or float weights quantized at
load, kept packed up to PyTorch's own weight-only matmuls (`packed.PackedWeight`)."""

from __future__ import annotations

import torch

from .formats import KERNEL_GROUPS, PACKED_GGUF_TYPES, Groups, from_float, from_gguf_blocks, int8_per_row
from .kernels import ROW_ALIGN
from .packed import PackedWeight, held_bytes

__all__ = ["KERNEL_GROUPS", "MODES", "PACKED_GGUF_TYPES", "PackedWeight", "held_bytes", "is_matmul_weight",
           "kind_for", "packed_nbytes",
           "pack_groups", "quantize", "from_gguf_blocks"]

MODES = ("int8", "int4", "none")
INT4_GROUP = 32  # the smallest group the CPU kernel takes: the best int4 quality it offers


def is_matmul_weight(name: str) -> bool:
    """The weights kept packed: every linear layer's, the head's and the embedding's (a
    lookup dequantizes just the rows it reads). Norms and biases stay float."""
    return name.endswith("weight") and "norm" not in name


def kind_for(name: str, mode: str) -> str:
    """The packing `--quantize mode` gives weight `name`: int4 keeps the embedding and the head
    at int8 (one scale a row), as llama.cpp's 4-bit schemes keep the output in more bits. On
    SmolLM2-135M (tied): all int4 +5.9% perplexity over fp32, int4 with an int8
    embedding/head +0.17%, for 92.5 instead of 82.3 MiB (BENCHMARKS.md)."""
    if mode == "int4" and name in ("tok_embeddings.weight", "output.weight"):
        return "int8"
    return mode


def packed_nbytes(shape: tuple[int, int], kind: str) -> int:
    """Bytes a weight [out, in] takes packed as `kind`: "int4" (groups of 32), "q8_0" (two
    nibble matrices), "int8" (one bf16 scale a row); rows padded as the int4 layout pads them."""
    n, k = shape
    rows = -(-n // ROW_ALIGN) * ROW_ALIGN
    if kind == "int8":
        return n * k + 2 * n
    k = 2 * k if kind == "q8_0" else k
    return rows * k // 2 + rows * (k // INT4_GROUP) * 4


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
