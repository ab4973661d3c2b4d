"""The dashboard's HTTP surface: `/metrics` (Prometheus text, no redirect), `/healthz`, and the web UI
(`/` plus the JSON it polls: `/api/runs`, `/api/runs/{run_id}/series`, `/api/telemetry`)."""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from furlong.core.errors import NotFoundError, UnavailableError
from furlong.dashboard.core.lanes import UtilizationLanes
from furlong.dashboard.core.run_series import run_series
from furlong.dashboard.exporter import exposition
from furlong.dashboard.run_source import RunSource

RUN_FIELDS = ("run_id", "name", "state", "current_step", "policy_version", "created_at", "reason")


def _index_html() -> str:
    return resources.files("furlong.dashboard").joinpath("static/index.html").read_text("utf-8")


def create_app(
    registry: CollectorRegistry, runs: RunSource | None = None, lanes: UtilizationLanes | None = None
) -> FastAPI:
    app = FastAPI(title="Furlong dashboard", docs_url=None, redoc_url=None)
    index = _index_html()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(content=exposition(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return index

    @app.get("/api/runs")
    def list_runs() -> dict[str, Any]:
        if runs is None:
            return {"runs": [], "source": None}
        try:
            found = runs.runs()
        except UnavailableError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        return {"runs": [{k: r.get(k) for k in RUN_FIELDS} for r in found], "source": "controller"}

    @app.get("/api/runs/{run_id}/series")
    def series(run_id: str) -> dict[str, Any]:
        if runs is None:
            raise HTTPException(status_code=404, detail="no run source configured")
        try:
            steps = runs.steps(run_id)
        except NotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        except UnavailableError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        return {"run_id": run_id, "num_steps": len(steps), **run_series(steps)}

    @app.get("/api/telemetry")
    def telemetry() -> dict[str, Any]:
        return {"lanes": lanes.snapshot() if lanes is not None else {}}

    return app
