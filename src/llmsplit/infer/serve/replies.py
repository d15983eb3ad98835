"""OpenAI's response and stream-chunk objects for one request, tool calls included.

A chat request with tools gets its calls back as `tool_calls` in OpenAI's shape. With
tool_choice "required" or a named function the model's text is held by a grammar to
{"name": ..., "arguments": {...}} for one of the offered functions (`forced_call_schema`),
so the call always parses; with "auto" the model writes calls the way its chat template asks
for them, read by one of tool_calls.py's parsers (Hermes <tool_call> JSON, Llama 3.1+ JSON,
Mistral [TOOL_CALLS]), and the text around them stays the content. Streamed, text that may
begin a call is held until it is decided, and each call goes out as a tool_calls delta.
"""

from __future__ import annotations

import time
import uuid

from .logprobs import TokenTexts, chat_logprobs, completion_logprobs
from .tool_calls import CallScanner, ToolParser, json_call


def forced_call_schema(functions: list[dict], name: str | None) -> dict:
    """The JSON schema of a call to the function `name`, or to any of `functions` (None)."""
    chosen = [f for f in functions if name is None or f["name"] == name]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class Reply:
    """`tools`: None (plain text), "forced" (the whole text is one call) or the ToolParser of
    "auto" (calls found in the text by it). `texts` (a TokenTexts): log-probabilities were
    asked for; `echo`: the prompt's text of each sequence, which comes back before its
    completion; `score_only`: the prompt alone comes back (max_tokens 0 with echo: the one
    token computed is not shown)."""

    def __init__(self, model: str, chat: bool, seqs, tools: str | ToolParser | None = None,
                 texts: TokenTexts | None = None, echo: list[str] | None = None, score_only: bool = False):
        self.model, self.chat, self.seqs, self.tools = model, chat, seqs, tools
        # Streamed with "auto": each sequence's text read for calls as it comes.
        self.scanners = [CallScanner(tools) for _ in seqs] if isinstance(tools, ToolParser) else None
        self.texts, self.score_only = texts, score_only
        # Each sequence's echoed prompt, by id: best_of drops and reorders sequences.
        self.echo = None if echo is None else {s.id: text for s, text in zip(seqs, echo)}
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent = [0] * len(seqs)  # streamed: the generated tokens whose log-probabilities went out
        self.echoed = [False] * len(seqs)

    def _logprobs(self, index: int, upto: int | None = None, prompt: bool = False) -> dict | None:
        """The log-probabilities of sequence `index`'s generated tokens not sent yet, up to
        `upto` tokens (None: all), after its prompt's with `prompt`; None when not asked for."""
        if self.texts is None:
            return None
        seq = self.seqs[index]
        upto = 0 if self.score_only else len(seq.logprobs) if upto is None else min(upto, len(seq.logprobs))
        ids, entries = seq.tokens[self.sent[index]:upto], seq.logprobs[self.sent[index]:upto]
        self.sent[index] = max(self.sent[index], upto)
        if self.chat:
            return chat_logprobs(self.texts, ids, entries)
        if prompt:
            ids, entries = seq.prompt + ids, seq.prompt_logprobs + entries
        return completion_logprobs(self.texts, ids, entries)

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        prompt = sum(len(s.prompt) for s in self.seqs)
        completion = 0 if self.score_only else sum(len(s.tokens) for s in self.seqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def message(self, seq) -> tuple[dict, str | None]:
        """The assistant's message for a finished sequence, and its finish reason."""
        if self.tools == "forced":
            call = json_call(seq.text) if seq.finish_reason == "stop" else None
            calls, content = ([call], None) if call else ([], seq.text)
        elif self.tools:
            content, calls = CallScanner(self.tools).feed(seq.text, final=True)
            content = (content or None) if calls else content
        else:
            calls, content = [], seq.text
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, _finish(seq, bool(calls))

    def whole(self, best_of: int = 1, n: int = 1) -> dict:
        """The finished answer; with `best_of` > `n` samples per prompt, the `n` likeliest of
        each (by the sum of their tokens' log-probabilities), as OpenAI's best_of picks them."""
        usage = self.usage()
        if best_of > n:
            groups = [self.seqs[i:i + best_of] for i in range(0, len(self.seqs), best_of)]
            self.seqs = [s for g in groups for s in sorted(g, key=lambda s: -sum(lp for lp, _ in s.logprobs))[:n]]
            self.sent, self.echoed = [0] * len(self.seqs), [False] * len(self.seqs)
        if self.chat:
            choices = []
            for i, s in enumerate(self.seqs):
                message, finish = self.message(s)
                choices.append({"index": i, "message": message, "logprobs": self._logprobs(i),
                                "finish_reason": finish})
        else:
            choices = [{"index": i, "text": self._echo(i) + ("" if self.score_only else s.text),
                        "logprobs": self._logprobs(i, prompt=self.echo is not None),
                        "finish_reason": "length" if self.score_only else s.finish_reason}
                       for i, s in enumerate(self.seqs)]
        return {**self._head(False), "choices": choices, "usage": usage}

    def _echo(self, index: int) -> str:
        return self.echo[self.seqs[index].id] if self.echo is not None else ""

    def chunk(self, index: int, text: str = "", finish: str | None = None, role: bool = False,
              tokens: int | None = None) -> dict | None:
        """A piece of sequence `index`'s text, with the log-probabilities of its tokens up to
        `tokens` generated (None: all) when they were asked for; the echoed prompt (and its
        log-probabilities) comes with its first piece. None: nothing to send yet (with tools,
        text that may begin a call is held until it is decided)."""
        echo = not (role or self.chat or self.echo is None or self.echoed[index])
        self.echoed[index] = self.echoed[index] or echo
        logprobs = None if role else self._logprobs(index, tokens, prompt=echo)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else self._delta(index, text)
            if not (delta or logprobs is not None or finish is not None):
                return None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            text = (self._echo(index) if echo else "") + ("" if self.score_only else text)
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def _delta(self, index: int, text: str, final: bool = False) -> dict:
        """A chat delta for a piece of text: with "auto" tools, the content and the calls it decides."""
        if self.scanners is None:
            return {"content": text} if text else {}
        scanner = self.scanners[index]
        first = scanner.calls
        content, calls = scanner.feed(text, final)
        delta = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(calls)]
        return delta

    def last_chunk(self, index: int, seq) -> dict:
        """A streamed sequence's end: with "auto" tools, the text held back until now, as content
        or calls; a forced call's text (held back whole: it must be whole to parse) as its call."""
        if not (self.chat and self.tools):
            return self.chunk(index, finish="length" if self.score_only else seq.finish_reason)
        if self.scanners is not None:
            # The engine streams text once final, so what it has not streamed yet is the end of seq.text.
            delta = self._delta(index, seq.text[len(self.scanners[index].text):], final=True)
            finish = _finish(seq, self.scanners[index].calls > 0)
        else:
            message, finish = self.message(seq)
            delta = {"content": message["content"]} if message["content"] else {}
            if "tool_calls" in message:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        return {**self._head(True), "choices": [{"index": index, "delta": delta, "logprobs": self._logprobs(index),
                                                 "finish_reason": finish}]}

    def usage_chunk(self) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage()}


def _finish(seq, called: bool) -> str | None:
    """A finished sequence's finish reason: "tool_calls" when it called and ended by itself."""
    return "tool_calls" if called and seq.finish_reason == "stop" else seq.finish_reason
