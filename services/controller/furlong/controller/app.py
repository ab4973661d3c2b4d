"""The controller's REST API (FastAPI): a thin layer over `RunService`.

Routes under `/v1` require `Authorization: Bearer <token>`: reads need a viewer or admin token,
changes an admin token (401 without a valid token, 403 for a viewer token on a change). Tokens are
compared in constant time and never logged. `/healthz`, `/readyz`, `/metrics` and `/openapi.json`
are open. Every error is `application/problem+json` (see `problems`); request bodies are limited
in size; CORS is off unless origins are configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from furlong.controller import api_models as m
from furlong.controller.auth import ApiTokens, Role
from furlong.controller.metrics import CONTENT_TYPE, ControllerMetrics
from furlong.controller.problems import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware, install_problem_handlers
from furlong.controller.run_events import EventPage, RunEvent
from furlong.controller.runs import RunService
from furlong.core.errors import NotFoundError, UnavailableError
from furlong.core.settings import SettingError
from furlong.rollout.api import EngineStatus, RolloutClient

log = logging.getLogger(__name__)

Readiness = Callable[[], dict[str, bool]]
MAX_PAGE = 1000
EVENT_POLL_S = 0.2
ENGINE_STATUS_TIMEOUT_S = 5.0  # the deadline of the rollout client behind /v1/engines
EVENT_BATCH = 100
KEEPALIVE_S = 15.0
_IDEMPOTENCY_KEY_MAX = 255


def _role_check(tokens: ApiTokens, needed: Role) -> Callable[..., Role]:
    bearer = HTTPBearer(auto_error=False)

    def require(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Role:
        role = tokens.role_for(credentials.credentials) if credentials is not None else None
        if role is None:
            raise HTTPException(
                status_code=401,
                detail="missing or invalid bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not role.allows(needed):
            raise HTTPException(
                status_code=403,
                detail=f"a {role.value} token cannot do this; it needs an {needed.value} token",
            )
        return role

    return require


def _check_idempotency_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not 1 <= len(key) <= _IDEMPOTENCY_KEY_MAX or not key.isascii() or not key.isprintable():
        raise SettingError(
            "Idempotency-Key",
            f"must be 1..{_IDEMPOTENCY_KEY_MAX} printable ASCII characters, got {len(key)} characters",
        )
    return key


def _read_routes(router: APIRouter, service: RunService) -> None:
    @router.get("/runs", response_model=m.RunPage, responses=m.problem_responses(401, 422, 503))
    def list_runs(
        state: str | None = Query(default=None),
        limit: int = Query(default=100, ge=1, le=MAX_PAGE),
        cursor: str | None = Query(default=None, max_length=512),
    ) -> dict[str, Any]:
        """Runs, newest first, one page at a time; pass `next_cursor` as `cursor` for the next."""
        try:
            runs, next_cursor = service.list_page(state, limit, cursor)
        except ValueError as exc:
            raise SettingError("cursor" if "cursor" in str(exc) else "state", str(exc)) from None
        return {"runs": [r.to_dict() for r in runs], "next_cursor": next_cursor}

    @router.get("/runs/{run_id}", response_model=m.RunModel, responses=m.problem_responses(401, 404, 503))
    def get_run(run_id: str) -> dict[str, Any]:
        return service.get_run(run_id).to_dict()

    @router.get(
        "/runs/{run_id}/metrics",
        response_model=m.StepsPage,
        responses=m.problem_responses(401, 404, 422, 503),
    )
    def run_metrics(run_id: str, since: int = Query(default=0, ge=0)) -> dict[str, Any]:
        steps = service.step_metrics(run_id, since)
        return {"run_id": run_id, "since": since, "steps": [s.to_dict() for s in steps]}

    @router.get(
        "/runs/{run_id}/events",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "Server-Sent Events: one per change of the run; "
                "the stream ends after the event of a final state",
                "content": m.event_stream_content(),
            },
            **m.problem_responses(401, 404, 503),
        },
    )
    async def run_events(
        request: Request, run_id: str, last_event_id: str | None = Header(default=None, max_length=64)
    ) -> StreamingResponse:
        """Replays the run's events after `Last-Event-ID` (all when absent), then follows it."""
        after = last_event_id or "0-0"
        if not _valid_stream_id(after):
            raise SettingError(
                "Last-Event-ID", f"must be a stream id like 1700000000000-0, got {after[:64]!r}"
            )
        first = await run_in_threadpool(service.events, run_id, after, EVENT_BATCH)
        return StreamingResponse(
            _event_stream(request, service, run_id, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


def _engine_routes(
    router: APIRouter, engines: RolloutClient | None, active_run: Callable[[], str | None]
) -> None:
    @router.get("/engines", response_model=m.EnginesPage, responses=m.problem_responses(401, 404, 409, 503))
    def list_engines(run_id: str | None = Query(default=None, max_length=128)) -> dict[str, Any]:
        """Engines of run_id (default: the run being executed; none when idle), as rollout
        reports them."""
        if engines is None:
            raise UnavailableError("engine status is not configured on this controller")
        target = run_id or active_run()
        if target is None:
            return {"run_id": None, "engines": []}
        found = engines.status(target).engines
        return {"run_id": target, "engines": [_engine_json(e) for e in found]}


def _drain_route(
    router: APIRouter,
    service: RunService,
    engines: RolloutClient | None,
    active_run: Callable[[], str | None],
) -> None:
    @router.post(
        "/engines/{engine_id}/drain",
        response_model=m.Engine,
        responses=m.problem_responses(401, 403, 404, 503),
    )
    def drain_engine(
        engine_id: str, run_id: str | None = Query(default=None, max_length=128)
    ) -> dict[str, Any]:
        """Drain an engine of run_id (default: the run being executed): it takes no new work and
        finishes what it has, then reports `drained`. Idempotent; a recovery of the run keeps the
        engine drained."""
        if engines is None:
            raise UnavailableError("engine status is not configured on this controller")
        target = run_id or active_run()
        if target is None:
            raise NotFoundError(f"engine {engine_id!r}: no run is being executed; pass run_id")
        drained = engines.drain_engine(target, engine_id)
        service.remember_drained(target, engine_id)
        return _engine_json(drained)


def _engine_json(e: EngineStatus) -> dict[str, Any]:
    return {
        "engine_id": e.engine_id,
        "policy_version": e.policy_version,
        "healthy": e.healthy,
        "state": e.state.value,
        "in_flight": e.in_flight,
    }


def _valid_stream_id(value: str) -> bool:
    ms, sep, seq = value.partition("-")
    return value.isascii() and ms.isdigit() and sep == "-" and seq.isdigit() and len(value) <= 40


async def _event_stream(
    request: Request, service: RunService, run_id: str, page: EventPage
) -> AsyncIterator[str]:
    idle_s = 0.0
    finished = False  # a terminal event was sent: end once the events recorded so far are sent too
    while True:
        for event_id, event in page.events:
            yield _sse_message(event_id, event)
            finished = finished or event.state.terminal
        caught_up = page.num_entries < EVENT_BATCH
        if finished and caught_up:
            return  # a checkpoint recorded after the run ended comes after its terminal event
        if page.events:
            idle_s = 0.0
        elif caught_up and await run_in_threadpool(_run_finished, service, run_id):
            return  # resumed after the final event (or the run was deleted while followed)
        elif idle_s >= KEEPALIVE_S:
            idle_s = 0.0
            yield ": keep-alive\n\n"
        if await request.is_disconnected():
            return
        if caught_up:  # wait for more; else keep replaying
            await asyncio.sleep(EVENT_POLL_S)
            idle_s += EVENT_POLL_S
        try:
            page = await run_in_threadpool(service.events, run_id, page.last_id, EVENT_BATCH)
        except NotFoundError:
            return  # the run was deleted while followed


def _sse_message(event_id: str, event: RunEvent) -> str:
    """One Server-Sent Event: the stream id, the event type, the typed payload as one JSON line."""
    data = json.dumps(event.to_dict(), sort_keys=True)
    return f"id: {event_id}\nevent: {event.TYPE.value}\ndata: {data}\n\n"


def _run_finished(service: RunService, run_id: str) -> bool:
    try:
        return service.get_run(run_id).state.terminal
    except NotFoundError:
        return True


def _change_routes(router: APIRouter, service: RunService) -> None:
    run_responses = m.problem_responses(401, 403, 404, 409, 503)

    @router.post(
        "/runs",
        status_code=201,
        response_model=m.RunModel,
        responses={
            200: {"model": m.RunModel, "description": "replayed: the run this Idempotency-Key created"},
            **m.problem_responses(401, 403, 409, 413, 422, 503),
        },
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": m.spec_schema()}}}
        },
    )
    async def create_run(request: Request, idempotency_key: str | None = Header(default=None)) -> Any:
        key = _check_idempotency_key(idempotency_key)
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SettingError("body", f"not valid JSON: {exc}") from None
        run, replayed = await run_in_threadpool(service.create_run_idempotent, data, key)
        if replayed:
            return JSONResponse(
                status_code=200, content=run.to_dict(), headers={"Idempotent-Replayed": "true"}
            )
        return run.to_dict()

    @router.post("/runs/{run_id}/stop", response_model=m.RunModel, responses=run_responses)
    def stop_run(run_id: str) -> dict[str, Any]:
        return service.stop_run(run_id).to_dict()

    @router.post("/runs/{run_id}/pause", response_model=m.RunModel, responses=run_responses)
    def pause_run(run_id: str) -> dict[str, Any]:
        """The run pauses before its next step (state `paused`); idempotent."""
        return service.pause_run(run_id).to_dict()

    @router.post("/runs/{run_id}/resume", response_model=m.RunModel, responses=run_responses)
    def resume_run(run_id: str) -> dict[str, Any]:
        return service.resume_run(run_id).to_dict()

    @router.post("/runs/{run_id}/checkpoint", response_model=m.RunModel, responses=run_responses)
    def checkpoint_run(run_id: str) -> dict[str, Any]:
        """The trainer writes a running or paused run's training state now (after a step in
        progress); the run with that `checkpoint` (step, path). 409 in any other state, or when
        the trainer cannot (no checkpoint directory, offloaded); 503 trainer unreachable."""
        return service.checkpoint_run(run_id).to_dict()

    @router.delete("/runs/{run_id}", status_code=204, response_class=Response, responses=run_responses)
    def delete_run(run_id: str, keep_checkpoints: bool = False) -> Response:
        """Delete a finished run, its metrics and events, and its training checkpoints on the
        trainer unless `keep_checkpoints=true`. 409 unfinished; 503 trainer unreachable (nothing
        is deleted then)."""
        service.delete_run(run_id, keep_checkpoints)
        return Response(status_code=204)


def create_app(
    service: RunService,
    tokens: ApiTokens | str,
    readiness: Readiness,
    metrics: ControllerMetrics,
    cors_origins: tuple[str, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    engines: RolloutClient | None = None,
    active_run: Callable[[], str | None] = lambda: None,
) -> FastAPI:
    """The REST application. tokens: the role tokens (a plain string is the one admin token);
    readiness returns named checks (True = ok) for `/readyz`; engines and active_run serve
    `/v1/engines` and `/v1/engines/{id}/drain` (503 without engines)."""
    if isinstance(tokens, str):
        tokens = ApiTokens(admin=(tokens,))
    app = FastAPI(title="Furlong controller", version="1", docs_url=None, redoc_url=None)
    install_problem_handlers(app)
    reader = APIRouter(prefix="/v1", dependencies=[Depends(_role_check(tokens, Role.VIEWER))])
    _read_routes(reader, service)
    _engine_routes(reader, engines, active_run)
    writer = APIRouter(prefix="/v1", dependencies=[Depends(_role_check(tokens, Role.ADMIN))])
    _change_routes(writer, service)
    _drain_route(writer, service, engines, active_run)
    app.include_router(reader)
    app.include_router(writer)

    @app.get("/healthz", response_model=m.Health)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", response_model=m.Readiness, responses={503: {"model": m.Readiness}})
    def readyz() -> JSONResponse:
        checks = readiness()
        ready = all(checks.values())
        return JSONResponse(status_code=200 if ready else 503, content={"ready": ready, "checks": checks})

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    def prometheus_metrics() -> Response:
        return Response(content=metrics.exposition(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = m.finish_openapi(
                get_openapi(
                    title=app.title,
                    version=app.version,
                    routes=app.routes,
                    description="Furlong controller REST API; errors are RFC 9457 problem+json.",
                )
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI documents replacing app.openapi to customise the schema
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
        )
    return app
