"""A request's sequence and its sampling parameters, as the engine tracks them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...errors import ConfigError
from .grammar import Grammar

MAX_LOGPROBS = 20  # the most likeliest tokens a request may ask for per position, as OpenAI's API


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
    # Logit processors, with OpenAI's and vLLM's meanings (sampler.py applies them, batched):
    presence_penalty: float = 0.0  # minus this from every token generated at least once
    frequency_penalty: float = 0.0  # minus this times the times a token was generated
    repetition_penalty: float = 1.0  # a token in the prompt or generated: logit / this (x this if < 0)
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest's probability
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # the end-of-sequence and stop_token_ids masked until this many were generated
    stop_token_ids: list[int] = field(default_factory=list)  # end the sequence like EOS (not in the text)
    logprobs: int | None = None  # each generated token's log-probability and this many likeliest (0: none)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    # The first prompt token that must be scored: the blocks before it may come from the prefix
    # cache (an evaluation's choices share their context's), those tokens then scored None.
    prompt_logprobs_from: int = 1

    def check(self) -> None:
        """Refuse values out of range, each named as the parameter of `llmsplit.load(...).generate`
        and the server's field of the same meaning."""
        rules = [
            (self.max_new_tokens >= 1, f"max_new_tokens {self.max_new_tokens} must be at least 1"),
            (self.temperature >= 0, f"temperature {self.temperature} must be 0 (greedy) or more"),
            (self.top_p is None or 0 < self.top_p <= 1, f"top_p {self.top_p} must be in (0, 1]"),
            (self.top_k is None or self.top_k >= 1, f"top_k {self.top_k} must be at least 1"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty {self.presence_penalty} must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty {self.frequency_penalty} must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 2, f"repetition_penalty {self.repetition_penalty} must be in (0, 2]"),
            (0 <= self.min_p <= 1, f"min_p {self.min_p} must be in [0, 1]"),
            (0 <= self.min_tokens <= self.max_new_tokens,
             f"min_tokens {self.min_tokens} must be in [0, max_new_tokens {self.max_new_tokens}]"),
            (all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()),
             "logit_bias values must be in [-100, 100]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs {self.logprobs} must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs {self.prompt_logprobs} must be in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, message in rules:
            if not ok:
                raise ConfigError(message)

    def check_ids(self, vocab_size: int) -> None:
        """Token ids named by logit_bias and stop_token_ids must be in the vocabulary."""
        for what, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise ConfigError(f"{what} names token id {bad[0]}, outside the vocabulary [0, {vocab_size})")

    @property
    def processed(self) -> bool:
        """Whether any logit processor applies (sampler.py skips the rest)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


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
    stop_token: int | None = None  # the end-of-sequence or stop token that ended it (not in `tokens`)
    on_text: Callable[[str], None] | None = None  # receives text once it can no longer change
    detok: object = None  # the tokenizer's incremental decoder (`stream()`): text one token at a time
    last_token_at: float = field(default_factory=time.monotonic)  # creation, then each token's time
    first_token: bool = True
    admitted_at: float | None = None  # when it first joined the running batch (its prompt's work began)
    first_token_at: float | None = None  # when its first token was sampled
    preemptions: int = 0  # times its blocks were taken back (it was then recomputed)
    filling: list[int] | None = None  # the context its cache is being filled with (None: filled)
    filled: int = 0  # tokens of `filling` in the cache so far
    matcher: object = None  # where its grammar stands (structured output), else None
    adapter: int = 0  # the served LoRA adapter it runs with (Runner.serve_adapters), 0: the base
    passed_over: int = 0  # tokens of others computed since its filling last got a chunk (_plan_chunks)
    # With params.logprobs: per generated token (its log-probability, [(id, log-prob)] of the
    # likeliest); with params.prompt_logprobs: the same per prompt token (None for the first).
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    # One of a request's n samples after the first: it starts once `parent` (the first) has
    # its prompt in the cache, and shares the prompt's full blocks through the prefix cache.
    parent: "Sequence | None" = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)
