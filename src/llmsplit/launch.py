"""Starting worker processes: torch's elastic launcher (what `torchrun` runs) for local
and multi-node jobs, or the environment `torchrun` already set up."""

from __future__ import annotations

import logging
import os
import socket
import uuid

import torch


class LaunchError(RuntimeError):
    """A worker failed; the message names the rank and what it reported."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def default_nproc() -> int:
    """One worker per GPU; on a CPU, two gloo workers (the smallest real distributed job)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(entrypoint, args: tuple, *, nproc: int, nnodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: int | None = None, max_restarts: int = 0) -> dict:
    """Run `entrypoint(*args)` in nproc × nnodes workers; returns {global rank: return value}.

    Uses the static rendezvous (as `torchrun --master-addr/--master-port` does), which
    honours --node-rank; the c10d rendezvous would order nodes by arrival instead.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    if master_port is None:
        if nnodes > 1:
            raise ValueError("--master-port is required with --nnodes > 1")
        master_port = free_port()
    # Threads per worker: share the cores instead of every worker taking all of them.
    threads = max(1, (os.cpu_count() or 1) // nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("LLMSPLIT_THREADS", os.environ["OMP_NUM_THREADS"])
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
        run_id=f"llmsplit-{uuid.uuid4().hex[:8]}" if nnodes == 1 else f"llmsplit-{master_addr}-{master_port}",
        rdzv_backend="static", rdzv_endpoint=f"{master_addr}:{master_port}",
        rdzv_configs={"rank": node_rank, "timeout": 900},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        last = [line for line in str(message).strip().splitlines() if line.strip()]
        detail = last[-1] if last else f"exit code {failure.exitcode}"
        raise LaunchError(f"worker rank {rank} failed: {detail}") from None
