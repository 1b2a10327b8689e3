"""The sim tests' shared fixture: `client`, an HTTP client on the module's own `sim` fixture (each module
starts its simulated engine with the options it tests)."""
from __future__ import annotations

from typing import AsyncIterator

import httpx
import pytest

from sim.server import SimServer


@pytest.fixture
async def client(sim: SimServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as c:
        yield c
