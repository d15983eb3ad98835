"""Generation: prefill and decode steps over a paged KV cache, several sequences at once.

The engine runs in the driving process (rank 0 when the model is split over workers). It
keeps the block pool and two queues: `waiting` sequences are admitted while the blocks for
their prompt are free (blocks are then taken one at a time as tokens arrive). Each step is
one forward: every `running` sequence whose context is in decodes a token, and the prompts
of the others are computed in chunks in the same forward, packed in one row (several
prompts at once, under `max_num_batched_tokens`). When the pool runs out, the newest
sequence is preempted (its blocks freed, its cache recomputed once blocks free up) rather
than any request failing. A sequence leaves on EOS, a stop string or its token limit and
returns its blocks at once. `step()` is one such round, so a caller can add sequences
between rounds (continuous batching, as the server's scheduler does) or run them all to the
end (`generate`). The runner it drives hides where the model lives (one process with
offload, or tensor/pipeline-parallel workers).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from .grammar import Grammar, mask_logits
from .kv_cache import BlockPool, PackedStep


# Tokens a step computes by default: prompt tokens/s of SmolLM2-135M (GGUF Q4_1, 1 thread, load
# 10.5) by chunk size: 128: 74, 256: 125, 512: 149, 1024: 137, 2048: 121 (longer chunks cost
# more attention per token); and the streams' next token waits for at most one such step.
DEFAULT_BATCHED_TOKENS = 512
# Tokens of other contexts a context being filled may wait behind before it goes first (at
# ~2,000 prompt tokens/s on 2 CPU cores for SmolLM2-135M, about 8 s).
STARVE_TOKENS = 16384


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    grammar: Grammar | None = None  # structured output: what the text must follow (grammar.py)

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature {self.temperature} must be 0 (greedy) or more")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p {self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k {self.top_k} must be at least 1")


@dataclass(eq=False)  # a sequence is itself, whatever its contents: queues find it by identity
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far, cut at a stop string when one appears
    emitted: int = 0  # characters already streamed
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or "abort"
    on_text: Callable[[str], None] | None = None  # receives text once it can no longer change
    detok: object = None  # the tokenizer's incremental decoder (`stream()`): text one token at a time
    last_token_at: float = field(default_factory=time.monotonic)  # creation, then each token's time
    first_token: bool = True
    preemptions: int = 0  # times its blocks were taken back (it was then recomputed)
    filling: list[int] | None = None  # the context its cache is being filled with (None: filled)
    filled: int = 0  # tokens of `filling` in the cache so far
    matcher: object = None  # where its grammar stands (structured output), else None
    adapter: int = 0  # the served LoRA adapter it runs with (Runner.serve_adapters), 0: the base
    passed_over: int = 0  # tokens of others computed since its filling last got a chunk (_plan_chunks)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


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
    """One token id from a [vocab] row: greedy at temperature 0, else top-k / nucleus sampling."""
    if p.temperature <= 0:
        # max's index is argmax's (the first of equal values), in a third of the time at 49k entries.
        return int(logits.max(-1).indices)
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


class Engine:
    def __init__(self, runner, tokenizer, eos_ids: set[int], num_blocks: int, block_size: int,
                 max_batch: int, max_context: int, prefix_caching: bool = True,
                 max_num_batched_tokens: int | None = None, one_decode_batch: bool = False):
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        self.max_batch = max_batch
        self.max_context = max_context
        # Tokens one step computes at most (decodes first, then prefill chunks): a long prompt
        # is then filled over several steps while the running sequences keep their pace.
        self.max_num_batched_tokens = max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, max_batch)
        # Decodes in one part: a compiled graph's shape, or where the paged kernel reads each
        # sequence's own keys (runner.decodes_in_place); else in parts of similar lengths.
        self.one_decode_batch = one_decode_batch
        self._next_id = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # sequences preempted for want of KV blocks (since start)
        self.recomputed_tokens = 0  # what refilling their caches cost
        self.prompt_tokens = 0  # totals since start, for the server's metrics
        self.sampled_tokens = 0
        # Called with (first token?, seconds since the sequence's creation or its last token).
        self.on_latency: Callable[[bool, float], None] | None = None

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

    def _forward(self, groups: list[list[Sequence]], chunks: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        """One forward for the step: each decoding sequence's newest token (in `groups` of
        similar lengths, `BlockPool.by_length`) and every chunk, packed in one row when there
        are several parts (the weights are read once for all of them); logits
        [decoding sequences + len(chunks), vocab] of each one's last token, in that order."""
        decoding = [s for g in groups for s in g]
        decodes = [self.pool.step([s.id for s in g], 1) for g in groups]
        # The adapter of every token, in the row order of the forward (None: all on the base).
        adapters = [s.adapter for s in decoding] + [seq.adapter for seq, _, n in chunks for _ in range(n)]
        adapters = torch.tensor(adapters) if any(adapters) else None
        if not chunks and len(decodes) == 1:  # one batch of decodes: the shape a compiled decode graph takes
            tokens = torch.tensor([[s.tokens[-1]] for s in decoding])
            return self.runner.forward(tokens, decodes[0], last_only=True, adapters=adapters)[:, -1].float()
        parts = decodes
        tokens = [s.tokens[-1] for s in decoding]
        for seq, start, n in chunks:
            parts.append(self.pool.chunk(seq.id, start, n))
            tokens += seq.filling[start:start + n]
        return self.runner.forward(torch.tensor([tokens]), PackedStep.pack(parts), last_only=True,
                                   adapters=adapters)[0].float()

    def new_sequence(self, prompt: list[int], params: SamplingParams, adapter: int = 0) -> Sequence:
        if not prompt:
            raise ConfigError("the prompt is empty; pass some text or token ids")
        if len(prompt) >= self.max_context:
            raise ConfigError(f"the prompt has {len(prompt)} tokens but the context holds {self.max_context}; "
                              f"shorten it or load with a larger max_context")
        gen = torch.Generator()
        gen.manual_seed(params.seed) if params.seed is not None else gen.seed()
        self._next_id += 1
        return Sequence(self._next_id, list(prompt), params, gen, detok=self.tokenizer.stream(),
                        matcher=params.grammar.matcher() if params.grammar is not None else None, adapter=adapter)

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
            self._release(seq)
        seq.finish_reason = seq.finish_reason or "abort"

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        """What the engine holds and has done, for the server's /metrics and /health (read on
        the engine's own thread: the scheduler hands out a copy)."""
        pool = self.pool
        reserved, used = pool.usage()
        return {"running": len(self.running), "queued": len(self.waiting),
                "preempted": sum(s.preemptions > 0 for s in self.waiting),
                "kv_blocks_used": pool.num_blocks - pool.free_blocks, "kv_blocks_total": pool.num_blocks,
                "kv_tokens_reserved": reserved, "kv_tokens_used": used,
                "prefix_cache_queries": pool.query_tokens, "prefix_cache_hits": pool.hit_tokens,
                "preemptions": self.preemptions, "recomputed_tokens": self.recomputed_tokens,
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.sampled_tokens}

    def step(self) -> list[Sequence]:
        """Admit what fits, then one forward: the next token of every running sequence whose
        context is in, and in the same forward chunks of the contexts still being filled
        (under `max_num_batched_tokens`, the decodes taking their share first, so a long
        prompt never stalls the streams); returns the sequences that finished in this step
        (their blocks are already free)."""
        finished = []
        self._admit()
        decoding = self._make_room()
        chunks = self._plan_chunks(self.max_num_batched_tokens - len(decoding))
        if not (decoding or chunks):
            return finished
        for s in decoding:
            self.pool.append(s.id, 1)
        groups = self._decode_groups(decoding)
        decoding = [s for g in groups for s in g]
        logits = self._forward(groups, chunks)
        sampling, rows = list(decoding), list(range(len(decoding)))
        for row, (seq, start, n) in enumerate(chunks, len(decoding)):
            seq.filled = start + n
            if seq.filled == len(seq.filling):
                self.pool.commit(seq.id, seq.filling)
                seq.filling = None
                if not seq.tokens:  # a new sequence (a recomputed one already has its next token)
                    sampling.append(seq)
                    rows.append(row)
        for seq, token in zip(sampling, sample_batch(logits[rows], sampling)):
            self._advance(seq, token)
        self._collect(finished)
        return finished

    def _admit(self) -> None:
        """Blocks are taken as tokens arrive (as in vLLM): a sequence is admitted once the
        blocks for its prompt, and for what it had generated if it was preempted, are free,
        with one block to spare so that the batch can take its next tokens. Its prompt's
        blocks are taken at once (found cached where its start matches a cached one), and
        computed chunk by chunk in the following steps."""
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self.pool.blocks_for(seq.length) + 1 > self.pool.free_blocks and self.running:
                break  # wait until a running sequence returns its blocks
            self.waiting.popleft()
            self.running.append(seq)
            # A preempted sequence recomputes its prompt and every token it generated but the
            # newest, which the next decode step feeds as usual.
            seq.filling = seq.prompt + seq.tokens[:-1]
            if seq.tokens:
                self.recomputed_tokens += len(seq.filling)
            else:
                self.prompt_tokens += len(seq.prompt)
            # Another adapter computes other keys from the same tokens: prefixes are shared per adapter.
            seq.filled = self.pool.match_prefix(seq.id, seq.filling, namespace=seq.adapter)
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
            self._release(victim)  # its full blocks stay cached: the recompute may find them
            self.running.remove(victim)
            self.waiting.appendleft(victim)
            victim.preemptions += 1
            self.preemptions += 1
        return decoding

    def _collect(self, finished: list[Sequence]) -> None:
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self.running.remove(seq)
            self._release(seq)
            finished.append(seq)

    def generate(self, seqs: list[Sequence], on_text=None) -> list[Sequence]:
        """Run every sequence to its end; `on_text(index, piece)` receives text as it is final."""
        for seq in seqs:
            self.check(seq)
        for i, seq in enumerate(seqs):
            if on_text is not None:
                seq.on_text = lambda piece, i=i: on_text(i, piece)
            self.waiting.append(seq)
        try:
            while any(s.finish_reason is None for s in seqs):
                self.step()
        except BaseException:
            for seq in seqs:  # an interrupted call must not leave its sequences holding blocks
                self.abort(seq)
            raise
        return seqs

    def _budget(self, seq: Sequence) -> int:
        return min(len(seq.prompt) + seq.params.max_new_tokens, self.max_context)

    def _release(self, seq: Sequence) -> None:
        if seq.id in self.pool.lengths:  # what its cache holds (prompt, then every token fed) stays findable
            self.pool.commit(seq.id, (seq.prompt + seq.tokens)[:self.pool.lengths[seq.id]])
        self.pool.free(seq.id)

    def _advance(self, seq: Sequence, nxt: int) -> None:
        p = seq.params
        self.sampled_tokens += 1
        now = time.monotonic()
        if self.on_latency is not None:
            self.on_latency(seq.first_token, now - seq.last_token_at)
        seq.first_token, seq.last_token_at = False, now
        if seq.matcher is not None:
            seq.matcher.accept_token(nxt)  # the token came from its mask, so the grammar takes it
        if nxt in self.eos_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
            seq.text = self.tokenizer.decode(seq.tokens)  # with what the decoder still held back
        else:
            seq.tokens.append(nxt)
            before = len(seq.text)
            seq.text += seq.detok.step(nxt)
            # Only a stop string that ends in the new text can be new.
            hits = [i for i in (seq.text.find(s, max(0, before - len(s) + 1)) for s in p.stop) if i >= 0]
            if hits:
                seq.text, seq.finish_reason = seq.text[:min(hits)], "stop"
            elif len(seq.tokens) >= p.max_new_tokens or seq.length >= self.max_context:
                seq.finish_reason = "length"
                # The end: an unfinished character the decoder held back comes out as U+FFFD, as
                # decoding everything at once gives it (one full decode per sequence, not per token).
                seq.text = self.tokenizer.decode(seq.tokens)
        if seq.on_text is not None:
            self._stream(seq)

    @staticmethod
    def _stream(seq: Sequence) -> None:
        # Hold back what could still change: the start of a stop string. (A partial UTF-8
        # character never reaches seq.text: the incremental decoder keeps it until complete.)
        end = len(seq.text)
        if seq.finish_reason is None:
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)
            end = max(seq.emitted, end - hold)
        if end > seq.emitted:
            seq.on_text(seq.text[seq.emitted:end])
            seq.emitted = end
