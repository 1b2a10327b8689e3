"""Fixtures shared by the test files."""
from __future__ import annotations

import os
import shutil

import pytest

from helpers import RedisServer


def pytest_sessionstart(session):
    """Under `./dev sanitize` (DEV_SANITIZE_BUILD names its build), in every process running tests: the C
    extensions imported must be the instrumented builds, not the in-place ones a worker could find first."""
    build = os.environ.get("DEV_SANITIZE_BUILD")
    if build:
        import kvcache._native
        import tokenizer._scanner
        wrong = [m.__file__ for m in (kvcache._native, tokenizer._scanner) if not str(m.__file__).startswith(build)]
        if wrong:
            raise pytest.UsageError(f"./dev sanitize: uninstrumented builds imported: {wrong}")


@pytest.fixture
def redis_server():
    """A real redis-server on a free loopback port for one test (skipped where none is installed)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (Debian package redis-server; ./dev setup installs it)")
    server = RedisServer()
    server.start()
    yield server
    server.kill()
