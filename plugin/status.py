"""What the status page shows beyond the router's snapshot, kept in the process and bounded: the routing
mix per minute (`RoutingMix`: decisions by strategy and reason, the prompt blocks believed cached per model,
the engines' prefix cache counters per model) and the recent warnings and errors (`RecentErrors`, a logging
handler). Both answer `snapshot()` for `/debug`; the page and `kvgate status` render that (plugin.statusview).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

# The reason a routed request went where it did, as the page groups them.
PREFIX_HIT = "prefix-hit"  # the picked pod held some of the prompt's leading blocks
PREFIX_MISS = "prefix-miss"  # looked up, no pod held any
NO_LOOKUP = "no-lookup"  # no prefix looked up: a strategy that reads none, or no token ids (tokenizer fallback)
OTHER = "other"  # (strategy, reason) pairs beyond a minute's bound


def decision_reason(matched_blocks: int, total_blocks: int) -> str:
    if total_blocks <= 0:
        return NO_LOOKUP
    return PREFIX_HIT if matched_blocks > 0 else PREFIX_MISS


class _Minute:
    __slots__ = ("start", "mix", "believed", "engines")

    def __init__(self, start: int) -> None:
        self.start = start  # epoch minute (unix time // 60)
        self.mix: dict[tuple[str, str], int] = {}  # (strategy, reason) -> requests
        self.believed: dict[str, list[int]] = {}  # model -> [cached blocks, total blocks]
        # pod -> (model, queries, hits) at the minute's first scrape and at its last
        self.engines: dict[str, tuple[tuple[str, float, float], tuple[str, float, float]]] = {}


class RoutingMix:
    """Per-minute counts of the last `minutes` minutes: a ring of at most `minutes` buckets, each with at
    most `max_keys` (strategy, reason) pairs and one entry per model and pod. `record` runs once per routed
    or rejected request on the event loop (a dict increment); `engine` once per scrape of an engine."""

    def __init__(self, minutes: int = 15, max_keys: int = 64, clock: Callable[[], float] = time.time) -> None:
        if minutes < 1:
            raise ValueError("RoutingMix: minutes must be >= 1")
        self.minutes = minutes
        self.max_keys = max_keys
        self._clock = clock
        self._ring: deque[_Minute] = deque(maxlen=minutes)
        self._current: _Minute | None = None
        self._until = 0.0  # when the current minute ends (clock time)

    def _now(self) -> _Minute:
        now = self._clock()
        current = self._current
        if current is None or now >= self._until or now < self._until - 60:  # a new minute, or the clock went back
            minute = int(now // 60)
            ring = self._ring
            if not ring or ring[-1].start != minute:
                ring.append(_Minute(minute))
            current = self._current = ring[-1]
            self._until = (minute + 1) * 60.0
        return current

    def record(self, strategy: str, reason: str, model: str = "", matched_blocks: int = 0,
               total_blocks: int = 0) -> None:
        m = self._now()
        mix = m.mix
        key = (strategy, reason)
        n = mix.get(key)
        if n is None and len(mix) >= self.max_keys:
            key = (OTHER, OTHER)
            n = mix.get(key)
        mix[key] = (n or 0) + 1
        if total_blocks > 0 and model:
            pair = m.believed.get(model)
            if pair is None:
                if len(m.believed) >= self.max_keys:
                    return
                pair = m.believed[model] = [0, 0]
            pair[0] += matched_blocks
            pair[1] += total_blocks

    def engine(self, pod: str, model: str, queries: float, hits: float) -> None:
        """An engine's cumulative prefix cache counters (prompt tokens looked up, found cached), as scraped."""
        m = self._now()
        seen = (model, queries, hits)
        before = m.engines.get(pod)
        if before is not None:
            m.engines[pod] = (before[0], seen)
        elif len(m.engines) < 4 * self.max_keys:
            m.engines[pod] = (seen, seen)

    def snapshot(self) -> dict:
        """`minutes`: per minute, oldest first, its start (unix s) and requests by `strategy/reason`;
        `models`: per model over the window, the prompt blocks kvgate believed cached on the pod it picked
        (`believed_cached`/`believed_total`, this replica's picks) and the engines' own prefix cache counters'
        increase (`engine_queries`/`engine_hits`, in tokens, every engine of the model whatever routed to it)."""
        ring = list(self._ring)
        minutes = [{"start": m.start * 60, "requests": {f"{s}/{r}": n for (s, r), n in sorted(m.mix.items())}}
                   for m in ring]
        models: dict[str, dict[str, float]] = {}

        def entry(model: str) -> dict[str, float]:
            return models.setdefault(model, {"believed_cached": 0, "believed_total": 0,
                                             "engine_queries": 0.0, "engine_hits": 0.0})

        for m in ring:
            for model, (cached, total) in m.believed.items():
                e = entry(model)
                e["believed_cached"] += cached
                e["believed_total"] += total
        first: dict[str, tuple[str, float, float]] = {}
        last: dict[str, tuple[str, float, float]] = {}
        for m in ring:
            for pod, (early, late) in m.engines.items():
                first.setdefault(pod, early)
                last[pod] = late
        for pod, (model, q1, h1) in last.items():
            _, q0, h0 = first[pod]
            if q1 < q0 or h1 < h0:  # the engine restarted within the window: its counters began again
                q0 = h0 = 0.0
            e = entry(model)
            e["engine_queries"] += q1 - q0
            e["engine_hits"] += h1 - h0
        return {"window_minutes": self.minutes, "minutes": minutes, "models": models}


class RecentErrors(logging.Handler):
    """The last `size` log records at WARNING or above, whoever logged them (attach to the root logger)."""

    def __init__(self, size: int = 50, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.records: deque[tuple[float, str, str, str]] = deque(maxlen=size)
        self.total = 0  # every record handled, also those the ring no longer holds

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in someone's log call: keep its template
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        self.records.append((record.created, record.levelname, record.name, message[:500]))
        self.total += 1

    def snapshot(self) -> dict:
        records = list(self.records)  # one step: other threads (the ingest thread) log meanwhile
        return {"total": self.total, "recent": [{"time": t, "level": level, "logger": name, "message": message}
                                                for t, level, name, message in reversed(records)]}
