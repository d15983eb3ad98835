"""The follower ranks of a job whose rank 0 is the calling process (inference `--tp/--pp`),
started by the process layer of torch's elastic launcher with `launch`'s settings, on this
machine or, with `Nodes`, on several (`--nnodes/--node-rank/--master-addr/--master-port`,
the flags `launch` takes for training)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .cluster_env import drop_launcher_variables
from .presence import absent, never_reached
from .workers import (LaunchError, attempt_store, check_master_addr, doctor_hint, failure_error, join_job,
                      prepare_workers, use_master_route)

_JOINED = "llmsplit/followers_joined"


@dataclass(frozen=True)
class Nodes:
    """The machines a job's ranks run on, numbered as `launch` numbers them: node k holds
    ranks k * per_node .. (k + 1) * per_node - 1, so node 0 holds rank 0; node 0 hosts the
    job's store at master_port (every address of the machine), the others reach it at
    master_addr. One node (the default) keeps everything on 127.0.0.1 and a free port."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def check(self, resolve: bool = True) -> None:
        """Refuse flags that cannot form a job (ConfigError); `resolve`: also look the master
        address up (not inside torchrun, whose own flags name it)."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be between 0 and --nnodes - 1 = {self.nnodes - 1}")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("--nnodes > 1 needs --master-port (the same on every node)")
        if self.nnodes > 1 and resolve:
            check_master_addr(self.master_addr, self.master_port)

    def per_node(self, world: int) -> int:
        """The ranks each node holds of a job of `world` ranks."""
        return world // self.nnodes

    def ranks(self, world: int) -> range:
        """The ranks this node holds."""
        per_node = self.per_node(world)
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


def _run_follower(entrypoint, backend: str, timeout_s: float, args: tuple, cwd: str):
    """A follower's life: join rank 0's job (the variables Followers set), then run
    `entrypoint(*args)` as one of its ranks, in its launcher's directory (a forkserver started
    by an earlier launch keeps the directory it started in). The cluster launcher's PET_* it
    inherited describe the llmsplit command's job, not its own (cluster_env.drop_launcher_variables)."""
    os.chdir(cwd)
    drop_launcher_variables(os.environ)
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

    def __init__(self, entrypoint, args: tuple, world: int, backend: str, timeout_s: float = 600.0,
                 nodes: Nodes = Nodes()):
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

        ranks = nodes.ranks(world)
        method, threads = prepare_workers(len(ranks), [entrypoint.__module__])
        use_master_route(nodes.nnodes, f"node {nodes.node_rank}", nodes.master_addr, nodes.master_port)
        timeout = timedelta(seconds=timeout_s)
        self.nodes, self.world, self.store = nodes, world, None
        if nodes.node_rank == 0:  # the job's store; on the other nodes the followers reach it themselves
            self.store = dist.TCPStore(nodes.master_addr, nodes.master_port or 0, world, is_master=True,
                                       wait_for_workers=False, timeout=timeout)
        self._log_dir = tempfile.mkdtemp(prefix="llmsplit-followers-")
        job = {**os.environ, "MASTER_ADDR": "127.0.0.1" if self.store else nodes.master_addr,
               "MASTER_PORT": str(self.store.port if self.store else nodes.master_port),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(len(ranks)), **threads}
        # The ranks of this node but rank 0 (the calling process on node 0); start_processes
        # numbers its processes from 0 (their error files, its failures).
        self._ranks = [r for r in ranks if r != 0]
        envs = {i: {**job, "RANK": str(r), "LOCAL_RANK": str(r - ranks.start)} for i, r in enumerate(self._ranks)}
        follower = (entrypoint, backend, timeout_s, args, os.getcwd())
        self._procs = None  # node 0 may hold rank 0 alone (one rank per node)
        try:
            with _signal_handlers_kept():  # start() installs torchrun's handlers; the caller keeps its own
                if envs:
                    self._procs = start_processes("llmsplit-followers", _run_follower, dict.fromkeys(envs, follower),
                                                  envs, DefaultLogsSpecs(log_dir=self._log_dir), start_method=method)
        except BaseException:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            raise
        self._threads = torch.get_num_threads()
        # Left running, the followers would keep this process from exiting (they are not daemons).
        atexit.register(self.kill)
        if self.store is None:
            return  # this node has no rank 0: `follow_to_the_end` waits for its ranks
        try:
            self.wait_until(lambda: self.store.add(_JOINED, 0) == world - 1, " while starting",
                            timeout_s if nodes.nnodes > 1 else None)
            dist.init_process_group(backend, store=attempt_store(self.store), rank=0, world_size=world,
                                    timeout=timeout)
        except BaseException:
            self.kill()
            raise
        torch.set_num_threads(int(threads["LLMSPLIT_THREADS"]))  # rank 0 takes its share of the cores

    def wait_until(self, done, doing: str, timeout_s: float | None = None) -> None:
        """Poll `done()` until it is true; a follower that dies meanwhile raises LaunchError
        naming its rank and `doing` (e.g. " while loading the model"). A collective that
        `done` waits on may notice the death first ("Connection closed by peer"): the
        follower's own failure is then reported instead, once its exit shows. `timeout_s`:
        how long other nodes may take to join (a local follower either joins or dies)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._raise_if_ended(0, doing)
            try:
                if done():
                    return
            except RuntimeError:
                self._raise_if_ended(5, doing)
                raise
            if deadline is not None and time.monotonic() > deadline:
                n, addr, port = self.nodes.nnodes, self.nodes.master_addr, self.store.port
                missing, waited = absent(self.store, n), f"within {timeout_s:g}s{doing}"
                message = never_reached(missing, n, addr, port, waited) if missing else \
                    f"not all {n} nodes joined at {addr}:{port} {waited}"
                raise LaunchError(message, doctor_hint(addr, port))
            time.sleep(0.02)

    def follow_to_the_end(self) -> None:
        """On a node without rank 0: wait while this node's ranks follow rank 0 (on node 0)
        until it closes the job; a rank that fails (node 0 gone included) raises LaunchError."""
        with _quiet_process_layer():
            while (result := self._procs.wait(1.0, period=0.1)) is None:
                pass
        try:
            if result.failures:
                raise failure_error({self._ranks[i]: f for i, f in result.failures.items()},
                                    f" on node {self.nodes.node_rank}") from None
        finally:
            self.kill()

    def _raise_if_ended(self, timeout_s: float, doing: str) -> None:
        if self._procs is None:
            return
        with _quiet_process_layer():
            result = self._procs.wait(timeout_s, period=0.02)
        if result is None:
            return
        failures = {self._ranks[i]: f for i, f in result.failures.items()}
        if not failures:
            raise LaunchError(f"the worker ranks returned{doing}, before rank 0 told them to stop")
        raise failure_error(failures, doing) from None

    def close(self, timeout_s: float = 30.0) -> None:
        """Leave the job once the followers have been told to stop, and let them end."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._procs is not None:
            self._procs.wait(timeout_s, period=0.02)
        self.kill()

    def kill(self) -> None:
        """End the followers that still run, drop rank 0's part of the job and its files."""
        atexit.unregister(self.kill)
        with _quiet_process_layer():
            if self._procs is not None:
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
