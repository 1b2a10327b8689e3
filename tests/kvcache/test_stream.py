"""One engine's stream (kvcache.stream.Subscriber) against real ZMQ sockets and our vLLM-faithful
publisher, all generations: order, duplicates, replay, gaps, restarts, bad frames, runs of batches,
large batches in parts; the endpoint's description and the options."""
from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading

import msgpack
import pytest
import zmq

from kvcache.events import BlockRemoved, BlockStored
from kvcache.index import PrefixIndex, RunApplied
from kvcache.ingest import SubscriberManager
from kvcache.locking import GIL_SWITCH_INTERVAL_S
from kvcache.native import native
from kvcache.publisher import END_SEQ
from kvcache.stream import EndpointSpec, SubscriberOptions, tcp_endpoint
from helpers import free_port, wait_until_async
from kv_engines import counter, FAST, GENERATIONS, RecordingSink, status, subscribed


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_replays_history_then_follows_live(harness, generation):
    make, engine = harness
    e = engine(generation=generation)
    e.publish(0, 1, 2, 3)
    sink, manager = make()
    manager.sync([e.spec])
    await wait_until_async(lambda: sink.hashes() == [0, 1, 2, 3])
    e.publish(4, 5, 6)
    await wait_until_async(lambda: len(sink.hashes()) == 7)
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
    await wait_until_async(lambda: sink.hashes() == [0])  # the start replay is done: what follows is live
    e.publish(1)
    e.pub.drop_next(3)
    e.publish(2, 3, 4, 5, 6)
    e.pub.drop_next(1)
    e.publish(7, 8)
    await wait_until_async(lambda: len(sink.hashes()) == 9)
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
    await wait_until_async(lambda: sink.hashes() == [0])  # the start replay is done: what follows is live
    e.publish(1, 2)
    await wait_until_async(lambda: len(sink.hashes()) == 3)
    e.pub.drop_next(5)
    e.publish(3, 4, 5, 6, 7, 8)  # 3..7 lost live; the buffer only holds 7, 8
    await wait_until_async(lambda: len(sink.hashes()) == 5)
    assert sink.hashes() == [0, 1, 2, 7, 8]
    assert sink.drops() == 1 and sink.after_last_drop() == [7, 8]
    assert status(manager)["missed_batches"] == 4  # seqs 3..6


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_engine_restart_mid_stream(harness, generation):
    make, engine = harness
    e = engine(generation=generation)
    sink, manager = make()
    manager.sync([e.spec])
    await wait_until_async(lambda: status(manager)["connected"])
    e.publish(0, 1, 2)
    await wait_until_async(lambda: len(sink.hashes()) == 3)
    e.pub.stop()
    await wait_until_async(lambda: not status(manager)["connected"])
    e.pub.start()
    e.publish(100, 101)  # the new process starts again at seq 0
    await wait_until_async(lambda: sink.drops() == 1 and sink.after_last_drop() == [100, 101])
    e.publish(102)
    await wait_until_async(lambda: sink.after_last_drop() == [100, 101, 102])
    assert sink.drops() == 1
    assert status(manager)["last_seq"] == 2


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_restart_whose_new_stream_passes_the_old_seq_is_still_noticed(harness, generation):
    make, engine = harness
    e = engine(generation=generation)
    sink, manager = make()
    manager.sync([e.spec])
    await wait_until_async(lambda: status(manager)["connected"])
    e.publish(0, 1)
    await wait_until_async(lambda: len(sink.hashes()) == 2)
    e.pub.stop()
    await wait_until_async(lambda: not status(manager)["connected"])
    e.pub.start()
    e.publish(*range(100, 106))  # seqs 0..5 of the new process, past the old last seq 1
    await wait_until_async(lambda: sink.drops() >= 1 and len(sink.after_last_drop()) == 6)
    assert sink.after_last_drop() == list(range(100, 106))
    assert sink.drops() == 1


async def test_restart_without_replay_follows_new_stream(harness):
    make, engine = harness
    e = engine(replay=False)
    sink, manager = make()
    manager.sync([e.spec])
    await wait_until_async(lambda: status(manager)["connected"])
    # No replay: wait until batches arrive live (CI lost 0..2 when they were sent as soon as the socket
    # connected, before the engine's PUB had the subscription).
    await subscribed(e, manager)
    probes = len(sink.hashes())
    e.publish(0, 1, 2)
    await wait_until_async(lambda: sink.hashes()[probes:] == [0, 1, 2])
    e.pub.restart()
    # The SUB saw the old publisher go and is connected to the new one: a second connection, after a loss.
    await wait_until_async(lambda: counter(manager, "disconnections", pod="p", rank="0") == 1
                           and counter(manager, "connections", pod="p", rank="0") == 2 and status(manager)["connected"])

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
    await wait_until_async(lambda: status(manager)["connected"])
    # No replay here: what the engine sends before it has the subscription is lost for good, so wait
    # until batches arrive live (CI lost 1 and 2 when they were sent as soon as the socket connected).
    await subscribed(e, manager)
    probes = len(sink.hashes())
    e.publish(1, 2)
    await wait_until_async(lambda: sink.hashes()[probes:] == [1, 2])
    assert 0 not in sink.hashes()
    assert counter(manager, "replay_failures", pod="p", rank="0", reason="no_endpoint") >= 1


async def test_silent_replay_endpoint_does_not_block_live_events(harness):
    make, engine = harness
    e = engine(replay=False)
    dead = EndpointSpec("p", "m", "127.0.0.1", e.pub_port, free_port(), 0)  # nothing answers there
    sink, manager = make()
    manager.sync([dead])
    await wait_until_async(lambda: status(manager)["replay_failures"] >= 1)
    await subscribed(e, manager)  # the replay that never answers did not hold live batches back
    probes = len(sink.hashes())
    e.publish(1, 2)
    await wait_until_async(lambda: sink.hashes()[probes:] == [1, 2])
    assert status(manager)["connected"]


@pytest.mark.parametrize("generation", GENERATIONS)
async def test_garbage_is_counted_and_skipped_connection_stays_up(harness, generation, caplog):
    make, engine = harness
    e = engine(generation=generation)
    sink, manager = make()
    manager.sync([e.spec])
    await wait_until_async(lambda: status(manager)["connected"])
    first = await subscribed(e, manager)
    probes = len(sink.hashes())
    e.publish(0)
    e.pub.send_raw([b"only-two", b"frames"])
    e.pub.send_raw([b"", b"short", b"\x90"])
    e.pub.publish_payload(b"\xc1 not msgpack")  # takes seq first + 1
    e.pub.publish_payload(msgpack.packb([1.0, [["Mystery", 1], ["BlockStored", [1], None, [1], 2]], 0]))
    e.publish(3)
    await wait_until_async(lambda: status(manager)["last_seq"] == first + 3 and len(sink.hashes()) == probes + 2)
    assert sink.hashes()[probes:] == [0, 3]
    st = status(manager)
    assert st["connected"] and st["errors"] == 3 and st["missed_batches"] == 0 and sink.drops() == 0
    assert counter(manager, "errors", type="decode") == 1
    assert counter(manager, "events_skipped", reason="unknown_tag") == 1
    assert counter(manager, "events_skipped", reason="malformed_event") == 1
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
        await wait_until_async(lambda: sink.hashes() == [5])
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
    await wait_until_async(lambda: sink.hashes() == [0, 1])
    assert status(manager)["endpoint"].startswith("tcp://[::1]:")


async def test_data_parallel_ranks_are_tracked_apart(harness):
    make, engine = harness
    r0, r1 = engine(rank=0), engine(rank=1)
    sink, manager = make()
    manager.sync([r0.spec, r1.spec])
    await wait_until_async(lambda: all(s["connected"] for s in manager.status()))
    await subscribed(r0, manager, rank=0)
    await subscribed(r1, manager, rank=1)
    p0, p1 = len(sink.hashes(rank=0)), len(sink.hashes(rank=1))
    r0.publish(0, 1)
    r1.publish(10, 11)
    await wait_until_async(lambda: sink.hashes(rank=0)[p0:] == [0, 1] and sink.hashes(rank=1)[p1:] == [10, 11])
    r1.pub.stop()
    await wait_until_async(lambda: not status(manager, 1)["connected"])
    r1.pub.start()
    r1.publish(20)
    r0.publish(2)
    await wait_until_async(lambda: sink.drops(rank=1) == 1 and sink.after_last_drop(rank=1) == [20]
                and sink.hashes(rank=0)[p0:] == [0, 1, 2])
    assert sink.drops(rank=0) == 0 and sink.hashes(rank=0)[p0:] == [0, 1, 2]


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
    await wait_until_async(lambda: status(manager)["connected"])
    await subscribed(e, manager)
    probes = len(sink.hashes())
    e.publish(0, 1, 2)
    await wait_until_async(lambda: sink.hashes()[probes:] == [0, 2])
    assert sink.drops() == 1 and status(manager)["errors"] == 1


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
        await wait_until_async(lambda: sink.hashes() == [5, 6, 7])
        st = status(manager)
        assert sink.drops() == 1 and st["missed_batches"] == 5 and st["duplicates"] >= 1 and st["errors"] == 0
    finally:
        await manager.aclose()
        t.join()
        pub.close(0)
        router.close(0)
        ctx.term()


async def test_a_hole_inside_a_replay_is_asked_again():
    """vLLM's ROUTER queues 1000 replies per peer and silently drops beyond, so a replay can arrive with
    a hole the engine still holds. A replay answering 0..4, then 8, 9 is asked again from 4 (which must
    come back identical), and 5..9 are applied in order: nothing is lost or dropped."""
    ctx = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    held = {n: msgpack.packb([1.0, [["BlockStored", [n], None, [n], 1, None, "GPU", None]], 0]) for n in range(10)}
    asked: list[int] = []  # the start of each replay request
    done = threading.Event()

    def serve():
        while not done.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            start = int.from_bytes(start, "big")
            seqs = [n for n in held if n >= start and (asked or not 5 <= n < 8)]  # the first reply loses 5..7
            asked.append(start)
            for seq in seqs:
                router.send_multipart([client, b"", seq.to_bytes(8, "big"), held[seq]])
            router.send_multipart([client, b"", END_SEQ, b""])

    t = threading.Thread(target=serve)
    t.start()
    sink = RecordingSink()
    manager = SubscriberManager(sink, SubscriberOptions(replay_timeout=2.0))
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", pub_port, replay_port, 0)])
        await wait_until_async(lambda: status(manager)["last_seq"] == 9)
        assert sink.hashes() == list(range(10))
        assert asked == [0, 4]
        st = status(manager)
        assert st["replays"] == 2 and st["missed_batches"] == 0 and st["duplicates"] == 0 and sink.drops() == 0
    finally:
        done.set()
        await manager.aclose()
        t.join()
        pub.close(0)
        router.close(0)
        ctx.term()


async def test_a_replay_whose_tail_and_end_marker_were_dropped_is_asked_again():
    """A ROUTER past its queue drops the end marker with the rest of the reply: the replay answering 0..4
    and then nothing times out after progress, and is asked again from 4 (which must come back
    identical); 5..9 are applied in order, nothing lost or dropped (CI once lost 3000 batches' tail so)."""
    ctx = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    held = {n: msgpack.packb([1.0, [["BlockStored", [n], None, [n], 1, None, "GPU", None]], 0]) for n in range(10)}
    asked: list[int] = []  # the start of each replay request
    done = threading.Event()

    def serve():
        while not done.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            start = int.from_bytes(start, "big")
            first = not asked
            asked.append(start)
            for seq in (n for n in held if n >= start and not (first and n > 4)):
                router.send_multipart([client, b"", seq.to_bytes(8, "big"), held[seq]])
            if not first:  # the first reply's end marker is lost with its tail
                router.send_multipart([client, b"", END_SEQ, b""])

    t = threading.Thread(target=serve)
    t.start()
    sink = RecordingSink()
    manager = SubscriberManager(sink, SubscriberOptions(replay_timeout=0.5))
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", pub_port, replay_port, 0)])
        await wait_until_async(lambda: status(manager)["last_seq"] == 9)
        assert sink.hashes() == list(range(10))
        assert asked == [0, 4]
        st = status(manager)
        assert st["replays"] == 2 and st["missed_batches"] == 0 and st["duplicates"] == 0 and sink.drops() == 0
        assert st["replay_failures"] == 1  # the timeout, counted (and logged) though it was then repaired
    finally:
        done.set()
        await manager.aclose()
        t.join()
        pub.close(0)
        router.close(0)
        ctx.term()


async def test_a_3000_batch_replay_past_the_routers_queue_is_applied_complete_and_in_order(harness):
    """3000 batches replayed at once, three times what vLLM's ROUTER queues per peer (it drops beyond:
    whatever holes that leaves are asked again, test_a_hole_inside_a_replay_is_asked_again): each batch
    is applied once, in order, nothing lost or dropped."""
    make, engine = harness
    e = engine(generation="0.33")
    n = 3000
    for i in range(n):
        e.pub.publish([BlockRemoved((i,))])
    # 5 s without a frame before giving up on a reply (CI's four suite workers on two cores once starved
    # one for 2 s): a reply that stopped after some batches is asked again from there; one that never
    # started is not (no live batch follows here to show the gap)
    sink, manager = make(options=SubscriberOptions(replay_timeout=5.0))
    manager.sync([e.spec])
    await wait_until_async(lambda: status(manager)["last_seq"] == n - 1, timeout=60)
    assert [x[4].block_hashes[0] for x in sink.log] == list(range(n))
    st = status(manager)
    assert st["missed_batches"] == 0 and sink.drops() == 0


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
        while not done.is_set():  # the repair, and any later request, until the test is over
            if router.poll(20):
                client, _, start = router.recv_multipart()
                answer(client, int.from_bytes(start, "big"))

    done = threading.Event()
    t = threading.Thread(target=serve)
    t.start()
    sink = RecordingSink()
    manager = SubscriberManager(sink, SubscriberOptions(replay_timeout=2.0))
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", pub_port, replay_port, 0)])
        await wait_until_async(lambda: status(manager)["last_seq"] == 2)
        assert sink.hashes() == [0, 1, 2]
        st = status(manager)
        assert st["missed_batches"] == 0 and sink.drops() == 0
    finally:
        await manager.aclose()
        done.set()
        t.join()
        pub.close(0)
        router.close(0)
        ctx.term()


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
    await wait_until_async(lambda: status(manager)["connected"])
    first = await subscribed(e, manager)
    reg = manager.metrics.registry

    def received(source: str) -> float:
        return reg.get_sample_value("kvgate_kvevents_batches_received_total",
                                    {"pod": "p", "rank": "0", "source": source}) or 0.0

    # The probes' counts flushed (with the processing histogram): the baseline for the run's batches. (A
    # probe may have come by replay, and a replay at connection may repeat an applied batch: the received
    # counts of the probes need not equal the applied ones; the run's batches all come live.)
    await wait_until_async(lambda: reg.get_sample_value("kvgate_kvevents_processing_seconds_count") == status(manager)["batches"])
    live0, batches0 = received("live"), status(manager)["batches"]
    n = 300
    extra = {100: BlockStored((1,), None, (7, 7), 2, None, "CPU", None),  # a medium the index learns then
             200: BlockStored((2,), None, (8, 8), 2, None, "GPU", "a"),  # a LoRA adapter met for the first time
             250: BlockStored((3,), None, (9, 9), 2, None, "GPU", "a")}  # ... and again: a run takes it

    def publish() -> None:
        for i in range(n):
            e.pub.publish(_chain_batch(i) + ([extra[i]] if i in extra else []))

    await asyncio.to_thread(publish)
    await wait_until_async(lambda: status(manager)["last_seq"] == first + n - 1)
    batches = status(manager)["batches"]
    assert index.match("m", None, [t for i in range(n) for t in (2 * i, 2 * i + 1)], ["p"])["p"].blocks == n
    assert index.match("m", None, [7, 7], ["p"])["p"].by_medium == {"CPU": 1}
    assert index.match("m", "a", [8, 8], ["p"])["p"].blocks == 1 and index.match("m", "a", [9, 9], ["p"])["p"].blocks == 1
    assert status(manager)["events"] == batches + len(extra) and status(manager)["drops"] == 0
    await wait_until_async(lambda: reg.get_sample_value("kvgate_kvevents_processing_seconds_count") == batches)
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
    index = PartsIndex(lambda: manager_box[0].lock)
    _, manager = make(sink=index, options=dataclasses.replace(FAST, apply_blocks=50))
    manager_box.append(manager)
    manager.sync([e.spec])
    await wait_until_async(lambda: status(manager)["connected"])
    first = await subscribed(e, manager)
    index.calls.clear()
    events = status(manager)["events"]
    # one batch of 30 stores of 10 blocks each, one chain: 300 blocks
    big = [BlockStored(tuple(range(20_000 + 10 * i, 20_010 + 10 * i)), 20_000 + 10 * i - 1 if i else None,
                       tuple(range(20 * i, 20 * i + 20)), 2, None, "GPU", None) for i in range(30)]
    await asyncio.to_thread(e.pub.publish, big)
    # (last_seq moves when the batch is taken, its events count once its last part is applied)
    await wait_until_async(lambda: status(manager)["last_seq"] == first and status(manager)["events"] >= events + 30)
    assert [b for b, _ in index.calls] == [50] * 6 and all(held for _, held in index.calls), index.calls
    assert index.match("m", None, list(range(600)), ["p"])["p"].blocks == 300
    assert status(manager)["events"] >= 30 and status(manager)["drops"] == 0
    # applied with the GIL handed over quickly (GilHandOver); the process's own interval back once idle
    assert all(abs(i - GIL_SWITCH_INTERVAL_S) < 1e-9 for i in index.intervals), index.intervals
    await wait_until_async(lambda: sys.getswitchinterval() == before)


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
    await wait_until_async(lambda: status(manager)["connected"])
    first = await subscribed(e, manager)
    fail["seq"] = first + 20

    def publish() -> None:
        for i in range(60):
            e.pub.publish(_chain_batch(i))

    await asyncio.to_thread(publish)
    await wait_until_async(lambda: status(manager)["last_seq"] == first + 59)
    s = status(manager)
    assert fail["seq"] == -1 and s["drops"] == 1 and s["errors"] == 1
    assert manager.metrics.registry.get_sample_value("kvgate_kvevents_state_drops_total",
                                                     {"pod": "p", "rank": "0", "reason": "sink_error"}) == 1
    # the failed batch counts as received, not as applied; what followed it is applied
    assert s["batches"] == first + 60 and s["events"] == first + 59
    tokens = [t for i in range(60) for t in (2 * i, 2 * i + 1)]
    assert index.match("m", None, tokens, ["p"])["p"].blocks == 0  # the chain's start went with the drop


def test_endpoints_for_ipv4_ipv6_and_names():
    assert tcp_endpoint("10.0.0.5", 5557) == "tcp://10.0.0.5:5557"
    assert tcp_endpoint("::1", 5558) == tcp_endpoint("[::1]", 5558) == "tcp://[::1]:5558"
    assert tcp_endpoint("engine-0.svc", 5557) == "tcp://engine-0.svc:5557"
    assert EndpointSpec("p", "m", "fd00::2", 5557, None, 1).replay_endpoint is None


def test_options_reject_bad_values():
    with pytest.raises(ValueError, match="reconnect_max"):
        SubscriberOptions(reconnect_initial=2.0, reconnect_max=1.0)
    with pytest.raises(ValueError, match="replay_timeout"):
        SubscriberOptions(replay_timeout=0)
