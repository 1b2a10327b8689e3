"""Subscriber against real ZMQ sockets and our vLLM-faithful publisher, all generations."""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import sys
import threading
import time

import msgpack
import pytest
import zmq

from kvcache.events import BlockRemoved, BlockStored
from kvcache.index import PrefixIndex, RunApplied
from kvcache.native import native
from kvcache.metrics import KVEventMetrics
from kvcache.publisher import END_SEQ, EventPublisher
from kvcache.subscriber import GIL_SWITCH_INTERVAL_S, EndpointSpec, GilHandOver, SubscriberManager, SubscriberOptions

GENERATIONS = ["0.23", "0.25", "0.33"]
FAST = SubscriberOptions(replay_timeout=0.3, reconnect_initial=0.05, reconnect_max=0.2,
                         heartbeat_interval=0.5, heartbeat_timeout=1.5)


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RecordingSink:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def apply(self, pod, model, rank, events):
        for ev in events:
            self.log.append(("apply", pod, model, rank, ev))

    def drop(self, pod, rank):
        self.log.append(("drop", pod, rank))

    def hashes(self, pod="p", rank=0) -> list[int]:
        """First block hash of each applied event of (pod, rank): our events are numbered by it."""
        return [e[4].block_hashes[0] for e in self.log if e[0] == "apply" and e[1] == pod and e[3] == rank]

    def drops(self, pod="p", rank=0) -> int:
        return sum(1 for e in self.log if e == ("drop", pod, rank))

    def after_last_drop(self, pod="p", rank=0) -> list[int]:
        idx = max(i for i, e in enumerate(self.log) if e == ("drop", pod, rank))
        return [e[4].block_hashes[0] for e in self.log[idx + 1:] if e[0] == "apply" and e[1] == pod]


def ev(n: int) -> BlockStored:
    return BlockStored((n,), None, (n, n + 1), 2, None, "GPU", None)


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


class Engine:
    """One publisher with its endpoint spec."""

    def __init__(self, generation="0.33", replay=True, host="127.0.0.1", pod="p", rank=0, **kw):
        self.pub_port, self.replay_port = free_port(host), free_port(host) if replay else None
        fmt = (lambda p: f"tcp://[{host}]:{p}") if ":" in host else (lambda p: f"tcp://{host}:{p}")
        self.pub = EventPublisher(fmt(self.pub_port), fmt(self.replay_port) if replay else None,
                                  generation=generation, data_parallel_rank=rank, **kw)
        self.spec = EndpointSpec(pod, "m", host, self.pub_port, self.replay_port, rank)

    def publish(self, *ns: int) -> None:
        for n in ns:
            self.pub.publish([ev(n)])


@pytest.fixture
async def harness():
    made: list = []

    def make(sink=None, options=FAST):
        sink = sink or RecordingSink()
        metrics = KVEventMetrics()
        manager = SubscriberManager(sink, options, metrics)
        made.append(manager)
        return sink, manager

    engines: list[Engine] = []

    def engine(**kw) -> Engine:
        e = Engine(**kw)
        engines.append(e)
        return e

    yield make, engine
    for m in made:
        await m.aclose()
    for e in engines:
        e.pub.close()


def status(manager, rank=0, pod=None):
    return next(s for s in manager.status() if s["rank"] == rank and (pod is None or s["pod"] == pod))


def connections(manager, kind: str, pod: str = "p", rank: int = 0) -> float:
    """kvgate_kvevents_{connections,disconnections}_total of one endpoint."""
    return manager.metrics.registry.get_sample_value(f"kvgate_kvevents_{kind}_total",
                                                     {"pod": pod, "rank": str(rank)}) or 0.0


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_replays_history_then_follows_live(harness, generation):
    make, engine = harness
    e = engine(generation=generation)
    e.publish(0, 1, 2, 3)
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: sink.hashes() == [0, 1, 2, 3])
    e.publish(4, 5, 6)
    await until(lambda: len(sink.hashes()) == 7)
    assert sink.hashes() == list(range(7))
    assert sink.drops() == 0
    st = status(manager)
    assert st["connected"] and st["last_seq"] == 6 and st["missed_batches"] == 0


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_dropped_messages_are_replayed_in_order(harness, generation):
    make, engine = harness
    e = engine(generation=generation)
    e.publish(0)
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: sink.hashes() == [0])  # the start replay is done: what follows is live
    e.publish(1)
    e.pub.drop_next(3)
    e.publish(2, 3, 4, 5, 6)
    e.pub.drop_next(1)
    e.publish(7, 8)
    await until(lambda: len(sink.hashes()) == 9)
    assert sink.hashes() == list(range(9))
    st = status(manager)
    assert sink.drops() == 0 and st["missed_batches"] == 0 and st["replays"] >= 2  # start + at least one repair


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_gap_larger_than_replay_buffer_drops_then_rebuilds(harness, generation):
    make, engine = harness
    e = engine(generation=generation, buffer_steps=2)
    e.publish(0)
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: sink.hashes() == [0])  # the start replay is done: what follows is live
    e.publish(1, 2)
    await until(lambda: len(sink.hashes()) == 3)
    e.pub.drop_next(5)
    e.publish(3, 4, 5, 6, 7, 8)  # 3..7 lost live; the buffer only holds 7, 8
    await until(lambda: len(sink.hashes()) == 5)
    assert sink.hashes() == [0, 1, 2, 7, 8]
    assert sink.drops() == 1 and sink.after_last_drop() == [7, 8]
    assert status(manager)["missed_batches"] == 4  # seqs 3..6


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_engine_restart_mid_stream(harness, generation):
    make, engine = harness
    e = engine(generation=generation)
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    e.publish(0, 1, 2)
    await until(lambda: len(sink.hashes()) == 3)
    e.pub.stop()
    await until(lambda: not status(manager)["connected"])
    e.pub.start()
    e.publish(100, 101)  # the new process starts again at seq 0
    await until(lambda: sink.drops() == 1 and sink.after_last_drop() == [100, 101])
    e.publish(102)
    await until(lambda: sink.after_last_drop() == [100, 101, 102])
    assert sink.drops() == 1
    assert status(manager)["last_seq"] == 2


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_restart_whose_new_stream_passes_the_old_seq_is_still_noticed(harness, generation):
    make, engine = harness
    e = engine(generation=generation)
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    e.publish(0, 1)
    await until(lambda: len(sink.hashes()) == 2)
    e.pub.stop()
    await until(lambda: not status(manager)["connected"])
    e.pub.start()
    e.publish(*range(100, 106))  # seqs 0..5 of the new process, past the old last seq 1
    await until(lambda: sink.drops() >= 1 and len(sink.after_last_drop()) == 6)
    assert sink.after_last_drop() == list(range(100, 106))
    assert sink.drops() == 1


async def test_restart_without_replay_follows_new_stream(harness):
    make, engine = harness
    e = engine(replay=False)
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    # No replay: wait until batches arrive live (CI lost 0..2 when they were sent as soon as the socket
    # connected, before the engine's PUB had the subscription).
    await subscribed(e, manager)
    probes = len(sink.hashes())
    e.publish(0, 1, 2)
    await until(lambda: sink.hashes()[probes:] == [0, 1, 2])
    e.pub.restart()
    # The SUB saw the old publisher go and is connected to the new one: a second connection, after a loss.
    await until(lambda: connections(manager, "disconnections") == 1 and connections(manager, "connections") == 2
                and status(manager)["connected"])

    async def keep_publishing():  # live-only: what is sent before the SUB reconnects is lost
        n = 100
        while not sink.drops():
            e.publish(n)
            n += 1
            await asyncio.sleep(0.02)

    await asyncio.wait_for(keep_publishing(), 10)
    assert sink.hashes()[probes:probes + 3] == [0, 1, 2]
    assert all(h >= 100 for h in sink.after_last_drop())


async def test_no_replay_endpoint_starts_at_once(harness):
    make, engine = harness
    e = engine(replay=False)
    e.publish(0)  # before anyone listens: gone, nothing can replay it
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    # No replay here: what the engine sends before it has the subscription is lost for good, so wait
    # until batches arrive live (CI lost 1 and 2 when they were sent as soon as the socket connected).
    await subscribed(e, manager)
    probes = len(sink.hashes())
    e.publish(1, 2)
    await until(lambda: sink.hashes()[probes:] == [1, 2])
    assert 0 not in sink.hashes()
    assert manager.metrics.replay_failures.labels("p", "0", "no_endpoint")._value.get() >= 1


async def test_silent_replay_endpoint_does_not_block_live_events(harness):
    make, engine = harness
    e = engine(replay=False)
    dead = EndpointSpec("p", "m", "127.0.0.1", e.pub_port, free_port(), 0)  # nothing answers there
    sink, manager = make()
    manager.sync([dead])
    await until(lambda: status(manager)["replay_failures"] >= 1)
    await subscribed(e, manager)  # the replay that never answers did not hold live batches back
    probes = len(sink.hashes())
    e.publish(1, 2)
    await until(lambda: sink.hashes()[probes:] == [1, 2])
    assert status(manager)["connected"]


async def subscribed(e: Engine, manager, pod="p", rank=0, timeout: float = 10.0) -> int:
    """Publish probe batches until one arrives live: an engine's PUB drops what it sends before the
    SUB's subscription has reached it (libzmq's PUB even takes it in lazily, on a later send), and
    what is not replayable (bad frames) would then be lost. Returns the seq the next batch gets."""
    def live() -> float:
        return manager.metrics.registry.get_sample_value(
            "kvgate_kvevents_batches_received_total", {"pod": pod, "rank": str(rank), "source": "live"}) or 0.0

    deadline = time.monotonic() + timeout
    seq = 0
    while True:
        seq = e.pub.publish([ev(1000 + seq)]) + 1
        probe_deadline = min(deadline, time.monotonic() + 0.5)
        while not live() and time.monotonic() < probe_deadline:
            await asyncio.sleep(0.01)
        if live():
            await until(lambda: status(manager, rank, pod)["last_seq"] == seq - 1)
            return seq
        assert time.monotonic() < deadline, "no batch ever arrived live"


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_garbage_is_counted_and_skipped_connection_stays_up(harness, generation, caplog):
    make, engine = harness
    e = engine(generation=generation)
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    first = await subscribed(e, manager)
    probes = len(sink.hashes())
    e.publish(0)
    e.pub.send_raw([b"only-two", b"frames"])
    e.pub.send_raw([b"", b"short", b"\x90"])
    e.pub.publish_payload(b"\xc1 not msgpack")  # takes seq first + 1
    e.pub.publish_payload(msgpack.packb([1.0, [["Mystery", 1], ["BlockStored", [1], None, [1], 2]], 0]))
    e.publish(3)
    await until(lambda: status(manager)["last_seq"] == first + 3 and len(sink.hashes()) == probes + 2)
    assert sink.hashes()[probes:] == [0, 3]
    st = status(manager)
    assert st["connected"] and st["errors"] == 3 and st["missed_batches"] == 0 and sink.drops() == 0
    assert manager.metrics.errors.labels("decode")._value.get() == 1
    assert manager.metrics.events_skipped.labels("unknown_tag")._value.get() == 1
    assert manager.metrics.events_skipped.labels("malformed_event")._value.get() == 1
    assert sum("(frame" in r.getMessage() for r in caplog.records) == 1  # two bad frames, one log line


async def test_garbage_replay_frames_are_skipped():
    port = free_port()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    pub_port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    good = msgpack.packb([1.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU", None]], 0])

    def serve():
        if router.poll(5000):
            client, _, _ = router.recv_multipart()
            router.send_multipart([client, b"", b"x"])
            router.send_multipart([client, b"", b"bad", b"x"])
            router.send_multipart([client, b"", (0).to_bytes(8, "big"), good])
            router.send_multipart([client, b"", END_SEQ, b""])

    t = threading.Thread(target=serve)
    t.start()
    sink = RecordingSink()
    manager = SubscriberManager(sink, FAST)
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", pub_port, port, 0)])
        await until(lambda: sink.hashes() == [5])
        assert status(manager)["errors"] == 2
    finally:
        await manager.aclose()
        t.join()
        router.close(0)
        pub.close(0)
        ctx.term()


async def test_ipv6_endpoint(harness):
    make, engine = harness
    e = engine(host="::1", generation="0.25")
    e.publish(0, 1)
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: sink.hashes() == [0, 1])
    assert status(manager)["endpoint"].startswith("tcp://[::1]:")


async def test_data_parallel_ranks_are_tracked_apart(harness):
    make, engine = harness
    r0, r1 = engine(rank=0), engine(rank=1)
    sink, manager = make()
    manager.sync([r0.spec, r1.spec])
    await until(lambda: all(s["connected"] for s in manager.status()))
    await subscribed(r0, manager, rank=0)
    await subscribed(r1, manager, rank=1)
    p0, p1 = len(sink.hashes(rank=0)), len(sink.hashes(rank=1))
    r0.publish(0, 1)
    r1.publish(10, 11)
    await until(lambda: sink.hashes(rank=0)[p0:] == [0, 1] and sink.hashes(rank=1)[p1:] == [10, 11])
    r1.pub.stop()
    await until(lambda: not status(manager, 1)["connected"])
    r1.pub.start()
    r1.publish(20)
    r0.publish(2)
    await until(lambda: sink.drops(rank=1) == 1 and sink.after_last_drop(rank=1) == [20]
                and sink.hashes(rank=0)[p0:] == [0, 1, 2])
    assert sink.drops(rank=0) == 0 and sink.hashes(rank=0)[p0:] == [0, 1, 2]


async def test_sync_starts_and_stops_exactly_the_given_specs(harness):
    make, engine = harness
    a, b = engine(pod="a"), engine(pod="b")
    sink, manager = make()
    manager.sync([a.spec, b.spec])
    assert sorted(s["pod"] for s in manager.status()) == ["a", "b"]
    manager.sync([b.spec])
    assert [s["pod"] for s in manager.status()] == ["b"]
    await until(lambda: ("drop", "a", 0) in sink.log)  # nobody keeps a's state current any more
    manager.sync([b.spec])  # unchanged: keeps running
    await until(lambda: status(manager)["connected"])
    await subscribed(b, manager, pod="b")  # a lone batch sent before the subscription took hold is lost
    probes = len(sink.hashes("b"))
    b.publish(1)
    await until(lambda: sink.hashes("b")[probes:] == [1])



async def test_changes_wait_for_the_index_lock_on_the_ingest_thread_not_on_the_caller(harness):
    """A removed endpoint's drop, and any run_locked change, never make the caller (the event loop)
    wait for the index lock, which the ingest thread holds up to ~140 ms while a growing table is
    rehashed; they run once the lock is free, in the order posted, before a later-started subscriber's
    first batch."""
    make, engine = harness
    a = engine(pod="a")
    sink, manager = make()
    manager.sync([a.spec])
    await until(lambda: status(manager, pod="a")["connected"])
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with manager.lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        started = time.monotonic()
        manager.run_locked(lambda: sink.log.append(("call", "first")), "first")
        manager.sync([])  # a's drop
        manager.run_locked(lambda: sink.log.append(("call", "last")), "last")
        assert time.monotonic() - started < 0.05  # none of them waited for the lock
        await asyncio.sleep(0.2)
        assert ("call", "first") not in sink.log  # the lock still held: nothing ran around it
    finally:
        release.set()
        holder.join(5)
    await until(lambda: ("call", "last") in sink.log)
    # in the order posted, and no batch of a's after its drop
    assert sink.log[-3:] == [("call", "first"), ("drop", "a", 0), ("call", "last")], sink.log[-5:]

async def test_failing_sink_is_counted_and_state_dropped(harness):
    make, engine = harness

    class Flaky(RecordingSink):
        def apply(self, pod, model, rank, events):
            if events[0].block_hashes[0] == 1:
                raise RuntimeError("index full")
            super().apply(pod, model, rank, events)

    e = engine()
    sink, manager = make(Flaky())
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    await subscribed(e, manager)
    probes = len(sink.hashes())
    e.publish(0, 1, 2)
    await until(lambda: sink.hashes()[probes:] == [0, 2])
    assert sink.drops() == 1 and status(manager)["errors"] == 1


async def test_flood_keeps_order_and_leaves_the_loop_responsive(harness):
    """Completeness and order under a flood, while a coroutine measures its own loop lag."""
    make, engine = harness
    e = engine(generation="0.33", hwm=1_000_000)
    sink, manager = make(options=SubscriberOptions(replay_timeout=0.3, apply_chunk=3))
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    n_batches, per_batch = 1500, 8
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe():
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    def flood():
        for b in range(n_batches):
            e.pub.publish([BlockStored((b * per_batch + i,), None, tuple(range(16)), 16) for i in range(per_batch)])

    probe_task = asyncio.create_task(probe())
    await asyncio.to_thread(flood)
    await until(lambda: len(sink.hashes()) == n_batches * per_batch, timeout=30)
    stop.set()
    await probe_task
    assert sink.hashes() == list(range(n_batches * per_batch))
    assert sink.drops() == 0 and len(lags) > 10
    print(f"\nflood: {n_batches * per_batch} events, loop lag max {max(lags) * 1e3:.1f} ms, "
          f"median {sorted(lags)[len(lags) // 2] * 1e3:.2f} ms over {len(lags)} probes")


async def test_subscriber_bug_restarts_the_stream_from_replay(harness, monkeypatch):
    import kvcache.subscriber as subscriber_module

    real = subscriber_module.decode_batch
    calls = []

    def buggy_once(payload):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("bug")
        return real(payload)

    monkeypatch.setattr(subscriber_module, "decode_batch", buggy_once)
    make, engine = harness
    e = engine()
    sink, manager = make()
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    e.publish(0, 1, 2)
    await until(lambda: sink.drops() == 1 and sink.after_last_drop() == [0, 1, 2])
    assert manager.metrics.errors.labels("subscriber")._value.get() == 1
    e.publish(3)
    await until(lambda: sink.after_last_drop() == [0, 1, 2, 3])


async def test_live_batch_older_than_a_jumping_replay_is_stale_not_a_restart():
    """The replay answers from seq 5 while live seq 3 (same engine) is still queued: 3 is stale."""
    ctx = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    pub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)  # XPUB: tells when the SUB has subscribed
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router.bind(f"tcp://127.0.0.1:{replay_port}")

    def batch(n):
        return msgpack.packb([1.0, [["BlockStored", [n], None, [n], 1, None, "GPU", None]], 0])

    def live(seq, n):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), batch(n)])

    def serve():
        if router.poll(5000):
            client, _, _ = router.recv_multipart()
            assert pub.poll(5000), "the SUB never subscribed"
            assert pub.recv() == b"\x01"  # its subscription to everything: live 3 now reaches it
            live(3, 3)
            for seq in (5, 6):
                router.send_multipart([client, b"", seq.to_bytes(8, "big"), batch(seq)])
            router.send_multipart([client, b"", END_SEQ, b""])
            live(7, 7)

    t = threading.Thread(target=serve)
    t.start()
    sink = RecordingSink()
    manager = SubscriberManager(sink, SubscriberOptions(replay_timeout=2.0))
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", pub_port, replay_port, 0)])
        await until(lambda: sink.hashes() == [5, 6, 7])
        st = status(manager)
        assert sink.drops() == 1 and st["missed_batches"] == 5 and st["duplicates"] >= 1 and st["errors"] == 0
    finally:
        await manager.aclose()
        t.join()
        pub.close(0)
        router.close(0)
        ctx.term()


async def test_replies_dropped_by_the_engines_router_are_asked_again(harness):
    """vLLM's ROUTER queues 1000 replies per peer and silently drops beyond: a 3000-batch replay
    arrives with holes. The engine still holds those batches, so they are requested again."""
    make, engine = harness
    e = engine(generation="0.33")
    n = 3000
    for i in range(n):
        e.pub.publish([BlockRemoved((i,))])
    sink, manager = make(options=SubscriberOptions(replay_timeout=2.0))
    manager.sync([e.spec])
    await until(lambda: status(manager)["last_seq"] == n - 1, timeout=30)
    assert [x[4].block_hashes[0] for x in sink.log] == list(range(n))
    st = status(manager)
    assert st["missed_batches"] == 0 and sink.drops() == 0
    print(f"\nlong replay: {st['replays']} replay requests for {n} batches")


class BlackholeProxy:
    """TCP proxy whose existing connections can go silent without closing, as a crashed host does."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.dead: set[int] = set()
        self.generation = 0
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def blackhole(self) -> None:
        self.dead.add(self.generation)
        self.generation += 1

    async def _handle(self, reader, writer):
        gen = self.generation
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src, dst):
            while data := await src.read(65536):
                if gen not in self.dead:
                    dst.write(data)
                    await dst.drain()

        self.tasks += [asyncio.create_task(pipe(reader, up_writer)), asyncio.create_task(pipe(up_reader, writer))]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.server.close()


async def test_silent_dead_connection_is_detected_by_heartbeat_and_repaired(harness):
    make, engine = harness
    e = engine()
    proxy = BlackholeProxy(e.pub_port)
    port = await proxy.start()
    try:
        sink, manager = make()
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", port, e.replay_port, 0)])
        await until(lambda: status(manager)["connected"])
        # Connected, the SUB's subscription still has to cross the proxy to the engine: publish until
        # events arrive live. (Those the engine published before it had the subscription are gone: the
        # replay at connection found nothing yet, and the first live batch is where the stream starts.)
        published = 0
        while not sink.hashes():
            assert published < 200, "no event ever arrived through the proxy"
            e.publish(published)
            published += 1
            await asyncio.sleep(0.05)
        await until(lambda: sink.hashes()[-1] == published - 1)
        live = sink.hashes()
        assert live == list(range(live[0], published))
        proxy.blackhole()  # no FIN, no RST: only missing heartbeats reveal it
        e.publish(published, published + 1)
        await until(lambda: manager.metrics.disconnections.labels("p", "0")._value.get() >= 1)
        # reconnected through the proxy, the two sent into the black hole replayed
        await until(lambda: sink.hashes() == live + [published, published + 1])
        assert sink.drops() == 0
    finally:
        await proxy.close()


def test_endpoints_for_ipv4_ipv6_and_names():
    from kvcache.subscriber import tcp_endpoint

    assert tcp_endpoint("10.0.0.5", 5557) == "tcp://10.0.0.5:5557"
    assert tcp_endpoint("::1", 5558) == tcp_endpoint("[::1]", 5558) == "tcp://[::1]:5558"
    assert tcp_endpoint("engine-0.svc", 5557) == "tcp://engine-0.svc:5557"
    assert EndpointSpec("p", "m", "fd00::2", 5557, None, 1).replay_endpoint is None


def test_options_reject_bad_values():
    with pytest.raises(ValueError, match="reconnect_max"):
        SubscriberOptions(reconnect_initial=2.0, reconnect_max=1.0)
    with pytest.raises(ValueError, match="replay_timeout"):
        SubscriberOptions(replay_timeout=0)


async def test_matches_through_locked_index_while_the_ingest_thread_applies(harness):
    """The request path matches on the event loop while the ingest thread stores a growing chain:
    every match sees a whole prefix of it (never less than before), and finally all of it."""
    from kvcache.index import PrefixIndex
    from kvcache.subscriber import LockedIndex

    make, engine = harness
    e = engine(generation="0.33", hwm=1_000_000)
    index = PrefixIndex(max_entries=100_000)
    # No dead-peer detection: on a loaded machine (CI runs two suites and the sanitizer on two cores) a
    # heartbeat timeout would reconnect, and a reconnection that cannot prove continuity drops the pod's
    # blocks until the replay: a legitimate dip this test is not about.
    _, manager = make(sink=index, options=dataclasses.replace(FAST, heartbeat_interval=0))
    shared = LockedIndex(index, manager.lock)
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    n, bs, chunk = 1500, 4, 100
    tokens = list(range(n * bs))
    # The chain goes out in chunks, each once the request path has seen the one before: matches then
    # see it grow whatever the machine's load (a flood sent all at once could land before any match).
    seen_chunk = [threading.Event() for _ in range(n // chunk)]

    def flood():
        for c, seen_it in enumerate(seen_chunk):
            for i in range(c * chunk, (c + 1) * chunk):
                e.pub.publish([BlockStored((i + 1,), i or None, tuple(tokens[i * bs:(i + 1) * bs]), bs, None, "GPU",
                                           None)])
            if not seen_it.wait(30):
                return

    publishing = asyncio.ensure_future(asyncio.to_thread(flood))
    seen = [0]
    deadline = time.monotonic() + 30
    while seen[-1] < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"the chain never completed: {seen[-1]} of {n} blocks")
        m = shared.match("m", None, tokens, ["p"]).get("p")
        seen.append(m.blocks if m is not None else 0)
        for c in range(seen[-1] // chunk):
            seen_chunk[c].set()
        await asyncio.sleep(0.001)
    await publishing
    assert all(a <= b for a, b in zip(seen, seen[1:])), ("a match saw less of the chain than an earlier one",
                                                          status(manager))
    assert len(set(seen)) > 2  # matches really ran while the chain grew


async def test_batches_published_before_the_subscription_took_hold_are_replayed():
    """The engine held nothing when asked at connection; it then published seqs 0 and 1 before the
    SUB's subscription reached its PUB (so they went nowhere live). The first live batch, seq 2,
    reveals them: they are replayed, in order, before it."""
    ctx = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    pub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)  # XPUB: tells when the SUB has subscribed
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    held: list[tuple[int, bytes]] = []

    def batch(n):
        return msgpack.packb([1.0, [["BlockStored", [n], None, [n], 1, None, "GPU", None]], 0])

    def answer(client, start):
        for seq, payload in held:
            if seq >= start:
                router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        router.send_multipart([client, b"", END_SEQ, b""])

    def serve():
        assert router.poll(5000), "no replay request at connection"
        client, _, start = router.recv_multipart()
        answer(client, int.from_bytes(start, "big"))  # nothing held yet
        held.extend((n, batch(n)) for n in (0, 1))  # published while nobody was subscribed
        assert pub.poll(5000), "the SUB never subscribed"
        assert pub.recv() == b"\x01"
        held.append((2, batch(2)))
        pub.send_multipart([b"", (2).to_bytes(8, "big"), held[-1][1]])
        while router.poll(3000):  # the repair
            client, _, start = router.recv_multipart()
            answer(client, int.from_bytes(start, "big"))

    t = threading.Thread(target=serve)
    t.start()
    sink = RecordingSink()
    manager = SubscriberManager(sink, SubscriberOptions(replay_timeout=2.0))
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", pub_port, replay_port, 0)])
        await until(lambda: status(manager)["last_seq"] == 2)
        assert sink.hashes() == [0, 1, 2]
        st = status(manager)
        assert st["missed_batches"] == 0 and sink.drops() == 0
    finally:
        await manager.aclose()
        t.join()
        pub.close(0)
        router.close(0)
        ctx.term()


async def test_an_unanswered_replay_does_not_hold_other_engines_batches(harness):
    """Engine a's replay port never answers (its replay at connection waits out the timeout); engine b's
    live batches are applied meanwhile, not after it."""
    make, engine = harness
    a, b = engine(replay=False, pod="a"), engine(pod="b")
    silent = EndpointSpec("a", "m", "127.0.0.1", a.pub_port, free_port(), 0)  # nothing answers there
    sink, manager = make(options=SubscriberOptions(replay_timeout=4.0, reconnect_initial=0.05, reconnect_max=0.2))
    manager.sync([silent, b.spec])
    await until(lambda: all(s["connected"] for s in manager.status()))
    b.publish(1, 2)
    await until(lambda: sink.hashes("b") == [1, 2])
    a_status = next(s for s in manager.status() if s["pod"] == "a")
    assert a_status["replays"] == 1 and a_status["replay_failures"] == 0  # a's replay still under way


async def test_a_hanging_name_lookup_holds_back_no_other_engine(harness, monkeypatch):
    """Endpoints named by host name are resolved off the ingest thread: while one engine's lookup
    hangs (a dead DNS server takes seconds per try), the other engines' batches keep arriving, and
    the named engine follows once its name resolves."""
    make, engine = harness
    named, plain = engine(pod="named", replay=False), engine(pod="plain")
    release = threading.Event()
    real = socket.getaddrinfo

    def lookup(host, *args, **kwargs):  # a name server that answers only when released
        if host == "engine.kvgate.test" and not kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            release.wait(20)
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    plain.publish(0, 1)
    sink, manager = make()
    manager.sync([dataclasses.replace(named.spec, host="engine.kvgate.test"), plain.spec])  # the named one first
    try:
        await until(lambda: sink.hashes("plain") == [0, 1])
        assert not status(manager, pod="named")["connected"]
    finally:
        release.set()
    await until(lambda: status(manager, pod="named")["connected"])
    await subscribed(named, manager, pod="named")
    probes = len(sink.hashes("named"))
    named.publish(5)
    await until(lambda: sink.hashes("named")[probes:] == [5])


def _chain_batch(i: int) -> list[BlockStored]:
    """Batch i of one chain of blocks of 2 tokens (the probes' block size): block 10_000 + i."""
    return [BlockStored((10_000 + i,), 10_000 + i - 1 if i else None, (2 * i, 2 * i + 1), 2, None, "GPU", None)]


class CountingIndex(PrefixIndex):
    """A PrefixIndex that records how many batches each apply_run call took."""

    def __init__(self) -> None:
        super().__init__(max_entries=100_000)
        self.runs: list[int] = []

    def apply_run(self, *args):
        r = super().apply_run(*args)
        self.runs.append(r.batches)
        return r


async def test_in_order_batches_are_applied_in_runs_and_each_one_counted(harness):
    """Live batches that continue the stream are applied many per native call (apply_run); those it
    declines (a new medium, a new LoRA adapter) take the per-batch path in their place; every batch is
    applied once, in order, and counted once in the status, the batch, event and processing metrics."""
    make, engine = harness
    e = engine(generation="0.33", hwm=1_000_000)
    index = CountingIndex()
    _, manager = make(sink=index)
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    first = await subscribed(e, manager)
    reg = manager.metrics.registry

    def received(source: str) -> float:
        return reg.get_sample_value("kvgate_kvevents_batches_received_total",
                                    {"pod": "p", "rank": "0", "source": source}) or 0.0

    # The probes' counts flushed (with the processing histogram): the baseline for the run's batches. (A
    # probe may have come by replay, and a replay at connection may repeat an applied batch: the received
    # counts of the probes need not equal the applied ones; the run's batches all come live.)
    await until(lambda: reg.get_sample_value("kvgate_kvevents_processing_seconds_count") == status(manager)["batches"])
    live0, batches0 = received("live"), status(manager)["batches"]
    n = 300
    extra = {100: BlockStored((1,), None, (7, 7), 2, None, "CPU", None),  # a medium the index learns then
             200: BlockStored((2,), None, (8, 8), 2, None, "GPU", "a"),  # a LoRA adapter met for the first time
             250: BlockStored((3,), None, (9, 9), 2, None, "GPU", "a")}  # ... and again: a run takes it

    def publish() -> None:
        for i in range(n):
            e.pub.publish(_chain_batch(i) + ([extra[i]] if i in extra else []))

    await asyncio.to_thread(publish)
    await until(lambda: status(manager)["last_seq"] == first + n - 1)
    batches = status(manager)["batches"]
    assert index.match("m", None, [t for i in range(n) for t in (2 * i, 2 * i + 1)], ["p"])["p"].blocks == n
    assert index.match("m", None, [7, 7], ["p"])["p"].by_medium == {"CPU": 1}
    assert index.match("m", "a", [8, 8], ["p"])["p"].blocks == 1 and index.match("m", "a", [9, 9], ["p"])["p"].blocks == 1
    assert status(manager)["events"] == batches + len(extra) and status(manager)["drops"] == 0
    await until(lambda: reg.get_sample_value("kvgate_kvevents_processing_seconds_count") == batches)
    assert batches - batches0 == n and received("live") - live0 == n  # each run batch applied and counted once
    assert reg.get_sample_value("kvgate_kvevents_events_applied_total", {"type": "BlockStored"}) == batches + len(extra)
    assert sum(index.runs) >= n - 10 and max(index.runs) > 1, index.runs


class PartsIndex(PrefixIndex):
    """A PrefixIndex that records the blocks of each apply_payload call and whether the lock was held."""

    def __init__(self, lock_of) -> None:
        super().__init__(max_entries=100_000)
        self.lock_of = lock_of
        self.calls: list[tuple[int, bool]] = []
        self.intervals: list[float] = []

    def apply_payload(self, pod, model, rank, payload):
        scan = native.scan_batch(payload)
        self.calls.append((scan[1] + scan[3] if scan else -1, self.lock_of().locked()))
        self.intervals.append(sys.getswitchinterval())
        return super().apply_payload(pod, model, rank, payload)


async def test_a_large_live_batch_is_applied_in_parts_one_hold_of_the_lock_each(harness):
    """A batch above SubscriberOptions.apply_blocks leaves the run (apply_run stops before it) and is cut
    between its events (split_payload): each part one apply_payload under the lock, released between
    two so the request path's matches interleave; the index ends up holding the whole batch."""
    make, engine = harness
    before = sys.getswitchinterval()
    e = engine(generation="0.33", hwm=1_000_000)
    manager_box: list = []
    index = PartsIndex(lambda: manager_box[0].lock._lock)
    _, manager = make(sink=index, options=dataclasses.replace(FAST, apply_blocks=50))
    manager_box.append(manager)
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    first = await subscribed(e, manager)
    index.calls.clear()
    # one batch of 30 stores of 10 blocks each, one chain: 300 blocks
    big = [BlockStored(tuple(range(20_000 + 10 * i, 20_010 + 10 * i)), 20_000 + 10 * i - 1 if i else None,
                       tuple(range(20 * i, 20 * i + 20)), 2, None, "GPU", None) for i in range(30)]
    await asyncio.to_thread(e.pub.publish, big)
    await until(lambda: status(manager)["last_seq"] == first)
    assert [b for b, _ in index.calls] == [50] * 6 and all(held for _, held in index.calls), index.calls
    assert index.match("m", None, list(range(600)), ["p"])["p"].blocks == 300
    assert status(manager)["events"] >= 30 and status(manager)["drops"] == 0
    # applied with the GIL handed over quickly (GilHandOver); the process's own interval back once idle
    assert all(abs(i - GIL_SWITCH_INTERVAL_S) < 1e-9 for i in index.intervals), index.intervals
    await until(lambda: sys.getswitchinterval() == before)


def test_gil_hand_over_holds_the_short_interval_while_any_thread_is_inside():
    """Two threads, each with its own GilHandOver (two managers in one process), overlapping: the short
    interval holds until the last one leaves, then the process's own is back."""
    before = sys.getswitchinterval()
    hand_over = GilHandOver()
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with GilHandOver():
            entered.set()
            leave.wait(5)

    with hand_over:
        assert abs(sys.getswitchinterval() - GIL_SWITCH_INTERVAL_S) < 1e-9 < before
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(5)
    assert abs(sys.getswitchinterval() - GIL_SWITCH_INTERVAL_S) < 1e-9  # the other thread is still inside
    leave.set()
    thread.join()
    assert sys.getswitchinterval() == before


async def test_a_batch_failing_inside_a_run_is_counted_and_state_dropped(harness):
    make, engine = harness
    e = engine(generation="0.33", hwm=1_000_000)
    index = CountingIndex()
    fail = {"seq": -1}
    real = index.apply_run

    def apply_run(pod, model, rank, messages, start, seq, max_batches, *rest):
        f = fail["seq"]
        if seq == f:
            fail["seq"] = -1
            return RunApplied(0, 0, 0, 0.0, RuntimeError("index full"))
        if seq < f < seq + max_batches:
            max_batches = f - seq  # the run stops right before the failing batch
        return real(pod, model, rank, messages, start, seq, max_batches, *rest)

    index.apply_run = apply_run
    _, manager = make(sink=index)
    manager.sync([e.spec])
    await until(lambda: status(manager)["connected"])
    first = await subscribed(e, manager)
    fail["seq"] = first + 20

    def publish() -> None:
        for i in range(60):
            e.pub.publish(_chain_batch(i))

    await asyncio.to_thread(publish)
    await until(lambda: status(manager)["last_seq"] == first + 59)
    s = status(manager)
    assert fail["seq"] == -1 and s["drops"] == 1 and s["errors"] == 1
    assert manager.metrics.registry.get_sample_value("kvgate_kvevents_state_drops_total",
                                                     {"pod": "p", "rank": "0", "reason": "sink_error"}) == 1
    # the failed batch counts as received, not as applied; what followed it is applied
    assert s["batches"] == first + 60 and s["events"] == first + 59
    tokens = [t for i in range(60) for t in (2 * i, 2 * i + 1)]
    assert index.match("m", None, tokens, ["p"])["p"].blocks == 0  # the chain's start went with the drop
