"""Clients of the controller's REST API: over HTTP, and an in-process twin with the same interface.

Both return the JSON shapes of `docs/rest-api.md` (plain dicts) and raise the same domain errors:
SettingError (422 naming a field), ValueError (other 422), NotFoundError (404), ConflictError (409),
UnavailableError (503 or the controller cannot be reached), PermissionError (401, 403).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import httpx

from furlong.controller.runs import RunService
from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.core.settings import SettingError


class ControllerClient(Protocol):
    """Blocking calls; thread-safe."""

    def create_run(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Submit a run spec; the created run (state pending)."""

    def list_runs(self, state: str | None = None) -> list[dict[str, Any]]:
        """All runs, newest first."""

    def get_run(self, run_id: str) -> dict[str, Any]: ...

    def stop_run(self, run_id: str) -> dict[str, Any]:
        """Ask a run to stop; the run as it is right after the request."""

    def run_metrics(self, run_id: str, since: int = 0) -> list[dict[str, Any]]:
        """Step records from index since."""


def _raise_for(response: httpx.Response) -> None:
    """Raise the domain error an RFC 9457 problem answer stands for."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
        detail, field = body.get("detail"), body.get("field")
    except (ValueError, AttributeError):
        detail, field = response.text, None
    if response.status_code in (401, 403):
        raise PermissionError(f"controller rejected the token: {detail}")
    if response.status_code == 404:
        raise NotFoundError(str(detail))
    if response.status_code == 409:
        raise ConflictError(str(detail))
    if response.status_code == 422:
        if field:
            raise SettingError(str(field), str(detail).removeprefix(f"{field}: "))
        raise ValueError(str(detail))
    if response.status_code == 503:
        raise UnavailableError(str(detail))
    raise RuntimeError(f"controller answered {response.status_code}: {detail}")


class HttpControllerClient:
    def __init__(self, base_url: str, token: str, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"}
        )

    def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise UnavailableError(f"controller at {self.base_url} unreachable: {exc}") from None
        _raise_for(response)
        body: dict[str, Any] = response.json()  # every endpoint answers with an object
        return body

    def create_run(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/v1/runs", json=dict(spec))

    def list_runs(self, state: str | None = None) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        params: dict[str, Any] = {"limit": 1000, **({"state": state} if state else {})}
        while True:
            page = self._request("GET", "/v1/runs", params=params)
            runs += page["runs"]
            if not page.get("next_cursor"):
                return runs
            params["cursor"] = page["next_cursor"]

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/runs/{run_id}")

    def stop_run(self, run_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/runs/{run_id}/stop")

    def run_metrics(self, run_id: str, since: int = 0) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = self._request(
            "GET", f"/v1/runs/{run_id}/metrics", params={"since": since}
        )["steps"]
        return steps

    def close(self) -> None:
        self._http.close()


class InProcessControllerClient:
    """The same interface straight over a RunService, for tests and embedding."""

    def __init__(self, service: RunService) -> None:
        self._service = service

    def create_run(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        return self._service.create_run(dict(spec)).to_dict()

    def list_runs(self, state: str | None = None) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self._service.list_runs(state)]

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self._service.get_run(run_id).to_dict()

    def stop_run(self, run_id: str) -> dict[str, Any]:
        return self._service.stop_run(run_id).to_dict()

    def run_metrics(self, run_id: str, since: int = 0) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self._service.step_metrics(run_id, since)]

    def close(self) -> None:
        return None
