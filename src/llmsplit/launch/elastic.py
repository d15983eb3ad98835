"""Elastic membership: `--nnodes MIN:MAX`, a job whose machines may come and go.

Torch's own pieces do the work (never a home-made rendezvous): its elastic agent with the
c10d rendezvous backend, hosted in a TCPStore on the machine at --master-addr. Every node
joins the rendezvous; once MIN have joined, it waits `last_call` seconds for more (up to
MAX), numbers the nodes and starts the workers. When a node is lost, the workers of the
others fail in their next collective (the peer's connection closes) and their agents,
within --max-restarts, meet again without it and start new workers, which resume from the
newest complete checkpoint on the new world size (train/run_files.resume_source) with
`parallel.dp` derived again from it (train.trainer.train_worker). A node that starts while
the job runs waits in the rendezvous; the running agents see it (`num_nodes_waiting`) and
restart their workers to take it in, which torch does not count against --max-restarts.

Node numbers come from the rendezvous, not from --node-rank: global rank 0, which writes
the run folder, may run on any machine, so the run folder must be one every node reaches
(a shared file system), as a resume on other machines needs anyway.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from ..errors import ConfigError
from .network import route_source

# How long a rendezvous that has MIN nodes waits for more before it starts the job (torch's
# default is 30 s): long enough for the nodes of a job started together to arrive, short
# enough that a job that lost a node goes on soon.
LAST_CALL_S = 10


def node_range(nnodes: int | str, flag: str = "--nnodes ") -> tuple[int, int]:
    """(MIN, MAX) machines: `nnodes` is a count (MIN = MAX) or "MIN:MAX"; ConfigError naming
    `flag` ("--nnodes " on the command line, "nnodes=" in Python) for anything else."""
    if isinstance(nnodes, int):
        low = high = nnodes
    else:
        text = str(nnodes).strip()
        low_text, colon, high_text = text.partition(":")
        try:
            low, high = int(low_text), int(high_text if colon else low_text)
        except ValueError:
            raise ConfigError(f"{flag}{text!r} is not a number of machines or MIN:MAX; pass e.g. {flag}2 or "
                              f"{flag}1:2") from None
    if low < 1:
        raise ConfigError(f"{flag}{nnodes}: a job needs at least 1 machine; pass a MIN of 1 or more")
    if low > high:
        raise ConfigError(f"{flag}{nnodes}: MIN {low} is above MAX {high}; pass {flag}{high}:{low}")
    return low, high


def check_node_rank(node_rank: int, min_nodes: int, nnodes: int) -> None:
    if node_rank != 0:
        raise ConfigError(f"--node-rank {node_rank}: with --nnodes {min_nodes}:{nnodes} the rendezvous numbers the "
                          f"machines; leave --node-rank out")


def hosts_rendezvous(master_addr: str) -> bool:
    """Whether `master_addr` is this machine's own (the machine that hosts the rendezvous's
    store, and llmsplit's lock on the run folder): the kernel's route to it starts at it."""
    try:
        address = socket.getaddrinfo(master_addr, None)[0][4][0]
        return route_source(address) == address
    except OSError:
        return False


def c10d_settings(master_addr: str, master_port: int, timeout_s: float) -> dict:
    """The LaunchConfig fields of an elastic job (launch.workers.launch): every node names
    the same run id and endpoint; `timeout_s` bounds the wait for MIN nodes. Which node hosts
    the store is said outright (torch's guess compares the address with those the host name
    resolves to, which on a machine whose name maps to 127.0.1.1 matches none, so that no
    node would host it), except on a loopback master, where every "node" is this machine
    and torch's guess, with its fallback to joining when the port is taken, is right."""
    # torch 2.13 shares the rendezvous's store with the workers by default and keeps the
    # address it published in the first round: when a machine joins, the agents of the next
    # round wait for a MASTER_ADDR the old rank 0 never publishes again (both stopped after
    # 60 s; measured on network namespaces). Without the sharing, rank 0's node publishes a
    # fresh address every round. A value the user exported is kept.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    configs = {"join_timeout": int(max(1, timeout_s)), "last_call_timeout": LAST_CALL_S}
    settings = {"rdzv_backend": "c10d", "rdzv_endpoint": f"{master_addr}:{master_port}",
                "run_id": f"llmsplit-{master_addr}-{master_port}", "rdzv_configs": configs}
    if not ipaddress.ip_address(socket.getaddrinfo(master_addr, None)[0][4][0]).is_loopback:
        configs["is_host"] = hosts_rendezvous(master_addr)
        # The address the workers of the node holding rank 0 are reached at (torch's
        # MASTER_ADDR for every worker): this node's on its route to the master, not what the
        # host name resolves to (127.0.1.1 on Debian: the other machines' workers would wait
        # on their own loopback).
        settings["local_addr"] = route_source(master_addr, master_port)
    return settings
