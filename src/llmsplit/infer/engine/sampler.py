"""Batched sampling: the next token of every sequence from its row of logits, under its
grammar's mask (structured output) and its own generator."""

from __future__ import annotations

import torch

from .grammar import mask_logits
from .sequence import SamplingParams, Sequence


def sample_batch(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The next token of every sequence from its row of logits [b, vocab]: the greedy rows
    from one max over the whole batch (one op, not one per sequence), the others drawn each
    with its own generator (so a seeded request repeats whatever it is batched with)."""
    constrained = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
    if constrained:
        mask_logits(logits, constrained, [seqs[row].matcher for row in constrained])
    greedy = logits.max(-1).indices.tolist()  # max's index is argmax's (the first of equal values)
    return [greedy[row] if seq.params.temperature <= 0 else sample(logits[row], seq.params, seq.generator)
            for row, seq in enumerate(seqs)]


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token id from a [vocab] row at temperature > 0: top-k / nucleus sampling (the greedy
    rows are `sample_batch`'s, one max over the batch)."""
    logits = logits.float() / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p is not None and p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < p.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
