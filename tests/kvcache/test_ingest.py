"""The ingest thread (kvcache.ingest): SubscriberManager starts and stops exactly the endpoints it is
given, changes the index in order without the caller waiting for the lock, keeps one endpoint's
trouble (a replay that never answers, a name lookup that hangs, a bug, a silent dead peer) from
holding back the others, and follows a flood complete and in order."""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading

from kvcache.events import BlockStored
from kvcache.stream import EndpointSpec, SubscriberOptions
from helpers import free_port, wait_until_async
from kv_engines import counter, status, subscribed


async def test_sync_starts_and_stops_exactly_the_given_specs(harness):
    make, engine = harness
    a, b = engine(pod="a"), engine(pod="b")
    sink, manager = make()
    manager.sync([a.spec, b.spec])
    assert sorted(s["pod"] for s in manager.status()) == ["a", "b"]
    manager.sync([b.spec])
    assert [s["pod"] for s in manager.status()] == ["b"]
    await wait_until_async(lambda: ("drop", "a", 0) in sink.log)  # nobody keeps a's state current any more
    manager.sync([b.spec])  # unchanged: keeps running
    await wait_until_async(lambda: status(manager)["connected"])
    await subscribed(b, manager, pod="b")  # a lone batch sent before the subscription took hold is lost
    probes = len(sink.hashes("b"))
    b.publish(1)
    await wait_until_async(lambda: sink.hashes("b")[probes:] == [1])


async def test_changes_wait_for_the_index_lock_on_the_ingest_thread_not_on_the_caller(harness):
    """A removed endpoint's drop, and any run_locked change, never make the caller (the event loop)
    wait for the index lock, which the ingest thread holds up to ~140 ms while a growing table is
    rehashed; they run once the lock is free, in the order posted, before a later-started subscriber's
    first batch."""
    make, engine = harness
    a = engine(pod="a")
    sink, manager = make()
    manager.sync([a.spec])
    await wait_until_async(lambda: status(manager, pod="a")["connected"])
    held, release = threading.Event(), threading.Event()
    holding = [False]  # the holder has the lock (cleared before it lets go)

    def hold() -> None:
        with manager.lock:
            holding[0] = True
            held.set()
            release.wait(10)
            holding[0] = False

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        manager.run_locked(lambda: sink.log.append(("call", "first")), "first")
        manager.sync([])  # a's drop
        manager.run_locked(lambda: sink.log.append(("call", "last")), "last")
        assert holding[0]  # none of them waited for the lock: it was never free meanwhile
        await asyncio.sleep(0.2)
        assert ("call", "first") not in sink.log  # the lock still held: nothing ran around it
    finally:
        release.set()
        holder.join(5)
    await wait_until_async(lambda: ("call", "last") in sink.log)
    # in the order posted, and no batch of a's after its drop
    assert sink.log[-3:] == [("call", "first"), ("drop", "a", 0), ("call", "last")], sink.log[-5:]


async def test_a_flood_is_applied_complete_and_in_order_while_the_event_loop_runs(harness):
    """Completeness and order under a flood (1,500 batches of 8 events, 3 events per hold of the lock),
    while the event loop keeps running beside the ingest thread: a coroutine ticking every millisecond
    sees the flood part-applied. (How late such ticks come beside ingestion is a timing figure, not a
    test's: `kvgate bench index`'s churn_loop_lag_* rows.)"""
    make, engine = harness
    e = engine(generation="0.33", hwm=1_000_000)
    sink, manager = make(options=SubscriberOptions(replay_timeout=0.3, apply_chunk=3))
    manager.sync([e.spec])
    await wait_until_async(lambda: status(manager)["connected"])
    n_batches, per_batch = 1500, 8
    total = n_batches * per_batch
    seen: list[int] = []  # events the sink held at each tick of the event loop
    stop = asyncio.Event()

    async def probe():
        while not stop.is_set():
            await asyncio.sleep(0.001)
            seen.append(len(sink.log))

    def flood():
        for b in range(n_batches):
            e.pub.publish([BlockStored((b * per_batch + i,), None, tuple(range(16)), 16) for i in range(per_batch)])

    probe_task = asyncio.create_task(probe())
    await asyncio.to_thread(flood)
    await wait_until_async(lambda: len(sink.hashes()) == total, timeout=30)
    stop.set()
    await probe_task
    assert sink.hashes() == list(range(total))
    assert sink.drops() == 0 and len(seen) > 10
    assert any(0 < n < total for n in seen), seen[::50]  # the loop ran while the flood was being applied


async def test_subscriber_bug_restarts_the_stream_from_replay(harness, monkeypatch):
    import kvcache.stream as stream_module

    real = stream_module.decode_batch
    calls = []

    def buggy_once(payload):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("bug")
        return real(payload)

    monkeypatch.setattr(stream_module, "decode_batch", buggy_once)
    make, engine = harness
    e = engine()
    sink, manager = make()
    manager.sync([e.spec])
    await wait_until_async(lambda: status(manager)["connected"])
    e.publish(0, 1, 2)
    await wait_until_async(lambda: sink.drops() == 1 and sink.after_last_drop() == [0, 1, 2])
    assert counter(manager, "errors", type="subscriber") == 1
    e.publish(3)
    await wait_until_async(lambda: sink.after_last_drop() == [0, 1, 2, 3])


async def test_an_unanswered_replay_does_not_hold_other_engines_batches(harness):
    """Engine a's replay port never answers (its replay at connection waits out the timeout); engine b's
    live batches are applied meanwhile, not after it."""
    make, engine = harness
    a, b = engine(replay=False, pod="a"), engine(pod="b")
    silent = EndpointSpec("a", "m", "127.0.0.1", a.pub_port, free_port(), 0)  # nothing answers there
    sink, manager = make(options=SubscriberOptions(replay_timeout=4.0, reconnect_initial=0.05, reconnect_max=0.2))
    manager.sync([silent, b.spec])
    await wait_until_async(lambda: all(s["connected"] for s in manager.status()))
    b.publish(1, 2)
    await wait_until_async(lambda: sink.hashes("b") == [1, 2])
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
        await wait_until_async(lambda: sink.hashes("plain") == [0, 1])
        assert not status(manager, pod="named")["connected"]
    finally:
        release.set()
    await wait_until_async(lambda: status(manager, pod="named")["connected"])
    await subscribed(named, manager, pod="named")
    probes = len(sink.hashes("named"))
    named.publish(5)
    await wait_until_async(lambda: sink.hashes("named")[probes:] == [5])


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
        await wait_until_async(lambda: status(manager)["connected"])
        # Connected, the SUB's subscription still has to cross the proxy to the engine: publish until
        # events arrive live. (Those the engine published before it had the subscription are gone: the
        # replay at connection found nothing yet, and the first live batch is where the stream starts.)
        published = 0
        while not sink.hashes():
            assert published < 200, "no event ever arrived through the proxy"
            e.publish(published)
            published += 1
            await asyncio.sleep(0.05)
        await wait_until_async(lambda: sink.hashes()[-1] == published - 1)
        live = sink.hashes()
        assert live == list(range(live[0], published))
        proxy.blackhole()  # no FIN, no RST: only missing heartbeats reveal it
        e.publish(published, published + 1)
        await wait_until_async(lambda: counter(manager, "disconnections", pod="p", rank="0") >= 1)
        # reconnected through the proxy, the two sent into the black hole replayed
        await wait_until_async(lambda: sink.hashes() == live + [published, published + 1])
        assert sink.drops() == 0
    finally:
        await proxy.close()
