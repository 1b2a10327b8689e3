"""The ingest thread: `SubscriberManager` runs one kvcache.stream.Subscriber per engine endpoint,
all on one thread of its own (`IngestLoop`), off the event loop that serves requests.

The loop waits on every endpoint's socket with epoll (the GIL released), reads each with one recv
per wake-up, hands each endpoint its batches in order, and the streams call the sink under the
manager's lock (kvcache.locking.IndexLock), which the request path takes too (LockedIndex) since
the index is not thread-safe. While batches keep coming it wakes every `coalesce` seconds and takes
all that queued meanwhile; the batches of one read that continue the stream in order are applied
in runs, one native call each (the sink's apply_run), the others one by one. An endpoint that has
work queued gets `tick_budget` seconds before the others have their turn. A replay runs on a worker
thread of its endpoint: meanwhile that endpoint's live batches wait, in order, in its socket (TCP
flow control bounds them, then the engine's send queue), and the other endpoints go on. The loop
owns the connections (connect, reconnect with back-off, heartbeats, handshake deadline); it reads
and writes the streams only through their public fields and methods.

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
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import zmq

from kvcache.locking import GilHandOver, IndexLock
from kvcache.metrics import KVEventMetrics
from kvcache.sink import EventSink
from kvcache.stream import MORE, REPLAY, EndpointSpec, Subscriber, SubscriberOptions
from kvcache.zmtp import Connection, ProtocolError, ping

log = logging.getLogger(__name__)

_FLUSH_EVERY = 0.5  # s between two writes of the locally counted metrics (a scrape sees them this late at most)
_HANDSHAKE_TIMEOUT = 30.0  # s for a connection to complete its handshake (libzmq's default)

READ, WRITE = select.EPOLLIN, select.EPOLLOUT
_READABLE, _WRITABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR, select.EPOLLOUT | select.EPOLLERR


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


def _locked_call(lock: IndexLock | threading.Lock, fn: Callable[[], object], what: str) -> None:
    """fn() under the index lock; a failure is logged (`what` names the operation)."""
    try:
        with lock:
            fn()
    except Exception:
        log.exception("%s failed", what)


class _Mailbox:
    """Commands for the ingest thread: (start|stop|done|resolved|exit, subscriber) or ("call", (fn,
    what)), in a list under a lock, and a pipe whose read end wakes the thread's epoll. Closed once the
    thread is gone: what is posted after that (a name lookup finishing late) goes nowhere."""

    def __init__(self) -> None:
        self._commands: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.rx, self._tx = os.pipe()
        os.set_blocking(self.rx, False)
        os.set_blocking(self._tx, False)

    def post(self, commands: list[tuple[str, Any]]) -> None:
        with self._lock:
            if self._closed:
                return
            self._commands.extend(commands)
            try:
                os.write(self._tx, b"\0")
            except BlockingIOError:  # the pipe is full: the ingest thread has wake-ups pending anyway
                pass

    def take(self) -> list[tuple[str, Any]]:
        """Every command posted so far, in order (the ingest thread, woken by `rx`)."""
        try:
            while os.read(self.rx, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self._tx)
            os.close(self.rx)


class IngestLoop:
    """The ingest thread's state and its steps: `run` waits on the endpoints' connections and the
    mailbox, and hands each endpoint what it read; the other methods are one step each (connect, lose
    a connection, hand a replay to a worker, the timers...). Every method runs on the ingest thread,
    except a worker's and a name lookup's, which only post to the mailbox."""

    def __init__(self, options: SubscriberOptions, metrics: KVEventMetrics, lock: IndexLock | threading.Lock,
                 mailbox: _Mailbox, hand_over: GilHandOver) -> None:
        self.opt = options
        self.metrics = metrics
        self.lock = lock
        self.mailbox = mailbox
        self.hand_over = hand_over
        self.ep = select.epoll()  # epoll itself: the selectors module's Python costs ~5 us more per call
        self.ep.register(mailbox.rx, select.EPOLLIN)
        self.owners: dict[int, Subscriber] = {}  # registered fd -> its subscriber
        self.running: set[Subscriber] = set()
        self.backlog: list[Subscriber] = []  # spent their tick budget with messages still pending
        self.workers: set[Subscriber] = set()
        self.budget = options.tick_budget
        self.hb_ivl, self.hb_timeout = options.heartbeat_interval, options.heartbeat_timeout
        self.next_timers = 0.0  # when timers() must run next
        self.last_timers = 0.0
        self.handing = False  # inside hand_over: from a wake-up with work until the next wait

    # --- connections ----------------------------------------------------------------------------

    def watch(self, sub: Subscriber) -> None:
        """(Re-)register sub's connection for what it waits on; nothing while a worker has sub."""
        conn = sub.conn
        want = 0
        if conn is not None and sub.worker is None:
            want = (READ if conn.state != "connecting" and not sub.pending else 0) | (WRITE if conn.wants_write else 0)
        fd = conn.fileno() if conn is not None else -1
        if want == sub.registered and fd == sub.registered_fd:
            return
        ep = self.ep
        if sub.registered:
            if want and fd == sub.registered_fd:
                ep.modify(fd, want)
                sub.registered = want
                return
            ep.unregister(sub.registered_fd)
            self.owners.pop(sub.registered_fd, None)
            sub.registered = 0
        if want:
            ep.register(fd, want)
            self.owners[fd] = sub
            sub.registered_fd = fd
            sub.registered = want

    def close_conn(self, sub: Subscriber) -> None:
        if sub.registered:
            self.ep.unregister(sub.registered_fd)
            self.owners.pop(sub.registered_fd, None)
            sub.registered = 0
        if sub.conn is not None:
            sub.conn.close()
            sub.conn = None

    def connect(self, sub: Subscriber) -> None:
        sub.connect_at = None
        if sub.resolving:  # its lookup's answer connects it
            return
        host, port = sub.spec.host.strip("[]"), sub.spec.pub_port
        try:
            address = _numeric_address(host, port)
        except OSError as e:
            self.connect_failed(sub, e)
            return
        if address is None:
            # A host name: looked up on a thread of its own, since a lookup can take seconds (a dead
            # DNS server) and this thread follows every engine.
            sub.resolving = True
            threading.Thread(target=self.resolve, args=(sub, host, port), daemon=True,
                             name=f"kvgate-resolve-{sub.spec.pod}").start()
            return
        self.open_connection(sub, address)

    def resolve(self, sub: Subscriber, host: str, port: int) -> None:
        """Look `host` up (on a thread of its own) and hand the answer to the ingest thread."""
        try:
            family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            sub.resolved = (family, addr)
        except OSError as e:
            sub.resolved = e
        except Exception as e:  # noqa: BLE001 - whatever the lookup raised, the endpoint retries
            sub.resolved = OSError(f"name lookup failed: {e!r}")
        self.mailbox.post([("resolved", sub)])

    def connect_failed(self, sub: Subscriber, e: OSError) -> None:
        log.debug("kv events %s: connect to %s failed: %s", sub.spec.pod, sub.spec.pub_endpoint, e)
        self.retry(sub)

    def open_connection(self, sub: Subscriber, address: tuple[int, Any]) -> None:
        try:
            sub.conn = Connection(address[1], address[0])
        except OSError as e:
            self.connect_failed(sub, e)
            return
        sub.last_rx = time.monotonic()  # the handshake deadline counts from here
        self.next_timers = min(self.next_timers, sub.last_rx + _HANDSHAKE_TIMEOUT)
        self.watch(sub)

    def retry(self, sub: Subscriber) -> None:
        self.close_conn(sub)
        sub.on_retry()
        sub.connect_at = time.monotonic() + sub.retry_delay
        sub.retry_delay = min(sub.retry_delay * 2, self.opt.reconnect_max)
        self.next_timers = min(self.next_timers, sub.connect_at)

    def lost(self, sub: Subscriber) -> None:
        """The connection ended: reconnect after the initial interval (or retry one never made)."""
        if sub.connected:
            self.close_conn(sub)
            sub.on_disconnected()
            sub.connect_at = time.monotonic() + self.opt.reconnect_initial
            self.next_timers = min(self.next_timers, sub.connect_at)
        else:
            self.retry(sub)

    # --- endpoints ------------------------------------------------------------------------------

    def start(self, sub: Subscriber) -> None:
        self.running.add(sub)
        sub.catch_up_on_connect = True
        self.connect(sub)

    def stop(self, sub: Subscriber) -> None:
        self.running.discard(sub)
        if sub in self.backlog:
            self.backlog.remove(sub)
        self.close_conn(sub)
        sub.on_stopped()

    def failed(self, sub: Subscriber, error: BaseException) -> None:
        # A bug must not stop one pod's stream for good: count, drop, start over after a back-off.
        log.error("kv events %s rank %d: subscriber failed; restarting in %.1f s", sub.spec.pod,
                  sub.spec.rank, sub.retry_delay, exc_info=error)
        self.metrics.errors.labels("subscriber").inc()
        delay = sub.retry_delay
        self.stop(sub)
        self.running.add(sub)
        sub.reset("subscriber_error")
        sub.catch_up_on_connect = True
        sub.connect_at = time.monotonic() + delay
        sub.retry_delay = min(delay * 2, self.opt.reconnect_max)
        self.next_timers = min(self.next_timers, sub.connect_at)

    def hand_off(self, sub: Subscriber, job: Callable[[], None]) -> None:
        """Run job() (which may replay) on a worker thread; sub waits meanwhile."""
        hand_over, mailbox = self.hand_over, self.mailbox

        def run() -> None:
            error = None
            try:
                with hand_over:
                    job()
            except Exception as e:  # reported to the ingest thread, which restarts the stream
                error = e
            sub.worker_error = error
            mailbox.post([("done", sub)])

        sub.worker = threading.Thread(target=run, name=f"kvgate-replay-{sub.spec.pod}-{sub.spec.rank}",
                                      daemon=True)
        self.workers.add(sub)
        self.watch(sub)
        sub.worker.start()

    def worker_done(self, sub: Subscriber) -> None:
        assert sub.worker is not None  # "done" comes from the worker hand_off started
        sub.worker.join()
        sub.worker = None
        self.workers.discard(sub)
        error, sub.worker_error = sub.worker_error, None
        if sub not in self.running:
            return
        if error is not None:
            self.failed(sub, error)
            return
        sub.last_rx = time.monotonic()  # nothing was read meanwhile
        if sub.conn is not None:
            self.watch(sub)
        if sub.pending and sub not in self.backlog:
            self.backlog.append(sub)

    def resolved(self, sub: Subscriber) -> None:
        result, sub.resolved, sub.resolving = sub.resolved, None, False
        if sub not in self.running or sub.stopped or sub.conn is not None:
            return  # stopped meanwhile
        if isinstance(result, OSError):
            self.connect_failed(sub, result)
        else:
            assert result is not None  # resolve() set it before posting "resolved"
            self.open_connection(sub, result)

    def commands(self) -> bool:
        """Carry out the commands posted; False on exit."""
        for what, sub in self.mailbox.take():
            if what == "exit":
                return False
            if what == "start":
                self.start(sub)
            elif what == "call":
                _locked_call(self.lock, *sub)
            elif what == "resolved":
                self.resolved(sub)
            elif what == "done":
                self.worker_done(sub)
            elif sub in self.running:  # stop
                self.stop(sub)
        self.next_timers = 0.0
        return True

    # --- batches --------------------------------------------------------------------------------

    def on_event(self, sub: Subscriber, mask: int) -> None:
        deadline = 0.0  # the end of sub's tick budget, once its turn started
        conn = sub.conn
        if conn is None:
            return
        if mask & WRITE:
            try:
                conn.on_writable()
            except OSError:
                self.lost(sub)
                return
        if mask & READ:
            out: list = []
            alive = True
            try:
                ready = conn.read(out)  # None: the peer closed the connection
            except OSError:
                ready = None
            except ProtocolError as e:
                sub.count_error("protocol", f"connection dropped: {e}")
                ready, alive = False, False  # what came before the bad frame is still handled
            if ready is None:
                alive = False
            else:
                sub.last_rx = now = time.monotonic()
                if out:
                    if alive and not ready and not sub.pending and sub.worker is None:
                        # The common case: the batches continue the stream in order. Whole runs of
                        # them in one native call each, within the tick budget; the rest one by one.
                        deadline = now + self.budget
                        take_run = sub.take_run
                        i, n = 0, len(out)
                        while i < n:
                            k = take_run(out, i)
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
                    sub.ping_at = sub.last_rx + self.hb_ivl
                    if sub.catch_up_on_connect:
                        self.hand_off(sub, sub.catch_up)
                        return
            if not alive:
                self.lost(sub)
                if sub.worker is None and sub.pending and sub not in self.backlog:
                    self.backlog.append(sub)  # what came before the end is still handled
                return
        if sub.pending and sub.worker is None:
            turn = sub.handle_pending(deadline or time.monotonic() + self.budget)
            if turn == REPLAY:
                self.hand_off(sub, sub.replay_held)
            elif turn == MORE and sub not in self.backlog:
                self.backlog.append(sub)
        if sub.conn is not None and (sub.registered != READ or sub.pending or sub.conn.wants_write):
            self.watch(sub)  # (what it waits on changed: registered for reading alone is the common case)

    def take_turns(self) -> None:
        """Endpoints with messages still pending take turns, one tick budget each."""
        backlog, budget = self.backlog, self.budget
        for sub in backlog[:]:
            backlog.remove(sub)
            if sub.stopped or sub.worker is not None or sub not in self.running:
                continue
            try:
                turn = sub.handle_pending(time.monotonic() + budget)
                if turn == MORE:
                    backlog.append(sub)
                elif turn == REPLAY:
                    self.hand_off(sub, sub.replay_held)
                elif sub.conn is not None:
                    self.watch(sub)
            except Exception as e:
                self.failed(sub, e)

    def timers(self, now: float) -> float:
        """Reconnections, pings, dead peers, metrics; when to come back."""
        hb_ivl, hb_timeout = self.hb_ivl, self.hb_timeout
        nxt = now + 3600.0
        for sub in list(self.running):
            if sub.worker is not None:
                continue
            sub.flush_metrics()
            if sub.conn is None:
                if sub.connect_at is not None:
                    if sub.connect_at <= now:
                        self.connect(sub)
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
                    sub.count_error("handshake", "no handshake in time")
                    self.lost(sub)
                    nxt = min(nxt, sub.connect_at or nxt)
                else:
                    nxt = min(nxt, sub.last_rx + _HANDSHAKE_TIMEOUT)
                continue
            if hb_ivl > 0:
                if now - sub.last_rx >= hb_timeout:  # not even a PONG: the peer (or the path) is dead
                    self.lost(sub)
                    nxt = min(nxt, sub.connect_at or nxt)
                    continue
                if now >= sub.ping_at:
                    conn.send(ping(hb_timeout))
                    sub.ping_at = now + hb_ivl
                    self.watch(sub)
                nxt = min(nxt, sub.ping_at, sub.last_rx + hb_timeout)
        return nxt

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Until the exit command: wait, read, hand each endpoint its batches, run the timers."""
        try:
            self._run()
        except Exception:
            log.exception("kv events: the ingest thread failed; KV events are no longer followed")
            self.metrics.errors.labels("subscriber").inc()
        finally:
            self.close()

    def _run(self) -> None:
        # Locals for what every wake-up uses: an attribute read per use costs on a cold cache.
        hand_over, ep, wake_fd = self.hand_over, self.ep, self.mailbox.rx
        backlog, running, owners = self.backlog, self.running, self.owners
        on_event, failed, take_turns, timers, commands = (self.on_event, self.failed, self.take_turns, self.timers,
                                                         self.commands)
        coalesce = self.opt.coalesce
        monotonic, sleep = time.monotonic, time.sleep
        streaming = False  # the last wake-up found batches: the next one is a sleep, not a wait
        while True:
            if self.handing:
                hand_over.__exit__(None, None, None)
                self.handing = False
            if backlog:
                ready = ep.poll(0)
            elif streaming and coalesce > 0:
                # Batches keep coming: sleep, then take what queued meanwhile. One context switch per
                # round instead of two (a wait that wakes at the first batch, then the sleep). Timers
                # that fall due meanwhile run right after it, at most `coalesce` late: waiting for them
                # instead would wake at every batch until they are due (the last interval before
                # every flush of the metrics: with a flush every 0.1 s, a third more wake-ups).
                sleep(coalesce)
                ready = ep.poll(0)
            else:
                ready = ep.poll(max(0.0, self.next_timers - monotonic()))
                if coalesce > 0 and ready and (len(ready) > 1 or ready[0][0] != wake_fd):
                    # Woken from idle by a batch: let a few more queue before handling any, so that one
                    # wake-up (and one recv per engine) serves several; the index lags by at most this long.
                    sleep(coalesce)
                    ready = ep.poll(0)
            streaming = bool(ready)
            if ready or backlog:
                hand_over.__enter__()
                self.handing = True
            for fd, ev in ready:
                if fd == wake_fd:
                    if not commands():
                        return
                    continue
                sub = owners.get(fd)
                if sub is not None and sub in running and not sub.stopped:
                    mask = (READ if ev & _READABLE else 0) | (WRITE if ev & _WRITABLE else 0)
                    try:
                        on_event(sub, mask)
                    except Exception as e:
                        failed(sub, e)
            if backlog:
                take_turns()
            now = monotonic()
            if ready:  # counted locally: written to the metrics within _FLUSH_EVERY
                self.next_timers = min(self.next_timers, self.last_timers + _FLUSH_EVERY)
            if now >= self.next_timers:
                self.last_timers = now
                self.next_timers = timers(now)

    def close(self) -> None:
        """Leave the GIL hand-over, stop every endpoint, wait for the workers (a replay stops at its
        timeout or as soon as it sees `stopped`)."""
        if self.handing:
            self.hand_over.__exit__(None, None, None)
            self.handing = False
        for sub in list(self.running):
            self.stop(sub)
        for sub in list(self.workers):
            with self.lock:
                sub.stopped = True
            assert sub.worker is not None  # in `workers` from hand_off until worker_done
            sub.worker.join()
        self.ep.close()


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
        self._mailbox = _Mailbox()
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
        self._mailbox.post(commands)
        if self._thread is None:
            loop = IngestLoop(self._opt, self.metrics, self.lock, self._mailbox, self.hand_over)
            self._thread = threading.Thread(target=loop.run, name="kvgate-ingest", daemon=True)
            self._thread.start()

    def run_locked(self, fn: Callable[[], object], what: str) -> None:
        """Run `fn` under the index lock on the ingest thread, in order with the subscribers' starts and
        stops posted before and after it (a pod's removal lands before its successor's first batch).
        The caller (the event loop) never waits for the lock, which the ingest thread holds up to
        ~140 ms while a growing table is rehashed. Without a running ingest thread it runs here, now.
        A failure is logged (`what` names the operation)."""
        if self._thread is None or self._closed:
            _locked_call(self.lock, fn, what)
        else:
            self._mailbox.post([("call", (fn, what))])

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
            self._mailbox.post([("exit", None)])
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._mailbox.close()
        self._ctx.destroy(linger=0)
