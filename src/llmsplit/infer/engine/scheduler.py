"""Which sequences run and what each step computes: admission while KV blocks are free,
preemption when they run out, chunked prefill under a token budget, and decode groups.

Blocks are taken as tokens arrive (as in vLLM): a waiting sequence is admitted once the blocks
for its prompt are free. Each step every running sequence whose context is in decodes a token,
and the prompts of the others are computed in chunks in the same forward, packed in one row
(several prompts at once, under `max_num_batched_tokens`). When the pool runs out, the newest
sequence is preempted (its blocks freed, its cache recomputed once blocks free up) rather than
any request failing. No model code: `schedule()` says what to compute, `inputs()` packs it for
the runner, `settle()` says which rows are sampled.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ...errors import ConfigError
from .block_manager import BlockPool
from .sequence import Sequence
from .speculative import SPECULATE_UP_TO, Speculation
from .step import PackedStep, Step

# Tokens a step computes by default: prompt tokens/s of SmolLM2-135M (GGUF Q4_1, 1 thread, load
# 10.5) by chunk size: 128: 74, 256: 125, 512: 149, 1024: 137, 2048: 121 (longer chunks cost
# more attention per token); and the streams' next token waits for at most one such step.
DEFAULT_BATCHED_TOKENS = 512
# Tokens of other contexts a context being filled may wait behind before it goes first (at
# ~2,000 prompt tokens/s on 2 CPU cores for SmolLM2-135M, about 8 s).
STARVE_TOKENS = 16384


@dataclass
class Batch:
    """One step's work: decoding sequences in `groups` (each one part of the step), sequences
    `verifying` speculative proposals (each its newest token and the proposals, one part),
    and prefill `chunks` (sequence, start, tokens); logits come back in that order."""
    groups: list[list[Sequence]]
    chunks: list[tuple[Sequence, int, int]]
    verifying: list[tuple[Sequence, list[int]]] = field(default_factory=list)

    @property
    def decoding(self) -> list[Sequence]:
        return [s for g in self.groups for s in g]


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch: int, max_context: int,
                 max_num_batched_tokens: int | None = None, one_decode_batch: bool = False,
                 speculation: Speculation | None = None):
        self.pool = pool
        self.speculation = speculation
        self.max_batch = max_batch
        self.max_context = max_context
        # Tokens one step computes at most (decodes first, then prefill chunks): a long prompt
        # is then filled over several steps while the running sequences keep their pace.
        self.max_num_batched_tokens = max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, max_batch)
        # Decodes in one part: a compiled graph's shape, or where the paged kernel reads each
        # sequence's own keys (runner.decodes_in_place); else in parts of similar lengths.
        self.one_decode_batch = one_decode_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # sequences preempted for want of KV blocks (since start)
        self.recomputed_tokens = 0  # what refilling their caches cost
        self.prompt_tokens = 0  # totals since start, for the server's metrics

    def check(self, seq: Sequence) -> None:
        """Refuse a sequence whose worst case could never fit in the pool (it would wait forever)."""
        if self.pool.blocks_for(self._budget(seq)) > self.pool.num_blocks:
            raise ConfigError(f"prompt + max_new_tokens = {self._budget(seq)} tokens exceed the KV cache "
                              f"({self.pool.num_blocks * self.pool.block_size} tokens)")

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and return its blocks (e.g. its client went away)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.release(seq)
        seq.finish_reason = seq.finish_reason or "abort"

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """Admit what fits, then this step's work: the next token of every running sequence whose
        context is in (room taken for it), and chunks of the contexts still being filled under
        `max_num_batched_tokens`, the decodes taking their share first so that a long prompt
        never stalls the streams. None when there is nothing to compute."""
        self._admit()
        decoding = self._make_room()
        for s in decoding:
            self.pool.append(s.id, 1)
        verifying = self._propose(decoding)
        decoding = [s for s in decoding if all(s is not v for v, _ in verifying)]
        computed = len(decoding) + sum(1 + len(p) for _, p in verifying)
        chunks = self._plan_chunks(self.max_num_batched_tokens - computed)
        if not (decoding or verifying or chunks):
            return None
        return Batch(self._decode_groups(decoding), chunks, verifying)

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, object, torch.Tensor | None]:
        """(tokens, step, adapters) of the runner's forward for `batch`: each decoding sequence's
        newest token (in its groups) and every chunk, packed in one row when there are several
        parts (the weights are read once for all of them); `adapters` the LoRA adapter of each
        token in row order (None: all on the base). One batch of decodes alone keeps the
        [b, 1] shape a compiled decode graph takes."""
        decoding = batch.decoding
        decodes = [self.pool.step([s.id for s in g], 1) for g in batch.groups]
        adapters = ([s.adapter for s in decoding] + [seq.adapter for seq, p in batch.verifying for _ in range(1 + len(p))]
                    + [seq.adapter for seq, _, n in batch.chunks for _ in range(n)])
        adapters = torch.tensor(adapters) if any(adapters) else None
        if not batch.chunks and not batch.verifying and len(decodes) == 1:
            return torch.tensor([[s.tokens[-1]] for s in decoding]), decodes[0], adapters
        if not batch.chunks and self.one_decode_batch:  # proposals verified as decode rows (Step.one_token_rows)
            rows = decodes + [self.pool.rows(seq.id, 1 + len(p)) for seq, p in batch.verifying]
            tokens = [s.tokens[-1] for s in decoding] + [t for seq, p in batch.verifying for t in (seq.tokens[-1], *p)]
            return torch.tensor(tokens)[:, None], Step.one_token_rows(rows), adapters
        parts = decodes
        tokens = [s.tokens[-1] for s in decoding]
        for seq, proposal in batch.verifying:  # the newest token, then the proposals: a row each
            parts.append(self.pool.rows(seq.id, 1 + len(proposal)))
            tokens += [seq.tokens[-1], *proposal]
        for seq, start, n in batch.chunks:
            parts.append(self.pool.chunk(seq.id, start, n))
            tokens += seq.filling[start:start + n]
        first_rows = [None] * (len(batch.groups) + len(batch.verifying)) + [_first_row(*chunk) for chunk in batch.chunks]
        return torch.tensor([tokens]), PackedStep.pack(parts, first_rows), adapters

    def settle(self, batch: Batch) -> tuple[list[Sequence], list[int], list[tuple[Sequence, int, int, int]],
                                            list[tuple[Sequence, list[int], int]]]:
        """After the forward: chunks count as computed, a context filled to its end becomes
        findable by prefix; returns the sequences to sample and their rows of logits (every
        decode, and each new sequence whose prompt is now complete), the chunks of prompts
        being scored with the rows that came back: (sequence, position of the first, its row,
        rows), and the sequences verifying proposals: (sequence, proposals, first row)."""
        decoding = batch.decoding
        sampling, rows, scored, verifying = list(decoding), list(range(len(decoding))), [], []
        first = len(decoding)
        for seq, proposal in batch.verifying:
            verifying.append((seq, proposal, first))
            first += 1 + len(proposal)
        for seq, start, n in batch.chunks:
            skip = _first_row(seq, start, n)
            if skip is not None:
                scored.append((seq, start + skip, first, n - skip))
            first += 1 if skip is None else n - skip
            row = first - 1  # the chunk's last token: what a prompt filled to its end samples from
            seq.filled = start + n
            if seq.filled == len(seq.filling):
                self.pool.commit(seq.id, seq.filling)
                seq.filling = None
                if not seq.tokens:  # a new sequence (a recomputed one already has its next token)
                    sampling.append(seq)
                    rows.append(row)
        return sampling, rows, scored, verifying

    def collect(self) -> list[Sequence]:
        """The running sequences that finished, their blocks returned."""
        finished = [s for s in self.running if s.finish_reason is not None]
        for seq in finished:
            self.running.remove(seq)
            self.release(seq)
        return finished

    def forget_rejected(self, seq: Sequence) -> None:
        """After verifying: the cache keeps the sequence's context but its newest token (fed
        next step, as after any decode), not the proposals the model did not take."""
        if seq.id in self.pool.lengths:
            self.pool.truncate(seq.id, seq.length - 1)

    def release(self, seq: Sequence) -> None:
        if seq.id in self.pool.lengths:  # what its cache holds (prompt, then every token fed) stays findable
            self.pool.commit(seq.id, (seq.prompt + seq.tokens)[:self.pool.lengths[seq.id]])
        self.pool.free(seq.id)

    def _budget(self, seq: Sequence) -> int:
        return min(len(seq.prompt) + seq.params.max_new_tokens, self.max_context)

    def _admit(self) -> None:
        """A sequence is admitted once the blocks for its prompt, and for what it had generated
        if it was preempted, are free, with one block to spare so that the batch can take its
        next tokens. Its prompt's blocks are taken at once (found cached where its start
        matches a cached one), and computed chunk by chunk in the following steps."""
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self.pool.blocks_for(seq.length) + 1 > self.pool.free_blocks and self.running:
                break  # wait until a running sequence returns its blocks
            if seq.parent is not None and not seq.tokens and not _prompt_cached(seq.parent):
                break  # one of n samples: its prompt's blocks come from the first's, filled in a step or two
            self.waiting.popleft()
            self.running.append(seq)
            seq.admitted_at = seq.admitted_at or time.monotonic()
            # A preempted sequence recomputes its prompt and every token it generated but the
            # newest, which the next decode step feeds as usual.
            seq.filling = seq.prompt + seq.tokens[:-1]
            if seq.tokens:
                self.recomputed_tokens += len(seq.filling)
            else:
                self.prompt_tokens += len(seq.prompt)
            # Another adapter computes other keys from the same tokens: prefixes are shared per adapter.
            # A prompt to be scored takes from the cache only blocks before its first scored token.
            scored = _scores_prompt(seq)
            seq.filled = self.pool.match_prefix(seq.id, seq.filling[:seq.params.prompt_logprobs_from] if scored
                                                else seq.filling, namespace=seq.adapter)
            self.pool.append(seq.id, len(seq.filling) - seq.filled)

    def _make_room(self) -> list[Sequence]:
        """The running sequences that decode this step. When the pool has too few free blocks
        for the batch's next tokens, the newest sequence is preempted: its blocks are freed
        and it goes back to the head of the queue, to be recomputed when blocks free up (no
        request fails for want of blocks, and the oldest keep going)."""
        decoding = [s for s in self.running if s.filling is None and s.finish_reason is None]
        bs = self.pool.block_size
        while len(decoding) > 1 and sum(self.pool.lengths[s.id] % bs == 0 for s in decoding) > self.pool.free_blocks:
            victim = decoding.pop()
            self.release(victim)  # its full blocks stay cached: the recompute may find them
            self.running.remove(victim)
            self.waiting.appendleft(victim)
            victim.preemptions += 1
            self.preemptions += 1
        return decoding

    def _propose(self, decoding: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """(sequence, proposals) of the decoding sequences that verify proposals this step, their
        room in the cache taken; none when nothing speculates or too many decode at once. A
        sequence proposes no more than it may still generate and its context and the pool hold."""
        if self.speculation is None or len(decoding) > SPECULATE_UP_TO or self.speculation.resting():
            return []
        pool = self.pool

        def pool_room(seq: Sequence) -> int:  # tokens its blocks and the free ones still hold
            return (len(pool.tables[seq.id]) + pool.free_blocks) * pool.block_size - pool.lengths[seq.id]

        wants = []
        for seq in decoding:
            length = pool.lengths[seq.id]  # its context, the newest token's room taken
            room = min(seq.params.max_new_tokens - len(seq.tokens) - 1, self.max_context - length, pool_room(seq))
            wants.append((seq.prompt + seq.tokens, max(0, room)))
        verifying = []
        for seq, proposal in zip(decoding, self.speculation.propose(wants)):
            proposal = proposal[:pool_room(seq)]  # the others' proposals took blocks too
            if proposal:
                pool.append(seq.id, len(proposal))
                verifying.append((seq, proposal))
        return verifying

    def _plan_chunks(self, budget: int) -> list[tuple[Sequence, int, int]]:
        """(sequence, start, tokens) of the contexts being filled that this step computes, up
        to `budget` tokens, each chunk after what its cache already holds (a cached prefix,
        the chunks before). The fewest tokens left to fill first (shortest remaining first,
        which minimises the mean time to first token: benchmarks/serve.py's 32 prompts of
        16-1,024 tokens arriving together under a 512-token budget get their median first
        token after 6,656 tokens computed, against 11,776 oldest first), the oldest among
        equals; one that has waited while STARVE_TOKENS tokens of others were computed goes
        first, so a long prompt under a stream of short ones is still filled."""
        filling = [s for s in self.running if s.filling is not None]
        order = sorted(filling, key=lambda s: (s.passed_over < STARVE_TOKENS, len(s.filling) - s.filled))
        chunks = []
        for seq in order:
            if budget <= 0:
                break
            n = min(len(seq.filling) - seq.filled, budget)
            chunks.append((seq, seq.filled, n))
            budget -= n
        computed = sum(n for _, _, n in chunks)
        chunked = {seq.id for seq, _, _ in chunks}
        for seq in filling:
            seq.passed_over = 0 if seq.id in chunked else seq.passed_over + computed
        return chunks

    def _decode_groups(self, decoding: list[Sequence]) -> list[list[Sequence]]:
        """A compiled decode graph, or the paged kernel, takes one batch; else sequences of similar
        lengths attend together (each part gathers keys as wide as its longest)."""
        if not decoding or self.one_decode_batch:
            return [decoding] if decoding else []
        by_id = {s.id: s for s in decoding}
        return [[by_id[i] for i in g] for g in self.pool.by_length(list(by_id))]


def _first_row(seq: Sequence, start: int, n: int) -> int | None:
    """The first row of this chunk whose logits are wanted, when it belongs to a prompt being
    scored (the row before its first scored token, or the last row, which the next token is
    sampled from); None: the last row only, as for any chunk."""
    if not _scores_prompt(seq):
        return None
    return min(max(0, seq.params.prompt_logprobs_from - 1 - start), n - 1)


def _scores_prompt(seq: Sequence) -> bool:
    """Whether this chunk's every row of logits is wanted: the first fill of a prompt whose
    log-probabilities were asked for (a recomputed one has them already)."""
    return seq.params.prompt_logprobs is not None and not seq.tokens


def _prompt_cached(seq: Sequence) -> bool:
    """Whether `seq`'s prompt is in the cache (committed at the end of its fill), for the samples
    that share it; also when it ended or failed, whose blocks were committed as it left."""
    return seq.finish_reason is not None or (seq.filling is None and seq.filled > 0)
