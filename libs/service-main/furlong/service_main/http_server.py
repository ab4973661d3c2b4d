"""An ASGI app served by uvicorn on a background thread, on a socket bound at construction (so port
0 works and the port is known before the first request), stopped gracefully: `stop(timeout_s)`
closes the listening socket at once, lets requests in flight finish for up to timeout_s, then
cancels what is left. The process's signals stay with the scaffold (`furlong.service_main`):
uvicorn installs no handlers off the main thread, so it never re-raises a signal at exit."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from typing import Any

import uvicorn

_JOIN_MARGIN_S = 1.0  # uvicorn polls its exit flag every 0.1 s and waits 0.1 s for connections


class HttpServer:
    """uvicorn on a socket bound at construction; `start()` serves on a background thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host = host
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> HttpServer:
        """Serve on a background thread; returns once the server accepts connections."""
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[self._socket])),
            name="furlong-http",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.url} did not start within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting connections, let requests in flight finish for up to timeout_s (then
        cancel them), and wait for the server thread."""
        self._server.config.timeout_graceful_shutdown = max(1, math.ceil(timeout_s))  # whole seconds
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s + _JOIN_MARGIN_S)
        self._socket.close()

    def still_running(self) -> str:
        """The connections and request tasks still open ("" when none)."""
        state = self._server.server_state
        connections, tasks = len(state.connections), len(state.tasks)
        if not connections and not tasks:
            return ""
        return f"{connections} HTTP connection(s), {tasks} request task(s)"
