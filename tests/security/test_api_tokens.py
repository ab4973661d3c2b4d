"""REST tokens and roles, the controller's token flags, and CORS (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from furlong.controller.__main__ import load_config, parse_args
from furlong.controller.auth import ApiTokens, Role
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
from controller_fakes import fake_stack

ADMIN = "admin-token-0123456789abcdef"
VIEWER = "viewer-token-0123456789abcdef"
BASE = [
    "--port",
    "0",
    "--redis-url",
    "redis://127.0.0.1:1/0",
    "--trainer",
    "127.0.0.1:2",
    "--rollout",
    "127.0.0.1:3",
    "--broker",
    "127.0.0.1:4",
]


@pytest.mark.unit
def test_roles_and_validation():
    tokens = ApiTokens(admin=(ADMIN,), viewer=(VIEWER,))
    assert tokens.role_for(ADMIN) == Role.ADMIN and tokens.role_for(VIEWER) == Role.VIEWER
    for wrong in ("", ADMIN[:-1], ADMIN + "x", VIEWER.upper(), "é" * 20):
        assert tokens.role_for(wrong) is None
    assert Role.ADMIN.allows(Role.ADMIN) and Role.ADMIN.allows(Role.VIEWER)
    assert Role.VIEWER.allows(Role.VIEWER) and not Role.VIEWER.allows(Role.ADMIN)
    assert ADMIN not in repr(tokens) and VIEWER not in repr(tokens)
    with pytest.raises(ValueError, match="at least one admin"):
        ApiTokens(admin=())
    with pytest.raises(ValueError, match="viewer token #1 must be at least 16"):
        ApiTokens(admin=(ADMIN,), viewer=("short",))
    with pytest.raises(ValueError, match="both an admin and a viewer"):
        ApiTokens(admin=(ADMIN,), viewer=(ADMIN,))


@pytest.mark.unit
def test_controller_token_flags(tmp_path, monkeypatch):
    admin_file, viewer_file = tmp_path / "admin", tmp_path / "viewer"
    admin_file.write_text(ADMIN + "\n")
    viewer_file.write_text(VIEWER)
    config = load_config(
        parse_args(
            [
                *BASE,
                "--token-file",
                str(admin_file),
                "--viewer-token-file",
                str(viewer_file),
                "--cors-origin",
                "https://ui.example.org",
            ]
        )
    )
    assert (config.token, config.viewer_token) == (ADMIN, VIEWER)
    assert config.cors_origins == ("https://ui.example.org",)
    assert ADMIN not in repr(config) and VIEWER not in repr(config)
    monkeypatch.setenv("FURLONG_TEST_ADMIN", ADMIN)
    assert load_config(parse_args([*BASE, "--token-env", "FURLONG_TEST_ADMIN"])).token == ADMIN
    for argv, message in [
        ([], "one of --token-file or --token-env is required"),
        (["--token-file", str(admin_file), "--token-env", "X"], "not both"),
        (["--token-env", "FURLONG_TEST_UNSET_VAR"], "FURLONG_TEST_UNSET_VAR is not set"),
        (["--token-file", str(tmp_path / "missing")], "cannot read --token-file"),
        (["--token-file", str(admin_file), "--viewer-token-file", str(admin_file)], "must differ"),
        (["--token-file", str(admin_file), "--cors-origin", "ui.example.org"], "cors_origins"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            load_config(parse_args([*BASE, *argv]))
        assert ADMIN not in str(err.value)


@pytest.mark.integration
@pytest.mark.parametrize("origins", [(), ("https://ui.example.org",)])
def test_cors_is_off_unless_configured(redis_url, origins):
    fakes = fake_stack()
    store = RunStore.from_url(redis_url)
    controller = build_controller(
        store,
        fakes.services,
        ADMIN,
        lambda: {},
        cors_origins=origins,
    )
    server = HttpServer(controller.app).start()
    try:
        preflight = httpx.options(
            server.url + "/v1/runs",
            headers={
                "Origin": "https://ui.example.org",
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        get = httpx.get(
            server.url + "/v1/runs",
            headers={"Origin": "https://ui.example.org", "Authorization": f"Bearer {ADMIN}"},
        )
        assert get.status_code == 200
        allowed = get.headers.get("access-control-allow-origin")
        if origins:
            assert preflight.status_code == 200 and allowed == "https://ui.example.org"
        else:
            assert allowed is None and "access-control-allow-origin" not in preflight.headers
        other = httpx.get(
            server.url + "/v1/runs",
            headers={"Origin": "https://evil.example", "Authorization": f"Bearer {ADMIN}"},
        )
        assert "access-control-allow-origin" not in other.headers
    finally:
        controller.close(10)
        server.stop()
        store.close()
