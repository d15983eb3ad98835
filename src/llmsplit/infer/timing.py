"""What one generation took, as `llmsplit generate --verbose` prints it."""

from __future__ import annotations

import time


class GenerationTiming:
    """`generate --verbose`: prompt tokens/s up to the first token, decode tokens/s after it
    (as llama.cpp prints them), from the engine's latency hook, and what speculation did."""

    def __init__(self, engine, prompt_tokens: int):
        self.engine, self.prompt_tokens, self.clock = engine, prompt_tokens, time.perf_counter
        self.start, self.first, self.last, self.tokens = self.clock(), None, None, 0
        engine.on_latency = self._token

    def _token(self, first: bool, _seconds: float) -> None:
        self.last = self.clock()
        self.first = self.first or self.last
        self.tokens += 1

    def summary(self) -> str:
        if self.first is None:
            return "llmsplit: no token generated"
        decode = self.last - self.first
        lines = [f"llmsplit: prompt {self.prompt_tokens} tokens in {self.first - self.start:.3f} s "
                 f"({self.prompt_tokens / max(self.first - self.start, 1e-9):.1f} tokens/s); decode {self.tokens - 1} "
                 f"tokens in {decode:.3f} s ({(self.tokens - 1) / decode if decode > 0 else 0:.1f} tokens/s)"]
        if self.engine.speculation is not None:
            lines.append(f"llmsplit: {self.engine.speculation.summary()}")
        return "\n".join(lines)
