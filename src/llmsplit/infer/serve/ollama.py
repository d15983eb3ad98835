"""Ollama's API on the same server as OpenAI's (`llmsplit serve`), so that Ollama's clients and
the apps built on them work unchanged: /api/version, /api/tags, /api/show, /api/ps,
/api/chat and /api/generate (NDJSON streams, Ollama's default, or one JSON object with
`"stream": false`).

The routes are mixed into the server (`OllamaRoutes`), so a request goes the way an OpenAI
one does: its body counted and parsed (request_body.py), its messages through the model's
chat template under the same limits, `format` through the same grammars, its sequence to the
same engine thread and batched with the OpenAI requests. Only the shapes differ: Ollama's
request fields (ollama_protocol.py), its replies with their figures (`Answer`), and its errors,
`{"error": "..."}` (edge.error_body). Model management (pull, create, ...) is a 501: this
server serves the models it was started with. /api/embed and /api/embeddings: embeddings.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..chat import chat_prompt
from .channel import Channel
from .engine_thread import Request as Work
from .ollama_protocol import ChatRequest, GenerateRequest, ShowRequest
from .protocol import APIError, check_fits

OLLAMA_VERSION = "0.12.0"  # the Ollama release whose API this mirrors (clients check it before using newer fields)
LATEST = ":latest"  # Ollama's default tag: "llama" and "llama:latest" are one model
NOT_HERE = {  # Ollama's routes this server answers with a 501 that says why
    "/api/pull": ["POST"], "/api/push": ["POST"], "/api/create": ["POST"], "/api/copy": ["POST"],
    "/api/delete": ["DELETE"], "/api/blobs/{digest}": ["HEAD", "POST"],
}
NDJSON = "application/x-ndjson"


class Answer:
    """One request's Ollama-shaped objects: a piece of text while it streams, then the last one
    with Ollama's figures (durations in nanoseconds, as Ollama gives them)."""

    def __init__(self, model: str, chat: bool, started: float):
        self.model, self.chat, self.started = model, chat, started
        self.submitted = None  # when the engine got it

    def _object(self, text: str, done: bool) -> dict:
        out = {"model": self.model, "created_at": _now()}
        out.update({"message": {"role": "assistant", "content": text}} if self.chat else {"response": text})
        out["done"] = done
        return out

    def piece(self, text: str) -> dict:
        return self._object(text, False)

    def last(self, seq, text: str = "") -> dict:
        """The end of an answer, with its whole `text` unless it was streamed. The prompt's time
        runs from when the engine admitted the sequence to its first token (the time it waited in
        the queue is in total_duration only), the answer's from its first token to its last."""
        end = time.monotonic()
        first = seq.first_token_at or end
        return {**self._object(text, True), "done_reason": seq.finish_reason,
                "total_duration": _ns(end - self.started), "load_duration": 0,  # loaded before the server started
                "prompt_eval_count": len(seq.prompt),
                "prompt_eval_duration": _ns(first - (seq.admitted_at or self.submitted)),
                "eval_count": len(seq.tokens), "eval_duration": _ns(seq.last_token_at - first)}

    def loaded(self) -> dict:
        """Ollama's answer to a request with nothing to generate, which clients send to load a model."""
        return {**self._object("", True), "done_reason": "load"}


class OllamaRoutes:
    """Ollama's routes, mixed into the server: they use its parsing, templates, grammars and
    engine thread (self._parse, self._off_loop, self._grammar, self.scheduler ...)."""

    def add_ollama_routes(self, app) -> None:
        app.get("/api/version")(self.ollama_version)
        app.get("/api/tags")(self.ollama_tags)
        app.post("/api/show")(self.ollama_show)
        app.get("/api/ps")(self.ollama_ps)
        app.post("/api/chat")(self.ollama_chat)
        app.post("/api/generate")(self.ollama_generate)
        for path, methods in NOT_HERE.items():
            app.api_route(path, methods=methods)(self.ollama_not_here)

    # ------------------------------------------------------------ what is served

    async def ollama_version(self):
        return {"version": OLLAMA_VERSION}

    async def ollama_tags(self):
        return {"models": [self._ollama_card(m) for m in self.models]}

    async def ollama_ps(self):
        # Every served model is loaded as long as the server runs: no expires_at to give.
        return {"models": [{**self._ollama_card(m), "context_length": self.scheduler.max_context}
                           for m in self.models]}

    async def ollama_show(self, request: Request):
        body = await self._parse(request, ShowRequest)
        model = self.models[self._ollama_adapter(body.model or body.name)]
        cfg, details = self.model.config, self._ollama_card(model)["details"]
        arch = details["family"]
        return {"modelfile": f"# llmsplit serves this model; it has no Modelfile\nFROM {model}\n",
                "parameters": "", "template": "", "details": details,
                "model_info": {"general.architecture": arch, "general.parameter_count": cfg.num_params(),
                               f"{arch}.context_length": self.scheduler.max_context,
                               f"{arch}.embedding_length": cfg.dim, f"{arch}.block_count": cfg.n_layers,
                               f"{arch}.attention.head_count": cfg.n_heads,
                               f"{arch}.attention.head_count_kv": cfg.n_kv_heads or cfg.n_heads},
                "capabilities": ["completion"], "modified_at": self._ollama_files[1]}

    async def ollama_not_here(self, request: Request):
        what = request.url.path
        raise APIError(501, f"{what} is not supported: this server serves the models it was started with "
                            f"({', '.join(self.models)}; --model and --lora)")

    def _ollama_card(self, model: str) -> dict:
        """/api/tags' entry for a served model. size and digest are those of --model's files
        (hashing the weights would read every byte): the digest changes when they do."""
        size, modified, fmt, where = self._ollama_files
        digest = hashlib.sha256(f"{model}\n{where}\n{size}\n{modified}".encode()).hexdigest()
        family = self.model.config.family or "llama"
        details = {"parent_model": "" if model == self.name else self.name, "format": fmt, "family": family,
                   "families": [family], "parameter_size": _count(self.model.config.num_params()),
                   "quantization_level": ""}
        return {"name": model, "model": model, "modified_at": modified, "size": size, "digest": digest,
                "details": details}

    @cached_property
    def _ollama_files(self) -> tuple[int, str, str, str]:
        """(bytes, modification time, format, path) of --model: its file, or the files directly in
        its folder (a training run's checkpoints, in folders of their own, are not counted)."""
        path = Path(self.path).resolve() if self.path else None
        if path is None or not path.exists():
            return 0, _now(self.created), "", ""
        files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
        stats = [f.stat() for f in files]
        fmt = "gguf" if path.is_file() else "safetensors" if (path / "config.json").is_file() else "llmsplit"
        return (sum(s.st_size for s in stats), _now(max((s.st_mtime for s in stats), default=self.created)), fmt,
                str(path))

    def _ollama_adapter(self, model: str | None) -> int:
        if model and model.endswith(LATEST) and model not in self.models:
            model = model[:-len(LATEST)]
        return self._adapter(model)

    # ------------------------------------------------------------ answers

    async def ollama_generate(self, request: Request):
        started = time.monotonic()
        body = await self._parse(request, GenerateRequest)
        adapter = self._ollama_adapter(body.model)
        answer = Answer(body.model or self.name, False, started)
        if not body.prompt:
            return answer.loaded()
        if body.raw:
            if body.system:
                raise APIError(400, "system is not applied to a raw prompt (no chat template renders it); put it "
                                    "in the prompt, or drop raw")
            ids = await self._off_loop("prompt", "tokenizing the prompt", self.tokenizer.encode, body.prompt)
            stops = []
        else:
            messages = [{"role": "system", "content": body.system}] if body.system else []
            ids, stops = await self._ollama_render([*messages, {"role": "user", "content": body.prompt}])
        return await self._ollama_answer(request, body, ids, stops, adapter, answer, "prompt")

    async def ollama_chat(self, request: Request):
        started = time.monotonic()
        body = await self._parse(request, ChatRequest)
        adapter = self._ollama_adapter(body.model)
        answer = Answer(body.model or self.name, True, started)
        if not body.messages:
            return answer.loaded()
        ids, stops = await self._ollama_render([{"role": m.role, "content": m.content} for m in body.messages])
        return await self._ollama_answer(request, body, ids, stops, adapter, answer, "messages")

    async def _ollama_render(self, messages: list[dict]) -> tuple[list[int], list[str]]:
        return await self._off_loop("messages", "rendering the chat template", chat_prompt, messages,
                                    self.tokenizer, None, self.template_limits)

    async def _ollama_answer(self, request: Request, body, ids: list[int], stops: list[str], adapter: int,
                             answer: Answer, prompt_param: str):
        context = body.context(self.scheduler.max_context)
        check_fits([len(ids)], 1, context, self._most_sequences(), prompt_param)
        params = body.sampling(context - len(ids), stops)
        if body.format:  # Ollama's "json" is any JSON object, as its own grammar has it
            params.grammar = await self._grammar(None, {"type": "object"} if body.format == "json" else body.format)
        channel = Channel(asyncio.get_running_loop())
        work = self.scheduler.submit([ids], params, channel.put, stream=body.stream, adapter=adapter)
        answer.submitted = time.monotonic()
        if body.stream:
            return StreamingResponse(self._ollama_lines(work, channel, answer), media_type=NDJSON)
        done = await channel.finished(request.receive, 1, lambda: self.scheduler.abort(work))
        return None if done is None else answer.last(done[0], done[0].text)  # None: the client left

    async def _ollama_lines(self, work: Work, channel: Channel, answer: Answer):
        pending = True
        try:
            while pending:
                event = await channel.queue.get()
                if event[0] == "text":
                    line = answer.piece(event[2])
                else:
                    pending = False
                    line = answer.last(event[2]) if event[0] == "finish" else {"error": event[1]}
                yield json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"  # compact, as Ollama's
        finally:
            if pending:  # the client went away mid-stream (this generator was cancelled)
                self.scheduler.abort(work)


def _now(at: float | None = None) -> str:
    """A time as Ollama writes it: RFC 3339 in UTC, to the microsecond."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _count(n: int) -> str:
    """A parameter count as Ollama writes it: 134.52M, 8.0B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
