"""Worker processes of a whole job: torch's elastic launcher (what `torchrun` runs) for
local and multi-node jobs, joining the job a worker finds itself in (`join_job`), and what a
failed worker reported."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import socket
import sys
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from ..allocator import M_MMAP_THRESHOLD, mallopt
from ..errors import ConfigError
from ..threads import runnable_elsewhere, workers_threads
from .cluster_env import drop_launcher_variables
from .elastic import c10d_settings
from .forkserver import fork_forkserver
from .network import bind_collectives_to_master_route
from .presence import NodeSignIns, never_reached, sign_in
from .restarts import FailureWatch


class LaunchError(RuntimeError):
    """A worker failed (the message names the rank and what it reported), or the nodes
    did not find each other (`hint` then says how to check the network). When the failing
    worker's exception carried fields (see `worker_entry`), `error_type` names its class
    and `details` holds them."""

    def __init__(self, message: str, hint: str | None = None, error_type: str | None = None,
                 details: dict | None = None):
        super().__init__(message)
        self.hint = hint
        self.error_type = error_type
        self.details = details


def worker_entry(fn):
    """A worker's entry point, wrapped: torch's `record` (the error file torchrun reports
    from), and an exception with a `details` dict (JSON values) leaves its class name and
    that dict next to the error file, so that the launching process gets the numbers as data
    (`LaunchError.error_type` and `.details`) rather than parsing them back out of the
    message. A worker's return value travels back only when every worker succeeds; its
    folder in the launcher's log directory is what a failed worker still has. (Not inside
    the error file: the launcher's own `record` around every worker rewrites that file.)"""
    from functools import wraps

    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    @wraps(fn)
    def entry(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            error_file, details = os.environ.get("TORCHELASTIC_ERROR_FILE"), getattr(e, "details", None)
            if error_file and isinstance(details, dict):
                with open(_details_file(error_file), "w") as f:
                    json.dump({"type": type(e).__name__, "details": details}, f)
            raise

    return entry


def _details_file(error_file: str) -> str:
    return os.path.join(os.path.dirname(error_file), "llmsplit_details.json")


def _carried(failure) -> dict:
    """What `worker_entry` left for a failed worker: {"type", "details"}, or {}."""
    error_file = getattr(failure, "error_file", "")
    if not os.path.isabs(error_file or "") or not os.path.isfile(_details_file(error_file)):
        return {}  # no error file ("<N/A>"), or an exception without details
    path = _details_file(error_file)
    with open(path) as f:
        return json.load(f)


def check_master_addr(addr: str, port: int | None) -> None:
    """A master address that does not resolve is a typo, not a network failure: say so
    before waiting timeout_s for a rendezvous that cannot happen."""
    try:
        socket.getaddrinfo(addr, port)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--master-addr {addr!r} does not resolve ({e}); pass node 0's host name or IP "
                          f"address (`llmsplit doctor --master-addr {addr} --master-port {port}` checks it)") from None


def doctor_hint(addr: str, port: int) -> str:
    return (f"start the same command on every node (same --nnodes, --master-addr, --master-port; node 0 first), "
            f"check that node 0's firewall lets port {port} in, set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on "
            f"GPUs) on a node whose peers reach it through another interface than its route to {addr}, and run "
            f"`llmsplit doctor --master-addr {addr} --master-port {port}` on each node")


def use_master_route(nnodes: int, node: str, master_addr: str, master_port: int | None) -> None:
    """Across machines, bind this node's collectives to its route to the master (launch/network.py)
    and say which interface that is: the one thing a peer needs to reach this node (`node`
    names it: "node 1")."""
    if nnodes > 1:
        name = bind_collectives_to_master_route(master_addr, master_port)
        if name is not None:
            print(f"llmsplit: {node}: collectives on interface {name}, the route to the master "
                  f"{master_addr} (set GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME to choose another)",
                  file=sys.stderr, flush=True)


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def default_nproc() -> int:
    """One worker per GPU; on a CPU, two gloo workers (the smallest real distributed job)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def claim_process_for_launching(worker_modules: tuple[str, ...] = ()) -> None:
    """Called by the `llmsplit train` program before it computes anything: this process only
    plans and launches, so it keeps to one thread and leaves the cores to its workers; on the
    CPU it forks its workers' server from itself now, while that is safe, and the server
    imports `worker_modules` while this process plans (launch/forkserver.py)."""
    torch.set_num_threads(1)
    fork_workers_server(worker_modules)


_busy_at_start: int | None = None  # threads of other processes that wanted the cores as this program started


def fork_workers_server(worker_modules: tuple[str, ...]) -> None:
    """On the CPU, fork the workers' server from this process now: only at a program's start,
    before it computes anything (launch/forkserver.py). Other processes' demand for the cores
    is read first, while nothing of this program's runs but this thread (the server's imports
    would count as another's; `prepare_workers` acts on it)."""
    global _busy_at_start
    if start_method() == "forkserver":
        _busy_at_start = runnable_elsewhere()
        fork_forkserver(["torch", *worker_modules])


def start_method() -> str:
    """How the launcher starts its workers: `forkserver` on the CPU, `spawn` (torchrun's
    way) with CUDA. Never `fork`: the launching process runs threads of its own (the elastic
    agent's TCPStore daemon, `pt_tcpstore_uv`, which formats peer addresses through glibc's
    resolver as connections come and go), and a child forked while such a thread held
    glibc's resolver lock deadlocks in its first TCPStore connect, and the other workers
    with it in gloo's connectFullMesh (1 in 60 four-worker runs hung so; a bare torch
    parent with a master TCPStore forking 8 clients hung 17-22 of 80 in two sessions, from
    a forkserver 0 of 80). The forkserver is a fresh interpreter, single-threaded, that
    imports torch and the workers' modules once
    (`prepare_workers`' preload) and forks every worker from there: a 1-step run on 2
    workers took 4.8-5.1 s (fork 3.7-4.5, spawn 5.3-6.3) and on 4 workers 5.6-5.8 s (fork
    4.3-5.1, spawn 9.7-11.6) on a 2-core machine (the test suite, whose command lines are
    forked from a process with everything imported, pays 1.5-2.8 s a multi-worker run more
    than a fork; the forkserver started at the program's start instead of at launch hid
    none of it). CUDA keeps spawn, as torchrun does.
    `LLMSPLIT_START_METHOD` overrides (fork only from a process that never ran a
    multi-threaded op: an OpenMP team that ran before the fork hangs the child's first
    parallel op)."""
    chosen = os.environ.get("LLMSPLIT_START_METHOD")
    if chosen:
        if chosen not in ("spawn", "fork", "forkserver"):
            raise ConfigError(f"LLMSPLIT_START_METHOD={chosen!r} is not one of spawn, fork, forkserver; "
                              f"unset it or pick one")
        return chosen
    return "spawn" if torch.cuda.is_available() else "forkserver"


def _preload(method: str, modules: list[str]) -> None:
    """Import the workers' modules (DTensor, DCP: ~2 s) once rather than in every worker on
    the same cores: in the forkserver, before it forks any worker, or here before a fork.
    A forkserver already running (an earlier launch from this process) keeps what it has."""
    if method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", *modules])
    elif method == "fork":
        for module in modules:
            importlib.import_module(module)


def _small_mmap_threshold() -> None:
    """glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after
    which FSDP's per-step gather/scatter buffers come from the heap, fragment it and are never
    returned: a zero-3 worker's resident peak measured 1.38× its live tensors. A fixed 4 MiB
    threshold keeps big tensors in their own mappings (freed at once) and small activations on
    the fast heap: zero 2 peak 950 → 806 MiB at the same step time. Spawned workers read it
    from the environment at start-up; forked ones inherit this process's allocator, so it is
    set here too. A value the user exported is kept, and applied here as well: glibc reads
    the variable only when a process starts, so a value set after this process started (an
    earlier launch from the same process sets it) would reach spawned workers but not forked
    ones, whose zero-3 peaks then came out 1.25-1.35x higher (in the test suite)."""
    value = os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 << 20))
    if value.isdigit():  # not a number: glibc ignores it too
        mallopt(M_MMAP_THRESHOLD, int(value))


# What the other ranks report once one rank has died: the peer's connection closed under
# them. Naming such a rank would hide the one that failed first (here and train/entry.py).
PEER_GONE = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer",
             "communicator was aborted")


def _root_failure(failures: dict) -> tuple[int, str]:
    """(rank, last line of its error) of the worker that failed first, preferring one whose
    error is its own over one that only saw a peer go away (the first to be noticed need
    not be the first to fail)."""
    def detail(failure) -> str:
        error_file = getattr(failure, "error_file", None)
        if error_file is not None and not os.path.isfile(error_file):  # it died without raising (os._exit, a signal)
            return f"exit code {failure.exitcode}" if failure.exitcode >= 0 else failure.message
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        last = [line for line in str(message).strip().splitlines() if line.strip()]
        return last[-1] if last else f"exit code {failure.exitcode}"

    ordered = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    own = [(rank, f) for rank, f in ordered if not any(s in detail(f) for s in PEER_GONE)]
    rank, failure = (own or ordered)[0]
    return rank, detail(failure)


def failure_error(failures: dict, doing: str = "") -> LaunchError:
    """The LaunchError for failed workers ({global rank: torch's ProcessFailure}): the rank
    that failed first, its last line, and what its exception carried (worker_entry)."""
    rank, detail = _root_failure(failures)
    carried = _carried(failures[rank])
    return LaunchError(f"worker rank {rank} failed{doing}: {detail}", _unreachable_peer_hint(detail),
                       error_type=carried.get("type"), details=carried.get("details"))


def _unreachable_peer_hint(detail: str) -> str | None:
    """What to do when gloo could not reach the address a peer advertised: that address came
    from the peer's choice of interface (launch/network.py), so name the variable that sets it."""
    m = re.search(r"connectFullMesh failed.*remote=\[([^\]]+)\]", detail)
    if m is None:
        return None
    return (f"a worker could not connect to {m.group(1)}, the address a peer advertised; on every node set "
            f"GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) to the interface the other nodes reach it on "
            f"(`llmsplit doctor --master-addr ADDR --master-port PORT` shows each node's)")


def prepare_workers(nproc: int, preload: list[str], tuned: bool = False) -> tuple[str, dict[str, str]]:
    """What every start of local workers shares (`launch` and `Followers`): torch's elastic
    logging at warnings, the malloc policy, the start method with the workers' modules
    (`preload`) imported once, and each worker's thread count, returned as the environment
    that carries it (`threads.workers_threads`): the cores shared among the workers instead
    of every worker taking all of them; values the user exported are kept. `tuned`: CPU
    workers that tune their count as they run (training's), which start at one thread where
    other processes want the cores (read once, as the program started, when it did). The caller hands each worker this
    process's whole environment with it (`_in_environment`, Followers' envs): a worker forked
    from the forkserver inherits the forkserver's, which is this process's environment as it
    was when an earlier launch started the server (a variable unset since then still
    reaches the workers)."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    _small_mmap_threshold()
    busy = 0
    if tuned and not torch.cuda.is_available():
        busy = _busy_at_start if _busy_at_start is not None else runnable_elsewhere()
    threads = workers_threads(nproc, busy)
    method = start_method()
    _preload(method, preload)
    return method, threads


# What torch's elastic agent sets for each worker (its local_elastic_agent): the launching
# process's own values must not replace them. A PyTorchJob's pod carries RANK and WORLD_SIZE
# for the node, which would give every worker of a node the same rank.
AGENT_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                             "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})


def _in_environment(environment: dict[str, str], cwd: str, entrypoint, *args):
    """A worker of `launch`: the launching process's environment and directory at this launch
    (torch's elastic agent hands on only OMP_NUM_THREADS of it, and the forkserver's own may be
    older: a library caller may have changed directory since an earlier launch started it) but
    the cluster launcher's PET_* (inherited, so removed here), then the entrypoint."""
    os.chdir(cwd)
    os.environ.update(environment)
    drop_launcher_variables(os.environ)
    _small_mmap_threshold()
    return entrypoint(*args)


def launch(entrypoint, args: tuple, *, nproc: int, nnodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: int | None = None, max_restarts: int = 0,
           timeout_s: float = 600.0, preload: tuple[str, ...] = (), min_nodes: int | None = None) -> dict:
    """Run `entrypoint(*args)` in nproc × nnodes workers; returns {global rank: return value}.
    The nodes wait up to `timeout_s` for each other. `preload`: modules the workers import
    besides the entrypoint's own, imported once for all of them (`prepare_workers`).
    `min_nodes` below `nnodes`: an elastic job of min_nodes to nnodes machines, numbered by
    torch's c10d rendezvous instead of `node_rank` (launch/elastic.py).

    The rendezvous is the static one (what `torchrun --node-rank --master-addr
    --master-port` uses): node 0 hosts a c10d TCPStore at master-addr:master-port and every
    node joins it under its --node-rank. The c10d *backend* (`--rdzv-backend c10d`) would
    ignore --node-rank and number nodes by sorting host names and process ids, so global
    rank 0, the one that writes metrics, summary and checkpoint markers, could land on
    any machine; users of --node-rank expect node 0 to be the master they named. What
    c10d adds, nodes leaving a running job, is what `min_nodes` asks for, and there the
    rendezvous numbers the nodes; plain `torchrun --rdzv-backend c10d` runs llmsplit too.
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if master_port is None:
        if nnodes > 1:
            raise ValueError("--master-port is required with --nnodes > 1")
        master_port = free_port()
    elastic = min_nodes is not None and min_nodes < nnodes
    method, threads = prepare_workers(nproc, [entrypoint.__module__, *preload], tuned=True)
    os.environ.update(threads)  # the elastic agent hands OMP_NUM_THREADS on from here
    use_master_route(nnodes, "this node" if elastic else f"node {node_rank}", master_addr, master_port)
    if elastic:
        rendezvous = c10d_settings(master_addr, master_port, timeout_s)
    else:
        run_id = f"llmsplit-{uuid.uuid4().hex[:8]}" if nnodes == 1 else f"llmsplit-{master_addr}-{master_port}"
        rendezvous = {"rdzv_backend": "static", "rdzv_endpoint": f"{master_addr}:{master_port}", "run_id": run_id,
                      "rdzv_configs": {"rank": node_rank, "timeout": int(max(1, timeout_s))}}
    config = LaunchConfig(min_nodes=min_nodes if elastic else nnodes, max_nodes=nnodes, nproc_per_node=nproc,
                          max_restarts=max_restarts, monitor_interval=0.1, start_method=method, **rendezvous)
    environment = {name: value for name, value in os.environ.items() if name not in AGENT_VARIABLES}
    # Static multi-node: a timeout names the nodes that never signed in (presence.py).
    sign_ins = NodeSignIns(master_addr, master_port, node_rank, nnodes) if nnodes > 1 and not elastic else None
    try:
        watch = FailureWatch(environment, None, rendezvous.get("local_addr", "this machine")) if elastic else \
            FailureWatch(environment, first_rank=node_rank * nproc)
        with watch, sign_ins or contextlib.nullcontext():  # a restart's workers say why
            return elastic_launch(config, _in_environment)(environment, os.getcwd(), entrypoint, *args)
    except ChildFailedError as e:
        raise failure_error(e.failures, f" on node {node_rank}" if nnodes > 1 and not elastic else "") from None
    except DistError as e:
        if nnodes == 1:
            raise
        waited = f"within {timeout_s:g}s (train.timeout_s)"
        if elastic:
            raise LaunchError(f"fewer than {min_nodes} nodes met at {master_addr}:{master_port} {waited}: {e}",
                              doctor_hint(master_addr, master_port)) from None
        if sign_ins is not None and sign_ins.missing:
            raise LaunchError(never_reached(sign_ins.missing, nnodes, master_addr, master_port, waited),
                              doctor_hint(master_addr, master_port)) from None
        if node_rank == 0:
            raise LaunchError(f"not all {nnodes} nodes joined at {master_addr}:{master_port} {waited}: {e}",
                              doctor_hint(master_addr, master_port)) from None
        raise LaunchError(f"node {node_rank} could not reach the master {master_addr}:{master_port} {waited}: {e}",
                          doctor_hint(master_addr, master_port)) from None


# Each follower adds 1 here once it has reached rank 0's store (the env:// rendezvous).


def attempt_store(store):
    """The elastic agent keeps one store for the whole job (the static rendezvous reuses it
    after a restart), so a restarted worker could read an address its dead predecessor
    published and fail to connect. Keys are kept apart per attempt there. An elastic job's
    workers get a fresh store every round (launch/elastic.py) and must not: a machine that
    joined later counts its own restarts from 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        return store
    return dist.PrefixStore(f"llmsplit/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def join_job(timeout_s: float, backend: str | None = None, announce: str | None = None) -> torch.device:
    """Join the job that torchrun's variables describe (env:// rendezvous: what `launch`,
    `Followers` and torchrun itself set) as this process's rank: NCCL on its local GPU, or
    gloo on the CPU, and its share of the cores. `announce`: a store key counted up once the
    rendezvous is reached, before the group forms (Followers' rank 0 watches it)."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    if announce:
        store.add(announce, 1)
        sign_in(store, rank // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))  # its node (presence.py)
    group = {"store": attempt_store(store), "rank": rank, "world_size": world, "timeout": timeout}
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **group)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **group)
    threads = int(os.environ.get("LLMSPLIT_THREADS", "0")) or max(
        1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(threads)
    return device
