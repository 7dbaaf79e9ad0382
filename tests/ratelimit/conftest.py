"""A real redis-server for the rate-limit and metering tests, which they may kill, pause and restart."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.redis_server import REDIS_SERVER, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server on a free port in a temporary directory, killed at the end of the session."""
    if not os.path.exists(REDIS_SERVER):
        pytest.fail(
            "redis-server is not installed (apt-get install redis-server); these tests need a real one"
        )
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        if server.running:
            server.resume()
        server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The URL of a running, empty Redis; a test that killed or paused it leaves it running again."""
    redis_server.start()
    redis_server.flush()
    yield redis_server.url
    if redis_server.running:
        redis_server.resume()
    else:
        redis_server.start()
