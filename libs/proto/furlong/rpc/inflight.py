"""The calls a gRPC server is executing right now, by method: a server interceptor that counts each
handler from its start until it returns (for a streaming response, until the stream ends or is
dropped). A service's shutdown quotes it when in-flight work outlives the grace period, so the log
says which calls were still running.

Knows nothing about the servicers; thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc


class InFlightCalls(grpc.ServerInterceptor):
    """Counts running handlers per full method name (`/furlong.v1.Trainer/TrainStep`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()

    def running(self) -> dict[str, int]:
        with self._lock:
            return {method: n for method, n in sorted(self._running.items()) if n > 0}

    def describe(self) -> str:
        """ "/pkg.Service/Method x2, ..." for the calls running now ("" when none)."""
        return ", ".join(f"{method} x{n}" for method, n in self.running().items())

    def _enter(self, method: str) -> None:
        with self._lock:
            self._running[method] += 1

    def _leave(self, method: str) -> None:
        with self._lock:
            self._running[method] -= 1
            if self._running[method] <= 0:
                del self._running[method]

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._unary(method, handler.stream_unary), **kwargs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._stream(method, handler.unary_stream), **kwargs)
        assert handler.stream_stream is not None  # a handler has one of the four kinds
        return grpc.stream_stream_rpc_method_handler(self._stream(method, handler.stream_stream), **kwargs)

    def _unary(self, method: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            self._enter(method)
            try:
                return behaviour(request, context)
            finally:
                self._leave(method)

        return counted

    def _stream(self, method: str, behaviour: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def counted(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._enter(method)
            try:
                yield from behaviour(request, context)
            finally:
                self._leave(method)

        return counted
