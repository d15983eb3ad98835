"""A request's sequence and its sampling parameters, as the engine tracks them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...errors import ConfigError
from .grammar import Grammar


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
