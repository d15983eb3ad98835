"""The request body of OpenAI's Responses API (/v1/responses), the subset vLLM serves.

Stateless: nothing is stored, so `previous_response_id` (and `conversation`) are a 400 and
`store` is accepted and changes nothing. The input is a string or a list of messages (content
a string or `input_text` parts, `output_text` for earlier assistant turns), `instructions` a
system message before it, `text.format` the answer's structure (text, any JSON object, or JSON
held to a schema), with `max_output_tokens`, `temperature`, `top_p` and vLLM's `top_k`, `seed`
and `ignore_eos`. As on the other routes (protocol.py) the fields are an allow list: those that
change nothing in an answer (protocol.IGNORED) are accepted, those that would but are not
implemented are accepted only at the value that asks for nothing, anything else is a 400
naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine import SamplingParams
from .protocol import (SEED_RANGE, APIError, JSONSchemaFormat, ResponseFormat, engine_checked, refuse_fields,
                       refuse_lone_surrogates)

# Responses fields not implemented here, each with the value that asks for nothing (null for
# the stateful ones: STATEFUL).
STATEFUL = ("previous_response_id", "conversation")
UNSUPPORTED: dict[str, Any] = {
    "tools": [], "tool_choice": "none", "truncation": "disabled", "background": False, "include": [],
    "reasoning": None, "max_tool_calls": None, "top_logprobs": 0, "prompt": None, **dict.fromkeys(STATEFUL),
}
HINTS = {
    "tools": " on /v1/responses yet; use /v1/chat/completions",
    "tool_choice": " on /v1/responses yet; use /v1/chat/completions",
    "previous_response_id": " by this server: it stores no responses (it is stateless); send the whole conversation "
                            "as input",
    "conversation": " by this server: it stores no conversations (it is stateless); send the whole conversation as "
                    "input",
}


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back as history
    text: str


class InputMessage(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    json_schema: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def as_response_format(self) -> ResponseFormat:
        """The chat route's response_format that asks for the same (server._grammar compiles it)."""
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        if self.json_schema is None:
            raise APIError(400, "text.format of type json_schema needs its schema", "text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name=self.name, schema=self.json_schema, description=self.description, strict=self.strict))


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept so that the others can be refused by name

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)  # vLLM's extensions
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    ignore_eos: bool = False
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored either way
    metadata: dict[str, str] | None = None  # echoed back, as OpenAI does

    def refuse_unsupported(self) -> None:
        """The 400 for a field this server would otherwise ignore, or for text that is not Unicode."""
        refuse_fields(self.model_extra, UNSUPPORTED, hints=HINTS)
        refuse_lone_surrogates(self)

    def messages(self) -> list[dict]:
        """What the chat template renders: the instructions as a system message, then the input."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*head, {"role": "user", "content": self.input}]
        return [*head, *(m.as_template_input() for m in self.input)]

    def response_format(self) -> ResponseFormat | None:
        return self.text.format.as_response_format() if self.text and self.text.format else None

    def sampling(self, max_tokens: int, stops: list[str], vocab_size: int) -> SamplingParams:
        return engine_checked(SamplingParams(max_tokens, self.temperature, self.top_k,
                                             None if self.top_p >= 1 else self.top_p, self.seed, stops,
                                             self.ignore_eos), vocab_size)
