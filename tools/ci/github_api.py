"""The GitHub REST calls CI makes, behind small Protocols, and their urllib implementation.

`CommentApi` is what the status comment needs, `RepoApi` what the `/rerun-test` gateway needs,
`UpstreamApi` what the dependency resolver needs. `GitHubRestApi` implements all three against
api.github.com with a token; tests use in-memory doubles of the same Protocols. No call is ever
retried: a failed or unexpected answer raises GitHubApiError with the method, path and status, and
the caller decides (the finalizer, for one, fails rather than write twice).
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Protocol

log = logging.getLogger(__name__)

DEFAULT_API_URL = "https://api.github.com"
API_VERSION = "2022-11-28"
DEFAULT_TIMEOUT_S = 30.0
_REPOSITORY = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9_.-]{1,100}")


def check_repository(repository: object) -> str:
    """Return `owner/name` when it is a well-formed repository name, else raise ValueError."""
    if (
        not isinstance(repository, str)
        or _REPOSITORY.fullmatch(repository) is None
        or repository.split("/")[1] in (".", "..")
    ):
        raise ValueError(f"repository must be 'owner/name', got {repository!r}")
    return repository


class GitHubApiError(RuntimeError):
    """A GitHub REST call failed or answered something unexpected."""

    def __init__(self, method: str, path: str, status: int | None, detail: str) -> None:
        super().__init__(f"GitHub {method} {path} -> {status}: {detail}")
        self.method = method
        self.path = path
        self.status = status


class CommentApi(Protocol):
    """Issue comments of one repository. Each call is one request; none is retried."""

    def get_comment(self, repository: str, comment_id: int) -> dict[str, Any]:
        """The comment as GitHub returns it (`id`, `body`, `issue_url`, `html_url`, ...)."""

    def create_comment(self, repository: str, issue_number: int, body: str) -> dict[str, Any]:
        """Add a comment to an issue or pull request; returns the created comment."""

    def update_comment(self, repository: str, comment_id: int, body: str) -> dict[str, Any]:
        """Replace a comment's body; returns the comment as stored after the edit."""


class RepoApi(Protocol):
    """What the gateway asks about the repository a command was posted in."""

    def collaborator_permission(self, repository: str, user: str) -> str:
        """Legacy permission of `user`: `admin`, `write`, `read` or `none`."""

    def pull_request(self, repository: str, number: int) -> dict[str, Any]:
        """The pull request as GitHub returns it (`state`, `head`, `base`, `body`, `user`)."""

    def dispatch_workflow(
        self, repository: str, workflow_file: str, ref: str, inputs: dict[str, str]
    ) -> None:
        """Start `workflow_file` on branch `ref` with string `inputs`."""


class UpstreamApi(Protocol):
    """Read-only questions about an upstream dependency's repository."""

    def pull_request(self, repository: str, number: int) -> dict[str, Any]:
        """The pull request (its `head.sha` is what `#N` means)."""

    def branch_head_sha(self, repository: str, branch: str) -> str:
        """The commit a branch points at now."""

    def commit_sha(self, repository: str, ref: str) -> str:
        """The full SHA of a commit (raises GitHubApiError when it does not exist)."""


class GitHubRestApi:
    """GitHub REST v3 over urllib with a bearer token. Thread-safe (no shared mutable state)."""

    def __init__(
        self, token: str, api_url: str = DEFAULT_API_URL, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        if not token:
            raise ValueError("GitHub token must be non-empty")
        if not api_url.startswith(("https://", "http://127.0.0.1")):
            raise ValueError(f"api_url must be https (or loopback for tests), got {api_url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._token = token
        self._api_url = api_url.rstrip("/")
        self._timeout_s = timeout_s

    # CommentApi
    def get_comment(self, repository: str, comment_id: int) -> dict[str, Any]:
        return self._json("GET", _repo(repository) + f"/issues/comments/{int(comment_id)}")

    def create_comment(self, repository: str, issue_number: int, body: str) -> dict[str, Any]:
        path = _repo(repository) + f"/issues/{int(issue_number)}/comments"
        return self._json("POST", path, {"body": body})

    def update_comment(self, repository: str, comment_id: int, body: str) -> dict[str, Any]:
        path = _repo(repository) + f"/issues/comments/{int(comment_id)}"
        return self._json("PATCH", path, {"body": body})

    # RepoApi
    def collaborator_permission(self, repository: str, user: str) -> str:
        path = _repo(repository) + f"/collaborators/{_segment(user)}/permission"
        permission = self._json("GET", path).get("permission")
        if not isinstance(permission, str):
            raise GitHubApiError("GET", path, 200, f"no permission field: {permission!r}")
        return permission

    def pull_request(self, repository: str, number: int) -> dict[str, Any]:
        return self._json("GET", _repo(repository) + f"/pulls/{int(number)}")

    def dispatch_workflow(
        self, repository: str, workflow_file: str, ref: str, inputs: dict[str, str]
    ) -> None:
        path = _repo(repository) + f"/actions/workflows/{_segment(workflow_file)}/dispatches"
        self._request("POST", path, {"ref": ref, "inputs": inputs})

    # UpstreamApi
    def branch_head_sha(self, repository: str, branch: str) -> str:
        path = _repo(repository) + f"/branches/{_segment(branch)}"
        sha = self._json("GET", path).get("commit", {}).get("sha")
        if not isinstance(sha, str):
            raise GitHubApiError("GET", path, 200, f"no commit sha: {sha!r}")
        return sha

    def commit_sha(self, repository: str, ref: str) -> str:
        path = _repo(repository) + f"/commits/{_segment(ref)}"
        sha = self._json("GET", path).get("sha")
        if not isinstance(sha, str):
            raise GitHubApiError("GET", path, 200, f"no sha: {sha!r}")
        return sha

    def _json(self, method: str, path: str, payload: dict | None = None) -> dict[str, Any]:
        raw = self._request(method, path, payload)
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise GitHubApiError(method, path, 200, f"answer is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise GitHubApiError(method, path, 200, f"answer is not an object: {type(data).__name__}")
        return data

    def _request(self, method: str, path: str, payload: dict | None) -> bytes:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self._api_url + path, data=data, method=method)
        request.add_header("Accept", "application/vnd.github+json")
        request.add_header("Authorization", f"Bearer {self._token}")
        request.add_header("X-GitHub-Api-Version", API_VERSION)
        request.add_header("User-Agent", "furlong-ci")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        log.info("GitHub %s %s", method, path)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode("utf-8", "replace")
            raise GitHubApiError(method, path, exc.code, detail) from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise GitHubApiError(method, path, None, str(exc)) from None


def _repo(repository: str) -> str:
    return f"/repos/{check_repository(repository)}"


def _segment(value: str) -> str:
    """Quote one URL path segment (branch names may contain '/')."""
    if not value:
        raise ValueError("URL path segment must be non-empty")
    return urllib.parse.quote(value, safe="")
