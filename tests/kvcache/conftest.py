"""The kvcache tests' fixture: `harness`, see kv_engines.harness."""
from __future__ import annotations

from kv_engines import harness  # noqa: F401 (a fixture, found here by every test module of this folder)
