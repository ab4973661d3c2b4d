"""The OpenAI-compatible HTTP API over a `Gateway` (FastAPI):

    GET  /v1/models                 GET /v1/models/{model}
    POST /v1/chat/completions       POST /v1/completions
    GET  /health

The same three `/v1` routes under `/sessions/{session_id}/v1` record every call in that session
(token ids and log-probs, `core.gateway_session`): an agent bound to a session is an OpenAI client
with that base URL; a catalog may serve a session's calls from one engine (`ModelCatalog.get`).
`GET /sessions/{session_id}` returns the session's records, `DELETE` removes them (and returns them)
and ends the session in the catalog.

Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}`, mapped here in one
place: a bad request 400 (`invalid_request_error`, naming the parameter), an unknown model or
session 404, a wrong method 405, a run whose engines are all drained 503, anything else 500
(`server_error`, logged; never for bad input).
A streamed reply is sent as it is generated: `data: {chunk}` events, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from furlong.core.errors import NotFoundError, UnavailableError
from furlong.rollout.core.checks import check_id
from furlong.rollout.gateway.calls import Call, Gateway
from furlong.rollout.gateway.requests import RequestError
from furlong.rollout.gateway.responses import error_body

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


def _error(
    status: int, message: str, error_type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status)


async def _json_body(request: Request) -> object:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None


class _ClientGone(Exception):
    """The client of a stream went away: the call ends at its next token."""


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _events(gateway: Gateway, call: Call) -> AsyncIterator[bytes]:
    """The call's chunks as server-sent events, sent as the engine draws the tokens (the engine runs
    on a thread of its own), then `data: [DONE]`. A failure after the first chunk is sent as an
    error event (OpenAI's error body; the `openai` package raises it). When the client goes away
    the call ends at its next token."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    gone = threading.Event()

    def put(item: bytes | None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            gone.set()

    def send(chunk: dict[str, Any]) -> None:
        if gone.is_set():
            raise _ClientGone()
        put(_event(chunk))

    def work() -> None:
        try:
            gateway.stream(call, send)
        except _ClientGone:
            log.info("%s: the client went away; sampling stopped", call.response_id)
        except ValueError as exc:
            put(_event(error_body(str(exc), INVALID_REQUEST)))
        except Exception as exc:
            log.error("%s: streaming failed", call.response_id, exc_info=exc)
            put(_event(error_body(f"internal error: {type(exc).__name__}", SERVER_ERROR)))
        finally:
            put(None)

    threading.Thread(target=work, name=f"furlong-gateway-{call.response_id}", daemon=True).start()
    try:
        while (item := await queue.get()) is not None:
            yield item
        yield b"data: [DONE]\n\n"
    finally:
        gone.set()


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="Furlong OpenAI-compatible gateway", docs_url=None, redoc_url=None, openapi_url=None)

    async def request_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return _error(400, exc.message, INVALID_REQUEST, exc.param, exc.code)

    async def not_found(_: Request, exc: Exception) -> Response:
        return _error(404, str(exc), INVALID_REQUEST, "model", "model_not_found")

    async def unavailable(_: Request, exc: Exception) -> Response:
        return _error(503, str(exc), SERVER_ERROR, None, "unavailable")

    async def value_error(_: Request, exc: Exception) -> Response:
        return _error(400, str(exc), INVALID_REQUEST)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return _error(exc.status_code, str(exc.detail), kind)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}", SERVER_ERROR)

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(NotFoundError, not_found)
    app.add_exception_handler(UnavailableError, unavailable)
    app.add_exception_handler(ValueError, value_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)

    async def call(
        prepare: Callable[[object, str | None], Call], request: Request, session_id: str | None
    ) -> Response:
        if session_id is not None:
            try:
                check_id("session_id", session_id)
            except ValueError as exc:
                raise RequestError(str(exc), "session_id") from None
        body = await _json_body(request)
        checked = await asyncio.to_thread(prepare, body, session_id)
        if checked.stream:
            return StreamingResponse(_events(gateway, checked), media_type="text/event-stream")
        return JSONResponse(await asyncio.to_thread(gateway.reply, checked))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": gateway.catalog.names()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return gateway.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        return gateway.model(model)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await call(gateway.prepare_chat, request, None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await call(gateway.prepare_text, request, None)

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str) -> dict[str, Any]:
        return gateway.models()

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat(session_id: str, request: Request) -> Response:
        return await call(gateway.prepare_chat, request, session_id)

    @app.post("/sessions/{session_id}/v1/completions")
    async def session_completions(session_id: str, request: Request) -> Response:
        return await call(gateway.prepare_text, request, session_id)

    @app.get("/sessions/{session_id}")
    async def session(session_id: str) -> Response:
        record = gateway.session(session_id)
        if record is None:
            return _error(404, f"session {session_id!r} has no calls", NOT_FOUND, "session_id")
        return JSONResponse(record)

    @app.delete("/sessions/{session_id}")
    async def close_session(session_id: str) -> Response:
        record = gateway.close_session(session_id)
        if record is None:
            return _error(404, f"session {session_id!r} has no calls", NOT_FOUND, "session_id")
        return JSONResponse(record)

    return app
