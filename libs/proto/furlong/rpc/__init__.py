"""gRPC plumbing every Furlong service shares: one place that maps domain errors to status codes and
back, a server factory that always serves grpc.health.v1, and channels with sane defaults.

Servicers decorate their methods with `@rpc_errors`; clients call through `call()` so that a remote
`ValueError` arrives as a local `ValueError` with the remote message.

Authentication between services: a shared token sent as `authorization: Bearer <token>` metadata.
`start_server(auth_token=...)` installs an interceptor that answers UNAUTHENTICATED to any call
without it (grpc.health.v1 stays open for probes); `channel(address, auth_token=...)` attaches it
to every call. A service's `__main__` sets the process's token once with `use_auth_token` (from
its `--auth-token-file`), so every server and channel the process creates uses it; an explicit
`auth_token` argument overrides that. The token is compared in constant time and never logged.

Mutual TLS, when certificates are configured (see `furlong.rpc.tls`): `use_tls` sets the process's
`TlsConfig` (from `--tls-ca-file/--tls-cert-file/--tls-key-file`); then every server serves only
TLS and requires a client certificate signed by the CA, and every channel presents the process's
certificate. The token still applies on top: TLS says which machine is calling, the token that it
belongs to this deployment.
"""

from __future__ import annotations

import functools
import hmac
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from furlong.core.errors import ConflictError, IntegrityError, NotFoundError, UnavailableError
from furlong.rpc.inflight import InFlightCalls
from furlong.rpc.tls import TlsConfig as TlsConfig
from furlong.rpc.tls import TlsFiles as TlsFiles

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
    grpc.StatusCode.UNAUTHENTICATED: PermissionError,
}

AUTH_METADATA_KEY = "authorization"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
MIN_AUTH_TOKEN_CHARS = 16
_process_auth_token: str | None = None
_process_tls: TlsConfig | None = None


def use_auth_token(token: str | None) -> None:
    """Set the token every server and channel of this process uses by default (None: none). Called
    once by a service's composition root; ValueError for a token too short or with whitespace."""
    global _process_auth_token
    if token is not None:
        check_auth_token(token)
    _process_auth_token = token


def use_tls(tls: TlsConfig | None) -> None:
    """Set the mutual-TLS configuration every server and channel of this process uses by default
    (None: plaintext). Called once by a service's composition root."""
    global _process_tls
    if tls is not None and not isinstance(tls, TlsConfig):
        raise TypeError(f"use_tls needs a TlsConfig or None, got {type(tls).__name__}")
    if tls is not None:
        log.info("gRPC mutual TLS on%s", f" (server name {tls.server_name})" if tls.server_name else "")
    _process_tls = tls


def install_credentials(auth_token_file: Path | str | None, tls: TlsFiles) -> None:
    """A service's start-up: read its `--auth-token-file` (empty or None: no token) and its TLS
    files, and make both the process defaults. ValueError naming the flag and file (never the
    token) when either is invalid: the service then exits with status 2
    (`furlong.rpc.service_main`)."""
    use_auth_token(read_auth_token_file(auth_token_file or None))
    use_tls(tls.load())


def add_tls_arguments(parser: Any) -> None:
    """Add --tls-ca-file, --tls-cert-file, --tls-key-file and --tls-server-name to an argparse
    parser (the composition root turns them into a `TlsFiles`)."""
    parser.add_argument(
        "--tls-ca-file",
        default="",
        help="PEM CA certificate; with --tls-cert-file and --tls-key-file turns on "
        "mutual TLS for every gRPC server and channel of the process",
    )
    parser.add_argument("--tls-cert-file", default="", help="PEM certificate (chain) of this process")
    parser.add_argument("--tls-key-file", default="", help="PEM private key of --tls-cert-file")
    parser.add_argument(
        "--tls-server-name",
        default="",
        help="name to verify in servers' certificates instead of the dialled host",
    )


def check_auth_token(token: str) -> str:
    if len(token) < MIN_AUTH_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(
            f"the gRPC auth token must be at least {MIN_AUTH_TOKEN_CHARS} characters "
            f"without whitespace (got {len(token)} characters)"
        )
    return token


def read_auth_token_file(path: Path | str | None) -> str | None:
    """The token in an `--auth-token-file` (stripped), or None for no file; ValueError naming the
    file (never the token) when it cannot be read or is not a valid token."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read --auth-token-file {path}: {exc.strerror}") from None
    try:
        return check_auth_token(token)
    except ValueError as exc:
        raise ValueError(f"--auth-token-file {path}: {exc}") from None


def _token(explicit: str | None) -> str | None:
    return explicit if explicit is not None else _process_auth_token


def _abort_unauthenticated(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid service token")


class TokenServerInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose `authorization` metadata is not `Bearer <token>` (health checks pass)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {check_auth_token(token)}".encode()
        self._reject: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(
            _abort_unauthenticated
        )

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return continuation(handler_call_details)
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
        if hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        return self._reject


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._header = (AUTH_METADATA_KEY, f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        details: grpc.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        details: grpc.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return continuation(self._with_token(details), request_iterator)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A channel whose peer went away retries connecting with exponential backoff; calls made while it
# waits fail at once with UNAVAILABLE. gRPC's default cap (120 s) would keep a restarted service
# unreachable for minutes; with this cap a channel reconnects within about a second of the restart.
MAX_RECONNECT_BACKOFF_S = 1.0
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
]

_Servicer = TypeVar("_Servicer")
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")
_UnaryMethod = Callable[[_Servicer, _Request, grpc.ServicerContext], _Response]


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in _TO_STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def rpc_errors(
    method: _UnaryMethod[_Servicer, _Request, _Response],
) -> _UnaryMethod[_Servicer, _Request, _Response]:
    """Decorate a unary servicer method: domain errors become their status code with the message."""

    @functools.wraps(method)
    def wrapper(self: _Servicer, request: _Request, context: grpc.ServicerContext) -> _Response:
        try:
            return method(self, request, context)
        except Exception as exc:
            code = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__qualname__)
            context.abort(
                code,
                clip_details(
                    f"{type(exc).__name__}: {exc}" if code == grpc.StatusCode.INTERNAL else str(exc)
                ),
            )

    return wrapper


MAX_DETAILS_CHARS = 800


def clip_details(message: str) -> str:
    """A status message short enough for gRPC's trailing metadata (8 KiB by default, percent-encoded):
    a message that echoes a huge bad value keeps its start and end and says how much was cut.
    Without this the client sees RESOURCE_EXHAUSTED instead of the status the server sent."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    head, tail = message[: MAX_DETAILS_CHARS // 2], message[-MAX_DETAILS_CHARS // 4 :]
    return f"{head} ... ({len(message) - len(head) - len(tail)} characters cut) ... {tail}"


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


def channel(address: str, auth_token: str | None = None, tls: TlsConfig | None = None) -> grpc.Channel:
    """A channel to address; every call carries the auth token (explicit, else the process's), over
    mutual TLS when configured (explicit, else the process's)."""
    tls = tls if tls is not None else _process_tls
    if tls is None:
        ch = grpc.insecure_channel(address, options=_OPTIONS)
    else:
        ch = grpc.secure_channel(
            address, tls.channel_credentials(), options=[*_OPTIONS, *tls.channel_options()]
        )
    token = _token(auth_token)
    if token is None:
        return ch
    return grpc.intercept_channel(ch, _TokenClientInterceptor(token))


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    in_flight: InFlightCalls

    def begin_stop(self, grace_s: float) -> threading.Event:
        """Report NOT_SERVING, refuse new calls, and give the calls in flight grace_s to finish
        before they are cancelled; the event is set once the server has stopped."""
        self.health.enter_graceful_shutdown()
        return self.server.stop(grace_s)

    def stop(self, grace_s: float = 2.0) -> None:
        """`begin_stop`, then wait until the server has stopped (about grace_s at most)."""
        self.begin_stop(grace_s).wait()


def start_server(
    register: Iterable[Callable[[grpc.Server], None]],
    service_names: Iterable[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 16,
    auth_token: str | None = None,
    tls: TlsConfig | None = None,
) -> RunningServer:
    """Start a gRPC server with the given servicers plus grpc.health.v1 reporting SERVING for each
    name in service_names and for "" (the whole server). port=0 picks a free port. With an auth
    token (explicit, else the process's), every call but health checks must carry it. With TLS
    (explicit, else the process's), the port serves only mutual TLS: a client without a
    certificate signed by the CA fails the handshake (health checks included)."""
    token = _token(auth_token)
    in_flight = InFlightCalls()
    interceptors: list[grpc.ServerInterceptor] = [
        in_flight,
        *([TokenServerInterceptor(token)] if token is not None else []),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS, interceptors=interceptors
    )
    for add in register:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    tls = tls if tls is not None else _process_tls
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    server.start()
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, port=bound, health=health_servicer, in_flight=in_flight)


def check_health(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when the server at address reports SERVING for service (over the process's TLS, when
    configured)."""
    ch = channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False
    finally:
        ch.close()
