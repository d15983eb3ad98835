"""The block manager of the paged KV cache (as in vLLM's PagedAttention): memory is a pool of
fixed-size blocks; each sequence owns a block table and grows one block at a time, so the only
waste is the unfilled tail of each sequence's last block, and a finished sequence returns its
blocks. This is the bookkeeping, kept by the process that drives generation (the engine); the
storage is the runner's (`runner/kv_cache.py`). The bookkeeping of a step becomes a `Step`
(engine/step.py) that every process applies to its storage.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from .step import Step


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
            self._release(block)
        self.lengths.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget what `seq_id` holds past `length` tokens (speculative proposals the model did
        not take); the blocks past it go back to the pool (never committed: nothing finds them)."""
        if length >= self.lengths[seq_id]:
            return
        table, keep = self.tables[seq_id], self.blocks_for(length)
        for block in reversed(table[keep:]):
            self._release(block)
        del table[keep:]
        self.lengths[seq_id] = length

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None  # kept for a later prompt with the same start
            else:
                self._free.append(block)

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

    def rows(self, seq_id: int, n: int) -> "Step":
        """The last n tokens of one sequence (already appended) as n one-token rows, row i
        attending up to its own position: speculative proposals verified by the very kernels
        that decode one token at a time, so each row's logits are bit for bit a decode step's
        (a prefill chunk's attention sums in another order, enough to flip the argmax of two
        nearly equal logits)."""
        length = self.lengths[seq_id]
        gather = self._gather([seq_id], length).expand(n, length).contiguous()
        return Step.masked(torch.arange(length - n, length), 1, gather)

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
