"""Paged KV storage (as in vLLM's PagedAttention) for the layers one process holds: K and V
pools of fixed-size blocks per layer, on the device where that layer runs. Which blocks belong
to which sequence is the engine's bookkeeping (engine/block_manager.py); each step it hands
every process a `Step` (engine/step.py: where the new keys go, where each sequence's keys are,
the mask), which this storage applies. Decode attention on CPU reads each sequence's slots in
place (`paged_attention`, a kernel of llmsplit's own: PyTorch has none); everywhere else
attention reads a sequence's keys by gathering its slots, one indexed copy per layer, for the
model's own attention (SDPA).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..engine.step import PackedStep, Step
from . import paged_attention


def kv_element_bytes(dtype_bytes: int, head_dim: int, kv_dtype: str | None) -> float:
    """Bytes one key (or value) element takes in the pool: the compute dtype's, bfloat16's 2, or
    int8's 1 plus its share of the float32 scale each (token, head) has."""
    return 1 + 4 / head_dim if kv_dtype == "int8" else 2 if kv_dtype == "bfloat16" else dtype_bytes


class PagedKVCache:
    """K and V pools for the layers one process holds: [blocks * block_size, kv_heads, head_dim]
    per layer, on the device where that layer runs.

    `kv_dtype="int8"`: the pools hold int8 with a float32 scale per (token, head) in
    `k_scale`/`v_scale` ([blocks * block_size, kv_heads]), symmetric (amax / 127), as vLLM's
    and llama.cpp's 8-bit KV caches scale per token and head; stored as the step writes them,
    widened to `dtype` as attention reads them. head_dim 64: 68 bytes a (token, head) against
    256 in float32 and 128 in bfloat16.

    `kv_dtype="bfloat16"` under a float32 compute dtype (the CPU's): the pools hold bfloat16 (as
    llama.cpp's f16 cache) and attention reads them widened to float32. Decoding many long
    sequences is bound by the bytes of keys and values read (46 KB a token for SmolLM2-135M
    in float32, every step), and SDPA's own bfloat16 kernel is slower on CPUs without AMX than
    gathering half the bytes and widening them: 32 streams of 100-1,200 tokens, one layer's
    decode attention 3.5 against 5.0 ms on 2 cores (benchmarks/serve.py, BENCHMARKS.md). The
    paged decode kernel reads either narrow pool in place, widening each value as it reads it
    (the same layer: 2.0 ms in bfloat16, 2.3 in float32)."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 layer_devices: dict[int, torch.device], dtype: torch.dtype, kv_dtype: str | None = None):
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.dtype, self.quantized = dtype, kv_dtype == "int8"
        stored = torch.int8 if self.quantized else torch.bfloat16 if kv_dtype == "bfloat16" else dtype
        self.k = {i: torch.zeros(shape, device=d, dtype=stored) for i, d in layer_devices.items()}
        self.v = {i: torch.zeros(shape, device=d, dtype=stored) for i, d in layer_devices.items()}
        scales = {i: torch.ones(shape[:2], device=d) for i, d in layer_devices.items()} if self.quantized else {}
        self.k_scale, self.v_scale = scales, {i: s.clone() for i, s in scales.items()}
        self._step: Step | None = None
        self._on: dict[torch.device, tuple] = {}

    def pools(self) -> list[torch.Tensor]:
        return [*self.k.values(), *self.v.values(), *self.k_scale.values(), *self.v_scale.values()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pools())

    def set_step(self, step: Step | PackedStep | None) -> None:
        self._step, self._on = step, {}

    def reads_in_place(self) -> bool:
        """Whether decode attention runs the paged kernel over these pools (CPU, float32 compute):
        it reads each sequence's own keys, so decodes need no grouping by length."""
        pools = self.pools()
        return (self.dtype == torch.float32 and all(p.device.type == "cpu" for p in pools)
                and all(p.dtype in paged_attention.KINDS for p in pools) and paged_attention.available())

    @property
    def packed(self) -> bool:
        return isinstance(self._step, PackedStep)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend, rule) -> torch.Tensor:
        """Store the step's new k/v [b, kv_heads, s, head_dim] and attend each sequence's queries
        q [b, heads, s, head_dim] to its own keys; returns [b, s, heads * head_dim]. Under a
        PackedStep q is [1, heads, T, head_dim], each part attends to its own sequences' keys,
        and the result is [1, T, heads * head_dim]. One-token parts on CPU run the paged kernel
        over the pool in place, with `rule` = (scale, softcap, window) of the model's scores, and
        so do one sequence's chunks (its causal prefill kernel); the others gather their keys
        and call the model's `attend(q, k, v, mask, start_pos)`."""
        slots, parts = self._parts(q.device)
        self._store(layer_id, slots, k, v)
        if not self.packed:
            return self._attend_part(layer_id, q, parts[0], attend, rule)
        out, row = [], 0
        for part in parts:
            q_part = q[0, :, row:row + part.rows].unflatten(1, (part.b, -1)).transpose(0, 1)  # [b, heads, s, hd]
            out.append(self._attend_part(layer_id, q_part, part, attend, rule).reshape(part.rows, -1))
            row += part.rows
        return torch.cat(out)[None]

    def _attend_part(self, layer_id: int, q: torch.Tensor, part: _Part, attend, rule) -> torch.Tensor:
        b, heads, s, dim = q.shape
        if part.lens is not None and paged_attention.applies(q, self.k[layer_id]):
            scale, softcap, window = rule
            out = paged_attention.decode(q[:, :, 0], self.k[layer_id], self.v[layer_id],
                                         self.k_scale.get(layer_id), self.v_scale.get(layer_id),
                                         part.gather, part.lens, scale, softcap, window)
            return out.view(b, 1, heads * dim)
        if (part.lens is None and b == 1 and part.mask is None and isinstance(part.start, int)
                and (rule[2] is None or part.start + s <= rule[2])
                and paged_attention.applies_prefill(q, self.k[layer_id], rule[1])):
            return paged_attention.prefill(q, self.k[layer_id], self.v[layer_id], self.k_scale.get(layer_id),
                                           self.v_scale.get(layer_id), part.gather[0], part.start, rule[0])[None]
        out = attend(q, *self._read(layer_id, part.gather.view(-1), b), part.mask, part.start)
        return out.transpose(1, 2).reshape(b, s, heads * dim)

    def _store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for pools, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            pool = pools[layer_id]
            x = x.transpose(1, 2).reshape(-1, *pool.shape[1:])
            if self.quantized:
                scale = x.abs().amax(-1).float().clamp_(min=1e-12) / 127
                scales[layer_id].index_copy_(0, slots, scale)
                x = (x / scale[..., None]).round_().clamp_(-127, 127)
            pool.index_copy_(0, slots, x.to(pool.dtype))

    def _read(self, layer_id: int, gather: torch.Tensor, b: int):
        """Keys and values at the flattened slots `gather` of b sequences, [b, kv_heads, width, head_dim]."""
        out = []
        for pools, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            pool = pools[layer_id]
            x = pool.index_select(0, gather).to(self.dtype)
            if self.quantized:
                x = x * scales[layer_id].index_select(0, gather).to(self.dtype)[..., None]
            out.append(x.view(b, -1, *pool.shape[1:]).transpose(1, 2))
        return tuple(out)

    def _parts(self, device: torch.device) -> tuple[torch.Tensor, list[_Part]]:
        """The step's new-token slots and its parts on `device`: moved once per step and
        device, not once per layer. A plain Step is one part."""
        if device not in self._on:
            s = self._step
            self._on[device] = (s.slots.to(device), [_Part.of(p, device) for p in
                                                     (s.parts if isinstance(s, PackedStep) else [s])])
        return self._on[device]


class _Part(NamedTuple):
    """One part of a step as attention reads it: `rows` query rows of `b` sequences, where each
    sequence's keys are (`gather` [b, width] pool slots, int64), the mask and start positions
    for the model's attention, and for one-token parts the number of keys of each (`lens`)."""
    rows: int
    b: int
    gather: torch.Tensor
    mask: torch.Tensor | None
    start: int | torch.Tensor
    lens: torch.Tensor | None

    @staticmethod
    def of(step: Step, device: torch.device) -> _Part:
        b, rows = step.gather.shape[0], step.slots.numel()
        start = step.start.to(device) if isinstance(step.start, torch.Tensor) else step.start
        lens = None
        if rows == b:  # one new token a sequence: it sees its keys up to and including itself
            lens = (step.start + 1 if isinstance(step.start, torch.Tensor) else torch.full((b,), step.start + 1))
            lens = lens.to(device=device, dtype=torch.int64)
        return _Part(rows, b, step.gather.to(device).contiguous(), None if step.mask is None else step.mask.to(device),
                     start, lens)
