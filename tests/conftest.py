"""Fixtures shared by the test files."""
from __future__ import annotations

import shutil

import pytest

from helpers import RedisServer


@pytest.fixture
def redis_server():
    """A real redis-server on a free loopback port for one test (skipped where none is installed)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (Debian package redis-server; ./dev setup installs it)")
    server = RedisServer()
    server.start()
    yield server
    server.kill()
