"""Batched sampling: the next token of every sequence from its row of logits, after its logit
processors (penalties, bias, min_tokens) and under its grammar's mask (structured output),
drawn with its own generator; and the log-probabilities a request asked for."""

from __future__ import annotations

import torch

from .grammar import mask_logits
from .sequence import SamplingParams, Sequence


def sample_batch(logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int]) -> tuple[list[int], list]:
    """The next token of every sequence from its row of logits [b, vocab], and for each the
    log-probability entry it asked for (params.logprobs) or None. Log-probabilities are those
    of the model's own distribution, before any processor, as vLLM reports them by default.
    The greedy rows come from one max over the whole batch (one op, not one per sequence), the
    others are drawn each with its own generator (so a seeded request repeats whatever it is
    batched with)."""
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    logprobs = torch.log_softmax(logits[wanted].float(), -1) if wanted else None
    process(logits, seqs, eos_ids)
    constrained = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
    if constrained:
        mask_logits(logits, constrained, [seqs[row].matcher for row in constrained])
    greedy = logits.max(-1).indices.tolist()  # max's index is argmax's (the first of equal values)
    tokens = [greedy[row] if seq.params.temperature <= 0 else sample(logits[row], seq.params, seq.generator)
              for row, seq in enumerate(seqs)]
    entries: list = [None] * len(seqs)
    for i, row in enumerate(wanted):
        entries[row] = logprob_entry(logprobs[i], tokens[row], seqs[row].params.logprobs)
    return tokens, entries


def logprob_entry(logprobs: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `token`, [(id, log-probability)] of the `top` likeliest) from one
    row of log-probabilities."""
    best = torch.topk(logprobs, top) if top else None
    return float(logprobs[token]), ([] if best is None else list(zip(best.indices.tolist(), best.values.tolist())))


def process(logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int]) -> None:
    """Apply each sequence's logit processors to its row, in place, the rows that have any
    together: repetition_penalty over the prompt and generated tokens (HF's and vLLM's rule:
    a positive logit divided, a negative one multiplied), frequency and presence penalties
    over the generated tokens (OpenAI's), logit_bias, and the end masked before min_tokens."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.processed]
    if not rows:
        return
    sub = logits[rows].float()
    counts = torch.zeros_like(sub)
    for i, row in enumerate(rows):
        if seqs[row].tokens:
            counts[i].index_add_(0, torch.tensor(seqs[row].tokens), torch.ones(len(seqs[row].tokens)))
    params = [seqs[row].params for row in rows]
    penalty = torch.tensor([p.repetition_penalty for p in params])[:, None]
    if (penalty != 1).any():
        seen = counts > 0
        for i, row in enumerate(rows):
            seen[i, seqs[row].prompt] = True
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    sub -= torch.tensor([p.frequency_penalty for p in params])[:, None] * counts
    sub -= torch.tensor([p.presence_penalty for p in params])[:, None] * (counts > 0)
    for i, (row, p) in enumerate(zip(rows, params)):
        if p.logit_bias:
            sub[i, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()))
        if len(seqs[row].tokens) < p.min_tokens:
            sub[i, sorted(({*eos_ids} if not p.ignore_eos else set()) | set(p.stop_token_ids))] = float("-inf")
    logits[rows] = sub.to(logits.dtype)


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token id from a [vocab] row at temperature > 0: top-k, then min-p, then nucleus
    (top-p) sampling (the greedy rows are `sample_batch`'s, one max over the batch)."""
    logits = logits.float() / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p:
        probs = probs * (probs >= p.min_p * probs.max())
    if p.top_p is not None and p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < p.top_p * sorted_p.sum()  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
