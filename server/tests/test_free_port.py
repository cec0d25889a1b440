"""The test helpers' ports: a node restarted on the port it was given must find it free."""

from __future__ import annotations

import socket

from conftest import free_port


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_handed_out_are_outside_the_ephemeral_range_distinct_and_free() -> None:
    """A port from a bind to 0 is an ephemeral one: released, the kernel may give it to
    any socket (an outgoing connection's, another process's port 0) while the node that
    was given it is down, and its restart then fails (address in use)."""
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert all(p < low for p in ports), [p for p in ports if p >= low]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out
