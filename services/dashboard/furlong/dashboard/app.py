"""The dashboard's HTTP surface: `/metrics` (Prometheus text, no redirect) and `/healthz`."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from furlong.dashboard.exporter import exposition


def create_app(registry: CollectorRegistry) -> FastAPI:
    app = FastAPI(title="Furlong dashboard", docs_url=None, redoc_url=None)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(content=exposition(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
