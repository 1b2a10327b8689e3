"""Log a recurring failure at most once per interval, saying how many were suppressed."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable


class LogThrottle:
    def __init__(self, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> int | None:
        """The number suppressed since the last allowed one if `key` may be logged now, else None."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)

    def log(self, logger: logging.Logger, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log `msg % args` unless `key` was logged within the interval; True if logged."""
        suppressed = self.allow(key)
        if suppressed is None:
            return False
        if suppressed:
            logger.log(level, msg + " (%d similar suppressed)", *args, suppressed)
        else:
            logger.log(level, msg, *args)
        return True
