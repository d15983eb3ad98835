"""Integer weights and their group scales, from GGUF blocks or from float weights.

`Groups` is the one intermediate form every source goes through before packing: values
`q` in [0, 15] (uint8, one per weight) with a scale and a zero per group of `group` inputs,
meaning w = (q - 8) * scale + zero, which is the affine form PyTorch's int4 kernels use.

GGUF types and what they become (docs/quantization.md has the table):
- Q4_0 (w = d * (q - 8), 32 per block): scale d, zero 0. Same weights.
- Q4_1 (w = d * q + m): scale d, zero m + 8 d. Same weights.
- Q4_K (256-value super-blocks of 8 sub-blocks of 32, 6-bit sub-scales and mins):
  scale d * sc, zero 8 d sc - dmin * m per sub-block. Same weights.
- Q8_0 (w = d * q, q an int8): split into two nibbles, q + 128 = 16 hi + lo, which are two
  int4 matrices side by side over twice the inputs (the input is fed twice): hi with scale
  16 d and zero 0, lo with scale d and zero 8 d. Same weights, one kernel, 8 bits a weight;
  packed where int4_matmul.cpp runs, only d is kept (`kernels.pack_int4`), as in the file.
  (`_weight_int8pack_mm` takes one scale per output row only, so it cannot hold Q8_0's
  per-block scales without requantizing.)
Every other type (F32, F16, BF16, Q5_*, Q2_K, Q3_K, Q5_K, Q6_K) is widened to the compute
dtype as before: their values do not fit 4 bits, or their groups of 16 are smaller than
the smallest group the CPU kernel takes (32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PACKED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
KERNEL_GROUPS = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts


@dataclass
class Groups:
    q: torch.Tensor  # uint8 [rows, cols], values 0..15
    scale: torch.Tensor  # float32 [rows, cols // group]
    zero: torch.Tensor  # float32 [rows, cols // group]
    group: int
    doubled: bool = False  # Q8_0: columns [0, in) are the high nibbles, [in, 2 in) the low ones

    @property
    def in_features(self) -> int:
        return self.q.shape[1] // (2 if self.doubled else 1)

    def rows(self, index: torch.Tensor | slice) -> Groups:
        return Groups(self.q[index], self.scale[index], self.zero[index], self.group, self.doubled)

    def dequantize(self) -> torch.Tensor:
        r, c = self.q.shape
        w = ((self.q.view(r, -1, self.group).float() - 8) * self.scale[..., None] + self.zero[..., None]).view(r, c)
        if self.doubled:
            w = w[:, :c // 2] + w[:, c // 2:]
        return w

    def column_chunk(self, index: int, parts: int) -> Groups:
        """Inputs [index / parts, (index + 1) / parts) of every row, along whole groups."""
        k = self.in_features
        size = k // parts
        if k % parts or size % self.group:
            raise ValueError(f"{parts} shards of {k} inputs do not fall on whole groups of {self.group}")
        lo, hi = index * size, (index + 1) * size
        cols = torch.arange(lo, hi)
        if self.doubled:
            cols = torch.cat([cols, cols + k])
        g = cols[::self.group] // self.group
        return Groups(self.q[:, cols], self.scale[:, g], self.zero[:, g], self.group, self.doubled)


def _f16(raw: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw[:, start:start + 2]).view(np.float16).astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[blocks, 16] bytes -> [blocks, 32] values: low nibbles first, then high ones (ggml's order).
    In numpy: a torch.cat of 16-wide rows was most of a load's time."""
    out = np.empty((qs.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(qs, 15, out=out[:, :16])
    np.right_shift(qs, 4, out=out[:, 16:])
    return torch.from_numpy(out)


def from_gguf_blocks(kind: str, raw: np.ndarray, rows: int, cols: int) -> Groups:
    """A GGUF tensor's raw bytes ([rows, bytes per row], as `gguf.GGUFReader` maps them)."""
    blocks = cols // (256 if kind == "Q4_K" else 32)
    raw = raw.reshape(rows * blocks, -1)
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(raw, 0)
        off = 2 if kind == "Q4_0" else 4
        q = _nibbles(raw[:, off:off + 16])
        zero = torch.zeros_like(d) if kind == "Q4_0" else _f16(raw, 2) + 8 * d
        return Groups(q.reshape(rows, cols), d.reshape(rows, -1), zero.reshape(rows, -1), 32)
    if kind == "Q8_0":
        d = _f16(raw, 0).reshape(rows, -1)
        u = (np.ascontiguousarray(raw[:, 2:34]) ^ np.uint8(128)).reshape(rows, cols)  # int8 q + 128, as uint8
        q = torch.from_numpy(np.concatenate([u >> 4, u & 15], axis=1))
        return Groups(q, torch.cat([16 * d, d], 1), torch.cat([torch.zeros_like(d), 8 * d], 1), 32, doubled=True)
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        d, dmin = _f16(raw, 0), _f16(raw, 2)
        sc, m = (torch.from_numpy(x.astype(np.float32)) for x in Q4_K.get_scale_min(raw[:, 4:16]))
        qs = raw[:, 16:144].reshape(-1, 4, 1, 32)
        q = torch.from_numpy(np.concatenate([qs & 15, qs >> 4], axis=2))  # [blocks, 4, 2, 32]: sub-blocks 2j, 2j+1
        scale = d * sc
        return Groups(q.reshape(rows, cols), scale.reshape(rows, -1), (8 * scale - dmin * m).reshape(rows, -1), 32)
    raise ValueError(f"GGUF type {kind} is not kept packed")


def from_float(w: torch.Tensor, group: int) -> Groups:
    """Asymmetric int4 per group of `group` inputs, min/max (as gpt-fast's int4 weight-only).
    Shrinking each group's range to its least squared error was tried and was worse on
    SmolLM2-135M (+9.2% perplexity against +5.9%), so the plain range stays."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"a group size of {group} does not divide the {cols} inputs")
    g = w.float().reshape(rows, -1, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return Groups(q.reshape(rows, cols), scale, lo + 8 * scale, group)


def int8_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output row (what _weight_int8pack_mm takes)."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale
