"""Vocabulary-parallel embedding and output head for tensor-parallel inference.

Each of the tp ranks holds `rows = ceil(vocab / tp)` rows of the embedding and of the head:
rank r owns tokens [r * rows, r * rows + rows). When tp does not divide the vocabulary the
last shards are padded with zero rows, and the logits of those padding rows are cut off
after the gather, so they can never be sampled. Results equal one process's exactly for the
embedding (one rank contributes each row, the others add zeros) and to rounding for the
head (each logit is the same dot product, computed on one rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def shard_rows(vocab: int, rank: int, size: int) -> tuple[int, int, int]:
    """(first row, real rows held, padded rows held) of `rank`'s vocabulary shard."""
    rows = -(-vocab // size)
    start = rank * rows
    return start, max(0, min(vocab, start + rows) - start), rows


def read_vocab_shard(source, name: str, vocab: int, rank: int, size: int) -> torch.Tensor:
    """Rows of tensor `name` ([vocab, dim]) for `rank`, zero-padded to the shard size; a source
    that can read a region (Hugging Face safetensors) reads only those rows."""
    start, real, rows = shard_rows(vocab, rank, size)
    if vocab % size == 0:
        w = source.read(name, (0, rank, size))
    elif hasattr(source, "read_region") and hasattr(source, "shape"):
        w = source.read_region(name, (start, 0), (real, source.shape(name)[1]))
    else:
        w = source.read(name)[start:start + real]
    if real < rows:
        w = torch.cat([w, w.new_zeros(rows - real, w.shape[1])])
    return w


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, rank: int, size: int, group):
        super().__init__()
        self.start, self.real, rows = shard_rows(vocab, rank, size)
        self.group = group
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)  # each token's row comes from exactly one rank
        return out


class VocabParallelHead(nn.Module):
    def __init__(self, dim: int, vocab: int, rank: int, size: int, group):
        super().__init__()
        _, _, rows = shard_rows(vocab, rank, size)
        self.vocab, self.size, self.group = vocab, size, group
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab]  # padding rows' logits dropped
