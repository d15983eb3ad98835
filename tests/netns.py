"""Test hosts with separate network stacks: Linux network namespaces joined by a veth pair,
each with its own address from 198.18.0.0/15 (reserved for network benchmarks: traffic goes
nowhere but these namespaces; the test's own namespace reaches them through the bridge that joins
them, at .254). Made by the test itself (root only) and removed after it;
where they cannot be made, `hosts()` yields None and says why."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def hosts(n: int = 2):
    """Yield [(command prefix, address)] of `n` namespaces on one link, or None (with the reason
    printed) where this machine cannot make them."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("network namespaces need root and iproute2's `ip`; running the nodes on loopback", file=sys.stderr)
        yield None
        return
    tag = os.getpid() % 100000
    names = [f"llmsplit-{tag}-{i}" for i in range(n)]
    subnet = f"198.18.{tag % 250}"
    made = []
    try:
        _ip("link", "add", f"lsb{tag}", "type", "bridge")  # a bridge in the root namespace joins the hosts
        _ip("link", "set", f"lsb{tag}", "up")
        _ip("addr", "add", f"{subnet}.254/24", "dev", f"lsb{tag}")  # this (root) namespace reaches the hosts
        for i, name in enumerate(names):
            _ip("netns", "add", name)
            made.append(name)
            host_end, bridge_end = f"lsh{tag}{i}", f"lsp{tag}{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", bridge_end)
            _ip("link", "set", bridge_end, "master", f"lsb{tag}", "up")
            _ip("link", "set", host_end, "netns", name)
            _ip("-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", host_end)
            _ip("-n", name, "link", "set", host_end, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        _remove(made, tag)
        print(f"network namespaces could not be made ({getattr(e, 'stderr', e)}); running the nodes on loopback",
              file=sys.stderr)
        yield None
        return
    try:
        yield [(["ip", "netns", "exec", name], f"{subnet}.{i + 1}") for i, name in enumerate(names)]
    finally:
        _remove(made, tag)


def _remove(namespaces: list[str], tag: int) -> None:
    for name in namespaces:  # its veth end goes with it, and the peer end with that
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", f"lsb{tag}"], capture_output=True, timeout=30)
