"""The controller's REST API (FastAPI): a thin layer over `RunService`.

Routes under `/v1` require `Authorization: Bearer <token>` (compared in constant time; the token is
never logged). `/healthz`, `/readyz` and `/metrics` are open, for probes and Prometheus. Domain
errors map to status codes in one place: SpecError/ValueError 422 (body names the field),
NotFoundError 404, ConflictError 409, UnavailableError 503.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Callable

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from furlong.core.errors import ConflictError, NotFoundError, UnavailableError

from furlong.controller.metrics import CONTENT_TYPE, ControllerMetrics
from furlong.controller.run_spec import SpecError
from furlong.controller.runs import RunService

log = logging.getLogger(__name__)

Readiness = Callable[[], dict[str, bool]]


def _bearer_check(token: str) -> Callable[..., None]:
    expected = token.encode()

    def require_token(authorization: str | None = Header(default=None)) -> None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise HTTPException(status_code=401, detail="missing or invalid bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    return require_token


def _install_error_handlers(app: FastAPI) -> None:
    def handler(status: int, body: Callable[[Exception], Any]):
        async def handle(request: Request, exc: Exception) -> JSONResponse:
            return JSONResponse(status_code=status, content={"detail": body(exc)})
        return handle

    app.add_exception_handler(SpecError, handler(422, lambda e: {"field": e.field, "message": str(e)}))
    app.add_exception_handler(NotFoundError, handler(404, str))
    app.add_exception_handler(ConflictError, handler(409, str))
    app.add_exception_handler(UnavailableError, handler(503, str))
    app.add_exception_handler(ValueError, handler(422, lambda e: {"field": None, "message": str(e)}))


def _runs_router(service: RunService, token: str) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_bearer_check(token))])

    @router.post("/runs", status_code=201)
    async def create_run(request: Request) -> dict[str, Any]:
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpecError("body", f"not valid JSON: {exc}") from None
        run = await run_in_threadpool(service.create_run, data)
        return run.to_dict()

    @router.get("/runs")
    def list_runs(state: str | None = Query(default=None)) -> dict[str, Any]:
        try:
            runs = service.list_runs(state)
        except ValueError as exc:
            raise SpecError("state", str(exc)) from None
        return {"runs": [r.to_dict() for r in runs]}

    @router.get("/runs/{run_id}")
    def get_run(run_id: str) -> dict[str, Any]:
        return service.get_run(run_id).to_dict()

    @router.post("/runs/{run_id}/stop")
    def stop_run(run_id: str) -> dict[str, Any]:
        return service.stop_run(run_id).to_dict()

    @router.get("/runs/{run_id}/metrics")
    def run_metrics(run_id: str, since: int = Query(default=0, ge=0)) -> dict[str, Any]:
        steps = service.step_metrics(run_id, since)
        return {"run_id": run_id, "since": since, "steps": [s.to_dict() for s in steps]}

    return router


def create_app(service: RunService, token: str, readiness: Readiness,
               metrics: ControllerMetrics) -> FastAPI:
    """The REST application. readiness returns named checks (True = ok) for `/readyz`."""
    if not token:
        raise ValueError("token must be non-empty")
    app = FastAPI(title="Furlong controller", version="1", docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    app.include_router(_runs_router(service, token))

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        checks = readiness()
        ready = all(checks.values())
        return JSONResponse(status_code=200 if ready else 503,
                            content={"ready": ready, "checks": checks})

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(content=metrics.exposition(), media_type=CONTENT_TYPE)

    return app
