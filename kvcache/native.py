"""The compiled module kvcache._native (its sources: kvcache/csrc/), or a clear error saying how to build it."""
from __future__ import annotations

try:
    import kvcache._native as native
except ImportError as e:  # pragma: no cover - a source tree without `pip install`
    raise ImportError(
        "kvgate's compiled module kvcache._native is missing: install kvgate with a C compiler and "
        "Python headers available (`./dev test` or `pip install -e .`; on Debian: apt-get install gcc "
        f"python3-dev) ({e})") from e

__all__ = ["native"]
