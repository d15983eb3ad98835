"""The server's edge, before a request is parsed: how long it may take to arrive, who may send
it, how large it may be, and the count of every answer by status.

`Gate` is ASGI middleware around the whole app: the API key on /v1 and Ollama's /api/ routes
(and on /metrics with `metrics_auth`), a cap on the body size and on the time its bytes take
to arrive, and the status of every response counted for /metrics, 500s included (Starlette
answers unhandled errors outside every middleware, where they would go uncounted, so the gate
answers them itself); each refusal in the shape of the API asked, Ollama's or OpenAI's.
`TimedH11Protocol` is uvicorn's HTTP/1.1 protocol with a limit on the time a request's head
(request line and headers) takes to arrive, which uvicorn lacks: its keep-alive timeout only
runs between requests and stops at the first byte, so a client that sends half a header
holds its connection forever.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

from ...errors import ConfigError
from .protocol import APIError

log = logging.getLogger("llmsplit.serve")
OLLAMA_PREFIX = "/api/"  # Ollama's API (ollama.py), whose errors are shaped {"error": message}


class _TooLarge(Exception):
    pass


def check_keys(api_key: str | None, metrics_auth: bool) -> None:
    """Refuse a guard on /metrics with no key to guard it with, before anything is loaded."""
    if metrics_auth and not api_key:
        raise ConfigError("--metrics-auth needs --api-key (or LLMSPLIT_API_KEY) to check /metrics against; "
                          "set a key or drop --metrics-auth")


class Gate:
    def __init__(self, app, api_key: str | None, max_body: int, body_timeout: float, statuses: dict[int, int],
                 metrics_auth: bool = False):
        self.app, self.api_key, self.max_body, self.body_timeout = app, api_key, max_body, body_timeout
        self.statuses = statuses
        # /health stays open always (probes), and so does the chat page at / (it holds no data and asks
        # for the key itself); /metrics only on request: scrapers often have no key.
        # Ollama's API (/api/) answers from the same model as /v1, so the key guards it too.
        self.guarded = ("/v1", OLLAMA_PREFIX, "/metrics") if metrics_auth else ("/v1", OLLAMA_PREFIX)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.statuses[message["status"]] = self.statuses.get(message["status"], 0) + 1
            await send(message)

        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith(self.guarded) and not self._authorized(headers):
            return await error(APIError(401, "invalid or missing API key; send 'Authorization: Bearer KEY'",
                                        code="invalid_api_key"), counted_send, scope["path"])
        try:
            declared = int(headers.get(b"content-length", 0))
        except ValueError:
            return await error(APIError(400, "the Content-Length header is not a number"), counted_send, scope["path"])
        too_large = APIError(413, f"the request body exceeds {self.max_body} bytes", code="request_too_large")
        if declared > self.max_body:
            return await error(too_large, counted_send, scope["path"])
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except _TooLarge:
            return await error(too_large, counted_send, scope["path"])
        except asyncio.TimeoutError:
            return await error(APIError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                                        code="request_timeout"), counted_send, scope["path"])
        if body is None:
            return  # the client left while sending
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, counted_send)
        except Exception as e:
            if started:
                raise  # mid-stream: nothing left to answer with; uvicorn closes the connection
            log.exception("unhandled error answering %s %s", scope["method"], scope["path"])
            await error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"), counted_send,
                        scope["path"])

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        # The scheme is case-insensitive (RFC 7235): `bearer KEY` is as good as `Bearer KEY`. Only
        # the key is secret, so only its comparison needs to take the same time whatever it holds.
        given = key.lstrip(b" ").decode("latin-1").encode()
        return scheme.lower() == b"bearer" and hmac.compare_digest(given, self.api_key.encode())

    async def _read_body(self, receive) -> bytes | None:
        # Read here, capped, and replay it to the app: a chunked upload has no length to check up
        # front. Later receive() calls pass through, so disconnects are still seen.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                raise _TooLarge
        return body


def error_body(err: APIError, path: str) -> dict:
    """The error as the API at `path` shapes it: Ollama's {"error": message}, else OpenAI's."""
    return {"error": err.message} if path.startswith(OLLAMA_PREFIX) else err.body()


async def error(err: APIError, send, path: str = "") -> None:
    body = json.dumps(error_body(err, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class TimedH11Protocol(H11Protocol):
    """A request's head must arrive within `head_timeout` seconds of the connection opening or
    of its own first byte; otherwise the connection is closed."""

    def __init__(self, *args, head_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first byte of the next request on a kept-alive connection
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a whole head arrived: the request is under way
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the server starts so that --port 0 can say its port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
