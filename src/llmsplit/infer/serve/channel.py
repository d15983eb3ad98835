"""Where a request's events arrive on the event loop: the scheduler thread puts them in from
its own thread, a route awaits them, and stops awaiting when its client goes away (so that
its sequences can be aborted and their KV blocks freed before the next step). Shared by the
OpenAI routes (server.py) and Ollama's (ollama.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from .protocol import APIError


class Channel:
    """Events from the scheduler thread into one request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is waiting for this event
            pass

    async def watch(self, receive) -> AsyncIterator[tuple]:
        """The events as they come, until the client behind ASGI's `receive` disconnects: then
        the iteration just ends, and the caller aborts what is left. (A plain request has no
        stream whose cancellation would tell; close this with contextlib.aclosing.)"""
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            while True:
                event = asyncio.ensure_future(self.queue.get())
                await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    event.cancel()
                    return
                yield event.result()
        finally:
            gone.cancel()


    async def finished(self, receive, count: int, abort: Callable[[], None],
                       on_text: Callable[[str], None] | None = None) -> list | None:
        """A plain (not streamed) answer's wait: the `count` sequences as they finish (text
        events, where the request streams to the engine, go to `on_text`); None when the client
        left first, after `abort()` freed what it held. An error event (the engine failed the
        step, and the request with it) is a 503."""
        done, settled = [], False
        try:
            async with aclosing(self.watch(receive)) as events:
                async for event in events:
                    if event[0] == "text":
                        if on_text is not None:
                            on_text(event[2])
                        continue
                    if event[0] == "error":
                        settled = True
                        raise APIError(503, event[1], type="server_error")
                    done.append(event[2])
                    if len(done) == count:
                        settled = True
                        return done
            return None
        finally:
            if not settled:  # the client left, or this route was cancelled
                abort()


async def disconnected(receive) -> None:
    """Returns once the client has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass
