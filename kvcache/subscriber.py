"""Subscribers that keep each engine endpoint's KV event stream complete.

One `Subscriber` per (pod, DP rank): a SUB socket for live batches and a
short-lived DEALER per replay request. Every loss is either repaired by replay
or declared to the sink with `drop(pod, rank)`, counted and logged:
- start: replay from seq 0, then follow the live stream;
- gap in seq: replay the missing range; if the engine no longer holds it, drop;
- reconnect: replay from the last applied seq, whose payload must match the one
  applied before (otherwise the engine restarted);
- seq going backwards: the engine restarted; drop, replay the new stream from 0;
- reconnect without any replay: continuity cannot be verified, drop;
- a hole inside a replay (vLLM's ROUTER drops replies past its queue): ask again.

Ingestion runs on one thread of its own (`SubscriberManager`), off the event loop that
serves requests: it polls every endpoint's sockets with zmq (the GIL released while it
waits), handles each endpoint's batches in order, and calls the sink under the manager's
lock, which the request path takes too (`LockedIndex`) since the index is not thread-safe.
An endpoint that has work queued gets `tick_budget` seconds before the others have their
turn; a replay runs to its end (or its timeout) while the other endpoints' batches wait,
bounded, in their own socket queues. Every socket queue is bounded.

Measured (bench ingest, 3 engines x 300 one-block batches/s): on asyncio with zmq.asyncio this
cost 160-180 us of CPU per batch, ~85% of it zmq.asyncio's poller and future machinery and the
event loop, ~15 us the index's apply_payload and ~10 us metrics.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvcache.events import KVEvent
from kvcache.metrics import KVEventMetrics
from kvcache.wire import WireError, decode_batch

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8


class EventSink(Protocol):
    def apply(self, pod: str, model: str, rank: int, events: Sequence[KVEvent]) -> None: ...

    def drop(self, pod: str, rank: int) -> None: ...  # that rank's state can no longer be trusted

    # Optional: `apply_payload(pod, model, rank, payload) -> BatchApplied | None` decodes and applies
    # raw batch bytes in one pass (kvcache.index.PrefixIndex); None sends the batch down the general
    # path (decode_batch, then apply).


class LockedIndex:
    """The prefix index as the request path sees it while the ingest thread feeds it: every call
    under the lock the SubscriberManager applies batches under (an uncontended acquire costs
    ~0.1 us; a contended one waits for one batch, or one `apply_chunk` of a large one)."""

    def __init__(self, index: Any, lock: threading.Lock) -> None:
        self._index = index
        self._lock = lock

    def match(self, model, lora, token_ids, pods):
        with self._lock:
            return self._index.match(model, lora, token_ids, pods)

    def match_ranks(self, model, lora, token_ids, targets):
        with self._lock:
            return self._index.match_ranks(model, lora, token_ids, targets)

    def block_size(self, model):
        with self._lock:
            return self._index.block_size(model)

    def stats(self) -> dict:
        with self._lock:
            return self._index.stats()

    def remove_pod(self, pod: str) -> None:
        with self._lock:
            self._index.remove_pod(pod)

    def drop(self, pod: str, rank: int) -> None:
        with self._lock:
            self._index.drop(pod, rank)

    @property
    def unlocked(self) -> Any:
        """The index itself (only for a caller that knows no other thread uses it)."""
        return self._index


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
    rcv_hwm: int = 10_000  # batches queued in the SUB (and replay DEALER) socket at most
    apply_chunk: int = 512  # events per sink.apply call (the lock is released between two)
    tick_budget: float = 0.002  # s of one endpoint's live batches before the other endpoints' turn
    coalesce: float = 0.005  # s the ingest thread waits, once woken from idle, for more batches to queue

    def __post_init__(self) -> None:
        for name in ("replay_timeout", "reconnect_initial", "reconnect_max", "tick_budget"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SubscriberOptions.{name} must be > 0")
        if self.reconnect_max < self.reconnect_initial:
            raise ValueError("SubscriberOptions.reconnect_max must be >= reconnect_initial")
        if not 0 <= self.coalesce <= 0.1:
            raise ValueError("SubscriberOptions.coalesce must be between 0 and 0.1 s")
        if self.rcv_hwm < 1 or self.apply_chunk < 1:
            raise ValueError("SubscriberOptions.rcv_hwm and apply_chunk must be >= 1")


class _ReplayFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_HOLE_RETRIES = 3  # replays in a row that may stop at a hole without progress
_ERROR_LOG_EVERY = 10.0  # s between two log lines for the same kind of error
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class Subscriber:
    """Follows one engine endpoint and feeds `sink`. Driven by the SubscriberManager's thread:
    `open()`, then `on_monitor()` / `drain()` when its sockets are readable, `close()`."""

    def __init__(self, spec: EndpointSpec, sink: EventSink, ctx: zmq.Context, options: SubscriberOptions,
                 metrics: KVEventMetrics, lock: threading.Lock | None = None) -> None:
        self.spec = spec
        self._sink = sink
        self._fast = getattr(sink, "apply_payload", None)
        self._ctx = ctx
        self._opt = options
        self._m = metrics
        self._lock = lock or threading.Lock()
        self._labels = (spec.pod, str(spec.rank))
        self._last: int | None = None  # last seq applied (or consumed)
        self._recent: dict[int, int] = {}  # seq -> hash(payload) of batches a live message may repeat
        self._catch_up_on_connect = True  # replay once the SUB is connected, so nothing published meanwhile is missed
        self._unverified = False  # reconnected, and no replay could confirm the stream continues
        self._lost_range = (0, 0)  # seqs declared lost on this connection: late live copies are stale
        self._held_nothing = False  # the replay at connection answered, empty: the stream starts at seq 0
        self._error_log: dict[str, tuple[float, int]] = {}  # kind -> (last logged, suppressed since)
        self.stopped = False  # set (under the lock) by the manager: nothing more reaches the sink
        self.connected = False
        self.sub: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.counts: Counter[str] = Counter()
        self._connected_g = metrics.connected.labels(*self._labels)
        self._last_seq_g = metrics.last_seq.labels(*self._labels)
        # children bound once: a labels() lookup per batch costs about as much as applying a small one
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

    def reset(self, reason: str) -> None:
        """Forget the stream position: the next open starts over with a replay from 0."""
        self._drop(reason)
        self._last = None
        self._recent = {}
        self._unverified = False
        self._lost_range = (0, 0)
        self._held_nothing = False

    # --- sockets --------------------------------------------------------------

    def open(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        self.sub = sub
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._opt.rcv_hwm)
        sub.setsockopt(zmq.RECONNECT_IVL, int(self._opt.reconnect_initial * 1000))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._opt.reconnect_max * 1000))
        if self._opt.heartbeat_interval > 0:
            sub.setsockopt(zmq.HEARTBEAT_IVL, int(self._opt.heartbeat_interval * 1000))
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self._opt.heartbeat_timeout * 1000))
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = sub.get_monitor_socket(_MONITORED)
        self._catch_up_on_connect = True
        sub.connect(self.spec.pub_endpoint)

    def close(self) -> None:
        self.connected = False
        self._connected_g.set(0)
        if self.sub is not None:
            if self.monitor is not None:
                try:
                    self.sub.disable_monitor()
                except zmq.ZMQError:
                    pass
                self.monitor.close(linger=0)
            self.sub.close(linger=0)
        self.sub = self.monitor = None

    def on_monitor(self) -> None:
        assert self.monitor is not None
        while True:
            try:
                msg = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(msg)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                self._connected_g.set(1)
                self._m.connections.labels(*self._labels).inc()
                log.info("kv events %s rank %d: connected to %s", self.spec.pod, self.spec.rank,
                         self.spec.pub_endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self._connected_g.set(0)
                self._catch_up_on_connect = True
                self._lost_range = (0, 0)
                self._m.disconnections.labels(*self._labels).inc()
                log.warning("kv events %s rank %d: disconnected from %s", self.spec.pod, self.spec.rank,
                            self.spec.pub_endpoint)
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.counts["reconnects"] += 1
                self._m.reconnect_attempts.labels(*self._labels).inc()
        if self._catch_up_on_connect and self.connected:
            self._catch_up_on_connect = False
            self._unverified = not self._repair()

    def drain(self) -> bool:
        """Handle queued live batches until the queue is empty (False) or the tick budget is spent
        (True: more may be queued)."""
        sub = self.sub
        assert sub is not None
        deadline = time.monotonic() + self._opt.tick_budget
        # Frame by frame: a third of recv_multipart's cost. A message's frames arrive together.
        recv, more = sub.recv, sub.getsockopt
        while True:
            try:
                frames = [recv(zmq.NOBLOCK)]
            except zmq.Again:
                return False
            while more(zmq.RCVMORE):
                frames.append(recv())
            if len(frames) != 3 or len(frames[1]) != 8:
                self._error("frame", f"live message with {len(frames)} frames")
            else:
                self._on_live(int.from_bytes(frames[1], "big"), frames[2])
            if time.monotonic() >= deadline:
                return True

    # --- sequencing -----------------------------------------------------------

    def _is_duplicate(self, seq: int, payload: bytes) -> bool:
        return self._recent.get(seq) == hash(payload)

    def _on_live(self, seq: int, payload: bytes) -> None:
        self._live_batches.inc()
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
        self._last_seq_g.set(-1)
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
        self._last_seq_g.set(seq)
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

    def _apply(self, seq: int, payload: bytes) -> None:
        started = time.perf_counter()
        if self._fast is not None:
            try:
                with self._lock:
                    if self.stopped:
                        return
                    done = self._fast(self.spec.pod, self.spec.model, self.spec.rank, payload)
            except Exception:
                self._error("sink", f"sink.apply_payload failed on batch {seq}; its state is no longer trusted",
                            exc_info=True)
                self._drop("sink_error")
                return
            if done is not None:
                n = done.stored + done.removed
                self.counts["events"] += n
                for name, k in (("BlockStored", done.stored), ("BlockRemoved", done.removed)):
                    if k:
                        received, applied = self._by_type[name]
                        received.inc(k)
                        applied.inc(k)
                self._m.processing.observe(time.perf_counter() - started)
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
                if not dealer.poll(timeout_ms):
                    self._replay_failed("timeout")
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
    ingest thread; the sink is only ever called under `lock`."""

    def __init__(self, sink: EventSink, options: SubscriberOptions | None = None,
                 metrics: KVEventMetrics | None = None, lock: threading.Lock | None = None) -> None:
        self._sink = sink
        self._opt = options or SubscriberOptions()
        self.metrics = metrics or KVEventMetrics()
        self.lock = lock or threading.Lock()
        self._ctx = zmq.Context()
        self._subs: dict[tuple[str, int], Subscriber] = {}
        self._commands: list[tuple[str, Subscriber]] = []  # (start|stop, subscriber), under _cmd_lock
        self._cmd_lock = threading.Lock()
        self._wake_addr = f"inproc://kvgate-ingest-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)  # used by the owner's thread only
        self._wake_tx.connect(self._wake_addr)
        self._thread: threading.Thread | None = None
        self._closed = False

    def sync(self, specs: Iterable[EndpointSpec]) -> None:
        """Start and stop subscribers so that exactly `specs` run. Call from one thread (the event loop)."""
        if self._closed:
            raise RuntimeError("SubscriberManager is closed")
        wanted = {(s.pod, s.rank): s for s in specs}
        commands = []
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
        with self._cmd_lock:
            self._commands.extend(commands)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvgate-ingest", daemon=True)
            self._thread.start()
        self._wake_tx.send(b"")

    def _forget(self, sub: Subscriber) -> None:
        with self.lock:
            sub.stopped = True  # before the drop: no batch of this subscriber lands after it
            try:
                self._sink.drop(sub.spec.pod, sub.spec.rank)  # nobody keeps that state current any more
            except Exception:
                log.exception("sink.drop failed for %s rank %d", sub.spec.pod, sub.spec.rank)
        self.metrics.forget(sub.spec.pod, sub.spec.rank)

    def status(self) -> list[dict]:
        return [sub.status() for sub in list(self._subs.values())]

    async def aclose(self) -> None:
        self._closed = True
        for sub in list(self._subs.values()):
            with self.lock:
                sub.stopped = True
        self._subs.clear()
        if self._thread is not None:
            with self._cmd_lock:
                self._commands.append(("exit", None))  # type: ignore[arg-type]
            self._wake_tx.send(b"")
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._wake_tx.close(linger=0)
        self._wake_rx.close(linger=0)
        self._ctx.destroy(linger=0)

    # --- the ingest thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        owner: dict[zmq.Socket, Subscriber] = {}  # sub and monitor sockets -> their subscriber
        running: set[Subscriber] = set()
        restart_at: dict[Subscriber, float] = {}  # subscribers waiting out a back-off after a failure
        delays: dict[Subscriber, float] = {}
        busy: list[Subscriber] = []  # spent their tick budget with batches still queued
        coalesce = self._opt.coalesce

        def stop(sub: Subscriber) -> None:
            for sock in (sub.sub, sub.monitor):
                if sock is not None:
                    poller.unregister(sock)
                    owner.pop(sock, None)
            sub.close()

        def start(sub: Subscriber) -> None:
            sub.open()
            poller.register(sub.sub, zmq.POLLIN)
            poller.register(sub.monitor, zmq.POLLIN)
            owner[sub.sub] = owner[sub.monitor] = sub

        def failed(sub: Subscriber) -> None:
            # A bug must not stop one pod's stream for good: count, drop, start over after a back-off.
            delay = delays.get(sub, self._opt.reconnect_initial)
            log.exception("kv events %s rank %d: subscriber failed; restarting in %.1f s", sub.spec.pod,
                          sub.spec.rank, delay)
            self.metrics.errors.labels("subscriber").inc()
            stop(sub)
            sub.reset("subscriber_error")
            restart_at[sub] = time.monotonic() + delay
            delays[sub] = min(delay * 2, self._opt.reconnect_max)

        try:
            while True:
                timeout = None
                if busy:
                    timeout = 0
                elif restart_at:
                    timeout = max(0.0, (min(restart_at.values()) - time.monotonic()) * 1000)
                ready = poller.poll(timeout)
                if coalesce > 0 and timeout is None:
                    # Woken from idle: let a few more batches queue before handling any, so that one wake-up
                    # (and libzmq's signalling of it) serves several; the index lags by at most this long.
                    time.sleep(coalesce)
                    ready = poller.poll(0)
                for sock, _ in ready:
                    if sock is self._wake_rx:
                        while True:
                            try:
                                self._wake_rx.recv(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                        with self._cmd_lock:
                            commands, self._commands = self._commands, []
                        for what, sub in commands:
                            if what == "exit":
                                return
                            if what == "start":
                                running.add(sub)
                                try:
                                    start(sub)
                                except Exception:
                                    failed(sub)
                            elif sub in running:
                                running.discard(sub)
                                restart_at.pop(sub, None)
                                delays.pop(sub, None)
                                if sub in busy:
                                    busy.remove(sub)
                                stop(sub)
                        continue
                    sub = owner.get(sock)
                    if sub is None or sub.stopped:
                        continue
                    try:
                        if sock is sub.monitor:
                            sub.on_monitor()
                        elif sub not in busy and sub.drain():
                            busy.append(sub)
                    except Exception:
                        failed(sub)
                # Endpoints with batches still queued take turns, one tick budget each.
                for sub in busy[:]:
                    busy.remove(sub)
                    if sub.stopped or sub.sub is None:
                        continue
                    try:
                        if sub.drain():
                            busy.append(sub)
                    except Exception:
                        failed(sub)
                now = time.monotonic()
                for sub, at in list(restart_at.items()):
                    if at <= now:
                        del restart_at[sub]
                        if sub in running and not sub.stopped:
                            try:
                                start(sub)
                            except Exception:
                                failed(sub)
        except Exception:
            log.exception("kv events: the ingest thread failed; KV events are no longer followed")
            self.metrics.errors.labels("subscriber").inc()
        finally:
            for sub in running:
                stop(sub)
