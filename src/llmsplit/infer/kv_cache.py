"""Paged KV cache (as in vLLM's PagedAttention): memory is a pool of fixed-size blocks;
each sequence owns a block table and grows one block at a time, so the only waste is the
unfilled tail of each sequence's last block, and a finished sequence returns its blocks.

Two halves: `BlockPool` is the bookkeeping (which blocks belong to which sequence), kept by
the process that drives generation; `PagedKVCache` is the storage of one process's layers.
The driver turns the bookkeeping of a step into a `Step` (where the new keys go, where
each sequence's keys are, the attention mask) that every process applies to its storage.
Decode attention on CPU reads each sequence's slots in place (`paged_attention`, a kernel
of llmsplit's own: PyTorch has none); everywhere else attention reads a sequence's keys by
gathering its slots, one indexed copy per layer, for the model's own attention (SDPA).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import paged_attention


# What one more part of a step costs (its own gather, mask and attention call in every layer),
# in key slots read (BlockPool.by_length). Measured on SmolLM2-135M (Q4_1, 2 threads), 32
# streams of 60-1,000 tokens decoding: 739 ms a step as one part, 206 / 193 / 189 ms in parts
# at a part cost of 64 / 256 / 1,024 slots. The one part's gathered keys are twice as many,
# and a copy of tens of MB per layer also falls out of the cache (index_select 5.7 ms a call
# against 87 us for a part's).
PART_COST_SLOTS = 256


class CacheFull(RuntimeError):
    pass


class BlockPool:
    """Which blocks belong to which sequence, with prefix caching (as vLLM and nano-vllm do
    it): a full block is known by a hash chained over every token up to its end, so two
    prompts that start alike share the blocks of their common start (reference counted).
    A block nobody holds keeps its contents and its hash until the pool needs it again,
    least recently freed first, so a later prompt with the same start still finds it."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # empty blocks; pop() hands out low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> the hash of its contents, once full
        self._by_hash: dict[bytes, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._roots: dict[int, bytes] = {}  # sequence -> where its chain of block hashes starts
        self.hit_tokens = 0  # prompt tokens found cached, and looked up: the hit rate in /metrics
        self.query_tokens = 0

    @property
    def free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match_prefix(self, seq_id: int, tokens: list[int], namespace: int = 0) -> int:
        """Give a new sequence the cached blocks its `tokens` start with; returns how many
        tokens they hold. The last token is always left to compute (its logits are needed).
        Blocks are shared within one `namespace` only (the LoRA adapter a sequence runs with:
        the same tokens give other keys under other weights); its chain of hashes starts there."""
        assert seq_id not in self.tables
        parent = self._roots[seq_id] = namespace.to_bytes(8, "little") if namespace else b""
        table = self.tables.setdefault(seq_id, [])
        self.query_tokens += len(tokens)
        if self.prefix_caching:
            for i in range((len(tokens) - 1) // self.block_size):
                parent = self._hash(parent, tokens, i)
                block = self._by_hash.get(parent)
                if block is None:
                    break
                self._evictable.pop(block, None)
                self._refs[block] += 1
                table.append(block)
        self.lengths[seq_id] = len(table) * self.block_size
        self.hit_tokens += self.lengths[seq_id]
        return self.lengths[seq_id]

    def commit(self, seq_id: int, tokens: list[int]) -> None:
        """Make the full blocks of `seq_id`, whose cache now holds `tokens`, findable."""
        if not self.prefix_caching:
            return
        parent = self._roots.get(seq_id, b"")
        for i, block in enumerate(self.tables[seq_id][:len(tokens) // self.block_size]):
            parent = self._hash(parent, tokens, i)
            if block not in self._hash_of and parent not in self._by_hash:
                self._hash_of[block], self._by_hash[parent] = parent, block

    def append(self, seq_id: int, n: int) -> None:
        """Room for n more tokens of `seq_id` (a new sequence starts at length 0)."""
        table = self.tables.setdefault(seq_id, [])
        length = self.lengths.get(seq_id, 0) + n
        need = self.blocks_for(length) - len(table)
        if need > self.free_blocks:
            raise CacheFull(f"sequence {seq_id} needs {need} more KV blocks, {self.free_blocks} are free")
        table.extend(self._take() for _ in range(need))
        self.lengths[seq_id] = length

    def free(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None  # kept for a later prompt with the same start
                else:
                    self._free.append(block)
        self.lengths.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the cached block freed longest ago
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def _hash(self, parent: bytes, tokens: list[int], i: int) -> bytes:
        # A cryptographic digest, not hash(): a collision would hand a sequence another's keys.
        chunk = tokens[i * self.block_size:(i + 1) * self.block_size]
        return hashlib.blake2b(parent + array("q", chunk).tobytes(), digest_size=16).digest()

    def usage(self) -> tuple[int, int]:
        """(tokens of allocated blocks, tokens actually stored)."""
        return sum(len(t) for t in self.tables.values()) * self.block_size, sum(self.lengths.values())

    def chunk(self, seq_id: int, start: int, n: int) -> "Step":
        """The step that writes tokens [start, start + n) of one sequence (its blocks already
        taken): a prefill chunk after what its cache holds."""
        gather = self._gather([seq_id], start + n)
        return Step(start, gather[0, start:].clone(), gather, None)

    def step(self, seq_ids: list[int], n_new: int) -> "Step":
        """The step that writes the last n_new tokens of each sequence (already appended)."""
        # Built from Python lists in a few tensor ops: it runs once per decoded token.
        lengths = [self.lengths[s] for s in seq_ids]
        starts = [n - n_new for n in lengths]
        gather = self._gather(seq_ids, max(lengths))
        if all(st == starts[0] for st in starts):
            # Every sequence at the same position (so all end at width): the model's own causal rules apply.
            return Step(starts[0], gather[:, starts[0]:].flatten().clone(), gather, None)
        return Step.masked(torch.tensor(starts), n_new, gather)

    def by_length(self, seq_ids: list[int]) -> list[list[int]]:
        """`seq_ids` in groups of similar lengths, longest first, each group to be one part of
        the step: a part's gather and attention cover its longest sequence's width for every
        sequence in it, so under one part 32 streams of 16 to 1,280 tokens read about twice the
        keys they hold. The split minimises the key slots read plus PART_COST_SLOTS a part
        (exactly, by dynamic programming over the sorted lengths: n <= max_batch)."""
        order = sorted(seq_ids, key=lambda s: -self.lengths[s])
        widths = [self.lengths[s] for s in order]
        n = len(order)
        best, cut = [0] + [float("inf")] * n, [0] * (n + 1)
        for end in range(1, n + 1):
            for start in range(end):  # the part order[start:end], as wide as its first
                cost = best[start] + (end - start) * widths[start] + PART_COST_SLOTS
                if cost < best[end]:
                    best[end], cut[end] = cost, start
        groups, end = [], n
        while end:
            groups.append(order[cut[end]:end])
            end = cut[end]
        return groups[::-1]

    def _gather(self, seq_ids: list[int], width: int) -> torch.Tensor:
        """[b, width]: the pool slot of each key position (padding points at block 0). Built at
        exactly [b, width] with strides (width, 1) whatever the batch: a compiled decode step
        guards on strides, and a [1, width] slice of a wider tensor is "contiguous" with a
        stride that changes every block (issue 23: a recompile on the first real request)."""
        bs, blocks = self.block_size, self.blocks_for(width)
        tables = torch.tensor([self.tables[s] + [0] * (blocks - len(self.tables[s])) for s in seq_ids])
        pos = torch.arange(width)
        return tables[:, pos // bs] * bs + pos % bs


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


@dataclass
class PackedStep:
    """Several sequences' new tokens packed into one row [1, T]: a fused step, the prefill
    chunks of some sequences next to the decode tokens of others (as vLLM and nano-vllm run
    them). The weights are then read once for every token of the step, and attention runs
    part by part, each part against its own sequences' keys (without a varlen attention
    kernel on CPU, one masked attention over all of them would cost T x every key)."""
    positions: torch.Tensor  # [T] position of each new token, for the rotary tables
    slots: torch.Tensor  # [T] pool slot of each new token
    parts: list[Step]  # in row order: a batch of decodes (one row each), or one sequence's chunk
    pick: torch.Tensor  # [n] rows whose logits are wanted (each part's sequences' last tokens)

    @staticmethod
    def pack(parts: list[Step]) -> "PackedStep":
        positions, pick, row = [], [], 0
        for part in parts:
            b, n = part.gather.shape[0], part.slots.numel() // part.gather.shape[0]
            start = part.start if isinstance(part.start, torch.Tensor) else torch.full((b,), part.start)
            positions.append((start[:, None] + torch.arange(n)).reshape(-1))
            pick.append(row + n - 1 + n * torch.arange(b))
            row += b * n
        return PackedStep(torch.cat(positions), torch.cat([p.slots for p in parts]), parts, torch.cat(pick))


KV_DTYPES = ("int8", "bfloat16")  # --kv-dtype; default: the compute dtype


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
