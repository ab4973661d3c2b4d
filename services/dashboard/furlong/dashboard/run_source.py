"""Where the web UI reads runs from: the controller's REST API (docs/rest-api.md).

`RunSource` is the seam; `ControllerRuns` speaks HTTP with the controller's bearer token and
`StaticRuns` is the in-process twin holding runs and step records in memory.
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from furlong.core.errors import NotFoundError, UnavailableError


class RunSource(Protocol):
    """Thread-safe. `steps` raises NotFoundError for an unknown run; both raise UnavailableError
    when the source cannot be reached."""

    def runs(self) -> list[dict[str, Any]]: ...

    def steps(self, run_id: str) -> list[dict[str, Any]]: ...


class ControllerRuns:
    def __init__(self, base_url: str, token: str, timeout_s: float = 5.0) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout_s, headers={"Authorization": f"Bearer {token}"}
        )

    def _get(self, path: str) -> dict[str, Any]:
        try:
            resp = self._http.get(path)
        except httpx.TransportError as exc:
            raise UnavailableError(f"controller unreachable: {exc}") from exc
        if resp.status_code == 404:
            raise NotFoundError(f"controller: {path} not found")
        if resp.status_code != 200:
            raise UnavailableError(f"controller: GET {path} -> {resp.status_code} {resp.text[:200]}")
        body: dict[str, Any] = resp.json()  # the controller's REST API answers with an object
        return body

    def runs(self) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = self._get("/v1/runs")["runs"]
        return runs

    def steps(self, run_id: str) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = self._get(f"/v1/runs/{run_id}/metrics")["steps"]
        return steps

    def close(self) -> None:
        self._http.close()


class StaticRuns:
    def __init__(self, runs: list[dict[str, Any]], steps: dict[str, list[dict[str, Any]]]) -> None:
        self._runs = list(runs)
        self._steps = {k: list(v) for k, v in steps.items()}

    def runs(self) -> list[dict[str, Any]]:
        return list(self._runs)

    def steps(self, run_id: str) -> list[dict[str, Any]]:
        if run_id not in self._steps:
            raise NotFoundError(f"run {run_id!r} not found")
        return list(self._steps[run_id])
