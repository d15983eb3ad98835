"""--compile auto in a server: once the background build of the decode step is stored, swap the
compiled step in on the engine thread at a moment when no request runs (a warm compile: seconds,
during which requests queue), instead of at the next start (infer/compile_cache.py)."""

from __future__ import annotations

import sys
import threading

from ..compile_cache import find

POLL_S = 5.0  # how often the artifact, then an idle engine, is looked for


def watch_compile(model, scheduler, stop: threading.Event) -> threading.Thread | None:
    """A daemon thread that swaps the compiled decode step into `model` when it can; None when
    there is nothing to wait for."""
    if model.compile_pending is None:
        return None

    def watch() -> None:
        artifact = None  # read and checked once, then handed over at each try until the engine is idle
        while not stop.wait(POLL_S):
            artifact = artifact or find(model.compile_pending)
            if artifact is None:
                continue
            try:
                swapped = scheduler.call(lambda: model.compile_when_ready(artifact)).result()
            except Exception as e:  # shutting down, or the compile failed: stay eager
                print(f"llmsplit: the compiled decode step was not swapped in ({type(e).__name__}: {e}); "
                      f"decoding stays eager", file=sys.stderr, flush=True)
                return
            if swapped:
                print("llmsplit: decode step compiled in the background; swapped in", file=sys.stderr, flush=True)
                return

    thread = threading.Thread(target=watch, name="llmsplit-compile-watch", daemon=True)
    thread.start()
    return thread
