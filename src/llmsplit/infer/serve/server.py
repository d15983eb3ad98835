"""OpenAI-compatible HTTP server over the engine (`llmsplit serve`), with Ollama's API beside it (ollama.py)
and OpenAI's Responses API (responses.py).

The event loop only parses and relays: chat templates and tokenizing run in worker threads
under a time limit (time_limit.py), an `EngineThread` owns the engine and batches every
live request (continuous batching), and text comes back to each request's asyncio queue as
the engine makes it final. One process serves; with --tp/--pp it is rank
0 of the split model and its worker processes follow the engine's steps.

Safety at the edge (edge.py, before any parsing): /v1 and /api/ routes need the API key when
one is set, bodies are capped in size, heads and bodies must arrive within the request timeout,
and every refusal is a 4xx in OpenAI's error shape (Ollama's on /api/). SIGTERM
or Ctrl-C stops accepting connections and requests, lets in-flight requests finish for up to
the drain timeout, then aborts the rest (their clients get an error event) and frees the model.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from functools import partial

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import ConfigError
from ..chat import DEFAULT_TEMPLATE, TemplateError, TemplateLimitError, TemplateLimits, chat_prompt, compile_template
from ..config import InferConfig
from ..engine import SamplingParams
from ..engine.grammar import Grammars
from .channel import Channel
from .chat_page import add_chat_page
from .edge import Gate, TimedH11Protocol, bind, check_keys, error_body
from .compile_watch import watch_compile
from .engine_thread import EngineThread, QueueFull, Request as Work, ShuttingDown, load_off_the_main_thread
from .metrics import CONTENT_TYPE as PROMETHEUS_TEXT, ServeMetrics
from .ollama import OllamaRoutes
from .embeddings import EmbeddingRoutes
from .responses import ResponsesRoutes
from .protocol import APIError, ChatRequest, CompletionRequest, check_fits
from .request_body import parse_body, validation_error
from .logprobs import TokenTexts
from .replies import Reply, forced_call_schema
from .tool_calls import ToolParser, pick_parser
from .time_limit import OffLoop, TimeLimitExceeded

RETRY_AFTER_S = 1  # a full queue drains as fast as sequences finish; retry soon rather than give up
HEALTH_COUNTS = ("running", "waiting", "kv_blocks_used", "kv_blocks_total")
# After the drain timeout the scheduler fails what is left; uvicorn waits this much longer for
# those error events to reach their clients before it cuts the connections.
DELIVERY_GRACE_S = 5.0


class Server(OllamaRoutes, ResponsesRoutes, EmbeddingRoutes):
    """The app's state and routes over one loaded model (`path`: its files, which /api/tags describes;
    `tool_call_parser`: how tool_choice "auto" reads calls from replies, InferConfig.tool_call_parser)."""

    def __init__(self, model, name: str, max_queue: int = 64, api_key: str | None = None,
                 max_body: int = 1 << 20, announce: str | None = None, request_timeout: float = 10.0,
                 metrics_auth: bool = False, max_items: int = 10_000, template_limits: TemplateLimits | None = None,
                 path=None, tool_call_parser: str = "auto"):
        if max_queue < 0 or max_body < 1 or not request_timeout > 0 or max_items < 1:
            raise ConfigError(f"--max-queue {max_queue} must be 0 or more, --max-request-size {max_body}, "
                              f"--request-timeout {request_timeout} and --max-request-items {max_items} positive")
        self.max_items, self.template_limits = max_items, template_limits or TemplateLimits()
        self.model, self.name, self.announce, self.path = model, name, announce, path
        # The model field picks what answers: the base model's name, or a LoRA adapter's (serve --lora).
        self.models = [name, *model.adapters]
        if len(set(self.models)) < len(self.models):
            raise ConfigError(f"--lora names {model.adapters} repeat a name or the base model's {name!r} "
                              f"(--served-model-name); give each adapter its own name")
        self.tokenizer = model.tokenizer
        # A broken template fails the start, not every chat request.
        compile_template(self.tokenizer.chat_template or DEFAULT_TEMPLATE)
        # How tool_choice "auto" reads calls out of replies (None: they stay plain content).
        self.tool_parser = pick_parser(tool_call_parser, self.tokenizer.chat_template or "")
        self.off_loop = OffLoop(request_timeout)
        self.statuses: dict[int, int] = {}
        self.prometheus = ServeMetrics(self)
        # The engine from here on is the scheduler's: submit, abort and stats are all the server uses.
        self.scheduler = EngineThread(model.engine, max_queue, on_latency=self.prometheus.observe)
        self.grammars = Grammars(self.tokenizer, model.config.vocab_size, self.scheduler.eos_ids)
        self.created = int(time.time())
        self.app = self._app(api_key, max_body, request_timeout, metrics_auth)

    # ------------------------------------------------------------ app

    def _app(self, api_key, max_body, request_timeout, metrics_auth):
        @asynccontextmanager
        async def lifespan(app):
            self.scheduler.start()
            if self.announce:
                print(self.announce, file=sys.stderr, flush=True)
            stop = threading.Event()
            watch_compile(self.model, self.scheduler, stop)  # --compile auto: the background build's step
            try:
                yield
            finally:
                stop.set()
                self.scheduler.stop()

        app = FastAPI(title="llmsplit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        app.get("/v1/models")(self.list_models)
        app.get("/v1/models/{model_id:path}")(self.get_model)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        self.add_ollama_routes(app)
        self.add_responses_routes(app)
        self.add_embedding_routes(app)
        add_chat_page(app)
        for kind, convert in _ERRORS.items():
            app.exception_handler(kind)(_handler(convert))
        app.add_middleware(Gate, api_key=api_key, max_body=max_body, body_timeout=request_timeout,
                           statuses=self.statuses, metrics_auth=metrics_auth)
        return app

    # ------------------------------------------------------------ routes

    async def health(self):
        s = self.scheduler.stats()
        return {"status": "ok", "model": self.name, **{k: s[k] for k in HEALTH_COUNTS}}

    async def metrics(self):
        return Response(self.prometheus.render(), media_type=PROMETHEUS_TEXT)

    async def list_models(self):
        return {"object": "list", "data": [self._model_card(m) for m in self.models]}

    async def get_model(self, model_id: str):
        return self._model_card(self.models[self._adapter(model_id)])

    async def completions(self, request: Request):
        body = await self._parse(request, CompletionRequest)
        adapter = self._adapter(body.model)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        ids = await self._off_loop("prompt", "tokenizing the prompt", _encode_all, self.tokenizer, prompts)
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for p in ids for t in p):
            # Checked here: a bad id would fail the whole batch's step, not just this request.
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        logprobs, prompt_logprobs, score_only = body.scoring()
        max_tokens = 1 if score_only else body.max_tokens or 16  # OpenAI's default
        check_fits([len(p) for p in ids for _ in range(body.samples())], max_tokens, self.scheduler.max_context, self._most_sequences(), "prompt")
        params = body.sampling(max_tokens, body.stops(), vocab, logprobs, prompt_logprobs)
        params.grammar = await self._grammar(body.response_format)
        echo = [p if isinstance(p, str) else self.tokenizer.decode(i) for p, i in zip(prompts, ids)] if body.echo \
            else None
        return await self._answer(request, ids, params, body, chat=False, adapter=adapter, echo=echo,
                                  score_only=score_only)

    async def chat(self, request: Request):
        body = await self._parse(request, ChatRequest)
        adapter = self._adapter(body.model)
        tools, forced = body.tool_mode()
        functions = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
        if tools == "auto" and "tools" not in (self.tokenizer.chat_template or ""):
            raise APIError(400, "this model's chat template does not render tools, so the model would not see "
                                "them; pass tool_choice \"required\" or a named function (the call is then held to "
                                "the function's schema while sampling)", "tools")
        ids, template_stops = await self._off_loop("messages", "rendering the chat template", chat_prompt,
                                                   [m.as_template_input() for m in body.messages],
                                                   self.tokenizer, [t.model_dump(exclude_none=True) for t in
                                                                    body.tools] if tools else None,
                                                   self.template_limits)
        room = max(1, self.scheduler.max_context - len(ids))  # no limit given: up to the end of the context
        max_tokens = body.max_completion_tokens or body.max_tokens or room
        check_fits([len(ids)] * body.n, max_tokens, self.scheduler.max_context, self._most_sequences(), "messages")
        params = body.sampling(max_tokens, body.stops() + template_stops, self.model.config.vocab_size,
                               body.logprob_count())
        if tools == "forced":
            params.grammar = await self._grammar(None, forced_call_schema(functions, forced))
        else:
            params.grammar = await self._grammar(body.response_format)
        reading = self.tool_parser if tools == "auto" else tools  # "forced", a parser, or None: plain text
        return await self._answer(request, [ids], params, body, chat=True, tools=reading, adapter=adapter)

    # ------------------------------------------------------------ helpers

    def _model_card(self, model: str) -> dict:
        card = {"id": model, "object": "model", "created": self.created, "owned_by": "llmsplit",
                "max_model_len": self.scheduler.max_context}
        return card if model == self.name else {**card, "parent": self.name}  # a LoRA adapter over the base

    async def _parse(self, request: Request, kind):
        # Parsed here rather than by FastAPI, which would build every item before any check.
        return parse_body(await request.body(), kind, self.max_items)

    async def _off_loop(self, param: str, what: str, fn, *args):
        try:
            return await self.off_loop.run(fn, *args)
        except TimeLimitExceeded:
            raise APIError(400, f"{what} took longer than {self.off_loop.seconds:g} s (--request-timeout) and was "
                                f"stopped; the model's chat template may loop, or the input is too large", param,
                           code="request_timeout") from None

    def _most_sequences(self) -> int:
        return self.scheduler.max_sequences

    def _adapter(self, model: str | None) -> int:
        """The adapter a request's model field asks for: 0 the base (also when not given), k the k-th --lora."""
        if model is None or model == self.name:
            return 0
        if model not in self.models:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.models))}", "model", code="model_not_found")
        return self.models.index(model)

    async def _grammar(self, response_format, schema: dict | None = None):
        """The grammar a response is held to: a forced tool call's `schema`, else the response
        format's (None: free text). Compiled in a worker thread, under the request time limit."""
        if schema is None and (response_format is None or response_format.type == "text"):
            return None
        schema = schema if schema is not None else response_format.schema_or_none()
        return await self._off_loop("response_format", "compiling the response format into a grammar",
                                    self.grammars.json, schema)

    async def _answer(self, request: Request, ids: list[list[int]], params: SamplingParams, body, chat: bool,
                      tools: str | ToolParser | None = None, adapter: int = 0, echo: list[str] | None = None,
                      score_only: bool = False):
        channel = Channel(asyncio.get_running_loop())
        texts = TokenTexts(self.tokenizer) if params.logprobs is not None else None
        samples = body.n if chat else body.samples()
        if samples > body.n and params.logprobs is None:
            params.logprobs = 0  # best_of ranks the samples by their log-probabilities
        # A forced call's streamed text is held back until it ends: the call is parsed whole.
        work = self.scheduler.submit(ids, params, channel.put, stream=body.stream and tools != "forced",
                                     adapter=adapter, n=samples)
        seqs = work.seqs
        echo = None if echo is None else [text for text in echo for _ in range(samples)]  # one per sequence
        reply = Reply(self.models[adapter], chat, seqs, tools, texts, echo, score_only)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(work, channel, reply, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        # Watch the connection while waiting: a client that gives up must not keep its blocks.
        if await channel.finished(request.receive, len(seqs), lambda: self.scheduler.abort(work)) is None:
            return None  # nobody to answer; its blocks are freed
        return reply.whole(best_of=samples, n=body.n)

    async def _stream(self, work: Work, channel: Channel, reply: Reply, include_usage: bool):
        pending = len(work.seqs)
        try:
            if reply.chat:
                yield _sse(reply.chunk(0, role=True))
            while pending:
                event = await channel.queue.get()
                if event[0] == "text":
                    chunk = reply.chunk(event[1], text=event[2], tokens=event[3])
                    if chunk is not None:  # None: text held back (it may begin a tool call)
                        yield _sse(chunk)
                elif event[0] == "finish":
                    pending -= 1
                    yield _sse(reply.last_chunk(event[1], event[2]))
                else:
                    pending = 0
                    yield _sse(APIError(503, event[1], type="server_error").body())
                    break
            if include_usage:
                yield _sse(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            if pending:  # the client went away mid-stream (this generator was cancelled)
                self.scheduler.abort(work)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _handler(convert):
    async def handle(request, exc) -> JSONResponse:
        err = convert(exc)
        return JSONResponse(error_body(err, request.url.path), status_code=err.status,
                            headers={k: str(v) for k, v in err.headers.items()})

    return handle


# Every failure a request can meet, as the OpenAI error it is answered with.
_ERRORS = {
    APIError: lambda e: e,
    RequestValidationError: validation_error,
    ConfigError: lambda e: APIError(400, str(e)),
    TemplateError: lambda e: APIError(400, str(e), "messages"),
    TemplateLimitError: lambda e: APIError(400, str(e), "messages", code="template_limit"),
    QueueFull: lambda e: APIError(429, f"the server is busy ({e}); retry after {RETRY_AFTER_S} s", code="queue_full",
                                  type="rate_limit_error", headers={"Retry-After": RETRY_AFTER_S}),
    # Not a 429: the server is not busy but going away; 503 is what load balancers and clients retry elsewhere.
    ShuttingDown: lambda e: APIError(503, f"{e}; retry after {RETRY_AFTER_S} s (another replica, or this one "
                                     f"once restarted)", code="shutting_down", type="server_error",
                                     headers={"Retry-After": RETRY_AFTER_S}),
    StarletteHTTPException: lambda e: APIError(e.status_code, str(e.detail),
                                               type="invalid_request_error" if e.status_code < 500 else "server_error"),
}  # any other exception is a 500, answered (and counted) by edge.Gate


def _encode_all(tokenizer, prompts) -> list[list[int]]:
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


def serve(model_path, config: InferConfig | None = None, host: str = "127.0.0.1", port: int = 8000,
          name: str | None = None, api_key: str | None = None, max_queue: int = 64, max_body: int = 1 << 20,
          drain_timeout: float = 30.0, request_timeout: float = 10.0, metrics_auth: bool = False,
          max_items: int = 10_000, template_limits: TemplateLimits | None = None, **fields) -> None:
    """Load the model as `config` (with InferConfig `fields` on top) says and serve it until
    SIGTERM/Ctrl-C. On a node other than node 0 (the config's `nodes`), run this node's workers
    instead, until node 0 stops. `metrics_auth`: /metrics needs the API key too; `max_items`:
    messages, content parts and tools one request may hold; `template_limits`: the time and
    memory one chat template render may use (default 10 s and 1 GiB)."""
    from ..api import follow, load

    check_keys(api_key, metrics_auth)
    config = InferConfig.of(config, **fields)
    follower = config.nodes.node_rank > 0
    sock = None if follower else bind(host, port)
    if threading.current_thread() is threading.main_thread():
        # uvicorn drains on SIGTERM, then re-raises it; exiting through SystemExit instead of
        # the default kill lets `finally` stop the tp/pp workers, which would otherwise be orphaned.
        previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        if follower:  # node 1.. of --nnodes: this node's share of the workers, no HTTP
            follow(model_path, config, announce=lambda text: print(f"llmsplit: {text}", file=sys.stderr, flush=True))
            return
        # (a split's workers are processes, started from the main thread like any other)
        model = load(model_path, config) if config.split else load_off_the_main_thread(load, model_path, config)
        try:
            name = name or _default_name(model_path)
            where = sock.getsockname()
            url_host = f"[{where[0]}]" if ":" in where[0] else where[0]
            server = Server(model, name, max_queue, api_key, max_body,
                            announce=f"llmsplit: serving {name!r}{_with_adapters(model.adapters)} at "
                                     f"http://{url_host}:{where[1]}/v1 "
                                     f"(decode {model.decode_mode}; SIGTERM or Ctrl-C to stop)", request_timeout=request_timeout,
                            metrics_auth=metrics_auth, max_items=max_items, template_limits=template_limits,
                            path=model_path, tool_call_parser=config.tool_call_parser)
            config = uvicorn.Config(server.app, log_level="warning", access_log=False,
                                    timeout_graceful_shutdown=drain_timeout + DELIVERY_GRACE_S,
                                    http=partial(TimedH11Protocol, head_timeout=request_timeout))
            try:
                _Uvicorn(config, lambda: server.scheduler.drain(drain_timeout)).run(sockets=[sock])
            finally:
                print(f"llmsplit: stopped after answering {server.scheduler.finished_requests} requests"
                      + (f"; {model.engine.speculation.summary()}" if model.engine.speculation else ""),
                      file=sys.stderr, flush=True)
        finally:
            model.close()
    finally:
        if sock is not None:
            sock.close()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


class _Uvicorn(uvicorn.Server):
    """uvicorn, which on SIGTERM/Ctrl-C also starts the scheduler's drain: requests in flight
    finish for up to the drain timeout, then the rest are failed with an error event, so every
    client hears how its request ended before uvicorn closes the connections."""

    def __init__(self, config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._on_exit()
        super().handle_exit(sig, frame)


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def _with_adapters(names: list[str]) -> str:
    return f" with LoRA adapters {', '.join(map(repr, names))}" if names else ""


def _default_name(model_path) -> str:
    from pathlib import Path

    path = Path(model_path).resolve()
    return path.stem if path.is_file() else path.name
