"""Generation: prefill and decode steps over a paged KV cache, several sequences at once.

The engine runs in the driving process (rank 0 when the model is split over workers) and
knows requests only: `step()` is schedule -> run -> sample -> emit. The scheduler
(scheduler.py) admits, preempts and plans the step over the block manager (block_manager.py);
the runner computes it (it hides where the model lives: one process with offload, or
tensor/pipeline-parallel workers); the sampler (sampler.py) picks each next token; the engine
then applies it (EOS, stop strings, limits, streaming text). A sequence returns its blocks as
soon as it ends. A caller can add sequences between steps (continuous batching, as the
server's engine thread does) or run them all to the end (`generate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ...errors import ConfigError
from .block_manager import BlockPool
from .sampler import logprob_entry, sample_batch
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence
from .speculative import Speculation
from .step import PackedStep

__all__ = ["Engine", "SamplingParams", "Sequence"]


class Engine:
    def __init__(self, runner, tokenizer, eos_ids: set[int], num_blocks: int, block_size: int,
                 max_batch: int, max_context: int, prefix_caching: bool = True,
                 max_num_batched_tokens: int | None = None, one_decode_batch: bool = False,
                 speculation: Speculation | None = None):
        self.runner = runner
        self.speculation = speculation
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.scheduler = Scheduler(BlockPool(num_blocks, block_size, prefix_caching), max_batch, max_context,
                                   max_num_batched_tokens, one_decode_batch, speculation)
        self.pool = self.scheduler.pool
        self.max_batch = max_batch
        self.max_context = max_context
        self._next_id = 0
        self.sampled_tokens = 0  # since start, for the server's metrics
        # Called with (first token?, seconds since the sequence's creation or its last token).
        self.on_latency: Callable[[bool, float], None] | None = None
        # The scheduler's calls and counts, as the engine's (the server and tests read them here).
        self.check, self.add, self.abort = self.scheduler.check, self.scheduler.add, self.scheduler.abort

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def recomputed_tokens(self) -> int:
        return self.scheduler.recomputed_tokens

    @property
    def prompt_tokens(self) -> int:
        return self.scheduler.prompt_tokens

    def new_sequences(self, prompt: list[int], params: SamplingParams, n: int, adapter: int = 0) -> list[Sequence]:
        """`n` samples of one prompt: the first computes the prompt, the others start once it is
        in the cache and share its blocks (Scheduler._admit); sample i draws from seed + i when a
        seed is given, so the n results repeat."""
        first = self.new_sequence(prompt, params, adapter)
        rest = [self.new_sequence(prompt, params, adapter, seed_offset=i) for i in range(1, n)]
        for seq in rest:
            seq.parent = first
        return [first, *rest]

    def new_sequence(self, prompt: list[int], params: SamplingParams, adapter: int = 0,
                     seed_offset: int = 0) -> Sequence:
        if not prompt:
            raise ConfigError("the prompt is empty; pass some text or token ids")
        if len(prompt) >= self.max_context:
            raise ConfigError(f"the prompt has {len(prompt)} tokens but the context holds {self.max_context}; "
                              f"shorten it or load with a larger max_context")
        gen = torch.Generator()
        if params.seed is not None:
            gen.manual_seed((params.seed + seed_offset) % 2**64 if params.seed >= 0 else params.seed + seed_offset)
        else:
            gen.seed()
        self._next_id += 1
        return Sequence(self._next_id, list(prompt), params, gen, detok=self.tokenizer.stream(),
                        matcher=params.grammar.matcher() if params.grammar is not None else None, adapter=adapter)

    def stats(self) -> dict:
        """What the engine holds and has done, for the server's /metrics and /health (read on
        the engine's own thread: the server's engine thread hands out a copy)."""
        pool, sched = self.pool, self.scheduler
        reserved, used = pool.usage()
        return {"running": len(sched.running), "queued": len(sched.waiting),
                "preempted": sum(s.preemptions > 0 for s in sched.waiting),
                "kv_blocks_used": pool.num_blocks - pool.free_blocks, "kv_blocks_total": pool.num_blocks,
                "kv_tokens_reserved": reserved, "kv_tokens_used": used,
                "prefix_cache_queries": pool.query_tokens, "prefix_cache_hits": pool.hit_tokens,
                "preemptions": sched.preemptions, "recomputed_tokens": sched.recomputed_tokens,
                "prompt_tokens": sched.prompt_tokens, "generated_tokens": self.sampled_tokens,
                **(self.speculation.stats() if self.speculation is not None else {})}

    def step(self) -> list[Sequence]:
        """One round: what the scheduler admits and plans, one forward of the runner for all of
        it, the next token of every sequence whose context is in; returns the sequences that
        finished in this step (their blocks are already free)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        tokens, step, adapters = self.scheduler.inputs(batch)
        out = self.runner.forward(tokens, step, last_only=True, adapters=adapters)
        logits = (out[0] if isinstance(step, PackedStep) else out[:, -1]).float()
        sampling, rows, scored, verifying = self.scheduler.settle(batch)
        for seq, start, first, n in scored:
            _score_prompt(seq, start, logits[first:first + n])
        for seq, token, entry in zip(sampling, *sample_batch(logits[rows], sampling, self.eos_ids)):
            self._advance(seq, token, entry)
        for seq, proposal, first in verifying:
            self._verify(seq, proposal, logits[first:first + 1 + len(proposal)])
        return self.scheduler.collect()

    def _verify(self, seq: Sequence, proposal: list[int], logits: torch.Tensor) -> None:
        """Take the model's tokens from the rows of verified proposals (speculative.py): row i
        samples as a decode step would after the proposals before it, and the walk stops at
        the first token that is not the proposal (that token, the model's own, still counts)."""
        accepted = emitted = 0
        for i in range(len(proposal) + 1):
            guess = proposal[i] if i < len(proposal) else None
            (token,), (entry,) = sample_batch(logits[i:i + 1], [seq], self.eos_ids)
            self._advance(seq, token, entry)
            emitted += 1
            accepted += token == guess
            if seq.finish_reason is not None or token != guess:
                break
        self.scheduler.forget_rejected(seq)
        self.speculation.count(len(proposal), accepted, emitted)

    def generate(self, seqs: list[Sequence], on_text=None) -> list[Sequence]:
        """Run every sequence to its end; `on_text(index, piece)` receives text as it is final."""
        for seq in seqs:
            self.check(seq)
        for i, seq in enumerate(seqs):
            if on_text is not None:
                seq.on_text = lambda piece, i=i: on_text(i, piece)
            self.scheduler.waiting.append(seq)
        try:
            while any(s.finish_reason is None for s in seqs):
                self.step()
        except BaseException:
            for seq in seqs:  # an interrupted call must not leave its sequences holding blocks
                self.abort(seq)
            raise
        return seqs

    def _advance(self, seq: Sequence, nxt: int, logprob=None) -> None:
        p = seq.params
        self.sampled_tokens += 1
        now = time.monotonic()
        if self.on_latency is not None:
            self.on_latency(seq.first_token, now - seq.last_token_at)
        if seq.first_token:
            seq.first_token_at = now
        seq.first_token, seq.last_token_at = False, now
        if seq.matcher is not None:
            seq.matcher.accept_token(nxt)  # the token came from its mask, so the grammar takes it
        if (nxt in self.eos_ids and not p.ignore_eos) or nxt in p.stop_token_ids:
            seq.finish_reason, seq.stop_token = "stop", nxt
            seq.text = self.tokenizer.decode(seq.tokens)  # with what the decoder still held back
        else:
            seq.tokens.append(nxt)
            if logprob is not None:
                seq.logprobs.append(logprob)
            before = len(seq.text)
            seq.text += seq.detok.step(nxt)
            # Only a stop string that ends in the new text can be new; none counts before min_tokens.
            stops = p.stop if len(seq.tokens) >= p.min_tokens else ()
            hits = [i for i in (seq.text.find(s, max(0, before - len(s) + 1)) for s in stops) if i >= 0]
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


def _score_prompt(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """Record the prompt's log-probabilities (params.prompt_logprobs) from the logits of the
    chunk of its context that starts at `start`: the row of position i scores token i + 1.
    A recomputed context (after preemption) finds them recorded already."""
    prompt, top = seq.prompt, seq.params.prompt_logprobs
    # None for the first token (nothing before it) and for those whose rows were not asked for:
    # cached, or in an earlier chunk before prompt_logprobs_from.
    seq.prompt_logprobs.extend([None] * (start + 1 - len(seq.prompt_logprobs)))
    logprobs = torch.log_softmax(logits, -1)
    for i in range(logits.shape[0]):
        target = start + i + 1
        if target < len(prompt) and target == len(seq.prompt_logprobs):
            seq.prompt_logprobs.append(logprob_entry(logprobs[i], prompt[target], top))
