"""shared.ports: the ports handed to child servers are free, distinct, and out of the
range the kernel gives outgoing connections (where another connection could take them)."""

from __future__ import annotations

import socket
from pathlib import Path

from shared.ports import free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert 10_000 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
