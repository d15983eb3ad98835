"""Tool calls the model writes into its reply (tool_choice "auto"), found as the reply is read.

Chat templates that render tools ask for calls in one of a few formats; `PARSERS` has one
entry per format, and `pick_parser` chooses by the template's text (`serve --tool-call-parser
auto`) or by name:

- hermes: JSON inside <tool_call>...</tool_call> (Qwen2.5/Qwen3, Hermes, SmolLM3);
- llama3_json: {"name": ..., "parameters": {...}} (Llama 3.1+), after <|python_tag|> or as
  the reply itself, several separated by ';';
- mistral: [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}}.

The tokenizer decodes without special tokens, so a marker that is one (Mistral's [TOOL_CALLS],
Llama's <|python_tag|>) may not reach the text: a parser's `openers` ("[", "{") start a call
where the reply has had no content yet. One `CallScanner` reads a reply, whole or streamed
piece by piece, so the two always agree: text that may begin a call is held until it is
decided; a call that does not parse (malformed JSON, no "name") stays in the content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_JSON_SIGNIFICANT = re.compile(r'[{}\[\]"\\]')


def as_call(value, strict: bool = False) -> dict | None:
    """OpenAI's tool call for a decoded {"name": ..., "arguments" (or "parameters"): ...};
    None when `value` is not one. `strict`: the arguments must be there (JSON that no marker
    announced may be an answer that happens to have a "name")."""
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    if strict and not isinstance(value.get("arguments", value.get("parameters")), dict):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": arguments}}


def json_call(text: str) -> dict | None:
    """The call that `text` holds as one JSON object, or None."""
    try:
        return as_call(json.loads(text))
    except ValueError:
        return None


def _json_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array that opens at text[start], by its brackets (strings
    skipped); None while it is still open. json.loads checks the rest."""
    depth, in_string, escaped = 0, False, False
    for m in _JSON_SIGNIFICANT.finditer(text, start):
        c = m.group()
        if in_string:
            if escaped:  # this character is the one a backslash escaped
                escaped = False
            elif c == "\\":  # escapes the next character, which matters here only if it is " or \
                escaped = text[m.end():m.end() + 1] in ('"', "\\")
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return m.end()
    return None


# A parser's `read(text, final)`, given the text from where a call may begin: (end, calls)
# when text[:end] is decided, `calls` None when it is no call after all (it stays content);
# None while undecided (more text may come: `final` is False).
Read = Callable[[str, bool], "tuple[int, list[dict] | None] | None"]


def _read_hermes(text: str, final: bool):
    close = text.find(HERMES_CLOSE, len(HERMES_OPEN))
    if close < 0 and not final:
        return None
    # An unclosed call at the end of the reply (a stop string may have cut the close) still counts.
    body_end, end = (close, close + len(HERMES_CLOSE)) if close >= 0 else (len(text), len(text))
    call = json_call(text[len(HERMES_OPEN):body_end])
    return end, None if call is None else [call]


def _read_json(text: str, skip: int, final: bool, opens: str):
    """Calls as one JSON value after text[:skip] (a marker) and whitespace: a call's object, or
    (where `opens` allows "[") a list of them."""
    start = len(text) - len(text[skip:].lstrip())
    if start == len(text):
        return None if not final else (len(text), None)
    if text[start] not in opens:
        return skip, None  # a marker with no JSON after it: plain text
    end = _json_end(text, start)
    if end is None:
        return None if not final else (len(text), None)
    try:
        value = json.loads(text[start:end])
    except ValueError:
        return end, None
    values = value if isinstance(value, list) else [value]
    calls = [as_call(v, strict=skip == 0) for v in values]
    return end, calls if calls and all(calls) else None


def _read_llama3(text: str, final: bool):
    return _read_json(text, len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0, final, "{")


def _read_mistral(text: str, final: bool):
    return _read_json(text, len(MISTRAL_CALLS) if text.startswith(MISTRAL_CALLS) else 0, final, "[{")


@dataclass(frozen=True)
class ToolParser:
    """One format of calls. `markers` open a call anywhere in the reply; `openers` where it has
    had no content yet; `between` is dropped between two calls; `signs` in a chat template's
    text make `auto` pick this parser."""
    name: str
    read: Read
    markers: tuple[str, ...]
    openers: tuple[str, ...] = ()
    between: str = ""
    signs: tuple[str, ...] = ()


# In the order `auto` tries them; a template that renders tools with none of their signs gets hermes.
PARSERS = {p.name: p for p in (
    ToolParser("hermes", _read_hermes, (HERMES_OPEN,), signs=(HERMES_OPEN,)),
    ToolParser("mistral", _read_mistral, (MISTRAL_CALLS,), openers=("[",),
               signs=(MISTRAL_CALLS, "[AVAILABLE_TOOLS]")),
    ToolParser("llama3_json", _read_llama3, (PYTHON_TAG,), openers=("{",), between=";",
               signs=(PYTHON_TAG, "ipython", '"parameters"')),
)}


def pick_parser(choice: str, template: str) -> ToolParser | None:
    """The parser `--tool-call-parser choice` names; for "auto" the first whose signs are in the
    chat `template` (else hermes); None for "none" (calls stay plain content)."""
    if choice == "none":
        return None
    if choice != "auto":
        assert choice in PARSERS, choice  # InferConfig checked it
        return PARSERS[choice]
    return next((p for p in PARSERS.values() if any(s in template for s in p.signs)), PARSERS["hermes"])


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a marker."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class CallScanner:
    """One reply's content and calls, as its text comes (`feed`); the whole reply is one feed
    with `final`. Whitespace next to a call is dropped (before it always, after it while the
    reply has had no content); with no call, the content is the text unchanged."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text, self.pos = parser, "", 0  # text[:pos] is decided
        self.blank = ""  # whitespace held: dropped if a call comes next, else sent with what does
        self.calls = 0
        self.after_call = False
        self.no_content = True  # only whitespace and calls so far: where `openers` count

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        """The content and the calls decided once `piece` is added (`final`: the reply's end)."""
        self.text += piece
        content, calls = [], []
        while self.pos < len(self.text):
            rest = self.text[self.pos:]
            bare = rest.lstrip()
            if self.after_call and self.parser.between and bare.startswith(self.parser.between):
                self.pos += len(rest) - len(bare) + len(self.parser.between)
                continue
            at = self._start(rest, bare)
            if at is None:
                keep = 0 if final else _held_tail(rest, self.parser.markers)
                content.append(self._content(rest[:len(rest) - keep]))
                self.pos += len(rest) - keep
                break
            content.append(self._content(rest[:at]))
            self.pos += at
            decided = self.parser.read(rest[at:], final)
            if decided is None:
                break
            end, found = decided
            assert end > 0
            if found is None:
                content.append(self._content(rest[at:at + end]))
            else:
                calls += found
                self.blank, self.after_call = "", True
            self.pos += end
        self.calls += len(calls)
        if final and not self.calls:
            content.append(self.blank)
            self.blank = ""
        return "".join(content), calls

    def _start(self, rest: str, bare: str) -> int | None:
        found = [i for i in (rest.find(m) for m in self.parser.markers) if i >= 0]
        if self.no_content and any(bare.startswith(o) for o in self.parser.openers):
            found.append(len(rest) - len(bare))
        return min(found, default=None)

    def _content(self, text: str) -> str:
        text = self.blank + text
        if self.after_call and self.no_content:
            text = text.lstrip()
        body = text.rstrip()
        self.blank = text[len(body):]
        self.no_content = self.no_content and not body
        return body
