"""The OpenAI API's request bodies and error shape, as the server accepts them.

Fields follow OpenAI's reference for /v1/completions and /v1/chat/completions, with vLLM's
`top_k` and `ignore_eos` extensions. What is accepted is an allow list: the fields implemented
here, the fields that change nothing in an answer (`IGNORED`: user, metadata, ... accepted and
ignored, as vLLM does), and the fields of `UNSUPPORTED` at the values that ask for nothing.
Anything else, a field of OpenAI's that would change the answer or a name this server does not
know, is a 400 naming it, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...errors import ConfigError
from ..engine.sequence import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """A request the server answers with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Fields that would change the answer but are not implemented yet, each with the value that
# asks for nothing (clients often send defaults explicitly): any other value is refused with a
# 400 naming the field. A field leaves this table when it is implemented.
UNSUPPORTED: dict[str, Any] = {
    "suffix": "",
    "functions": [], "function_call": "none",  # the deprecated names of tools / tool_choice
    "modalities": ["text"], "audio": None,  # spoken answers: this server writes text only
}
MOST_SAMPLES = 128  # n and best_of: beyond, a 400 (the batch and queue bound the rest)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit) and of stop_token_ids
# Fields that change nothing in the answer's content: tracking, storage and latency hints.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                     "safety_identifier", "prediction"})
# What a message may carry besides role and content, all of it passed to the chat template
# (tool calls, their results, names, and the reasoning that Qwen3/DeepSeek templates render).
MESSAGE_FIELDS = frozenset({"name", "tool_calls", "tool_call_id", "refusal", "reasoning_content"})

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    json_schema: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`json_object`: any JSON object; `json_schema`: JSON valid against its schema (both
    enforced while sampling, infer/grammar.py)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def schema_or_none(self) -> dict | None:
        if self.type == "json_schema" and self.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs its json_schema", "response_format")
        return self.json_schema.json_schema if self.type == "json_schema" else None


class Function(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept so that UNSUPPORTED fields can be refused

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    # Logit processors (engine/sampler.py), OpenAI's and vLLM's names and ranges.
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_p: float = Field(0.0, ge=0, le=1)
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)  # token ids as JSON keys
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    n: int = Field(1, ge=1, le=MOST_SAMPLES)  # samples per prompt, sharing its KV blocks

    def refuse_unsupported(self) -> None:
        """The 400 for a field this server would otherwise ignore, or for text that is not Unicode."""
        refuse_fields(self.model_extra, UNSUPPORTED)
        for i, message in enumerate(getattr(self, "messages", ())):
            unknown = sorted(set(message.model_extra or ()) - MESSAGE_FIELDS)
            if unknown:
                raise APIError(400, f"messages[{i}].{unknown[0]} is not a field of a message this server knows; "
                                    f"remove it", f"messages.{i}.{unknown[0]}", code="unsupported_parameter")
        refuse_lone_surrogates(self)

    def sampling(self, max_tokens: int, stops: list[str], vocab_size: int, logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for this request; a 400 naming the field for a value the
        engine refuses (min_tokens above max_tokens, a token id outside the vocabulary)."""
        return engine_checked(SamplingParams(
            max_tokens, self.temperature, self.top_k, None if self.top_p >= 1 else self.top_p, self.seed, stops,
            self.ignore_eos, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p, logit_bias=self.logit_bias or None,
            min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs), vocab_size)

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or not all(stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", "stop")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the likeliest tokens listed per position
    echo: bool = False  # the prompt comes back before the completion (with its log-probabilities)
    best_of: int | None = Field(None, ge=1, le=MOST_SAMPLES)  # samples drawn; the n likeliest come back

    def samples(self) -> int:
        """How many sequences each prompt runs: best_of (at least n), or n."""
        if self.best_of is None or self.best_of == self.n:
            return self.n
        if self.best_of < self.n:
            raise APIError(400, f"best_of {self.best_of} must be at least n {self.n}", "best_of")
        if self.stream:
            raise APIError(400, "best_of above n cannot be streamed (the best are known only at the end)", "best_of")
        return self.best_of

    def scoring(self) -> tuple[int | None, int | None, bool]:
        """(logprobs per generated token, per prompt token, score only): max_tokens 0 with
        echo scores the prompt and shows no completion (what lm-eval's loglikelihood sends)."""
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 generates nothing; it is allowed with echo, to score the prompt",
                           "max_tokens")
        return self.logprobs, self.logprobs if self.echo else None, self.max_tokens == 0


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may use name, tool_calls, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprob_count(self) -> int | None:
        """How many likeliest tokens to list per generated token (None: no log-probabilities)."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def tool_mode(self) -> tuple[str | None, str | None]:
        """("forced", function name or None for any) when a call is required, ("auto", None)
        when the model may call, (None, None) without tools; a 400 for a choice that names
        no offered function."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice == "none":
            return None, None
        if not self.tools:
            raise APIError(400, "tool_choice asks for a tool call but no tools were given", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                               "tool_choice")
            return "forced", choice.function.name
        return ("forced", None) if choice == "required" else ("auto", None)


def check_fits(prompt_lengths: list[int], max_tokens: int, max_context: int, most_sequences: int,
               prompt_param: str) -> None:
    """A 400 for a request this server could never hold, which would otherwise wait (or get 429)
    forever or be cut short silently: more prompts than the batch and the queue hold together,
    or a prompt plus max_tokens beyond the context (a 400 in OpenAI's API too)."""
    if len(prompt_lengths) > most_sequences:
        raise APIError(400, f"{len(prompt_lengths)} prompts in one request, but this server holds at most "
                            f"{most_sequences} sequences at once (--max-batch plus --max-queue); send fewer",
                       prompt_param)
    longest = max(prompt_lengths, default=0)
    if longest >= max_context:
        raise APIError(400, f"the prompt has {longest} tokens but this model's context holds {max_context}; "
                            f"shorten it", prompt_param, code="context_length_exceeded")
    if longest + max_tokens > max_context:
        raise APIError(400, f"this model's maximum context length is {max_context} tokens, but {longest + max_tokens} "
                            f"were requested ({longest} in the prompt, {max_tokens} for the completion); lower "
                            f"max_tokens to at most {max_context - longest}", "max_tokens",
                       code="context_length_exceeded")


def refuse_fields(extra: dict | None, unsupported: dict, ignored=IGNORED, hints: dict | None = None,
                  where: str = "") -> None:
    """The allow list of every API this server speaks: each field of `extra` (pydantic's
    model_extra, the fields a request model does not declare) is a 400 naming it, unless it is
    `ignored` or one of `unsupported` at the value that asks for nothing (or null). `hints`: what
    follows "is not supported" for a field (default " by this server"); `where`: the path of the
    object the fields are in ("options.", "messages[2].")."""
    for name, value in (extra or {}).items():
        if name in ignored or (name in unsupported and value in (None, unsupported[name])):
            continue
        shown = _shown(f"{where}{name}", value)
        why = (f"not supported{(hints or {}).get(name, ' by this server')}" if name in unsupported
               else "not a field of this server; remove it")
        raise APIError(400, f"{shown} is {why}", f"{where}{name}", code="unsupported_parameter")


def refuse_lone_surrogates(request: BaseModel) -> None:
    """A 400 naming the first field whose text holds a lone UTF-16 surrogate: JSON's \\ud800
    escapes can spell half of a pair, and no tokenizer can encode that."""
    where = lone_surrogate(request.model_dump(), "")
    if where is not None:
        raise APIError(400, f"{where or 'the request'} holds a lone surrogate (half of a UTF-16 pair), which is not "
                            f"Unicode text", where or None)


def engine_checked(params: SamplingParams, vocab_size: int | None = None,
                   terms: Callable[[str], str] = lambda text: text) -> SamplingParams:
    """`params` once the engine accepts them (SamplingParams.check, and check_ids with a
    vocabulary), else a 400: the engine's message in the request's own terms (`terms` renames
    its parameters, as Ollama's), naming the field its first word is."""
    try:
        params.check()
        if vocab_size is not None:
            params.check_ids(vocab_size)
    except ConfigError as e:
        text = terms(str(e))
        raise APIError(400, text, text.split()[0]) from None
    return params


def _shown(name: str, value) -> str:
    if isinstance(value, (dict, list)):
        return name  # a tool list or a schema is too long to repeat
    text = repr(value)
    return f"{name}={text if len(text) <= 40 else text[:37] + '...'}"


def lone_surrogate(value, where: str) -> str | None:
    """The dotted path of the first string in `value` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = lone_surrogate(key, where) if isinstance(key, str) else None
        if found is None:
            found = lone_surrogate(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None
