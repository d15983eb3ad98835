"""The OpenAI API's request bodies and error shape, as the server accepts them.

Fields follow OpenAI's reference for /v1/completions and /v1/chat/completions, with vLLM's
`top_k` and `ignore_eos` extensions; fields that would change the answer but are not
implemented (n > 1, logprobs, echo) are refused rather than silently ignored, and the rest
of OpenAI's optional fields (user, metadata, ...) are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """A request the server answers with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool | int | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; send n separate requests", "n")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported by this server", "logprobs")

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or not all(stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", "stop")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", "echo")


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
