"""launch/network.py: the interface a node's collectives use is its route to the master,
unless the user named one."""

import os

from llmsplit.launch.network import IFNAME_VARIABLES, bind_collectives_to_master_route, collective_interface


def test_the_route_to_a_loopback_master_is_the_loopback_interface():
    name, address = collective_interface("127.0.0.1", 29500)
    assert address == "127.0.0.1" and name == "lo"


def test_the_users_interface_wins(monkeypatch):
    for variable in IFNAME_VARIABLES:  # set, then deleted: monkeypatch restores them as they were
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    assert bind_collectives_to_master_route("127.0.0.1") == "lo"
    assert all(os.environ[v] == "lo" for v in IFNAME_VARIABLES)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert bind_collectives_to_master_route("127.0.0.1") is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7" and "NCCL_SOCKET_IFNAME" not in os.environ


def test_a_master_without_a_route_names_nothing():
    assert collective_interface("no-such-host.invalid", 1) == (None, None)
