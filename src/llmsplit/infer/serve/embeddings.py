"""Embeddings: OpenAI's POST /v1/embeddings and Ollama's /api/embed and /api/embeddings, from
the served model's final hidden states pooled over each input (`LoadedModel.embed`: the last
token's, or their mean, as `serve --pooling` says), normalized to unit length.

The forward runs on the engine thread between generation steps (`EngineThread.call`: the one
thread that uses the model), one input at a time, so a batch of embeddings shares the model
with the streams being generated instead of racing them. Inputs are text (through the model's
tokenizer, no chat template) or token ids; each must fit the context. Embeddings come from the
base model: a request naming a --lora adapter is refused.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Literal

import torch
from fastapi import Request
from pydantic import BaseModel, ConfigDict

from .protocol import APIError, refuse_fields, refuse_lone_surrogates

# Fields of OpenAI's request not implemented here, at the value that asks for nothing.
UNSUPPORTED = {"dimensions": None}
OLLAMA_UNSUPPORTED = {"dimensions": None}
OLLAMA_IGNORED = frozenset({"keep_alive", "options"})  # how long the model stays loaded; runtime options


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept so that the others can be refused by name

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"

    def refuse_unsupported(self) -> None:
        refuse_fields(self.model_extra, UNSUPPORTED,
                      hints={"dimensions": " by this server: the vectors have the model's hidden size"})
        refuse_lone_surrogates(self)


class OllamaEmbedRequest(BaseModel):
    """/api/embed (`input`) and the older /api/embeddings (`prompt`)."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | None = None
    prompt: str | None = None
    truncate: bool = True

    def refuse_unsupported(self) -> None:
        refuse_fields(self.model_extra, OLLAMA_UNSUPPORTED, ignored=OLLAMA_IGNORED)
        refuse_lone_surrogates(self)


class EmbeddingRoutes:
    """The embedding routes, mixed into the server: its parsing, tokenizer and engine thread."""

    def add_embedding_routes(self, app) -> None:
        app.post("/v1/embeddings")(self.embeddings)
        app.post("/api/embed")(self.ollama_embed)
        app.post("/api/embeddings")(self.ollama_embeddings)

    async def embeddings(self, request: Request):
        body = await self._parse(request, EmbeddingRequest)
        self._embedding_model(self._adapter(body.model), "model")
        inputs = [body.input] if isinstance(body.input, str) or (body.input and isinstance(body.input[0], int)) \
            else body.input
        ids = self._embedding_ids(inputs, "input", truncate=False)
        vectors = await self._embed(ids)
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(v) if body.encoding_format == "base64" else v.tolist()}
                for i, v in enumerate(vectors)]
        used = sum(map(len, ids))
        return {"object": "list", "data": data, "model": body.model or self.name,
                "usage": {"prompt_tokens": used, "total_tokens": used}}

    async def ollama_embed(self, request: Request):
        started = time.monotonic()
        body = await self._parse(request, OllamaEmbedRequest)
        self._embedding_model(self._ollama_adapter(body.model), "model")
        if body.input is None:
            raise APIError(400, "input is required: a string or a list of strings", "input")
        ids = self._embedding_ids([body.input] if isinstance(body.input, str) else body.input, "input", body.truncate)
        vectors = await self._embed(ids)
        return {"model": body.model, "embeddings": vectors.tolist(), "total_duration": _ns(time.monotonic() - started),
                "load_duration": 0, "prompt_eval_count": sum(map(len, ids))}

    async def ollama_embeddings(self, request: Request):
        body = await self._parse(request, OllamaEmbedRequest)
        self._embedding_model(self._ollama_adapter(body.model), "model")
        if body.prompt is None:
            raise APIError(400, "prompt is required (or use /api/embed with input)", "prompt")
        return {"embedding": (await self._embed(self._embedding_ids([body.prompt], "prompt", True)))[0].tolist()}

    def _embedding_model(self, adapter: int, param: str) -> None:
        if adapter:
            raise APIError(400, f"embeddings come from the base model {self.name!r}; a LoRA adapter computes none",
                           param)

    def _embedding_ids(self, inputs: list, param: str, truncate: bool) -> list[list[int]]:
        """Each input's token ids, at most --max-request-items of them, each within the context
        (cut to it with Ollama's truncate, else a 400 naming the input)."""
        if not inputs:
            raise APIError(400, f"{param} is empty; send at least one text", param)
        if len(inputs) > self.max_items:
            raise APIError(400, f"the request holds {len(inputs):,} inputs; this server takes at most "
                                f"{self.max_items:,} per request (--max-request-items)", param,
                           code="request_too_large")
        context = self.scheduler.max_context
        ids = [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]
        for i, one in enumerate(ids):
            if not one:
                raise APIError(400, f"{param}[{i}] is empty", param)
            # Ids sent as ids are checked; the tokenizer's own are in the vocabulary by construction.
            if not isinstance(inputs[i], str) and any(not 0 <= t < self.model.config.vocab_size for t in one):
                raise APIError(400, f"{param}[{i}] holds a token id outside the vocabulary", param)
            if len(one) > context and not truncate:
                raise APIError(400, f"{param}[{i}] has {len(one)} tokens; the context holds {context}", param,
                               code="context_length_exceeded")
        return [one[:context] for one in ids]

    async def _embed(self, ids: list[list[int]]) -> torch.Tensor:
        future = self.scheduler.call(lambda: self.model.embed(ids))
        return await asyncio.wrap_future(future)


def _base64(vector: torch.Tensor) -> str:
    """OpenAI's base64 encoding: the float32 values' little-endian bytes."""
    return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
