"""Structured output: a sequence held to a grammar while it is sampled (OpenAI's
`response_format` json_object / json_schema, and forced tool calls), through xgrammar.

xgrammar was picked over outlines-core by measurement on SmolLM2's 49,152-token vocabulary
(docs/serving.md): a token's mask costs 0.24 ms against 9.6 ms, a schema compiles in 11 ms
against 145 ms, and its JSON grammar is context-free, so `json_object` takes any nesting
(a regular expression cannot). Each sequence gets its own matcher; before a batch is
sampled, the rows of constrained sequences get their masks (tokens the grammar forbids set
to -inf), and each sampled token then advances its sequence's matcher. xgrammar is imported
only when a request asks for structure (the `serve` extra installs it).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from ...errors import ConfigError

CACHED_GRAMMARS = 64  # compiled schemas kept, least recently used dropped first


class Grammar:
    """A compiled grammar; each constrained sequence takes a `matcher()` of its own."""

    def __init__(self, compiled):
        self._compiled = compiled

    def matcher(self):
        import xgrammar

        return xgrammar.GrammarMatcher(self._compiled)


class Grammars:
    """The grammar compiler for one model's tokenizer, built on first use (about 0.75 s for a
    49k vocabulary), and the grammars it compiled, kept by source."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()  # requests compile in worker threads

    def json(self, schema: dict | None) -> Grammar:
        """Any JSON object (schema None), or JSON valid against `schema`; ConfigError for a
        schema xgrammar cannot compile."""
        key = json.dumps(schema, sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._compiler or self._make_compiler()
        try:
            compiled = compiler.compile_grammar(_json_grammar('{"type": "object"}' if schema is None else key))
        except Exception as e:  # xgrammar's own errors name what in the schema it cannot take
            raise ConfigError(f"the JSON schema cannot be compiled into a grammar ({e})") from None
        with self._lock:
            self._cache[key] = grammar = Grammar(compiled)
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def _make_compiler(self):
        try:
            import xgrammar
        except ImportError:
            raise ConfigError("structured output (response_format, tool_choice) needs xgrammar; install it with "
                              "pip install 'llmsplit[serve]'") from None
        backend = getattr(self.tokenizer, "backend", None)
        if backend is None:
            raise ConfigError("structured output needs a Hugging Face tokenizer (tokenizer.json or GGUF); this "
                              "model has a byte tokenizer")
        from transformers import PreTrainedTokenizerFast

        info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                                       vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
        self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler


# xgrammar 0.2.8 writes a length-bounded string's characters (maxLength, minLength) as any
# character but quote, backslash, CR and LF: raw control characters then pass, which JSON
# forbids (json.loads refuses them). Its unbounded strings exclude them; so do these.
_LOOSE_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\]'


def _json_grammar(schema: str):
    import xgrammar

    # No free whitespace: a small model could otherwise fill its budget with blanks.
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    return xgrammar.Grammar.from_ebnf(ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER))


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Set to -inf, in place, every token that each row's matcher forbids next."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(rows), logits.shape[-1])
    for i, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, i)
    for i, row in enumerate(rows):
        xgrammar.apply_token_bitmask_inplace(logits[row:row + 1], bitmask[i:i + 1])
