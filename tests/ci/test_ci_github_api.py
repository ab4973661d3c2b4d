"""GitHubRestApi's requests, against a recording HTTP server on 127.0.0.1 (never GitHub itself)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.ci.github_api import GitHubApiError, GitHubRestApi, check_repository

REPO = "furlong-ai/furlong"
SHA = "0123456789abcdef0123456789abcdef01234567"


class Recorder(BaseHTTPRequestHandler):
    routes: dict[tuple[str, str], tuple[int, bytes]] = {}
    seen: list[dict] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append(
            {
                "method": self.command,
                "path": self.path,
                "body": json.loads(body) if body else None,
                "auth": self.headers.get("Authorization"),
                "accept": self.headers.get("Accept"),
                "version": self.headers.get("X-GitHub-Api-Version"),
            }
        )
        status, payload = self.routes.get((self.command, self.path), (404, b'{"message": "Not Found"}'))
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(monkeypatch):
    for name in ("no_proxy", "NO_PROXY"):  # a proxy from the environment must not see loopback
        monkeypatch.setenv(name, "127.0.0.1")
    Recorder.routes, Recorder.seen = {}, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", Recorder
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def answer(data) -> tuple[int, bytes]:
    return 200, json.dumps(data).encode()


@pytest.mark.integration
def test_requests_carry_token_version_and_json(server):
    url, rec = server
    comment = {"id": 7, "body": "hi", "issue_url": f"https://api.github.com/repos/{REPO}/issues/3"}
    rec.routes = {
        ("POST", f"/repos/{REPO}/issues/3/comments"): (201, json.dumps(comment).encode()),
        ("PATCH", f"/repos/{REPO}/issues/comments/7"): answer({**comment, "body": "done"}),
        ("GET", f"/repos/{REPO}/collaborators/alice/permission"): answer({"permission": "write"}),
        ("GET", "/repos/NVIDIA/Megatron-LM/branches/feature%2Fx"): answer({"commit": {"sha": SHA}}),
        ("POST", f"/repos/{REPO}/actions/workflows/rerun-test.yml/dispatches"): (204, b""),
    }
    api = GitHubRestApi("tok", api_url=url)
    assert api.create_comment(REPO, 3, "hi") == comment
    assert api.update_comment(REPO, 7, "done")["body"] == "done"
    assert api.collaborator_permission(REPO, "alice") == "write"
    assert api.branch_head_sha("NVIDIA/Megatron-LM", "feature/x") == SHA
    assert api.dispatch_workflow(REPO, "rerun-test.yml", "main", {"pr_number": "3"}) is None
    assert [(s["method"], s["body"]) for s in rec.seen] == [
        ("POST", {"body": "hi"}),
        ("PATCH", {"body": "done"}),
        ("GET", None),
        ("GET", None),
        ("POST", {"ref": "main", "inputs": {"pr_number": "3"}}),
    ]
    assert {(s["auth"], s["accept"], s["version"]) for s in rec.seen} == {
        ("Bearer tok", "application/vnd.github+json", "2022-11-28")
    }


@pytest.mark.integration
def test_errors_are_raised_once_with_status(server):
    url, rec = server
    rec.routes = {("GET", f"/repos/{REPO}/commits/{SHA}"): (200, b"not json")}
    api = GitHubRestApi("tok", api_url=url)
    with pytest.raises(GitHubApiError) as info:
        api.get_comment(REPO, 99)
    assert info.value.status == 404 and info.value.method == "GET"
    with pytest.raises(GitHubApiError, match="not JSON"):
        api.commit_sha(REPO, SHA)
    assert len(rec.seen) == 2  # no retries


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "ok"),
    [
        ({"token": "t"}, True),
        ({"token": ""}, False),
        ({"token": "t", "api_url": "http://api.github.com"}, False),
        ({"token": "t", "timeout_s": 0}, False),
    ],
)
def test_client_configuration(kwargs, ok):
    if ok:
        GitHubRestApi(**kwargs)
    else:
        with pytest.raises(ValueError):
            GitHubRestApi(**kwargs)


@pytest.mark.unit
@pytest.mark.parametrize("repo", ["a", "a/b/c", "../b", "a/..", "a b/c", "", None, "-a/b"])
def test_repository_names_are_checked(repo):
    with pytest.raises(ValueError):
        check_repository(repo)
    assert check_repository("NVIDIA/Megatron-LM") == "NVIDIA/Megatron-LM"
