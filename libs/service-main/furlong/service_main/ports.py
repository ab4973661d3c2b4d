"""TCP ports of the services: a free one for a process about to listen, and the check every service's
command line and configuration applies to the ports it is given (written once here)."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below this lie the ports of well-known and registered services
_handed_out: set[int] = set()
_lock = threading.Lock()
_random = random.SystemRandom()


def _ephemeral_low() -> int | None:
    """The lowest port the kernel hands to outgoing connections, None where it is not known."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return low if low > _LOWEST + 1000 else None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on host a moment ago, for a process that will listen on it soon.

    It is drawn from below the kernel's ephemeral range where that range is known: a port the kernel
    chose for bind(0) could, before the listener binds it, become the local port of an outgoing
    connection (every client socket on the machine draws from that range). Within this process no
    port is handed out twice."""
    low = _ephemeral_low()
    with _lock:
        if low is not None:
            for _ in range(200):
                port = _random.randrange(_LOWEST, low)
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        for _ in range(50):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free TCP port found on {host}")


def check_port(name: str, value: object, allow_zero: bool = True) -> int:
    """value as a port number (0 = any free port, when allowed); ValueError naming `name` otherwise."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 65535:
        raise ValueError(f"{name} must be a port number in {low}..65535, got {value!r}")
    return value
