"""Shared fixtures: a real private Redis server per test session."""

from __future__ import annotations

import pytest
import redis

from furlong.core.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
