"""One engine endpoint's KV event stream, kept complete: `Subscriber` puts the batches of one
(pod, DP rank) in sequence order, drops duplicates, replays what went missing and declares to the
sink (kvcache.sink.EventSink) whatever cannot be repaired. Also the endpoint's description
(`EndpointSpec`) and the ingest options (`SubscriberOptions`).

A Subscriber reads nothing itself: the ingest thread (kvcache.ingest) owns its live connection
(kvcache.zmtp, plain TCP) and hands it the messages read; a replay (a short-lived libzmq DEALER per
request) runs on a worker thread of its own. Every loss is either repaired by replay or declared to
the sink with `drop(pod, rank)`, counted and logged:
- start: replay from seq 0, then follow the live stream; if that replay found nothing and the
  first live batch is not seq 0, what came before it (published before the subscription took
  hold) is replayed;
- gap in seq: replay the missing range; if the engine no longer holds it, drop;
- reconnect: replay from the last applied seq, whose payload must match the one
  applied before (otherwise the engine restarted);
- seq going backwards: the engine restarted; drop, replay the new stream from 0;
- reconnect without any replay: continuity cannot be verified, drop;
- a hole inside a replay (vLLM's ROUTER drops replies past its queue): ask again; so too a replay
  that stops answering after some batches (the dropped tail took its end marker).
The batches of one read that continue the stream in order are applied in runs, one call of the
sink's apply_run each (one hold of the lock); the others one by one, a large one in parts.
"""
from __future__ import annotations

import logging
import threading
import time
from array import array
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Generator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import zmq

from kvcache.locking import IndexLock
from kvcache.metrics import PROCESSING_BOUNDS, KVEventMetrics
from kvcache.sink import EventSink
from kvcache.wire import WireError, batch_ts, decode_batch
from kvcache.zmtp import Connection

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8  # the seq frame of a replay's end marker

RUN_BATCHES = 64  # live batches one apply_run call (one hold of the lock) takes at most
PROC_BOUNDS = PROCESSING_BOUNDS  # KVEventMetrics.processing's
PROC_BOUNDS_D = array("d", PROC_BOUNDS)  # the same as doubles, for the sink's apply_run
_HOLE_RETRIES = 3  # replays in a row that may stop at a hole without progress
_ERROR_LOG_EVERY = 10.0  # s between two log lines for the same kind of error

# What Subscriber.handle_pending ends with.
DONE = 0  # no message left
MORE = 1  # the tick budget is spent (messages may be left): another turn
REPLAY = 2  # the next message needs a replay: run replay_held on a worker


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


class Subscriber:
    """Follows one engine endpoint and feeds `sink`. Driven by the ingest thread (kvcache.ingest), which
    owns its connection (`conn`, ZMTP over plain TCP) and the fields below marked as its own, and hands
    it the live messages read (`pending`, then handle_pending); whatever needs a replay runs on a worker
    thread of its own while the ingest thread goes on with the other endpoints (this one's messages
    wait, in order, until the worker is done)."""

    def __init__(self, spec: EndpointSpec, sink: EventSink, ctx: zmq.Context, options: SubscriberOptions,
                 metrics: KVEventMetrics, lock: IndexLock | threading.Lock | None = None) -> None:
        self.spec = spec
        self._sink = sink
        self._apply_payload = sink.apply_payload
        self._apply_run = sink.apply_run
        self._split_payload = sink.split_payload
        self._ctx = ctx
        self._opt = options
        self._m = metrics
        self._lock = lock or threading.Lock()
        self._labels = (spec.pod, str(spec.rank))
        self._where = (spec.pod, spec.model, spec.rank)  # the sink's first arguments
        self._last: int | None = None  # last seq applied (or consumed)
        self._recent: dict[int, int] = {}  # seq -> hash(payload) of batches a live message may repeat
        self._unverified = False  # reconnected, and no replay could confirm the stream continues
        self._lost_range = (0, 0)  # seqs declared lost on this connection: late live copies are stale
        self._held_nothing = False  # the replay at connection answered, empty: the stream starts at seq 0
        self._error_log: dict[str, tuple[float, int]] = {}  # kind -> (last logged, suppressed since)
        self._held: tuple[int, bytes] | None = None  # the message handle_pending stopped at for a replay
        self.stopped = False  # set (under the lock) by the manager: nothing more reaches the sink
        self.connected = False
        self.counts: Counter[str] = Counter()
        self.catch_up_on_connect = True  # replay once connected, so nothing published meanwhile is missed
        # connection state, the ingest thread's
        self.conn: Connection | None = None
        self.pending: deque[tuple[int, bytes] | list[bytes]] = deque()  # live messages read, not yet handled
        self.worker: threading.Thread | None = None  # a replay under way
        self.worker_error: Exception | None = None
        self.resolving = False  # a host name being looked up on a thread of its own
        self.resolved: tuple[int, Any] | OSError | None = None  # its (family, address), or why not
        self.registered_fd = -1  # the descriptor registered with the ingest thread's epoll
        self.retry_delay = options.reconnect_initial
        self.connect_at: float | None = None  # when to (re)connect, while there is no connection
        self.last_rx = 0.0  # when bytes last came in
        self.last_message_at = 0.0  # when live messages were last handled (monotonic; 0: never)
        self.lag_s: float | None = None  # the newest batch's age by its own timestamp when its handling began
        self.ping_at = 0.0
        self.registered = 0  # selector events the connection is registered for
        # Counted locally per batch, written to the metrics by flush_metrics (a prometheus update costs
        # about what applying a one-block batch does).
        self._n_live = 0
        self._n_events = [0, 0]  # BlockStored, BlockRemoved (fast path)
        self._proc_n = array("q", bytes(8 * (len(PROC_BOUNDS) + 1)))  # apply_run counts into it too
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
                # the event lag: live messages read and not yet applied, and how long ago the last ones came
                "backlog": len(self.pending),
                # how old (by the engine's clock) the newest batch was when kvgate began applying it
                "lag_s": None if self.lag_s is None else round(self.lag_s, 4),
                "last_message_age_s": (round(time.monotonic() - self.last_message_at, 3)
                                       if self.last_message_at else None),
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
            self._m.processing.add(counts, total)

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
        self.catch_up_on_connect = True
        self._lost_range = (0, 0)
        self._m.disconnections.labels(*self._labels).inc()
        log.warning("kv events %s rank %d: disconnected from %s", self.spec.pod, self.spec.rank,
                    self.spec.pub_endpoint)

    def on_retry(self) -> None:
        self.counts["reconnects"] += 1
        self._m.reconnect_attempts.labels(*self._labels).inc()

    def on_stopped(self) -> None:
        """The ingest thread stopped following the endpoint: nothing pending, no connection."""
        self.pending.clear()
        self.connect_at = None
        self.connected = False
        self._connected_g.set(0)

    def catch_up(self) -> None:
        """After a connection: replay what the engine published meanwhile (a worker's job)."""
        self.catch_up_on_connect = False
        self._unverified = not self._repair()

    def live_message(self, item: tuple[int, bytes] | list[bytes]) -> tuple[int, bytes] | None:
        """(seq, payload) of a live message as zmtp.Connection.messages gives it, or None (a bad one:
        not three frames with an 8-byte seq, counted)."""
        if type(item) is tuple:
            return item
        self.count_error("frame", f"live message with {len(item)} frames")
        return None

    # --- sequencing -----------------------------------------------------------

    def handle_pending(self, deadline: float) -> int:
        """Handle the pending live messages in order until none is left (DONE), `deadline` passed
        (MORE), or the next one needs a replay (REPLAY: run replay_held on a worker meanwhile)."""
        pending = self.pending
        counts = self.counts
        if pending:
            self.last_message_at = time.monotonic()
            newest = pending[-1]
            if type(newest) is tuple:
                ts = batch_ts(newest[1])
                if ts is not None:
                    self.lag_s = time.time() - ts
        while pending:
            msg = pending[0]
            if type(msg) is tuple and self._last is not None and msg[0] == self._last + 1 and not self._unverified:
                # a run of in-order batches (queued during a replay, or past a tick budget): one call
                k = self.take_run(list(islice(pending, RUN_BATCHES)), 0)
                if k:
                    for _ in range(k):
                        pending.popleft()
                    if time.monotonic() >= deadline:
                        return MORE if pending else DONE
                    continue
            msg = pending.popleft()
            if type(msg) is not tuple:
                self.live_message(msg)  # counted and logged
                continue
            seq, payload = msg
            last = self._last
            if last is not None and seq == last + 1 and not self._unverified:
                # on_live's common case (and _take's), inline: a call costs ~1 us on a cold cache
                self._n_live += 1
                counts["batches"] += 1
                self._last = seq
                self._apply(seq, payload)
                self._recent = {seq: hash(payload)}
            elif self.needs_replay(seq, payload):
                self._held = msg
                return REPLAY
            else:
                self.on_live(seq, payload)
            if time.monotonic() >= deadline:
                return MORE
        return DONE

    def replay_held(self) -> None:
        """on_live for the message handle_pending stopped at (a worker's job: it may replay)."""
        held, self._held = self._held, None
        if held is not None:
            self.on_live(*held)

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
                self.count_error("out_of_order", f"live seq {seq} differs from the replayed batch")
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
            assert self._last is not None  # a hole is only seen after a batch was taken
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
        except _ReplayFailed as failed:
            # The ROUTER dropped the reply's tail with its end marker: ask again from where it stopped.
            if failed.reason == "timeout" and got_any and retry_holes:
                return True
            raise
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
                self.count_error("out_of_order", f"seq {seq} after {last}")
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
            self.count_error("sink", "sink.drop failed", exc_info=True)

    def _duplicate(self) -> None:
        self.counts["duplicates"] += 1
        self._m.duplicates.labels(*self._labels).inc()

    def count_error(self, kind: str, what: str, exc_info: bool = False) -> None:
        """Count an error of `kind` and log it (at most one line per kind per _ERROR_LOG_EVERY s)."""
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
        per up to RUN_BATCHES batches or apply_chunk events; what each batch counts is counted as
        on_live would. Returns how many messages were taken: the caller handles the rest one by one."""
        last = self._last
        if last is None or self._unverified:
            return 0
        with self._lock:
            if self.stopped:
                return 0
            n, stored, removed, seconds, error = self._apply_run(*self._where, messages, start, last + 1, RUN_BATCHES,
                                                                 self._opt.apply_chunk, PROC_BOUNDS_D, self._proc_n,
                                                                 self._opt.apply_blocks)
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
                self.count_error("sink", f"sink.apply_run failed on batch {seq}; its state is no longer trusted",
                                 exc_info=True)
            self._drop("sink_error")
        return n

    def _apply(self, seq: int, payload: bytes) -> None:
        started = time.perf_counter()
        # A large batch in parts, one hold of the lock each: the request path's matches interleave.
        parts = self._split_payload(payload, self._opt.apply_blocks)
        stored = removed = 0
        try:
            for part in parts or (payload,):
                with self._lock:
                    if self.stopped:
                        return
                    done = self._apply_payload(self.spec.pod, self.spec.model, self.spec.rank, part)
                if done is None:
                    if parts:  # a part of a batch the sink took whole: it changed its mind midway
                        raise RuntimeError("sink.apply_payload declined a part of a batch it accepted")
                    break
                stored += done[0]
                removed += done[1]
        except Exception:
            self.count_error("sink", f"sink.apply_payload failed on batch {seq}; its state is no longer trusted",
                             exc_info=True)
            self._drop("sink_error")
            return
        if done is not None:
            self.counts["events"] += stored + removed
            totals = self._n_events
            totals[0] += stored
            totals[1] += removed
            seconds = time.perf_counter() - started
            self._proc_n[bisect_left(PROC_BOUNDS, seconds)] += 1
            self._proc_sum += seconds
            return
        # Declined: the general path.
        try:
            decoded = decode_batch(payload)
        except WireError as e:
            self.count_error("decode", f"batch {seq} skipped: {e}")
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
            self.count_error("sink", f"sink.apply failed on batch {seq}; its state is no longer trusted", exc_info=True)
            self._drop("sink_error")
            return
        self.counts["events"] += len(events)
        for name, n in by_type.items():
            self._m.events_applied.labels(name).inc(n)
        self._m.processing.observe(time.perf_counter() - started)

    # --- replay ---------------------------------------------------------------

    def _replay(self, start: int) -> Generator[tuple[int, bytes], None, None]:
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
                    self.count_error("replay_frame", f"replay reply with {len(frames)} frames")
                    continue
                if len(seq_b) != 8:
                    self.count_error("replay_frame", "replay reply with a bad seq frame")
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
