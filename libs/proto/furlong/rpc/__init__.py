"""gRPC plumbing every Furlong service shares: one place that maps domain errors to status codes and
back, a server factory that always serves grpc.health.v1, and channels with sane defaults.

Servicers decorate their methods with `@rpc_errors`; clients call through `call()` so that a remote
`ValueError` arrives as a local `ValueError` with the remote message.
"""

from __future__ import annotations

import functools
import logging
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from furlong.core.errors import ConflictError, IntegrityError, NotFoundError, UnavailableError

log = logging.getLogger(__name__)

# Domain exception -> gRPC status code. Order matters: first match wins.
_TO_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (ConflictError, grpc.StatusCode.FAILED_PRECONDITION),
    (IntegrityError, grpc.StatusCode.DATA_LOSS),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)
_FROM_STATUS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: ConflictError,
    grpc.StatusCode.DATA_LOSS: IntegrityError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TimeoutError,
    grpc.StatusCode.INVALID_ARGUMENT: ValueError,
}

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

F = TypeVar("F", bound=Callable[..., Any])


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in _TO_STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def rpc_errors(method: F) -> F:
    """Decorate a unary servicer method: domain errors become their status code with the message."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error must become a status, never a hang
            code = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__qualname__)
            context.abort(code, f"{type(exc).__name__}: {exc}" if code == grpc.StatusCode.INTERNAL else str(exc))

    return wrapper  # type: ignore[return-value]


def error_from_rpc(err: grpc.RpcError) -> Exception:
    """The domain exception a failed call stands for."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    kind = _FROM_STATUS.get(code, RuntimeError)
    if code == grpc.StatusCode.UNAVAILABLE:
        detail = f"service unavailable: {detail}"
    return kind(detail)


def call(method: Callable[..., Any], request: Any, timeout_s: float) -> Any:
    """Invoke a unary stub method with a deadline; failures are raised as domain exceptions."""
    try:
        return method(request, timeout=timeout_s)
    except grpc.RpcError as err:
        raise error_from_rpc(err) from None


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=_OPTIONS)


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_server(
    register: Iterable[Callable[[grpc.Server], None]],
    service_names: Iterable[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 16,
) -> RunningServer:
    """Start a gRPC server with the given servicers plus grpc.health.v1 reporting SERVING for each
    name in service_names and for "" (the whole server). port=0 picks a free port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS)
    for add in register:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    server.start()
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, port=bound, health=health_servicer)


def check_health(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when the server at address reports SERVING for service."""
    ch = channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        ch.close()
