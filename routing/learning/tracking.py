"""Request tracking, as AIBrix's gateway cache defines the contract, and per-model trace windows.

A tracker learns of a request three ways: `add_request_count` once it is routed (it may be called
again for the same request: it must count it once), then exactly one of `done_request_count` (no
usage known) or `done_request_trace` (input and output tokens known). `ctx` may be None (a request
cancelled before it was routed): every tracker must accept that. `TrackerRegistry` is itself a
tracker that calls the registered ones in registration order.

`TraceWindows` keeps, per model, the (input, output) token pairs of one write interval, keyed as
AIBrix's trace is: `"<i>:<o>"` with i and o = round(log2(tokens) * 10) (precision 0.1; 0 for 0
tokens), plus its meta keys (`meta_v` 4, `meta_interval_sec`, `meta_precision` 10,
`meta_total_reqs`, `meta_pending_reqs`, `meta_queueing_reqs`). Every interval the windows are
swapped for new ones and each model's is written to Redis as JSON under
`aibrix:<model>_request_trace_<t>` (t: the interval's start, Unix seconds, a multiple of the
interval), expiring after 10 minutes: the key and value AIBrix's GPU optimizer reads.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Protocol

from routing.background import BackgroundLoop

log = logging.getLogger(__name__)

TRACE_VERSION = 4
TRACE_PRECISION = 10  # buckets per doubling: AIBrix's precision 0.1, written as its inverse
TRACE_EXPIRE_S = 600
TRACE_KEY = "aibrix:{model}_request_trace_{t}"


class RequestTracker(Protocol):
    def add_request_count(self, ctx: Any, request_id: str, model: str) -> int: ...

    def done_request_count(self, ctx: Any, request_id: str, model: str, term: int) -> None: ...

    def done_request_trace(self, ctx: Any, request_id: str, model: str, input_tokens: int, output_tokens: int,
                           term: int) -> None: ...


class Tracker:
    """A RequestTracker that does nothing: a tracker subclassing it overrides what it acts on, and a
    TrackerRegistry does not call the methods it leaves as they are (they would do nothing)."""

    def add_request_count(self, ctx: Any, request_id: str, model: str) -> int:
        return 0

    def done_request_count(self, ctx: Any, request_id: str, model: str, term: int) -> None:
        return None

    def done_request_trace(self, ctx: Any, request_id: str, model: str, input_tokens: int, output_tokens: int,
                           term: int) -> None:
        return None


def _acts(tracker: RequestTracker, method: str) -> bool:
    """False when `tracker` has `method` from Tracker, unchanged: calling it does nothing."""
    return getattr(type(tracker), method, None) is not getattr(Tracker, method) or method in getattr(
        tracker, "__dict__", ())


class TrackerRegistry:
    """Several trackers, called in the order they were registered; one failing does not stop the others.

    `add_request_count` is idempotent per request id (a second call returns the first term and calls
    no tracker); a `done_*` for a request never started, or already done, calls no tracker either, so
    each tracker sees one start and one end per request whatever the caller repeats. A method a
    tracker inherits unchanged from `Tracker` (a no-op) is not called."""

    def __init__(self, trackers: tuple[RequestTracker, ...] = ()) -> None:
        self._trackers: list[RequestTracker] = []
        self._open: dict[str, int] = {}  # request id -> term of requests started and not done
        # per method, the trackers that act on it, in registration order
        self._adds: tuple[RequestTracker, ...] = ()
        self._counts: tuple[RequestTracker, ...] = ()
        self._traces: tuple[RequestTracker, ...] = ()
        for t in trackers:
            self.register(t)

    def register(self, tracker: RequestTracker) -> None:
        self._trackers.append(tracker)
        if _acts(tracker, "add_request_count"):
            self._adds += (tracker,)
        if _acts(tracker, "done_request_count"):
            self._counts += (tracker,)
        if _acts(tracker, "done_request_trace"):
            self._traces += (tracker,)

    @property
    def trackers(self) -> tuple[RequestTracker, ...]:
        return tuple(self._trackers)

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def add_request_count(self, ctx: Any, request_id: str, model: str) -> int:
        term = self._open.get(request_id)
        if term is not None:
            return term
        term = 0
        for t in self._adds:
            try:
                got = t.add_request_count(ctx, request_id, model)
                if got and term == 0:
                    term = got
            except Exception:
                log.exception("request tracker %s failed to count request %s", type(t).__name__, request_id)
        self._open[request_id] = term
        return term

    def done_request_count(self, ctx: Any, request_id: str, model: str, term: int) -> None:
        if self._open.pop(request_id, None) is None:
            return
        for t in self._counts:
            try:
                t.done_request_count(ctx, request_id, model, term)
            except Exception:
                log.exception("request tracker %s failed to finish request %s", type(t).__name__, request_id)

    def done_request_trace(self, ctx: Any, request_id: str, model: str, input_tokens: int, output_tokens: int,
                           term: int) -> None:
        if self._open.pop(request_id, None) is None:
            return
        for t in self._traces:
            try:
                t.done_request_trace(ctx, request_id, model, input_tokens, output_tokens, term)
            except Exception:
                log.exception("request tracker %s failed to trace request %s", type(t).__name__, request_id)


@lru_cache(maxsize=1 << 16)  # every request's ends ask again for the same few token counts
def trace_bucket(tokens: int) -> int:
    """AIBrix's trace bucket index: log2(tokens) rounded to 0.1, times 10; 0 for no tokens."""
    return int(round(math.log2(tokens) * TRACE_PRECISION)) if tokens > 0 else 0


@dataclass(slots=True)
class _Window:
    term: int
    counts: dict[str, int] = field(default_factory=dict)
    total: int = 0  # requests started in this window


class TraceWindows(Tracker):
    """A RequestTracker keeping per-model trace windows (AIBrix's format) and writing them to Redis."""

    def __init__(self, interval_s: float = 10.0, *, clock: Callable[[], float] = time.time,
                 queueing: Callable[[str], int] | None = None) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._queueing = queueing
        self._windows: dict[str, _Window] = {}
        self._pending: dict[str, int] = {}  # model -> requests started, not done (whatever the window)
        self._term = 1

    def _window(self, model: str) -> _Window:
        w = self._windows.get(model)
        if w is None:
            w = self._windows[model] = _Window(self._term)
        return w

    # --- RequestTracker ------------------------------------------------------------------
    def add_request_count(self, ctx: Any, request_id: str, model: str) -> int:
        w = self._windows.get(model) or self._window(model)
        w.total += 1
        pending = self._pending
        pending[model] = pending.get(model, 0) + 1
        return w.term

    def done_request_count(self, ctx: Any, request_id: str, model: str, term: int) -> None:
        self._done(model)

    def done_request_trace(self, ctx: Any, request_id: str, model: str, input_tokens: int, output_tokens: int,
                           term: int) -> None:
        w = self._done(model)
        key = f"{trace_bucket(input_tokens)}:{trace_bucket(output_tokens)}"
        w.counts[key] = w.counts.get(key, 0) + 1

    def _done(self, model: str) -> _Window:
        """One request of `model` is done. Returns the model's current window, made if a rotation left
        none: the model is still reported for this interval; done_request_trace counts the request's
        tokens there."""
        pending = self._pending
        left = pending.get(model, 0) - 1
        if left > 0:
            pending[model] = left
        else:
            pending.pop(model, None)
        return self._windows.get(model) or self._window(model)

    # --- windows -------------------------------------------------------------------------
    def snapshot(self, model: str) -> dict[str, int]:
        """The model's current window as AIBrix writes it (trace keys and meta keys)."""
        w = self._windows.get(model) or _Window(self._term)
        out = dict(w.counts)
        out.update({
            "meta_v": TRACE_VERSION,
            "meta_interval_sec": int(round(self.interval_s)),
            "meta_precision": TRACE_PRECISION,
            "meta_total_reqs": w.total,
            "meta_pending_reqs": self._pending.get(model, 0),
            "meta_queueing_reqs": self._queueing(model) if self._queueing else 0,
        })
        return out

    def rotate(self) -> tuple[int, dict[str, dict[str, int]]]:
        """Close every model's window: (the interval's start, Unix seconds; each model's trace). New
        windows get a new term (a request's term names the window it started in); a request started
        before ends in the new window: its trace is counted there, and it is no longer pending."""
        now = self._clock()
        step = max(1, int(round(self.interval_s)))
        t = int(now) - int(now) % step
        models = set(self._windows) | set(self._pending)
        traces = {m: self.snapshot(m) for m in models}
        self._windows = {}
        self._term += 1
        return t, traces


class TraceWriter(BackgroundLoop):
    """Writes TraceWindows to Redis every interval (a background task), under AIBrix's key names."""

    def __init__(self, windows: TraceWindows, redis_client: Any) -> None:
        self.windows = windows
        self._redis = redis_client
        self._task: asyncio.Task | None = None
        self.written = 0

    async def write_once(self) -> int:
        t, traces = self.windows.rotate()
        if not traces:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for model, trace in traces.items():
            pipe.set(TRACE_KEY.format(model=model, t=t), json.dumps(trace, separators=(",", ":")),
                     ex=TRACE_EXPIRE_S)
        await pipe.execute()
        self.written += len(traces)
        return len(traces)

    async def _run(self) -> None:
        interval = self.windows.interval_s
        while True:
            now = time.time()
            await asyncio.sleep(interval - now % interval)  # on the interval's boundary, as AIBrix's ticker
            try:
                await self.write_once()
            except Exception as e:  # Redis down: this window is lost, the next one is written
                log.warning("writing request traces to Redis failed: %s", e)

