"""Ollama's API's request bodies (/api/chat, /api/generate, /api/show), as the server accepts them.

As for OpenAI's API (protocol.py), what is accepted is an allow list: the fields implemented
here, those that change nothing in an answer (`IGNORED_OPTIONS`: where the model runs, how
many threads; `keep_alive`), and Ollama's fields that are not implemented at the value that
asks for nothing (`UNSUPPORTED`, `UNSUPPORTED_OPTIONS`). Anything else, at the top, in
`options` or in a message, is a 400 naming it rather than an answer made without it.

`options` map onto the engine's SamplingParams with Ollama's defaults (temperature 0.8,
top_k 40, top_p 0.9), except repeat_penalty, off (1.0) unless asked: Ollama's own Go engine
applies no penalty either (ollama/ollama#15783), and the penalties here have vLLM's meanings
over the whole sequence (engine/sampler.py), not llama.cpp's window of the last 64 tokens.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine import SamplingParams
from .protocol import SEED_RANGE, APIError, engine_checked, refuse_fields, refuse_lone_surrogates

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, where a request sets none
MAX_STOPS = 16  # Ollama sets no limit; this one bounds the stop strings checked at every token
# The engine's names for what Ollama calls otherwise, so that a refusal names the field sent.
OLLAMA_NAMES = {"max_new_tokens": "num_predict", "max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}

# Ollama's fields this server does not implement, each with the value that asks for nothing.
UNSUPPORTED: dict[str, Any] = {
    "suffix": "", "images": [], "context": [], "tools": [], "think": False, "logprobs": False, "top_logprobs": 0,
    "template": "", "width": None, "height": None, "steps": None,
}
HINTS = {  # what follows "is not supported" (protocol.refuse_fields)
    "template": " by this server; the model's own chat template renders the prompt (or send raw: true with a "
                "prompt formatted already)",
    "context": " by this server; send the conversation as messages to /api/chat",
    "tools": " by this server on /api/chat yet; use /v1/chat/completions with tools",
}
# Options for where and how the model runs, not for what it writes: the server decided those
# at its start. num_keep only matters when Ollama shifts a full context, which is refused here,
# and mirostat's settings only once mirostat is on, which is refused too.
IGNORED_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "num_thread", "use_mmap",
                             "use_mlock", "num_keep", "mirostat_tau", "mirostat_eta", "f16_kv"})
UNSUPPORTED_OPTIONS: dict[str, Any] = {
    "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "penalize_newline": True, "logits_all": False,
    "vocab_only": False, "embedding_only": False,
}
# What a message may carry besides role and content, at the value that asks for nothing.
MESSAGE_UNSUPPORTED: dict[str, Any] = {"images": [], "tool_calls": [], "tool_name": "", "thinking": ""}


class Options(BaseModel):
    """Ollama's `options` that this server applies (None: Ollama's default). Value ranges are
    the engine's (SamplingParams.check), named here by Ollama's names."""
    model_config = ConfigDict(extra="allow")  # kept so that the others can be refused by name

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or less: no top-k, as in llama.cpp
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # -1: a random seed, as in Ollama
    stop: str | list[str] | None = None
    num_predict: int | None = None  # -1 (Ollama's default) or -2: up to the end of the context
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_last_n: int | None = None  # -1: the whole context, the only window the penalties have here
    num_ctx: int | None = Field(None, ge=1)


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None: the served base model
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict | None = None  # "json": any JSON object; a dict: a JSON schema; "": free text
    options: Options | None = None
    keep_alive: float | str | None = None  # accepted and ignored: the model stays loaded while the server runs

    def refuse_unsupported(self) -> None:
        """The 400 for a field this server would otherwise ignore, or for text that is not Unicode."""
        refuse_fields(self.model_extra, UNSUPPORTED, (), HINTS)
        if isinstance(self.format, str) and self.format not in ("", "json"):
            raise APIError(400, f"format={self.format[:40]!r} must be \"json\" or a JSON schema (an object)")
        options = self.options or Options()
        refuse_fields(options.model_extra, UNSUPPORTED_OPTIONS, IGNORED_OPTIONS, where="options.")
        for i, message in enumerate(getattr(self, "messages", ())):
            refuse_fields(message.model_extra, MESSAGE_UNSUPPORTED, (), where=f"messages[{i}].")
        refuse_lone_surrogates(self)

    def context(self, served: int) -> int:
        """The tokens this request may fill: options.num_ctx, at most the server's context."""
        num_ctx = self.options.num_ctx if self.options else None
        if num_ctx is not None and num_ctx > served:
            raise APIError(400, f"options.num_ctx={num_ctx} is above this server's context of {served} tokens "
                                f"(--max-context); ask for at most {served}")
        return num_ctx or served

    def sampling(self, room: int, stops: list[str]) -> SamplingParams:
        """The engine's parameters; `room`: the context left after the prompt, where an answer
        without num_predict may run (and where a larger num_predict stops, as Ollama's does)."""
        o = self.options or Options()
        if o.num_predict is not None and not (o.num_predict >= 1 or o.num_predict in (-1, -2)):
            raise APIError(400, f"options.num_predict={o.num_predict} must be -1 (up to the end of the context), "
                                f"-2 or at least 1")
        asked = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
        if len(asked) > MAX_STOPS or not all(asked):
            raise APIError(400, f"options.stop takes up to {MAX_STOPS} non-empty strings")
        penalties = (o.repeat_penalty not in (None, 1), bool(o.presence_penalty), bool(o.frequency_penalty))
        if any(penalties) and o.repeat_last_n not in (None, -1):
            raise APIError(400, f"options.repeat_last_n={o.repeat_last_n} is not supported by this server: its "
                                f"penalties look at the whole sequence (-1), not at its last tokens; send -1")
        top_k, top_p = _given(o.top_k, "top_k"), _given(o.top_p, "top_p")
        params = SamplingParams(
            min(o.num_predict, room) if o.num_predict and o.num_predict > 0 else room,
            _given(o.temperature, "temperature"), top_k if top_k > 0 else None, top_p if top_p < 1 else None,
            None if o.seed == -1 else o.seed, stops + asked, min_p=o.min_p or 0.0,
            repetition_penalty=1.0 if o.repeat_penalty is None else o.repeat_penalty,
            presence_penalty=o.presence_penalty or 0.0, frequency_penalty=o.frequency_penalty or 0.0)
        return engine_checked(params, terms=ollama_terms)


class GenerateRequest(_Request):
    prompt: str = ""  # empty: only load the model (Ollama's way to preload one)
    system: str | None = None  # the system message the model's chat template renders before the prompt
    raw: bool = False  # the prompt as it is, no chat template


class ChatRequest(_Request):
    messages: list[OllamaMessage] = []  # none: only load the model, as for /api/generate


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # what older clients send instead of model
    verbose: bool = False  # Ollama lists the tokenizer's vocabulary then; no such lists here either way

    def refuse_unsupported(self) -> None:
        refuse_fields(self.model_extra, {}, ())


def ollama_terms(message: str) -> str:
    """An engine's message with its parameter names as Ollama calls them (`options.` in front)."""
    first, _, rest = message.partition(" ")
    return f"options.{OLLAMA_NAMES.get(first, first)} {rest}"


def _given(value, name: str):
    return DEFAULTS[name] if value is None else value
