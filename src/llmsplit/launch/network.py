"""Which network interface a node's collectives use when nodes are separate machines.

Gloo and NCCL pick the address a worker advertises to its peers from the machine's host name
unless told otherwise (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`). Where the host name
resolves to a loopback address (Debian's /etc/hosts maps it to 127.0.1.1; containers often to
127.0.0.1) every node advertises 127.0.0.1, which works while all "nodes" share one network
stack and fails as soon as they do not: measured on two network namespaces joined by a veth
pair, node 1 connected to 127.0.0.1 and was refused. The interface that routes to the master
address is the one every peer can reach this node on, so llmsplit names it (the user's own
setting wins), as torchrun users do by hand.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address (linux/sockios.h)


def route_source(addr: str, port: int | None = None) -> str:
    """This machine's address that the kernel would send from to reach `addr`: a UDP socket
    "connected" there picks the route without sending anything."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port or 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_of(name: str) -> list[str]:
    try:
        with open("/proc/net/if_inet6") as f:  # hex address, index, prefix, scope, flags, name
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [socket.inet_ntop(socket.AF_INET6, bytes.fromhex(r[0])) for r in rows if len(r) == 6 and r[5] == name]


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name` (else its first IPv6 one), or None."""
    return _ipv4_of(name) or next(iter(_ipv6_of(name)), None)


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address`, or None (not found, or not Linux)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if address == _ipv4_of(name) or address in _ipv6_of(name):
            return name
    return None


def collective_interface(master_addr: str, master_port: int | None = None) -> tuple[str | None, str | None]:
    """(interface, its address) through which this node reaches `master_addr`; (None, None)
    where it cannot be told (an address that does not resolve, no route, not Linux)."""
    try:
        source = route_source(master_addr, master_port)
    except OSError:
        return None, None
    return interface_of(source), source


def bind_collectives_to_master_route(master_addr: str, master_port: int | None = None) -> str | None:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (for this process and the workers it
    starts) to the interface that routes to the master, unless the user set either; returns
    the interface named, or None when nothing was set."""
    if any(os.environ.get(v) for v in IFNAME_VARIABLES):
        return None
    name, _ = collective_interface(master_addr, master_port)
    if name is None:
        return None
    for variable in IFNAME_VARIABLES:
        os.environ[variable] = name
    return name
