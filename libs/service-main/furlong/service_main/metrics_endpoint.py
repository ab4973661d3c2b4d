"""The Prometheus `/metrics` endpoint of a service with a metrics port of its own (trainer, rollout,
weight broker): serves exactly the registry it is given, on a background thread. The HTTP services
(controller, dashboard) serve `/metrics` from their app instead."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsEndpoint:
    """Serving from construction until `close()`; `port` is the bound port (0 picks a free one)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
