"""CPU-bound request work (rendering the chat template, tokenizing big inputs, compiling a
response format) off the event loop, with a time limit that actually stops it.

A thread alone keeps the event loop free, but Python cannot kill a thread, so work that loops
would run on until the process exits and hold SIGTERM's exit up. So when the limit passes,
the thread gets an exception raised inside it (`PyThreadState_SetAsyncExc`, the C API for
raising in another thread). CPython raises it between two bytecodes, so any Python-level loop
stops within microseconds. One C call that runs long is not interrupted: a chat template
runs in a child process of its own (io/template_process.py), which its own limits stop and
whose waiting thread wakes every 0.1 s, so the exception lands there too and the child is
killed; a tokenizer's time is bounded by the body size cap.

The exception derives from BaseException, so the `except Exception` clauses inside Jinja or
in a template cannot swallow it. Every call runs in a daemon thread of its own, so a thread
that is stuck in one C call never blocks the exit, and a semaphore bounds how many run at once.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading


class TimeLimitExceeded(Exception):
    """The work did not finish within the limit and was stopped."""


class _Stop(BaseException):
    """Raised inside the worker thread when its time is up."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    # None clears an exception that was scheduled but has not been raised yet.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class OffLoop:
    """Runs functions in worker threads, at most `max_threads` at once, each for at most `seconds`."""

    def __init__(self, seconds: float, max_threads: int = 4):
        if not seconds > 0:
            raise ValueError(f"the time limit must be positive, got {seconds}")
        self.seconds = seconds
        self._slots = asyncio.Semaphore(max_threads)
        self.active = 0  # calls running or waiting for a thread, for the server's metrics

    async def run(self, fn, *args):
        self.active += 1
        try:
            async with self._slots:
                return await self._run(fn, args)
        finally:
            self.active -= 1

    async def _run(self, fn, args):
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        lock, state = threading.Lock(), {"running": True}

        def settle(outcome):
            if not done.done():  # the waiter may have timed out or been cancelled already
                done.set_result(outcome)

        def work():
            try:
                try:
                    outcome = (True, fn(*args))
                except Exception as e:
                    outcome = (False, e)
                with lock:
                    state["running"] = False
                _raise_in(threading.get_ident(), None)  # an interrupt that came too late is dropped
            except _Stop:
                outcome = (False, TimeLimitExceeded(f"stopped after {self.seconds:g} s"))
            loop.call_soon_threadsafe(settle, outcome)

        thread = threading.Thread(target=work, name="llmsplit-request-work", daemon=True)
        thread.start()
        try:
            ok, value = await asyncio.wait_for(asyncio.shield(done), self.seconds)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            with lock:  # interrupt only while `fn` runs: never the thread's own bookkeeping
                if state["running"]:
                    _raise_in(thread.ident, _Stop)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise TimeLimitExceeded(f"stopped after {self.seconds:g} s") from None
        if not ok:
            raise value
        return value
