"""Assembling the controller (store, driver, executor, REST app) and serving it over HTTP.

`build_controller` wires given service clients into a ready application; `HttpServer`
(`furlong.service_main.http_server`, re-exported here) serves it with uvicorn on a background
thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
from furlong.service_main.http_server import HttpServer

__all__ = ["Controller", "HttpServer", "build_controller"]

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
