"""The follower ranks of a job whose rank 0 is the calling process (inference `--tp/--pp`),
started by the process layer of torch's elastic launcher with `launch`'s settings."""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import signal
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .workers import LaunchError, attempt_store, failure_error, join_job, prepare_workers

_JOINED = "llmsplit/followers_joined"


def _run_follower(entrypoint, backend: str, timeout_s: float, args: tuple):
    """A follower's life: join rank 0's job (the variables Followers set), then run
    `entrypoint(*args)` as one of its ranks."""
    join_job(timeout_s, backend, announce=_JOINED)
    try:
        return entrypoint(*args)
    finally:
        dist.destroy_process_group()


class Followers:
    """Ranks 1..world-1 of a job whose rank 0 is the calling process, which goes on running
    (an interactive session, an HTTP server) and drives them until it closes them; once
    this returns, the default process group spans all `world` ranks. `launch` instead
    runs every rank in a worker and returns when all have ended: right for training, not
    for a model that stays loaded.

    The followers are started by the process layer of torch's elastic launcher
    (`start_processes`, with `launch`'s start method, thread count and malloc policy) and
    join through torchrun's env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
    LOCAL_RANK), rank 0 hosting the store. They are polled, not waited on: `wait_until`
    names a follower that dies while rank 0 waits for something (a barrier on a dead rank
    would block for the full timeout instead)."""

    def __init__(self, entrypoint, args: tuple, world: int, backend: str, timeout_s: float = 600.0):
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

        method, threads = prepare_workers(world)
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
        self._log_dir = tempfile.mkdtemp(prefix="llmsplit-followers-")
        job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), **threads}
        # start_processes numbers its processes from 0 (their error files, its failures).
        envs = {i: {**job, "RANK": str(i + 1), "LOCAL_RANK": str(i + 1)} for i in range(world - 1)}
        follower = (entrypoint, backend, timeout_s, args)
        try:
            with _signal_handlers_kept():  # start() installs torchrun's handlers; the caller keeps its own
                self._procs = start_processes("llmsplit-followers", _run_follower, dict.fromkeys(envs, follower),
                                              envs, DefaultLogsSpecs(log_dir=self._log_dir), start_method=method)
        except BaseException:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            raise
        self._threads = torch.get_num_threads()
        # Left running, the followers would keep this process from exiting (they are not daemons).
        atexit.register(self.kill)
        try:
            self.wait_until(lambda: self.store.add(_JOINED, 0) == world - 1, " while starting")
            dist.init_process_group(backend, store=attempt_store(self.store), rank=0, world_size=world,
                                    timeout=timeout)
        except BaseException:
            self.kill()
            raise
        torch.set_num_threads(int(threads["LLMSPLIT_THREADS"]))  # rank 0 takes its share of the cores

    def wait_until(self, done, doing: str) -> None:
        """Poll `done()` until it is true; a follower that dies meanwhile raises LaunchError
        naming its rank and `doing` (e.g. " while loading the model"). A collective that
        `done` waits on may notice the death first ("Connection closed by peer"): the
        follower's own failure is then reported instead, once its exit shows."""
        while True:
            self._raise_if_ended(0, doing)
            try:
                if done():
                    return
            except RuntimeError:
                self._raise_if_ended(5, doing)
                raise
            time.sleep(0.02)

    def _raise_if_ended(self, timeout_s: float, doing: str) -> None:
        with _quiet_process_layer():
            result = self._procs.wait(timeout_s, period=0.02)
        if result is None:
            return
        failures = {rank + 1: f for rank, f in result.failures.items()}
        if not failures:
            raise LaunchError(f"the worker ranks returned{doing}, before rank 0 told them to stop")
        raise failure_error(failures, doing) from None

    def close(self, timeout_s: float = 30.0) -> None:
        """Leave the job once the followers have been told to stop, and let them end."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._procs.wait(timeout_s, period=0.02)
        self.kill()

    def kill(self) -> None:
        """End the followers that still run, drop rank 0's part of the job and its files."""
        atexit.unregister(self.kill)
        with _quiet_process_layer():
            self._procs.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)
        shutil.rmtree(self._log_dir, ignore_errors=True)


@contextlib.contextmanager
def _quiet_process_layer():
    """torch's process layer logs a failed follower with a traceback of its own (naming its
    local rank, one less than its rank) and each one it ends; the LaunchError says what
    matters once, by rank."""
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _signal_handlers_kept():
    """Put back the main thread's handlers of the signals that torchrun's process layer
    takes over: SIGINT must stay KeyboardInterrupt in an interactive session, SIGTERM the
    server's graceful stop."""
    main = threading.current_thread() is threading.main_thread()
    names = [n for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if main and hasattr(signal, n)]
    saved = {getattr(signal, n): signal.getsignal(getattr(signal, n)) for n in names}
    try:
        yield
    finally:
        for number, handler in saved.items():
            if handler is not None:
                signal.signal(number, handler)
