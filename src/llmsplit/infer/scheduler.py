"""Continuous batching for a server: one thread owns the engine and steps it while any
request is alive; requests arrive and leave between steps.

HTTP handlers run on an event loop and must never wait on the model, so they only hand
requests to this thread (`submit`) or withdraw them (`cancel`); the thread adds them to the
engine before its next step, which admits them into the running batch as KV blocks allow,
and every sequence leaves the batch (and frees its blocks) the step it finishes. Each
request gets exactly one outcome through its sink: a "finish" event per sequence, or one
"error" event; a cancelled request gets none, because nobody is listening.

With tensor or pipeline parallel workers this thread is the only one that drives them
(rank 0 broadcasts each step), so the collectives never interleave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .engine import Engine, Sequence

log = logging.getLogger("llmsplit.serve")

RATE_WINDOW_S = 10.0  # tokens/s is averaged over this window, so it falls to 0 when idle


class QueueFull(RuntimeError):
    """More requests than the batch and the wait queue hold; the client should retry later."""


@dataclass(eq=False)
class Request:
    seqs: list[Sequence]
    # Called on the scheduler thread with ("finish", index, seq) or ("error", message).
    sink: Callable[[tuple], None]


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._cancelled: list[Request] = []
        self._stopping = False
        self._in_flight = 0  # sequences accepted and not yet finished, cancelled or failed
        self._owner: dict[int, tuple[Request, int]] = {}  # thread-only: sequence id -> (request, index)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens sampled in that step)
        self.finished_requests = 0
        self.failed_requests = 0
        self._thread = threading.Thread(target=self._run, name="llmsplit-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> None:
        """Accept a request or raise QueueFull; `engine.check` errors (ConfigError) pass through."""
        for seq in req.seqs:
            self.engine.check(seq)
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self._in_flight + len(req.seqs) > self.engine.max_batch + self.max_queue:
                raise QueueFull(f"{self._in_flight} sequences are running or waiting, the most this server "
                                f"holds is {self.engine.max_batch + self.max_queue}")
            self._in_flight += len(req.seqs)
            self._inbox.append(req)
            self._cond.notify()

    def cancel(self, req: Request) -> None:
        """Withdraw a request (its client went away); its blocks are freed before the next step."""
        with self._cond:
            if req in self._inbox:
                self._inbox.remove(req)
                self._in_flight -= len(req.seqs)
            else:
                self._cancelled.append(req)
                self._cond.notify()

    def stop(self, timeout: float = 60.0) -> None:
        """Fail whatever is still in flight, free its blocks, and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------ metrics (any thread)

    def counts(self) -> dict[str, int]:
        with self._cond:
            in_flight = self._in_flight
        running = len(self.engine.running)
        pool = self.engine.pool
        return {"running": running, "waiting": max(0, in_flight - running),
                "kv_blocks_used": pool.num_blocks - pool.free_blocks, "kv_blocks_total": pool.num_blocks}

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._cond:
            return sum(n for t, n in self._recent if t > now - RATE_WINDOW_S) / RATE_WINDOW_S

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._cancelled or self._stopping or self.engine.busy):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                cancelled, self._cancelled = self._cancelled, []
                stopping = self._stopping
            for req in inbox:
                for i, seq in enumerate(req.seqs):
                    self._owner[seq.id] = (req, i)
                    self.engine.add(seq)
            for req in cancelled:
                self._drop(req)
            if stopping:
                self._fail_all("the server is shutting down")
                return
            before = self.engine.sampled_tokens
            try:
                finished = self.engine.step()
            except Exception as e:  # a failed step (a worker died, out of memory) fails its requests, not the server
                log.exception("generation step failed")
                self._fail_all(f"generation failed: {type(e).__name__}: {e}")
                continue
            self._record(self.engine.sampled_tokens - before)
            for seq in finished:
                req, i = self._owner.pop(seq.id)
                self._release(1)
                if not any(s.id in self._owner for s in req.seqs):
                    self.finished_requests += 1
                self._emit(req, ("finish", i, seq))

    def _drop(self, req: Request) -> None:
        live = [s for s in req.seqs if s.id in self._owner]
        for seq in live:
            self.engine.abort(seq)
            del self._owner[seq.id]
        self._release(len(live))

    def _fail_all(self, message: str) -> None:
        requests = {id(r): r for r, _ in self._owner.values()}.values()
        for req in list(requests):
            self._drop(req)
            self.failed_requests += 1
            self._emit(req, ("error", message))

    def _release(self, n: int) -> None:
        with self._cond:
            self._in_flight -= n

    def _record(self, tokens: int) -> None:
        now = time.monotonic()
        with self._cond:
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] <= now - RATE_WINDOW_S:
                self._recent.popleft()

    @staticmethod
    def _emit(req: Request, event: tuple) -> None:
        try:
            req.sink(event)
        except Exception:  # a sink whose listener is gone must not stop the other requests
            log.exception("could not deliver a %s event", event[0])
