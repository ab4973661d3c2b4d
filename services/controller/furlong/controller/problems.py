"""Every error of the REST API as RFC 9457 `application/problem+json`, and the request body limit.

A problem body is `{"type", "title", "status", "detail", "instance"}` plus, for a bad value,
`field` (the dotted path of the offending value, e.g. `sampling.top_p`) and, for a malformed
request, `errors` (each `{"field", "message"}`). `type` is `about:blank`: the status code and
title say what kind of problem it is. Domain errors map to codes here and only here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.core.settings import SettingError

log = logging.getLogger(__name__)

PROBLEM_TYPE = "application/problem+json"
DEFAULT_MAX_BODY_BYTES = 1024 * 1024


class BodyTooLargeError(Exception):
    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit_bytes} bytes")


def problem(
    status: int, detail: str, instance: str = "", headers: dict[str, str] | None = None, **extensions: Any
) -> JSONResponse:
    body = {
        "type": "about:blank",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "instance": instance,
        **extensions,
    }
    return JSONResponse(status_code=status, content=body, media_type=PROBLEM_TYPE, headers=headers)


def install_problem_handlers(app: FastAPI) -> None:
    # Starlette types every handler as taking any Exception; each below is registered for one
    # class, which it asserts.
    def simple(status: int) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
        async def handle(request: Request, exc: Exception) -> JSONResponse:
            return problem(status, str(exc), request.url.path)

        return handle

    async def spec_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, SettingError)
        return problem(422, str(exc), request.url.path, field=exc.field)

    async def value_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ValueError)
        return problem(422, str(exc), request.url.path, field=None)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return problem(
            exc.status_code, str(exc.detail), request.url.path, headers=getattr(exc, "headers", None)
        )

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            {
                "field": ".".join(str(p) for p in e.get("loc", ())[1:]) or "body",
                "message": str(e.get("msg", "")),
            }
            for e in exc.errors()
        ]
        first = errors[0] if errors else {"field": "body", "message": "invalid request"}
        return problem(
            422,
            f"{first['field']}: {first['message']}",
            request.url.path,
            field=first["field"],
            errors=errors,
        )

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem(500, f"internal error: {type(exc).__name__}", request.url.path)

    app.add_exception_handler(SettingError, spec_error)
    app.add_exception_handler(NotFoundError, simple(404))
    app.add_exception_handler(ConflictError, simple(409))
    app.add_exception_handler(BodyTooLargeError, simple(413))
    app.add_exception_handler(UnavailableError, simple(503))
    app.add_exception_handler(ValueError, value_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


class BodyLimitMiddleware:
    """Rejects a request whose body is larger than max_bytes: at once (413) when Content-Length
    says so, else by raising BodyTooLargeError from `receive` once the limit is crossed."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            response = problem(413, str(BodyTooLargeError(self.max_bytes)), scope.get("path", ""))
            await response(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, limited, send)
