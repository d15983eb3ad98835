"""Continuous batching for a server: one thread owns the engine and steps it while any
request is alive; requests arrive and leave between steps.

This is the server's whole view of the engine, three calls from any thread: `submit` hands
in a request's prompts and gets back its handle, `abort` withdraws it (its client went away:
its blocks are free before the next step), `stats` reads the counts as of the last step
(queue, running and preempted sequences, KV usage, prefix hits). HTTP handlers run on an
event loop and must never wait on the model, and nothing but this thread touches the
engine. Each request gets exactly one outcome through its sink: a "finish" event per
sequence, or one "error" event; an aborted request gets none, because nobody is listening.

With tensor or pipeline parallel workers this thread is the only one that drives them
(rank 0 broadcasts each step), so the collectives never interleave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from ..engine import Engine, SamplingParams, Sequence

log = logging.getLogger("llmsplit.serve")

RATE_WINDOW_S = 10.0  # tokens/s is averaged over this window, so it falls to 0 when idle
SHUTTING_DOWN = "the server is shutting down"


class QueueFull(RuntimeError):
    """More requests than the batch and the wait queue hold; the client should retry later."""


class ShuttingDown(RuntimeError):
    """The server is draining (SIGTERM): it takes no new request; the client should go to
    another replica, or retry once this one has restarted."""


@dataclass(eq=False)
class Request:
    """A submitted request: its sequences (read their tokens and text once they finish)."""
    seqs: list[Sequence]
    # Called on the engine thread with ("text", index, piece) when streaming,
    # ("finish", index, seq) or ("error", message).
    sink: Callable[[tuple], None]


class EngineThread:
    def __init__(self, engine: Engine, max_queue: int, on_latency: Callable[[bool, float], None] | None = None):
        self._engine = engine
        engine.on_latency = on_latency  # (first token?, seconds): the metrics' histograms
        self.max_queue = max_queue
        self.max_context = engine.max_context  # limits a request is checked against before it is sent
        self.max_sequences = engine.max_batch + max_queue
        self.eos_ids = set(engine.eos_ids)  # the tokens that end a sequence (a grammar's stop tokens)
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._cancelled: list[Request] = []
        self._calls: list[tuple[Callable, Future]] = []  # work for the model between steps (embeddings)
        self._stopping = False  # every request left is failed, then the thread ends
        self._draining = False
        self._in_flight = 0  # sequences accepted and not yet finished, cancelled or failed
        self._owner: dict[int, tuple[Request, int]] = {}  # thread-only: sequence id -> (request, index)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens sampled in that step)
        self._stats = engine.stats()  # as of the last step, read by any thread
        self.finished_requests = 0
        self.failed_requests = 0
        self._thread = threading.Thread(target=self._run, name="llmsplit-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ the interface (any thread)

    def submit(self, prompts: list[list[int]], params: SamplingParams, sink: Callable[[tuple], None],
               stream: bool = False, adapter: int = 0, n: int = 1) -> Request:
        """Accept a request's prompts or raise QueueFull (ShuttingDown while draining); a
        request that could never fit raises ConfigError. With `stream`, text reaches the sink as it becomes final.
        `adapter`: the served LoRA adapter its sequences run with (0: the base model); `n`: samples
        per prompt, which share its blocks (the sequences are prompt by prompt, n each)."""
        with self._cond:
            if self._stopping or self._draining:
                raise ShuttingDown(SHUTTING_DOWN)
            seqs = [s for p in prompts for s in self._engine.new_sequences(p, params, n, adapter)]
            for seq in seqs:
                self._engine.check(seq)
            if self._in_flight + len(seqs) > self.max_sequences:
                raise QueueFull(f"{self._in_flight} sequences are running or waiting, the most this server "
                                f"holds is {self.max_sequences}")
            req = Request(seqs, sink)
            if stream:
                for i, seq in enumerate(seqs):
                    # With the tokens generated so far: the log-probabilities that go with the piece.
                    seq.on_text = lambda piece, i=i, seq=seq: sink(("text", i, piece, len(seq.tokens)))
            self._in_flight += len(seqs)
            self._inbox.append(req)
            self._cond.notify()
        return req

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn()` on the engine thread between two steps (the only thread that uses the model),
        e.g. an embedding's forward; its result or exception comes back through the Future."""
        future: Future = Future()
        with self._cond:
            if self._stopping or self._draining:
                raise ShuttingDown(SHUTTING_DOWN)
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def abort(self, req: Request) -> None:
        """Withdraw a request (its client went away); its blocks are freed before the next step."""
        with self._cond:
            if req in self._inbox:
                self._inbox.remove(req)
                self._in_flight -= len(req.seqs)
            else:
                self._cancelled.append(req)
                self._cond.notify()

    def stats(self) -> dict:
        """The engine's counts as of its last step (engine.stats), with the sequences still
        on their way in counted as waiting, and the output rate."""
        now = time.monotonic()
        with self._cond:
            s = dict(self._stats)
            s["waiting"] = max(0, self._in_flight - s["running"])
            s["tokens_per_s"] = sum(n for t, n in self._recent if t > now - RATE_WINDOW_S) / RATE_WINDOW_S
            s["in_flight"] = self._in_flight
        return s

    # ------------------------------------------------------------ shutdown

    def drain(self, deadline_s: float) -> None:
        """Refuse new requests, let the ones in flight finish for up to `deadline_s`, then
        fail the rest (their clients get an error event, their blocks are freed)."""
        with self._cond:
            self._draining = True
        timer = threading.Timer(deadline_s, self._abort_all)
        timer.daemon = True
        timer.start()

    def _abort_all(self) -> None:
        with self._cond:
            if self._in_flight:
                self._stopping = True
                self._cond.notify()

    def stop(self, timeout: float = 60.0) -> None:
        """Fail whatever is still in flight, free its blocks, and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        engine = self._engine
        while True:
            with self._cond:
                while not (self._inbox or self._cancelled or self._calls or self._stopping or engine.busy):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                cancelled, self._cancelled = self._cancelled, []
                calls, self._calls = self._calls, []
                stopping = self._stopping
            for fn, future in calls:
                if stopping:
                    future.set_exception(ShuttingDown(SHUTTING_DOWN))
                elif future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # the caller's to report (a bad input, out of memory)
                        future.set_exception(e)
            for req in inbox:
                for i, seq in enumerate(req.seqs):
                    self._owner[seq.id] = (req, i)
                    engine.add(seq)
            for req in cancelled:
                self._drop(req)
            if stopping:
                self._fail_all(SHUTTING_DOWN)
                self._snapshot(0)
                return
            if cancelled:
                self._snapshot(0)  # a departed client's blocks show as free before the step runs
            before = engine.sampled_tokens
            try:
                finished = engine.step()
            except Exception as e:  # a failed step (a worker died, out of memory) fails its requests, not the server
                log.exception("generation step failed")
                self._fail_all(f"generation failed: {type(e).__name__}: {e}")
                self._snapshot(0)
                continue
            self._snapshot(engine.sampled_tokens - before)
            for seq in finished:
                req, i = self._owner.pop(seq.id)
                self._release(1)
                if not any(s.id in self._owner for s in req.seqs):
                    self.finished_requests += 1
                self._emit(req, ("finish", i, seq))

    def _drop(self, req: Request) -> None:
        live = [s for s in req.seqs if s.id in self._owner]
        for seq in live:
            self._engine.abort(seq)
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

    def _snapshot(self, tokens: int) -> None:
        stats, now = self._engine.stats(), time.monotonic()
        with self._cond:
            self._stats = stats
            if tokens:
                self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] <= now - RATE_WINDOW_S:
                self._recent.popleft()

    @staticmethod
    def _emit(req: Request, event: tuple) -> None:
        try:
            req.sink(event)
        except Exception:  # a sink whose listener is gone must not stop the other requests
            log.exception("could not deliver a %s event", event[0])


def load_off_the_main_thread(load, *args):
    """`load(*args)` in a thread of its own, which ends with it. libgomp keeps an OpenMP pool
    for every thread that ever ran a parallel region: a model loaded on the main thread left
    the main thread's pool alive beside the engine thread's, more OpenMP threads than cores,
    and libgomp then throttles its spin-waiting, so that every parallel region of a step waited
    to wake its workers (SmolLM2-135M decoding on the engine thread: 150 tokens in 5.0-5.2 s,
    against 2.3 s once the loading thread's pool had ended with it)."""
    box: dict = {}

    def run() -> None:
        try:
            box["model"] = load(*args)
        except BaseException as e:  # re-raised on the caller's thread, as if it had loaded there
            box["error"] = e

    thread = threading.Thread(target=run, name="llmsplit-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["model"]
