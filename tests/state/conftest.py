"""Fixtures of the state tests."""

from __future__ import annotations

import pytest

from support.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of this test's own, on a free port (skips where none is installed)."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()
