"""OpenAI's response and stream-chunk objects for one request, tool calls included.

A chat request with tools gets its calls back as `tool_calls` in OpenAI's shape. With
tool_choice "required" or a named function the model's text is held by a grammar to
{"name": ..., "arguments": {...}} for one of the offered functions (`forced_call_schema`),
so the call always parses; with "auto" the model writes calls the way chat templates that
render tools ask for them, as JSON inside <tool_call>...</tool_call> (the Hermes format of
Qwen2.5, Hermes and SmolLM3's templates), and the text around them stays the content.
"""

from __future__ import annotations

import json
import re
import time
import uuid

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def forced_call_schema(functions: list[dict], name: str | None) -> dict:
    """The JSON schema of a call to the function `name`, or to any of `functions` (None)."""
    chosen = [f for f in functions if name is None or f["name"] == name]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class Reply:
    """`tools`: None (plain text), "forced" (the whole text is one call) or "auto" (calls
    found in the text)."""

    def __init__(self, model: str, chat: bool, seqs, tools: str | None = None):
        self.model, self.chat, self.seqs, self.tools = model, chat, seqs, tools
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        prompt = sum(len(s.prompt) for s in self.seqs)
        completion = sum(len(s.tokens) for s in self.seqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def message(self, seq) -> tuple[dict, str | None]:
        """The assistant's message for a finished sequence, and its finish reason."""
        calls, content = self._calls(seq.text) if self.tools and seq.finish_reason == "stop" else ([], seq.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            return message, "tool_calls"
        return message, seq.finish_reason

    def _calls(self, text: str) -> tuple[list[dict], str | None]:
        if self.tools == "forced":
            found, rest = [text], ""
        else:
            found, rest = TOOL_CALL.findall(text), TOOL_CALL.sub("", text).strip()
        calls = []
        for raw in found:
            try:
                call = json.loads(raw)
                name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
            except (ValueError, KeyError, TypeError):  # not a call after all: left in the content
                return [], text
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        return calls, (rest or None) if calls else text

    def whole(self) -> dict:
        if self.chat:
            choices = []
            for i, s in enumerate(self.seqs):
                message, finish = self.message(s)
                choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": finish})
        else:
            choices = [{"index": i, "text": s.text, "logprobs": None, "finish_reason": s.finish_reason}
                       for i, s in enumerate(self.seqs)]
        return {**self._head(False), "choices": choices, "usage": self.usage()}

    def chunk(self, index: int, text: str = "", finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def last_chunk(self, index: int, seq) -> dict:
        """A streamed sequence's end. With tools its text was held back (a call must be whole
        to be parsed): it comes here, as content or as tool-call deltas."""
        if not (self.chat and self.tools):
            return self.chunk(index, finish=seq.finish_reason)
        message, finish = self.message(seq)
        delta = {"content": message["content"]} if message["content"] else {}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        return {**self._head(True), "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish}]}

    def usage_chunk(self) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage()}
