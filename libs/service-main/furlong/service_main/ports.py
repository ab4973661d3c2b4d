"""TCP ports of the services: a free one for a process about to listen, and the check every service's
command line and configuration applies to the ports it is given (written once here)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on host a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(name: str, value: object, allow_zero: bool = True) -> int:
    """value as a port number (0 = any free port, when allowed); ValueError naming `name` otherwise."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 65535:
        raise ValueError(f"{name} must be a port number in {low}..65535, got {value!r}")
    return value
