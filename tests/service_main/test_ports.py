"""free_port: ports a listener binds soon after, drawn where no outgoing connection takes them."""

from __future__ import annotations

import socket
from pathlib import Path

from furlong.service_main.ports import free_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < low for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))
