"""Paged KV cache (as in vLLM's PagedAttention): memory is a pool of fixed-size blocks;
each sequence owns a block table and grows one block at a time, so the only waste is the
unfilled tail of each sequence's last block, and a finished sequence returns its blocks.

Two halves: `BlockPool` is the bookkeeping (which blocks belong to which sequence), kept by
the process that drives generation; `PagedKVCache` is the storage of one process's layers.
The driver turns the bookkeeping of a step into a `Step` (where the new keys go, where
each sequence's keys are, the attention mask) that every process applies to its storage.
Without a paged-attention kernel on CPU, attention reads a sequence's keys by gathering
its slots; the gather is one indexed copy per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFull(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def append(self, seq_id: int, n: int) -> None:
        """Room for n more tokens of `seq_id` (a new sequence starts at length 0)."""
        table = self.tables.setdefault(seq_id, [])
        length = self.lengths.get(seq_id, 0) + n
        need = self.blocks_for(length) - len(table)
        if need > len(self._free):
            raise CacheFull(f"sequence {seq_id} needs {need} more KV blocks, {len(self._free)} are free")
        table.extend(self._free.pop() for _ in range(need))
        self.lengths[seq_id] = length

    def free(self, seq_id: int) -> None:
        self._free.extend(reversed(self.tables.pop(seq_id, [])))
        self.lengths.pop(seq_id, None)

    def usage(self) -> tuple[int, int]:
        """(tokens of allocated blocks, tokens actually stored)."""
        return sum(len(t) for t in self.tables.values()) * self.block_size, sum(self.lengths.values())

    def step(self, seq_ids: list[int], n_new: int) -> "Step":
        """The step that writes the last n_new tokens of each sequence (already appended)."""
        # Built from Python lists in a few tensor ops: it runs once per decoded token.
        bs = self.block_size
        lengths = [self.lengths[s] for s in seq_ids]
        starts = [n - n_new for n in lengths]
        width = max(lengths)
        blocks = self.blocks_for(width)
        tables = torch.tensor([self.tables[s] + [0] * (blocks - len(self.tables[s])) for s in seq_ids])
        # [b, width]: slot of each key position (padding points at block 0). Built at exactly
        # [b, width] with strides (width, 1) whatever the batch: a compiled decode step guards
        # on strides, and a [1, width] slice of a wider tensor is "contiguous" with a stride
        # that changes every block (issue 23: a recompile on the first real request).
        pos = torch.arange(width)
        gather = tables[:, pos // bs] * bs + pos % bs
        if all(st == starts[0] for st in starts):
            # Every sequence at the same position (so all end at width): the model's own causal rules apply.
            return Step(starts[0], gather[:, starts[0]:].flatten().clone(), gather, None)
        return Step.masked(torch.tensor(starts), n_new, gather)


@dataclass
class Step:
    start: int | torch.Tensor  # position of each sequence's first new token (an int when shared)
    slots: torch.Tensor  # [b * s] pool slot of every new token, row-major
    gather: torch.Tensor  # [b, width] pool slot of every key position (padding points anywhere)
    mask: torch.Tensor | None  # [b, 1, s, width] bool, or None when the model's causal rules apply

    @staticmethod
    def masked(start: torch.Tensor, n_new: int, gather: torch.Tensor) -> "Step":
        """The step with a start position [b] per sequence and the mask that keeps each query
        to its own sequence's past."""
        new = start[:, None] + torch.arange(n_new)  # positions of the new tokens
        mask = torch.arange(gather.shape[1])[None, None, :] <= new[:, :, None]  # [b, s, width]
        return Step(start, gather.gather(1, new).reshape(-1), gather, mask[:, None])

    def per_sequence(self) -> "Step":
        """This step in the masked form (one start per sequence), whether or not its
        sequences share a position: what a compiled batched decode step takes, so that one
        graph serves every batch (issue 23)."""
        if self.mask is not None:
            return self
        b, width = self.gather.shape
        return Step.masked(torch.full((b,), self.start), self.slots.numel() // b, self.gather)


class PagedKVCache:
    """K and V pools for the layers one process holds: [blocks * block_size, kv_heads, head_dim]
    per layer, on the device where that layer runs."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 layer_devices: dict[int, torch.device], dtype: torch.dtype):
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.k = {i: torch.zeros(shape, device=d, dtype=dtype) for i, d in layer_devices.items()}
        self.v = {i: torch.zeros(shape, device=d, dtype=dtype) for i, d in layer_devices.items()}
        self._step: Step | None = None
        self._on: dict[torch.device, tuple] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def set_step(self, step: Step | None) -> None:
        self._step, self._on = step, {}

    def _indices(self, device: torch.device):
        # Moved once per step and device, not once per layer.
        if device not in self._on:
            s = self._step
            self._on[device] = (s.slots.to(device), s.gather.reshape(-1).to(device),
                                None if s.mask is None else s.mask.to(device))
        return self._on[device]

    def update(self, layer_id: int, start_pos, k: torch.Tensor, v: torch.Tensor):
        """Store the new k/v [b, kv_heads, s, head_dim]; return every key/value of each
        sequence, [b, kv_heads, width, head_dim]."""
        slots, gather, _ = self._indices(k.device)  # gather flattened: index_select is the cheapest read
        kp, vp = self.k[layer_id], self.v[layer_id]
        kp.index_copy_(0, slots, k.transpose(1, 2).reshape(-1, *kp.shape[1:]))
        vp.index_copy_(0, slots, v.transpose(1, 2).reshape(-1, *vp.shape[1:]))
        shape = (k.shape[0], -1, *kp.shape[1:])
        return (kp.index_select(0, gather).view(shape).transpose(1, 2),
                vp.index_select(0, gather).view(shape).transpose(1, 2))

    def attn_mask(self, device: torch.device):
        return self._indices(device)[2]
