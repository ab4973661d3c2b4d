"""Assembling the controller (store, driver, executor, REST app) and serving it over HTTP.

`build_controller` wires given service clients into a ready application; `HttpServer` serves any
ASGI app with uvicorn on an already bound socket (so port 0 works and the port is known before the
first request), in the calling thread (`serve`) or a background thread (`start`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from furlong.controller.app import Readiness, create_app
from furlong.controller.auth import ApiTokens
from furlong.controller.config import DriverTimeouts
from furlong.controller.driver import RunDriver
from furlong.controller.executor import RunExecutor
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.run_store import RunStore
from furlong.controller.runs import RunService
from furlong.controller.services import Services
from furlong.rollout.api import RolloutClient

log = logging.getLogger(__name__)


@dataclass
class Controller:
    app: FastAPI
    service: RunService
    executor: RunExecutor
    store: RunStore
    metrics: ControllerMetrics

    def close(self, timeout_s: float = 60.0) -> None:
        if not self.executor.close(timeout_s):
            log.warning("the active run did not finish its teardown within %.0fs", timeout_s)


def build_controller(
    store: RunStore,
    services: Services,
    token: str | ApiTokens,
    readiness: Readiness,
    timeouts: DriverTimeouts = DriverTimeouts(),
    metrics: ControllerMetrics | None = None,
    cors_origins: tuple[str, ...] = (),
    engines: RolloutClient | None = None,
) -> Controller:
    """A controller whose executor is started and has recovered the runs already in the store.
    token: the role tokens of the REST API (a plain string is the one admin token). `engines` serves
    `/v1/engines` (default: services.rollout)."""
    metrics = metrics or ControllerMetrics()
    driver = RunDriver(store, services, timeouts, metrics)
    executor = RunExecutor(store, driver)
    service = RunService(
        store, executor, metrics, checkpointer=services.trainer, checkpoint_timeout_s=timeouts.checkpoint_s
    )
    app = create_app(
        service,
        token,
        readiness,
        metrics,
        cors_origins,
        engines=engines or services.rollout,
        active_run=lambda: executor.active_run,
    )
    executor.recover()
    executor.start()
    return Controller(app=app, service=service, executor=executor, store=store, metrics=metrics)


class HttpServer:
    """uvicorn on a socket bound at construction. `serve()` handles SIGINT/SIGTERM itself when
    called from the main thread."""

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

    def serve(self) -> None:
        """Serve until a signal or `stop()`; blocks."""
        self._server.run(sockets=[self._socket])

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
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._socket.close()
