"""The index between two threads: the lock the ingest thread applies batches under, the request
path's locked view of the index, and the GIL tuning while batches are applied.

The prefix index is not thread-safe. The ingest thread (kvcache.ingest) takes `IndexLock` around
each batch, or each run of them; the event loop reads through `LockedIndex`, which waits for that
lock a bounded time and answers "busy" past it. `GilHandOver` shortens the interpreter's GIL switch
interval while any thread applies batches, so the event loop is not held up a whole interval.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvcache.blockkeys import BlockExtras


class IndexLock:
    """The lock around the prefix index, taken by the ingest thread for each batch (`with`) and by
    the request path for each read (LockedIndex). A read that has to wait goes next: the ingest
    thread, about to take the lock for its next batch, first lets a waiting reader have it. (A plain
    threading.Lock hands off to nobody: the ingest thread releasing and taking it again at once,
    batch after batch, kept winning, and reads waited out their bound: in `kvgate bench index`'s fill,
    1,706 of ~1,800 matches.)"""

    __slots__ = ("_lock", "acquire", "locked", "release", "waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = 0  # readers waiting; written by the request path's thread only
        self.acquire = self._lock.acquire  # the reader's side: the lock's own methods, no Python frame
        self.release = self._lock.release
        self.locked = self._lock.locked

    def __enter__(self) -> IndexLock:
        if self.waiting:
            time.sleep(_YIELD_S)  # the GIL and the lock go to the reader woken by the last release
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


_YIELD_S = 0.0001

# While a thread of the manager applies batches, the interpreter makes the thread holding the GIL hand it to
# one waiting for it after this long, not after the process's own interval (CPython's default: 5 ms): the
# event loop needs the GIL each time it wakes, and while the ingest thread applied batches back to back (a
# burst, a replay) the loop waited out the whole interval every time. Only meanwhile (GilHandOver): set for
# the whole process, the shorter interval also made grpc.aio's poller thread and the event loop trade the
# GIL more often, and cost the request path ~8% of its throughput through Envoy.
# Measured (an asyncio loop ticking every 0.5 ms beside a thread applying live batches flat out into a
# 500k-entry index, 8 s each, 2 runs): loop lag p50 5.9 ms at 5 ms, 1.3 at 0.5, 0.9 at 0.1 (epoll's 1 ms
# timeout granularity included); p99 7.5-11.1, 2.2-2.4, 1.3-1.8 ms; batches applied meanwhile within noise.
# For the whole process, through Envoy (/tmp/prof/gw.py 6, wrk -c16, 5-7 alternations): CPU per request
# median 751 us at 5 ms, 825 at 0.1 ms; requests/s 1,238 vs 1,136.
GIL_SWITCH_INTERVAL_S = 0.0001


class GilHandOver:
    """`with hand_over:` around a stretch of applying batches: the GIL switch interval is
    GIL_SWITCH_INTERVAL_S while any thread is inside any GilHandOver, the process's own otherwise. The
    interval is one per process, so the count of threads inside is too (shared by every instance: with a
    count per instance, two managers overlapping would leave the short interval set for good)."""

    __slots__ = ()
    _lock = threading.Lock()
    _inside = 0
    _saved = 0.0

    def __enter__(self) -> GilHandOver:
        cls = GilHandOver
        with cls._lock:
            if not cls._inside:
                cls._saved = sys.getswitchinterval()
                sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            cls._inside += 1
        return self

    def __exit__(self, *exc: object) -> None:
        cls = GilHandOver
        with cls._lock:
            cls._inside -= 1
            if not cls._inside:
                sys.setswitchinterval(cls._saved)


class IndexBusy(RuntimeError):
    """The index stayed locked past the request path's wait (LockedIndex.stats)."""


class IndexReader(Protocol):
    """What the request path reads of the index (kvcache.index.PrefixIndex implements it)."""

    def match(self, model: str, lora: str | None, token_ids: Sequence[int], pods: Iterable[str], *,
              extras: BlockExtras | None = None) -> dict: ...

    def match_ranks(self, model: str, lora: str | None, token_ids: Sequence[int],
                    targets: Iterable[tuple[str, int]], *, extras: BlockExtras | None = None) -> dict: ...

    def block_size(self, model: str) -> int | None: ...

    def clears(self, pod: str, rank: int = 0) -> int: ...

    def single_group(self, model: str) -> bool: ...

    def pod_cache(self, pods: Sequence[str]) -> dict[str, tuple[int, int, int]]: ...

    def stats(self) -> dict: ...


class LockedIndex:
    """The prefix index as the request path sees it while the ingest thread feeds it: every call
    under the lock the SubscriberManager applies batches under (an uncontended acquire costs
    ~0.1 us; a contended one waits for one batch, or one `apply_chunk` of a large one).

    The request path waits for the lock at most `wait_s`: the ingest thread can hold it for much
    longer while a growing table is rehashed (~140 ms at 4M entries, with the GIL released, so the
    event loop runs meanwhile). Past the wait, a match answers as if no pod held any of the prompt
    (the request is routed on load and its family's last pod), `stats` raises IndexBusy, and
    `on_busy` counts it. A model's block size is read without the lock (a dict read)."""

    def __init__(self, index: IndexReader, lock: IndexLock | threading.Lock, wait_s: float = 0.001,
                 on_busy: Callable[[], None] | None = None) -> None:
        self._index = index
        self._lock = lock
        self._wait_s = wait_s
        self._on_busy = on_busy
        # read without the lock (a Counter and a dict the ingest thread changes under the GIL); an index
        # without them (a stand-in): no clears counted, no model whose prompts' tokens alone answer a hit
        self._clears = getattr(index, "clears", None)
        self._single_group = getattr(index, "single_group", None)

    def _wait(self) -> bool:
        """The lock, after the uncontended try failed: at most `wait_s` (False: busy, counted)."""
        lock = self._lock
        counted = lock if isinstance(lock, IndexLock) else None  # the ingest thread lets waiting readers first
        if counted is not None:
            counted.waiting += 1
        try:
            if lock.acquire(timeout=self._wait_s):
                return True
        finally:
            if counted is not None:
                counted.waiting -= 1
        if self._on_busy is not None:
            self._on_busy()
        return False

    # `extras` goes to the index only when there are some: a plain prompt's call stays what it was.
    def match(self, model, lora, token_ids, pods, *, extras=None):
        if not (self._lock.acquire(False) or self._wait()):
            return {}
        try:
            if extras is None:
                return self._index.match(model, lora, token_ids, pods)
            return self._index.match(model, lora, token_ids, pods, extras=extras)
        finally:
            self._lock.release()

    def match_ranks(self, model, lora, token_ids, targets, *, extras=None):
        if not (self._lock.acquire(False) or self._wait()):
            return {}
        try:
            if extras is None:
                return self._index.match_ranks(model, lora, token_ids, targets)
            return self._index.match_ranks(model, lora, token_ids, targets, extras=extras)
        finally:
            self._lock.release()

    def block_size(self, model):
        return self._index.block_size(model)  # a dict the ingest thread changes under the GIL

    def clears(self, pod, rank=0):
        return self._clears(pod, rank) if self._clears is not None else 0

    def single_group(self, model):
        return self._single_group is not None and self._single_group(model)

    def pod_cache(self, pods):
        if not (self._lock.acquire(False) or self._wait()):
            return {}
        try:
            return self._index.pod_cache(pods)
        finally:
            self._lock.release()

    def stats(self) -> dict:
        if not (self._lock.acquire(False) or self._wait()):
            raise IndexBusy("the prefix index is busy (a growing table being rehashed); ask again")
        try:
            return self._index.stats()
        finally:
            self._lock.release()
