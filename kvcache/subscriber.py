"""Subscribers that keep each engine endpoint's KV event stream complete.

One `Subscriber` per (pod, DP rank): a ZMTP SUB connection for live batches (kvcache.zmtp,
plain TCP) and a short-lived libzmq DEALER per replay request. Every loss is either repaired
by replay or declared to the sink with `drop(pod, rank)`, counted and logged:
- start: replay from seq 0, then follow the live stream; if that replay found nothing and the
  first live batch is not seq 0, what came before it (published before the subscription took
  hold) is replayed;
- gap in seq: replay the missing range; if the engine no longer holds it, drop;
- reconnect: replay from the last applied seq, whose payload must match the one
  applied before (otherwise the engine restarted);
- seq going backwards: the engine restarted; drop, replay the new stream from 0;
- reconnect without any replay: continuity cannot be verified, drop;
- a hole inside a replay (vLLM's ROUTER drops replies past its queue): ask again.

Ingestion runs on one thread of its own (`SubscriberManager`), off the event loop that
serves requests: it waits on every endpoint's socket with epoll (the GIL released), reads each
with one recv per wake-up, handles each endpoint's batches in order, and calls the sink under
the manager's lock, which the request path takes too (`LockedIndex`) since the index is not
thread-safe. While batches keep coming it wakes every `coalesce` seconds and takes all that
queued meanwhile; the batches of one read that continue the stream in order are applied in runs,
one native call each (the sink's apply_run), the others one by one. An endpoint that has work
queued gets `tick_budget` seconds before the others have their turn. A replay runs on a worker thread of its endpoint: meanwhile that endpoint's
live batches wait, in order, in its socket (TCP flow control bounds them, then the engine's
send queue), and the other endpoints go on.

Measured (kvgate bench ingest, 3 engines x 333 one-block batches/s, loaded 2-core VM, CPU per
batch): on asyncio with zmq.asyncio 160-180 us; on a thread with libzmq SUB sockets 68-78 us
(libzmq's I/O thread 19-23, woken per message; zmq_poll, recv and getsockopt per frame); read
here, 36-39 us; with runs and one wake-up per `coalesce` (then 10 ms) even when timers are due,
21-24 us (main's code 31-35 in the same interleaved runs). Where a wake-up's ~200 us go (perf,
thread-local timers): the sleep's context switch ~40, epoll ~5-20, recv ~15-18 per engine (half of
it sending the TCP ACK through loopback), Python ~100 (loop, read, sequencing, bookkeeping: cold
caches make each step several times its warm cost), C decode-and-apply ~2.5 per batch (1.3
warm). So it is mostly per wake-up: with KVGATE_KV_EVENTS_COALESCE_S=0.02, 14-17 us per batch.
The default is 25 ms: `kvgate bench ingest --coalesce C`, twice each, alternated: 0.01 25.0 / 26.0 us
per batch, 0.025 13.0 / 14.0, 0.05 3.9 / 5.9. The index's answers lag by that much more at most, which
`kvgate bench routing` shows costs nothing: kv-sync with every batch 50 ms late routes as well as
without (W1 hit rate 0.9175 both, W2 0.8762 against 0.8756).
"""
from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import sys
import threading
import time
from array import array
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import islice
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from kvcache.events import KVEvent
from kvcache.metrics import KVEventMetrics
from kvcache.wire import WireError, decode_batch
from kvcache.zmtp import Connection, ProtocolError, ping

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8


class EventSink(Protocol):
    def apply(self, pod: str, model: str, rank: int, events: Sequence[KVEvent]) -> None: ...

    def drop(self, pod: str, rank: int) -> None: ...  # that rank's state can no longer be trusted

    # Optional: `apply_payload(pod, model, rank, payload) -> BatchApplied | None` ((stored, removed) events) decodes and applies
    # raw batch bytes in one pass (kvcache.index.PrefixIndex); None sends the batch down the general
    # path (decode_batch, then apply).
    # Optional, with apply_payload: `apply_run(pod, model, rank, messages, start, seq, max_batches, max_events,
    # bounds, counts, max_blocks) -> RunApplied` applies a run of in-order live (seq, payload) messages in one call
    # (kvcache.index.PrefixIndex.apply_run); the messages it stops before take the per-batch path.
    # Optional, with apply_payload: `split_payload(payload, max_blocks) -> list[bytes] | None` cuts a large
    # batch into parts apply_payload takes one by one (one hold of the lock each); None: apply it whole.


class IndexLock:
    """The lock around the prefix index, taken by the ingest thread for each batch (`with`) and by
    the request path for each read (LockedIndex). A read that has to wait goes next: the ingest
    thread, about to take the lock for its next batch, first lets a waiting reader have it. (A plain
    threading.Lock hands off to nobody: the ingest thread releasing and taking it again at once,
    batch after batch, kept winning, and reads waited out their bound: in `kvgate bench index`'s fill,
    1,706 of ~1,800 matches.)"""

    __slots__ = ("_lock", "waiting", "acquire", "release")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = 0  # readers waiting; written by the request path's thread only
        self.acquire = self._lock.acquire  # the reader's side: the lock's own methods, no Python frame
        self.release = self._lock.release

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


class LockedIndex:
    """The prefix index as the request path sees it while the ingest thread feeds it: every call
    under the lock the SubscriberManager applies batches under (an uncontended acquire costs
    ~0.1 us; a contended one waits for one batch, or one `apply_chunk` of a large one).

    The request path waits for the lock at most `wait_s`: the ingest thread can hold it for much
    longer while a growing table is rehashed (~140 ms at 4M entries, with the GIL released, so the
    event loop runs meanwhile). Past the wait, a match answers as if no pod held any of the prompt
    (the request is routed on load and its family's last pod), `stats` raises IndexBusy, and
    `on_busy` counts it. A model's block size is read without the lock (a dict read)."""

    def __init__(self, index: Any, lock: IndexLock | threading.Lock, wait_s: float = 0.001,
                 on_busy: Callable[[], None] | None = None) -> None:
        self._index = index
        self._lock = lock
        self._wait_s = wait_s
        self._on_busy = on_busy

    def _wait(self) -> bool:
        """The lock, after the uncontended try failed: at most `wait_s` (False: busy, counted)."""
        lock = self._lock
        counted = hasattr(lock, "waiting")  # an IndexLock: the ingest thread lets waiting readers first
        if counted:
            lock.waiting += 1
        try:
            if lock.acquire(timeout=self._wait_s):
                return True
        finally:
            if counted:
                lock.waiting -= 1
        if self._on_busy is not None:
            self._on_busy()
        return False

    def match(self, model, lora, token_ids, pods):
        if not (self._lock.acquire(False) or self._wait()):
            return {}
        try:
            return self._index.match(model, lora, token_ids, pods)
        finally:
            self._lock.release()

    def match_ranks(self, model, lora, token_ids, targets):
        if not (self._lock.acquire(False) or self._wait()):
            return {}
        try:
            return self._index.match_ranks(model, lora, token_ids, targets)
        finally:
            self._lock.release()

    def block_size(self, model):
        return self._index.block_size(model)  # a dict the ingest thread changes under the GIL

    def stats(self) -> dict:
        if not (self._lock.acquire(False) or self._wait()):
            raise IndexBusy("the prefix index is busy (a growing table being rehashed); ask again")
        try:
            return self._index.stats()
        finally:
            self._lock.release()

    @property
    def unlocked(self) -> Any:
        """The index itself (only for a caller that knows no other thread uses it)."""
        return self._index


def _numeric_address(host: str, port: int) -> tuple[int, Any] | None:
    """(family, socket address) of an IP address given as text, found without any lookup; None for
    a host name."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                    flags=socket.AI_NUMERICHOST)[0]
    except socket.gaierror as e:
        if e.errno == socket.EAI_NONAME:
            return None
        raise
    return family, addr


def tcp_endpoint(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    pod: str
    model: str
    host: str
    pub_port: int
    replay_port: int | None
    rank: int = 0

    @property
    def pub_endpoint(self) -> str:
        return tcp_endpoint(self.host, self.pub_port)

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else tcp_endpoint(self.host, self.replay_port)


@dataclass(frozen=True, slots=True)
class SubscriberOptions:
    replay_timeout: float = 0.5  # s without a replay frame before giving up on replay
    reconnect_initial: float = 1.0  # s, doubled per failed attempt ...
    reconnect_max: float = 30.0  # ... up to this
    heartbeat_interval: float = 5.0  # s between ZMTP pings; 0 disables dead-peer detection
    heartbeat_timeout: float = 15.0  # s without traffic before the connection counts as dead
    rcv_hwm: int = 10_000  # batches a replay DEALER queues at most (live ones wait in the TCP socket buffer)
    apply_chunk: int = 512  # events per sink.apply call (the lock is released between two)
    apply_blocks: int = 128  # blocks one hold of the lock applies at most (a larger batch: sink.split_payload)
    tick_budget: float = 0.002  # s of one endpoint's live batches before the other endpoints' turn
    coalesce: float = 0.025  # s between two wake-ups of the ingest thread while batches keep coming

    def __post_init__(self) -> None:
        for name in ("replay_timeout", "reconnect_initial", "reconnect_max", "tick_budget"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SubscriberOptions.{name} must be > 0")
        if self.reconnect_max < self.reconnect_initial:
            raise ValueError("SubscriberOptions.reconnect_max must be >= reconnect_initial")
        if not 0 <= self.coalesce <= 0.1:
            raise ValueError("SubscriberOptions.coalesce must be between 0 and 0.1 s")
        if self.rcv_hwm < 1 or self.apply_chunk < 1 or self.apply_blocks < 1:
            raise ValueError("SubscriberOptions.rcv_hwm, apply_chunk and apply_blocks must be >= 1")


class _ReplayFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_HOLE_RETRIES = 3  # replays in a row that may stop at a hole without progress
_ERROR_LOG_EVERY = 10.0  # s between two log lines for the same kind of error
_PROC_BOUNDS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5)  # KVEventMetrics.processing's
_PROC_BOUNDS_D = array("d", _PROC_BOUNDS)
_RUN_BATCHES = 64  # live batches one apply_run call (one hold of the lock) takes at most
_FLUSH_EVERY = 0.5  # s between two writes of the locally counted metrics (a scrape sees them this late at most)
_HANDSHAKE_TIMEOUT = 30.0  # s for a connection to complete its handshake (libzmq's default)


class Subscriber:
    """Follows one engine endpoint and feeds `sink`. Driven by the SubscriberManager's thread, which
    owns its connection (`conn`, ZMTP over plain TCP) and hands it the live messages read from it;
    whatever needs a replay runs on a worker thread of its own while the ingest thread goes on with
    the other endpoints (this one's messages wait, in order, until the worker is done)."""

    def __init__(self, spec: EndpointSpec, sink: EventSink, ctx: zmq.Context, options: SubscriberOptions,
                 metrics: KVEventMetrics, lock: IndexLock | threading.Lock | None = None) -> None:
        self.spec = spec
        self._sink = sink
        self._fast = getattr(sink, "apply_payload", None)
        self._run = getattr(sink, "apply_run", None) if self._fast is not None else None
        self._split = getattr(sink, "split_payload", None) if self._fast is not None else None
        self._ctx = ctx
        self._opt = options
        self._m = metrics
        self._lock = lock or threading.Lock()
        self._labels = (spec.pod, str(spec.rank))
        self._where = (spec.pod, spec.model, spec.rank)  # the sink's first arguments
        self._last: int | None = None  # last seq applied (or consumed)
        self._recent: dict[int, int] = {}  # seq -> hash(payload) of batches a live message may repeat
        self._catch_up_on_connect = True  # replay once the SUB is connected, so nothing published meanwhile is missed
        self._unverified = False  # reconnected, and no replay could confirm the stream continues
        self._lost_range = (0, 0)  # seqs declared lost on this connection: late live copies are stale
        self._held_nothing = False  # the replay at connection answered, empty: the stream starts at seq 0
        self._error_log: dict[str, tuple[float, int]] = {}  # kind -> (last logged, suppressed since)
        self.stopped = False  # set (under the lock) by the manager: nothing more reaches the sink
        self.connected = False
        self.counts: Counter[str] = Counter()
        # connection state, the manager's (ingest thread)
        self.conn: Connection | None = None
        self.pending: deque[list[bytes]] = deque()  # live messages read, not yet handled
        self.worker: threading.Thread | None = None  # a replay under way
        self.worker_error: Exception | None = None
        self.resolving = False  # a host name being looked up on a thread of its own
        self.resolved: tuple[int, Any] | OSError | None = None  # its (family, address), or why not
        self._registered_fd = -1
        self.retry_delay = options.reconnect_initial
        self.connect_at: float | None = None  # when to (re)connect, while there is no connection
        self.last_rx = 0.0  # when bytes last came in
        self.ping_at = 0.0
        self.registered = 0  # selector events the connection is registered for
        # Counted locally per batch, written to the metrics by flush_metrics (a prometheus update costs
        # about what applying a one-block batch does).
        self._n_live = 0
        self._n_events = [0, 0]  # BlockStored, BlockRemoved (fast path)
        self._proc_n = array("q", bytes(8 * (len(_PROC_BOUNDS) + 1)))  # apply_run counts into it too
        self._proc_sum = 0.0
        self._connected_g = metrics.connected.labels(*self._labels)
        self._last_seq_g = metrics.last_seq.labels(*self._labels)
        self._last_seq_g.set_function(lambda: -1 if self._last is None else self._last)  # read when scraped
        self._live_batches = metrics.batches_received.labels(*self._labels, "live")
        self._replay_batches = metrics.batches_received.labels(*self._labels, "replay")
        self._by_type = {name: (metrics.events_received.labels(name), metrics.events_applied.labels(name))
                         for name in ("BlockStored", "BlockRemoved")}
        self._connected_g.set(0)

    # --- status -------------------------------------------------------------

    def status(self) -> dict:
        s = self.spec
        return {"pod": s.pod, "model": s.model, "rank": s.rank, "endpoint": s.pub_endpoint,
                "replay_endpoint": s.replay_endpoint, "connected": self.connected, "last_seq": self._last,
                **{k: self.counts[k] for k in ("batches", "events", "duplicates", "missed_batches", "drops",
                                                "replays", "replay_failures", "errors", "reconnects")}}

    def flush_metrics(self) -> None:
        """Write what was counted locally since the last flush to the prometheus metrics."""
        n = self._n_live
        if n:
            self._n_live = 0
            self._live_batches.inc(n)
        for i, name in enumerate(("BlockStored", "BlockRemoved")):
            k = self._n_events[i]
            if k:
                self._n_events[i] = 0
                received, applied = self._by_type[name]
                received.inc(k)
                applied.inc(k)
        if self._proc_sum or any(self._proc_n):
            counts, total = self._proc_n.tolist(), self._proc_sum
            self._proc_n, self._proc_sum = array("q", bytes(8 * len(counts))), 0.0
            hist = self._m.processing
            buckets, hist_sum = getattr(hist, "_buckets", None), getattr(hist, "_sum", None)
            if buckets is not None and hist_sum is not None and len(buckets) == len(counts):
                for i, c in enumerate(counts):  # what observe() does, once per bucket instead of per batch
                    if c:
                        buckets[i].inc(c)
                hist_sum.inc(total)
            else:  # pragma: no cover - another prometheus_client: one observation per batch at its mean
                mean = total / max(1, sum(counts))
                for _ in range(sum(counts)):
                    hist.observe(mean)

    def reset(self, reason: str) -> None:
        """Forget the stream position: the next open starts over with a replay from 0."""
        self._drop(reason)
        self._last = None
        self._recent = {}
        self._unverified = False
        self._lost_range = (0, 0)
        self._held_nothing = False

    # --- connection events (ingest thread) ------------------------------------------------------

    def on_connected(self) -> None:
        self.connected = True
        self.retry_delay = self._opt.reconnect_initial
        self._connected_g.set(1)
        self._m.connections.labels(*self._labels).inc()
        log.info("kv events %s rank %d: connected to %s", self.spec.pod, self.spec.rank, self.spec.pub_endpoint)

    def on_disconnected(self) -> None:
        self.connected = False
        self._connected_g.set(0)
        self._catch_up_on_connect = True
        self._lost_range = (0, 0)
        self._m.disconnections.labels(*self._labels).inc()
        log.warning("kv events %s rank %d: disconnected from %s", self.spec.pod, self.spec.rank,
                    self.spec.pub_endpoint)

    def on_retry(self) -> None:
        self.counts["reconnects"] += 1
        self._m.reconnect_attempts.labels(*self._labels).inc()

    def catch_up(self) -> None:
        """After a connection: replay what the engine published meanwhile (a worker's job)."""
        self._catch_up_on_connect = False
        self._unverified = not self._repair()

    def live_message(self, item: tuple[int, bytes] | list[bytes]) -> tuple[int, bytes] | None:
        """(seq, payload) of a live message as zmtp.Connection.messages gives it, or None (a bad one:
        not three frames with an 8-byte seq, counted)."""
        if type(item) is tuple:
            return item
        self._error("frame", f"live message with {len(item)} frames")
        return None

    # --- sequencing -----------------------------------------------------------

    def _is_duplicate(self, seq: int, payload: bytes) -> bool:
        return self._recent.get(seq) == hash(payload)

    def needs_replay(self, seq: int, payload: bytes) -> bool:
        """Whether on_live(seq, payload) may ask the engine for a replay (so a worker runs it)."""
        last = self._last
        if last is None:
            return seq > 0 and self._held_nothing
        if seq == last + 1:
            return self._unverified
        if seq > last + 1:
            return True
        return not self._lost_range[0] <= seq < self._lost_range[1] and not self._is_duplicate(seq, payload)

    def on_live(self, seq: int, payload: bytes) -> None:
        self._n_live += 1
        last = self._last
        if last is not None and seq == last + 1 and not self._unverified:  # the common case, in order
            self._take(seq, payload)
            self._recent = {seq: hash(payload)}
            return
        if last is not None and seq <= last and self._lost_range[0] <= seq < self._lost_range[1]:
            self._duplicate()  # queued before a replay that jumped past it; already declared lost
            return
        if last is not None and seq <= last and not self._is_duplicate(seq, payload):
            self._engine_restarted(f"live seq went back from {last} to {seq}")
        elif last is not None and seq > last + 1:
            self._repair(upto=seq)
        elif last is None and seq > 0 and self._held_nothing:
            # The engine held nothing when asked at connection, and this is not its first batch: those
            # before it were published before our subscription reached its PUB (the replay at connection
            # can run before it does). Replay them.
            self._held_nothing = False
            self._repair(upto=seq)
        elif self._unverified and last is not None and seq == last + 1 and not self._repair(upto=seq):
            # Reconnected without a replay to compare: a restarted engine can look like a continuation.
            log.warning("kv events %s rank %d: reconnected and cannot verify the stream continues (no replay); "
                        "dropping its blocks", self.spec.pod, self.spec.rank)
            self._drop("unverified_reconnect")
        self._unverified = False
        if self._last is not None and seq <= self._last:  # already applied through replay
            if self._is_duplicate(seq, payload):
                self._duplicate()
            else:
                self._error("out_of_order", f"live seq {seq} differs from the replayed batch")
            return
        self._take(seq, payload)  # still a gap: declared lost there
        self._recent = {seq: hash(payload)}

    def _repair(self, upto: int | None = None) -> bool:
        """Replay what follows the last applied batch (at start, everything the engine holds).
        False when replay is unavailable; the next live batch then declares whatever is missing."""
        try:
            if self._last is None:
                self._replay_apply(0, upto=upto)
                self._held_nothing = self._last is None and upto is None
            else:
                # From `last`, not last+1: that batch must come back identical, else the engine restarted.
                self._replay_apply(self._last, verify_first=True, upto=upto)
        except _ReplayFailed:
            return False
        return True

    def _engine_restarted(self, why: str) -> None:
        log.warning("kv events %s rank %d: engine restarted (%s); dropping its blocks and following the new "
                    "stream", self.spec.pod, self.spec.rank, why)
        self.reset("restart")
        try:
            self._replay_apply(0)
            self._held_nothing = self._last is None
        except _ReplayFailed:
            pass

    def _replay_apply(self, start: int, verify_first: bool = False, upto: int | None = None) -> None:
        """Replay from `start` and apply in order, stopping before `upto` (a live batch in hand:
        what follows it is still queued on the SUB socket). With `verify_first`, the batch at
        `start` must come back identical, else the engine restarted."""
        stalls = 0
        while True:
            before = self._last
            hole = self._replay_once(start, verify_first, upto, retry_holes=stalls < _HOLE_RETRIES)
            if not hole:
                return
            # A jump inside a reply: the transport dropped replies (vLLM's ROUTER queues 1000 per
            # peer), the engine still holds them. Ask again from where the reply broke off.
            stalls = stalls + 1 if self._last == before else 0
            start, verify_first = self._last, True

    def _replay_once(self, start: int, verify_first: bool, upto: int | None, retry_holes: bool) -> bool:
        """One replay request; True when it stopped at a hole worth asking again for."""
        got_any = False
        replies = self._replay(start)
        try:
            for seq, payload in replies:
                self._replay_batches.inc()
                if not got_any:
                    got_any = True
                    if verify_first and seq == start:
                        if self._is_duplicate(seq, payload):
                            continue
                        self._m.replay_successes.labels(*self._labels).inc()
                        self._engine_restarted(f"batch {seq} differs after reconnecting")
                        return False
                    if self._last is None and seq > start:
                        self._lost(start, seq)  # the engine's buffer starts later than asked
                elif retry_holes and self._last is not None and seq > self._last + 1:
                    return True
                if upto is not None and seq >= upto:
                    break
                self._take(seq, payload)
                self._recent[seq] = hash(payload)
        finally:
            replies.close()
        self._m.replay_successes.labels(*self._labels).inc()
        if len(self._recent) > 2 * self._opt.rcv_hwm:  # only batches still queued live can repeat
            floor = (self._last or 0) - self._opt.rcv_hwm
            self._recent = {k: v for k, v in self._recent.items() if k >= floor}
        if verify_first and not got_any:
            # The engine that published `start` still holds it or later batches: this is another one.
            self._engine_restarted(f"it no longer holds batch {start} or anything after it")
        return False

    def _take(self, seq: int, payload: bytes) -> None:
        """Apply the next batch in order; one that is not the next declares the loss first."""
        last = self._last
        if last is not None and seq <= last:
            if self._is_duplicate(seq, payload):
                self._duplicate()
            else:
                self._error("out_of_order", f"seq {seq} after {last}")
            return
        if last is not None and seq > last + 1:
            self._lost(last + 1, seq)
        self.counts["batches"] += 1
        self._last = seq
        self._apply(seq, payload)

    def _lost(self, first: int, upto: int) -> None:
        n = upto - first
        self._lost_range = (first, upto)
        self.counts["missed_batches"] += n
        self._m.missed.labels(*self._labels).inc(n)
        log.warning("kv events %s rank %d: batches %d..%d are lost (not received, engine no longer holds them);"
                    " dropping its blocks and rebuilding from seq %d", self.spec.pod, self.spec.rank, first,
                    upto - 1, upto)
        self._drop("gap")

    def _drop(self, reason: str) -> None:
        self.counts["drops"] += 1
        self._m.state_drops.labels(*self._labels, reason).inc()
        try:
            with self._lock:
                if not self.stopped:
                    self._sink.drop(self.spec.pod, self.spec.rank)
        except Exception:
            self._error("sink", "sink.drop failed", exc_info=True)

    def _duplicate(self) -> None:
        self.counts["duplicates"] += 1
        self._m.duplicates.labels(*self._labels).inc()

    def _error(self, kind: str, what: str, exc_info: bool = False) -> None:
        self.counts["errors"] += 1
        self._m.errors.labels(kind).inc()
        now = time.monotonic()
        last_logged, suppressed = self._error_log.get(kind, (-_ERROR_LOG_EVERY, 0))
        if now - last_logged < _ERROR_LOG_EVERY:  # a publisher sending garbage must not flood the log
            self._error_log[kind] = (last_logged, suppressed + 1)
            return
        self._error_log[kind] = (now, 0)
        more = f"; {suppressed} more since the last report" if suppressed else ""
        log.warning("kv events %s rank %d: %s (%s%s)", self.spec.pod, self.spec.rank, what, kind, more,
                    exc_info=exc_info)

    def take_run(self, messages: list, start: int) -> int:
        """Apply live messages[start:] while they continue the stream in order (the common case of
        on_live: no gap, nothing to verify) with the sink's apply_run, one call (one hold of the lock)
        per up to _RUN_BATCHES batches or apply_chunk events; what each batch counts is counted as
        on_live would. Returns how many messages were taken: the caller handles the rest one by one."""
        last = self._last
        if self._run is None or last is None or self._unverified:
            return 0
        with self._lock:
            if self.stopped:
                return 0
            n, stored, removed, seconds, error = self._run(*self._where, messages, start, last + 1, _RUN_BATCHES,
                                                           self._opt.apply_chunk, _PROC_BOUNDS_D, self._proc_n,
                                                           self._opt.apply_blocks if self._split else 0)
        if error is not None:
            n += 1  # the batch that failed was taken (and its state is dropped below)
        elif not n:
            return 0
        seq, payload = messages[start + n - 1]
        self._n_live += n
        counts = self.counts
        counts["batches"] += n
        counts["events"] += stored + removed
        self._last = seq
        self._recent = {seq: hash(payload)}
        ne = self._n_events
        ne[0] += stored
        ne[1] += removed
        self._proc_sum += seconds
        if error is not None:
            try:
                raise error
            except Exception:
                self._error("sink", f"sink.apply_run failed on batch {seq}; its state is no longer trusted",
                            exc_info=True)
            self._drop("sink_error")
        return n

    def _apply(self, seq: int, payload: bytes) -> None:
        started = time.perf_counter()
        if self._fast is not None:
            # A large batch in parts, one hold of the lock each: the request path's matches interleave.
            parts = self._split(payload, self._opt.apply_blocks) if self._split is not None else None
            stored = removed = 0
            try:
                for part in parts or (payload,):
                    with self._lock:
                        if self.stopped:
                            return
                        done = self._fast(self.spec.pod, self.spec.model, self.spec.rank, part)
                    if done is None:
                        if parts:  # a part of a batch the sink took whole: it changed its mind midway
                            raise RuntimeError("sink.apply_payload declined a part of a batch it accepted")
                        break
                    stored += done[0]
                    removed += done[1]
            except Exception:
                self._error("sink", f"sink.apply_payload failed on batch {seq}; its state is no longer trusted",
                            exc_info=True)
                self._drop("sink_error")
                return
            if done is not None:
                self.counts["events"] += stored + removed
                n = self._n_events
                n[0] += stored
                n[1] += removed
                seconds = time.perf_counter() - started  # _processed, inline
                self._proc_n[bisect_left(_PROC_BOUNDS, seconds)] += 1
                self._proc_sum += seconds
                return
        try:
            decoded = decode_batch(payload)
        except WireError as e:
            self._error("decode", f"batch {seq} skipped: {e}")
            return
        for reason, n in decoded.skipped.items():
            self._m.events_skipped.labels(reason).inc(n)
        events = decoded.batch.events
        by_type = Counter(type(e).__name__ for e in events)
        for name, n in by_type.items():
            self._m.events_received.labels(name).inc(n)
        chunk = self._opt.apply_chunk
        try:
            for i in range(0, len(events), chunk):
                with self._lock:  # released between chunks: the request path's matches interleave
                    if self.stopped:
                        return
                    self._sink.apply(self.spec.pod, self.spec.model, self.spec.rank, events[i:i + chunk])
        except Exception:
            self._error("sink", f"sink.apply failed on batch {seq}; its state is no longer trusted", exc_info=True)
            self._drop("sink_error")
            return
        self.counts["events"] += len(events)
        for name, n in by_type.items():
            self._m.events_applied.labels(name).inc(n)
        self._m.processing.observe(time.perf_counter() - started)

    def _processed(self, seconds: float) -> None:
        self._proc_n[bisect_left(_PROC_BOUNDS, seconds)] += 1
        self._proc_sum += seconds

    # --- replay ---------------------------------------------------------------

    def _replay(self, start: int) -> Iterator[tuple[int, bytes]]:
        """(seq, payload) the engine still holds from `start`, until its end marker.
        Raises _ReplayFailed (already counted) when there is no replay or it stops answering."""
        endpoint = self.spec.replay_endpoint
        if endpoint is None:
            self._replay_failed("no_endpoint")
        self.counts["replays"] += 1
        self._m.replay_requests.labels(*self._labels).inc()
        # A fresh DEALER per request: no stale answers, no inherited reconnect backoff.
        dealer = self._ctx.socket(zmq.DEALER)
        timeout_ms = self._opt.replay_timeout * 1000
        try:
            dealer.setsockopt(zmq.IPV6, 1)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RECONNECT_IVL, 50)
            # vLLM's ROUTER drops replies beyond its send queue (1000): take them off it quickly.
            dealer.setsockopt(zmq.RCVHWM, self._opt.rcv_hwm)
            dealer.connect(endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                waited = 0.0
                while not dealer.poll(min(100.0, timeout_ms - waited)):  # in slices: a close is not held up
                    waited += 100.0
                    if self.stopped:  # unsubscribed meanwhile: nothing more reaches the sink anyway
                        self._replay_failed("stopped")
                    if waited >= timeout_ms:
                        self._replay_failed("timeout")
                if self.stopped:
                    self._replay_failed("stopped")
                frames = dealer.recv_multipart()
                # 0.26+: [b"", topic, seq, payload]; 0.25-: [b"", seq, payload]
                if len(frames) == 4:
                    seq_b, payload = frames[2], frames[3]
                elif len(frames) == 3:
                    seq_b, payload = frames[1], frames[2]
                else:
                    self._error("replay_frame", f"replay reply with {len(frames)} frames")
                    continue
                if len(seq_b) != 8:
                    self._error("replay_frame", "replay reply with a bad seq frame")
                    continue
                if seq_b == END_SEQ:
                    return
                yield int.from_bytes(seq_b, "big"), payload
        finally:
            dealer.close(linger=0)

    def _replay_failed(self, reason: str) -> None:
        self.counts["replay_failures"] += 1
        self._m.replay_failures.labels(*self._labels, reason).inc()
        if reason != "no_endpoint":
            log.warning("kv events %s rank %d: replay from %s failed (%s)", self.spec.pod, self.spec.rank,
                        self.spec.replay_endpoint, reason)
        raise _ReplayFailed(reason)


class SubscriberManager:
    """Runs exactly one Subscriber per (pod, rank) of the specs last passed to `sync`, all on one
    ingest thread (replays on a worker thread each); the sink is only ever called under `lock`."""

    def __init__(self, sink: EventSink, options: SubscriberOptions | None = None,
                 metrics: KVEventMetrics | None = None, lock: IndexLock | threading.Lock | None = None) -> None:
        self._sink = sink
        self._opt = options or SubscriberOptions()
        self.metrics = metrics or KVEventMetrics()
        self.lock = lock or IndexLock()
        self.hand_over = GilHandOver()  # around each wake-up's work and each replay
        self._ctx = zmq.Context()  # replay DEALERs only: live batches are read without libzmq
        self._subs: dict[tuple[str, int], Subscriber] = {}
        # (start|stop|done|resolved|exit, subscriber) or ("call", (fn, what)), under _cmd_lock
        self._commands: list[tuple[str, Any]] = []
        self._cmd_lock = threading.Lock()
        self._wake_rx, self._wake_tx = os.pipe()
        os.set_blocking(self._wake_rx, False)
        os.set_blocking(self._wake_tx, False)
        self._thread: threading.Thread | None = None
        self._closed = False

    def sync(self, specs: Iterable[EndpointSpec]) -> None:
        """Start and stop subscribers so that exactly `specs` run. Call from one thread (the event loop)."""
        if self._closed:
            raise RuntimeError("SubscriberManager is closed")
        wanted = {(s.pod, s.rank): s for s in specs}
        commands: list[tuple[str, Any]] = []
        for key, sub in list(self._subs.items()):
            if wanted.get(key) != sub.spec:
                del self._subs[key]
                self._forget(sub)
                commands.append(("stop", sub))
        for key, spec in wanted.items():
            if key not in self._subs:
                sub = Subscriber(spec, self._sink, self._ctx, self._opt, self.metrics, self.lock)
                self._subs[key] = sub
                commands.append(("start", sub))
        if not commands:
            return
        self._post(commands)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvgate-ingest", daemon=True)
            self._thread.start()

    def _post(self, commands: list[tuple[str, Any]]) -> None:
        with self._cmd_lock:
            self._commands.extend(commands)
        try:
            os.write(self._wake_tx, b"\0")
        except BlockingIOError:  # the pipe is full: the ingest thread has wake-ups pending anyway
            pass

    def run_locked(self, fn: Callable[[], object], what: str) -> None:
        """Run `fn` under the index lock on the ingest thread, in order with the subscribers' starts and
        stops posted before and after it (a pod's removal lands before its successor's first batch).
        The caller (the event loop) never waits for the lock, which the ingest thread holds up to
        ~140 ms while a growing table is rehashed. Without a running ingest thread it runs here, now.
        A failure is logged (`what` names the operation)."""
        if self._thread is None or self._closed:
            self._locked_call(fn, what)
        else:
            self._post([("call", (fn, what))])

    def _locked_call(self, fn: Callable[[], object], what: str) -> None:
        try:
            with self.lock:
                fn()
        except Exception:
            log.exception("%s failed", what)

    def _forget(self, sub: Subscriber) -> None:
        # Read under the lock by whatever applies sub's batches: none lands after the drop, which
        # runs under the lock after the batch being applied now, if any.
        sub.stopped = True
        pod, rank = sub.spec.pod, sub.spec.rank
        # nobody keeps that state current any more
        self.run_locked(partial(self._sink.drop, pod, rank), f"sink.drop for {pod} rank {rank}")
        self.metrics.forget(pod, rank)

    def status(self) -> list[dict]:
        return [sub.status() for sub in list(self._subs.values())]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs.values()):
            with self.lock:
                sub.stopped = True
        self._subs.clear()
        if self._thread is not None:
            self._post([("exit", None)])
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        os.close(self._wake_tx)
        os.close(self._wake_rx)
        self._ctx.destroy(linger=0)

    def _resolve(self, sub: Subscriber, host: str, port: int) -> None:
        """Look `host` up (on a thread of its own) and hand the answer to the ingest thread."""
        try:
            family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            sub.resolved = (family, addr)
        except OSError as e:
            sub.resolved = e
        except Exception as e:  # noqa: BLE001 - whatever the lookup raised, the endpoint retries
            sub.resolved = OSError(f"name lookup failed: {e!r}")
        if not self._closed:
            self._post([("resolved", sub)])

    # --- the ingest thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        opt = self._opt
        ep = select.epoll()  # epoll itself: the selectors module's Python costs ~5 us more per call
        wake_fd = self._wake_rx
        ep.register(wake_fd, select.EPOLLIN)
        owners: dict[int, Subscriber] = {}  # registered fd -> its subscriber
        running: set[Subscriber] = set()
        backlog: list[Subscriber] = []  # spent their tick budget with messages still pending
        workers: set[Subscriber] = set()
        coalesce, budget = opt.coalesce, opt.tick_budget
        hb_ivl, hb_timeout = opt.heartbeat_interval, opt.heartbeat_timeout
        next_timers = 0.0  # when timers() must run next
        last_timers = 0.0
        READ, WRITE = select.EPOLLIN, select.EPOLLOUT
        READABLE, WRITABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR, select.EPOLLOUT | select.EPOLLERR

        def watch(sub: Subscriber) -> None:
            """(Re-)register sub's connection for what it waits on; nothing while a worker has sub."""
            conn = sub.conn
            want = 0
            if conn is not None and sub.worker is None:
                want = (READ if conn.state != "connecting" and not sub.pending else 0) | (WRITE if conn.wants_write else 0)
            fd = conn.fileno() if conn is not None else -1
            if want == sub.registered and fd == sub._registered_fd:
                return
            if sub.registered:
                if want and fd == sub._registered_fd:
                    ep.modify(fd, want)
                    sub.registered = want
                    return
                ep.unregister(sub._registered_fd)
                owners.pop(sub._registered_fd, None)
                sub.registered = 0
            if want:
                ep.register(fd, want)
                owners[fd] = sub
                sub._registered_fd = fd
                sub.registered = want

        def close_conn(sub: Subscriber) -> None:
            if sub.registered:
                ep.unregister(sub._registered_fd)
                owners.pop(sub._registered_fd, None)
                sub.registered = 0
            if sub.conn is not None:
                sub.conn.close()
                sub.conn = None

        def connect(sub: Subscriber) -> None:
            sub.connect_at = None
            if sub.resolving:  # its lookup's answer connects it
                return
            host, port = sub.spec.host.strip("[]"), sub.spec.pub_port
            try:
                address = _numeric_address(host, port)
            except OSError as e:
                connect_failed(sub, e)
                return
            if address is None:
                # A host name: looked up on a thread of its own, since a lookup can take seconds (a dead
                # DNS server) and this thread follows every engine.
                sub.resolving = True
                threading.Thread(target=self._resolve, args=(sub, host, port), daemon=True,
                                 name=f"kvgate-resolve-{sub.spec.pod}").start()
                return
            open_connection(sub, address)

        def connect_failed(sub: Subscriber, e: OSError) -> None:
            log.debug("kv events %s: connect to %s failed: %s", sub.spec.pod, sub.spec.pub_endpoint, e)
            retry(sub)

        def open_connection(sub: Subscriber, address: tuple[int, Any]) -> None:
            nonlocal next_timers
            try:
                sub.conn = Connection(address[1], address[0])
            except OSError as e:
                connect_failed(sub, e)
                return
            sub.last_rx = time.monotonic()  # the handshake deadline counts from here
            next_timers = min(next_timers, sub.last_rx + _HANDSHAKE_TIMEOUT)
            watch(sub)

        def retry(sub: Subscriber) -> None:
            nonlocal next_timers
            close_conn(sub)
            sub.on_retry()
            sub.connect_at = time.monotonic() + sub.retry_delay
            sub.retry_delay = min(sub.retry_delay * 2, opt.reconnect_max)
            next_timers = min(next_timers, sub.connect_at)

        def lost(sub: Subscriber) -> None:
            """The connection ended: reconnect after the initial interval (or retry one never made)."""
            nonlocal next_timers
            if sub.connected:
                close_conn(sub)
                sub.on_disconnected()
                sub.connect_at = time.monotonic() + opt.reconnect_initial
                next_timers = min(next_timers, sub.connect_at)
            else:
                retry(sub)

        def start(sub: Subscriber) -> None:
            running.add(sub)
            sub._catch_up_on_connect = True
            connect(sub)

        def stop(sub: Subscriber) -> None:
            running.discard(sub)
            if sub in backlog:
                backlog.remove(sub)
            close_conn(sub)
            sub.pending.clear()
            sub.connect_at = None
            sub.connected = False
            sub._connected_g.set(0)

        def failed(sub: Subscriber) -> None:
            nonlocal next_timers
            # A bug must not stop one pod's stream for good: count, drop, start over after a back-off.
            log.exception("kv events %s rank %d: subscriber failed; restarting in %.1f s", sub.spec.pod,
                          sub.spec.rank, sub.retry_delay)
            self.metrics.errors.labels("subscriber").inc()
            delay = sub.retry_delay
            stop(sub)
            running.add(sub)
            sub.reset("subscriber_error")
            sub._catch_up_on_connect = True
            sub.connect_at = time.monotonic() + delay
            sub.retry_delay = min(delay * 2, opt.reconnect_max)
            next_timers = min(next_timers, sub.connect_at)

        def hand_off(sub: Subscriber, job, *args) -> None:
            """Run job(*args) (which may replay) on a worker thread; sub waits meanwhile."""
            def run() -> None:
                error = None
                try:
                    with self.hand_over:
                        job(*args)
                except Exception as e:  # reported to the ingest thread, which restarts the stream
                    error = e
                sub.worker_error = error
                self._post([("done", sub)])

            sub.worker = threading.Thread(target=run, name=f"kvgate-replay-{sub.spec.pod}-{sub.spec.rank}",
                                          daemon=True)
            workers.add(sub)
            watch(sub)
            sub.worker.start()

        def handle(sub: Subscriber, deadline: float) -> bool:
            """Handle sub's pending messages in order until none is left (False), the tick budget is
            spent (True), or one needs a replay (handed to a worker: False)."""
            pending = sub.pending
            counts = sub.counts
            while pending:
                msg = pending[0]
                if (sub._run is not None and type(msg) is tuple and sub._last is not None
                        and msg[0] == sub._last + 1 and not sub._unverified):
                    # a run of in-order batches (queued during a replay, or past a tick budget): one call
                    k = sub.take_run(list(islice(pending, _RUN_BATCHES)), 0)
                    if k:
                        for _ in range(k):
                            pending.popleft()
                        if time.monotonic() >= deadline:
                            return bool(pending)
                        continue
                msg = pending.popleft()
                if type(msg) is not tuple:
                    sub.live_message(msg)  # counted and logged
                    continue
                seq, payload = msg
                last = sub._last
                if last is not None and seq == last + 1 and not sub._unverified:
                    # on_live's common case (and _take's), inline: a call costs ~1 us on a cold cache
                    sub._n_live += 1
                    counts["batches"] += 1
                    sub._last = seq
                    sub._apply(seq, payload)
                    sub._recent = {seq: hash(payload)}
                elif sub.needs_replay(seq, payload):
                    hand_off(sub, sub.on_live, seq, payload)
                    return False
                else:
                    sub.on_live(seq, payload)
                if time.monotonic() >= deadline:
                    return True
            return False

        def on_event(sub: Subscriber, mask: int) -> None:
            deadline = 0.0  # the end of sub's tick budget, once its turn started
            conn = sub.conn
            if conn is None:
                return
            if mask & WRITE:
                try:
                    conn.on_writable()
                except OSError:
                    lost(sub)
                    return
            if mask & READ:
                out: list = []
                alive = True
                try:
                    ready = conn.read(out)  # None: the peer closed the connection
                except OSError:
                    ready = None
                except ProtocolError as e:
                    sub._error("protocol", f"connection dropped: {e}")
                    ready, alive = False, False  # what came before the bad frame is still handled
                if ready is None:
                    alive = False
                else:
                    sub.last_rx = now = time.monotonic()
                    if out:
                        if alive and not ready and not sub.pending and sub.worker is None:
                            # The common case: the batches continue the stream in order. Whole runs of
                            # them in one native call each, within the tick budget; the rest one by one.
                            deadline = now + budget
                            i, n = 0, len(out)
                            while i < n:
                                k = sub.take_run(out, i)
                                if not k:
                                    break
                                i += k
                                if time.monotonic() >= deadline:
                                    break
                            if i:
                                del out[:i]
                        sub.pending.extend(out)
                    if ready:
                        sub.on_connected()
                        sub.ping_at = sub.last_rx + hb_ivl
                        if sub._catch_up_on_connect:
                            hand_off(sub, sub.catch_up)
                            return
                if not alive:
                    lost(sub)
                    if sub.worker is None and sub.pending and sub not in backlog:
                        backlog.append(sub)  # what came before the end is still handled
                    return
            if sub.pending and sub.worker is None:
                if handle(sub, deadline or time.monotonic() + budget) and sub not in backlog:
                    backlog.append(sub)
            if sub.conn is not None and (sub.registered != READ or sub.pending or sub.conn.wants_write):
                watch(sub)  # (what it waits on changed: registered for reading alone is the common case)

        def timers(now: float) -> float:
            """Reconnections, pings, dead peers, metrics; when to come back."""
            nxt = now + 3600.0
            for sub in list(running):
                if sub.worker is not None:
                    continue
                sub.flush_metrics()
                if sub.conn is None:
                    if sub.connect_at is not None:
                        if sub.connect_at <= now:
                            connect(sub)
                            if sub.conn is None:
                                nxt = min(nxt, sub.connect_at)
                                continue
                        else:
                            nxt = min(nxt, sub.connect_at)
                            continue
                    else:
                        continue
                conn = sub.conn
                if conn is None:
                    continue
                if conn.state != "ready":
                    if now - sub.last_rx >= _HANDSHAKE_TIMEOUT:
                        sub._error("handshake", "no handshake in time")
                        lost(sub)
                        nxt = min(nxt, sub.connect_at or nxt)
                    else:
                        nxt = min(nxt, sub.last_rx + _HANDSHAKE_TIMEOUT)
                    continue
                if hb_ivl > 0:
                    if now - sub.last_rx >= hb_timeout:  # not even a PONG: the peer (or the path) is dead
                        lost(sub)
                        nxt = min(nxt, sub.connect_at or nxt)
                        continue
                    if now >= sub.ping_at:
                        conn.send(ping(hb_timeout))
                        sub.ping_at = now + hb_ivl
                        watch(sub)
                    nxt = min(nxt, sub.ping_at, sub.last_rx + hb_timeout)
            return nxt

        handing = False  # inside self.hand_over: from a wake-up with work until the next wait
        try:
            streaming = False  # the last wake-up found batches: the next one is a sleep, not a wait
            while True:
                if handing:
                    self.hand_over.__exit__(None, None, None)
                    handing = False
                if backlog:
                    ready = ep.poll(0)
                elif streaming and coalesce > 0:
                    # Batches keep coming: sleep, then take what queued meanwhile. One context switch per
                    # round instead of two (a wait that wakes at the first batch, then the sleep). Timers
                    # that fall due meanwhile run right after it, at most `coalesce` late: waiting for them
                    # instead would wake at every batch until they are due (the last interval before
                    # every flush of the metrics: with a flush every 0.1 s, a third more wake-ups).
                    time.sleep(coalesce)
                    ready = ep.poll(0)
                else:
                    ready = ep.poll(max(0.0, next_timers - time.monotonic()))
                    if coalesce > 0 and ready and (len(ready) > 1 or ready[0][0] != wake_fd):
                        # Woken from idle by a batch: let a few more queue before handling any, so that one
                        # wake-up (and one recv per engine) serves several; the index lags by at most this long.
                        time.sleep(coalesce)
                        ready = ep.poll(0)
                streaming = bool(ready)
                if ready or backlog:
                    self.hand_over.__enter__()
                    handing = True
                for fd, ev in ready:
                    if fd == wake_fd:  # commands
                        try:
                            while os.read(self._wake_rx, 4096):
                                pass
                        except BlockingIOError:
                            pass
                        with self._cmd_lock:
                            commands, self._commands = self._commands, []
                        for what, sub in commands:
                            if what == "exit":
                                return
                            if what == "start":
                                start(sub)
                            elif what == "call":
                                self._locked_call(*sub)
                            elif what == "resolved":
                                result, sub.resolved, sub.resolving = sub.resolved, None, False
                                if sub not in running or sub.stopped or sub.conn is not None:
                                    continue  # stopped meanwhile
                                if isinstance(result, OSError):
                                    connect_failed(sub, result)
                                else:
                                    open_connection(sub, result)
                            elif what == "done":
                                sub.worker.join()
                                sub.worker = None
                                workers.discard(sub)
                                error, sub.worker_error = sub.worker_error, None
                                if sub not in running:
                                    continue
                                if error is not None:
                                    try:
                                        raise error
                                    except Exception:
                                        failed(sub)
                                    continue
                                sub.last_rx = time.monotonic()  # nothing was read meanwhile
                                if sub.conn is not None:
                                    watch(sub)
                                if sub.pending and sub not in backlog:
                                    backlog.append(sub)
                            elif sub in running:  # stop
                                stop(sub)
                        next_timers = 0.0
                        continue
                    sub = owners.get(fd)
                    if sub is not None and sub in running and not sub.stopped:
                        mask = (READ if ev & READABLE else 0) | (WRITE if ev & WRITABLE else 0)
                        try:
                            on_event(sub, mask)
                        except Exception:
                            failed(sub)
                # Endpoints with messages still pending take turns, one tick budget each.
                for sub in backlog[:] if backlog else ():
                    backlog.remove(sub)
                    if sub.stopped or sub.worker is not None or sub not in running:
                        continue
                    try:
                        if handle(sub, time.monotonic() + budget):
                            backlog.append(sub)
                        elif sub.conn is not None:
                            watch(sub)
                    except Exception:
                        failed(sub)
                now = time.monotonic()
                if ready:  # counted locally: written to the metrics within _FLUSH_EVERY
                    next_timers = min(next_timers, last_timers + _FLUSH_EVERY)
                if now >= next_timers:
                    last_timers = now
                    next_timers = timers(now)
        except Exception:
            log.exception("kv events: the ingest thread failed; KV events are no longer followed")
            self.metrics.errors.labels("subscriber").inc()
        finally:
            if handing:
                self.hand_over.__exit__(None, None, None)
            for sub in list(running):
                stop(sub)
            for sub in list(workers):  # bounded: a replay stops at its timeout or as soon as it sees `stopped`
                with self.lock:
                    sub.stopped = True
                sub.worker.join()
            ep.close()
