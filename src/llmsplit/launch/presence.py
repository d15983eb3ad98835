"""Which nodes of a multi-node job have reached the master, so that a node that never arrives
is named. torch's static rendezvous counts the clients of node 0's store ("Timed out after
600 seconds waiting for clients. 2/3 clients joined") and cannot say which node is missing;
on a cluster that is what the person has to know to go and look. So each node signs in under
its own number in the job's store, and node 0 reads the sign-ins while it waits.

A sign-in is a key, not a rendezvous: torch's rendezvous still forms the job. In training
(`launch`) the sign-ins go through a store client of their own beside the agent's (a client
without a world size does not count as one of the rendezvous' clients); the followers of
inference (`Followers`) sign in through the store they join by."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch.distributed as dist

_KEY = "llmsplit/present/node_{}"
POLL_S = 0.5  # how often node 0 reads the sign-ins while it waits (its timeout's answer is this old at most)


def sign_in(store, node: int) -> None:
    store.set(_KEY.format(node), "1")


def absent(store, nnodes: int) -> list[int]:
    """The nodes 1..nnodes-1 that have not signed in to `store` (node 0 hosts it, and in
    inference its only rank may be the caller, which does not sign in)."""
    return [node for node in range(1, nnodes) if not store.check([_KEY.format(node)])]


def never_reached(missing: list[int], nnodes: int, addr: str, port: int, waited: str) -> str:
    """The sentence for a timeout with `missing` nodes: "node 2 of 3 never reached ..."."""
    nodes = f"node {missing[0]}" if len(missing) == 1 else "nodes " + ", ".join(map(str, missing))
    verb = "was" if len(missing) == 1 else "were"
    return (f"{nodes} of {nnodes} never reached the master {addr}:{port} {waited}; {verb} "
            f"the same command started there with --node-rank {missing[0]}, and can that machine reach {addr}:{port}?")


class NodeSignIns:
    """For the length of a static multi-node launch: this node signs in at the master's store
    once the agent on node 0 has it up, then reads every POLL_S seconds which nodes have not,
    until all have or the launch ends; `missing` is what it read last (empty until the store
    was reached). Every node reads, so a node that did reach the master can say which other
    one the job waits for. A daemon thread: a store that never comes up must not keep the
    process alive."""

    def __init__(self, addr: str, port: int, node_rank: int, nnodes: int):
        self.addr, self.port, self.node_rank, self.nnodes = addr, port, node_rank, nnodes
        self.missing: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmsplit-node-sign-ins", daemon=True)

    def __enter__(self) -> NodeSignIns:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def _run(self) -> None:
        store = None
        while not self._done.wait(0 if store is None else POLL_S):
            if store is None and not _listening(self.addr, self.port):
                self._done.wait(POLL_S)  # the agent on node 0 has not started the store yet
                continue
            try:
                if store is None:
                    store = dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                                          timeout=timedelta(seconds=2))
                    sign_in(store, self.node_rank)
                self.missing = absent(store, self.nnodes)
            except (RuntimeError, OSError):
                store = None  # gone with the launch, or not a store after all: keep what was last read
                continue
            if not self.missing:
                return


def _listening(addr: str, port: int) -> bool:
    """Whether something accepts connections at addr:port. Asked with a plain socket before
    a store client is made: a TCPStore client that cannot connect logs a C++ stack trace
    each time, which a watcher retrying every few seconds would fill the terminal with."""
    try:
        socket.create_connection((addr, port), timeout=1).close()
        return True
    except OSError:
        return False
