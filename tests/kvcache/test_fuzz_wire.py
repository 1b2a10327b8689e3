"""The KV event decoder against bad input: at least 100k mutated and random payloads.

A seeded mutation loop over valid payloads of every vLLM generation (byte flips, inserts,
deletes, truncations, splices, structure-aware value swaps) plus random bytes: every payload
either decodes (and then feeds a PrefixIndex without raising) or raises WireError; nothing
else, nothing slow. Rejections are counted by kind; end to end over real ZMQ, every undecodable
batch and every skipped event shows up in kvgate_kvevents_* metrics.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import msgpack
import pytest

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcache.index import PrefixIndex
from kvcache.metrics import KVEventMetrics
from kvcache.publisher import EventPublisher
from kvcache.ingest import SubscriberManager
from kvcache.stream import EndpointSpec, SubscriberOptions
from kvcache.wire import GENERATIONS, WireError, decode_batch, encode_batch
from helpers import free_port

from eventcut import merged

TOTAL = 100_000
SEED = 20261129


def _valid_batch(rng: random.Random) -> EventBatch:
    events = []
    for _ in range(rng.randint(0, 6)):
        kind = rng.random()
        n = rng.randint(1, 3)
        hashes = tuple(rng.choice((rng.getrandbits(64), -rng.getrandbits(63), rng.randbytes(32))) for _ in range(n))
        if kind < 0.6:
            bs = 16
            events.append(BlockStored(hashes, rng.choice((None, rng.getrandbits(64))),
                                      tuple(rng.randrange(50_000) for _ in range(n * bs)), bs,
                                      rng.choice((None, 1)), rng.choice((None, "GPU", "CPU")),
                                      rng.choice((None, "adapter"))))
        elif kind < 0.9:
            events.append(BlockRemoved(hashes, rng.choice((None, "GPU", "CPU"))))
        else:
            events.append(AllBlocksCleared())
    return EventBatch(rng.random() * 1e9, tuple(events), rng.choice((None, 0, 3)))


_WEIRD = (None, True, -1, 2**64 - 1, -2**63, 0.5, float("nan"), "", "BlockStored", "x" * 300, b"\x00" * 40,
          [], {}, [[[]]], {"type": "BlockStored"}, {1: 2}, ["BlockRemoved"], [None] * 12)


def _swap_values(obj, rng: random.Random):
    """Structure-aware mutation: replace one nested value with a weird one, or drop or add an item."""
    if isinstance(obj, (list, tuple)):
        obj = list(obj)
        if obj and rng.random() < 0.7:
            i = rng.randrange(len(obj))
            obj[i] = _swap_values(obj[i], rng) if rng.random() < 0.6 else rng.choice(_WEIRD)
        elif obj and rng.random() < 0.5:
            del obj[rng.randrange(len(obj))]
        else:
            obj.append(rng.choice(_WEIRD))
        return obj
    if isinstance(obj, dict):
        obj = dict(obj)
        if obj and rng.random() < 0.7:
            k = rng.choice(list(obj))
            obj[k] = _swap_values(obj[k], rng) if rng.random() < 0.6 else rng.choice(_WEIRD)
        elif obj and rng.random() < 0.5:
            del obj[rng.choice(list(obj))]
        else:
            obj[rng.choice(("extra", "type", "block_hashes", 7))] = rng.choice(_WEIRD)
        return obj
    return rng.choice(_WEIRD)


def _mutate(payload: bytes, corpus: list[bytes], rng: random.Random) -> tuple[str, bytes]:
    b = bytearray(payload)
    op = rng.randrange(8)
    if op == 0 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return "bitflip", bytes(b)
    if op == 1:
        i = rng.randrange(len(b) + 1)
        return "insert", bytes(b[:i] + rng.randbytes(rng.randint(1, 8)) + b[i:])
    if op == 2 and b:
        i = rng.randrange(len(b))
        return "delete", bytes(b[:i] + b[i + rng.randint(1, 8):])
    if op == 3:
        return "truncate", bytes(b[:rng.randrange(len(b) + 1)])
    if op == 4:
        other = rng.choice(corpus)
        return "splice", bytes(b[:rng.randrange(len(b) + 1)] + other[rng.randrange(len(other) + 1):])
    if op == 5 and b:  # overwrite a byte with a msgpack type marker (lengths, containers, ext types)
        b[rng.randrange(len(b))] = rng.choice((0xC1, 0xC4, 0xC7, 0xD4, 0xD9, 0xDC, 0xDD, 0xDE, 0xDF, 0x9F, 0x8F))
        return "marker", bytes(b)
    if op == 6:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        return "structure", msgpack.packb(_swap_values(obj, rng), use_bin_type=True)
    return "random", rng.randbytes(rng.randint(0, 200))


def test_decoder_survives_100k_mutated_and_random_payloads(record_property):
    rng = random.Random(SEED)
    corpus = [encode_batch(_valid_batch(rng), g) for g in GENERATIONS for _ in range(60)]
    outcomes: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    index = PrefixIndex(max_entries=50_000)
    slowest = 0.0
    started = time.perf_counter()
    for i in range(TOTAL):
        op, payload = _mutate(corpus[i % len(corpus)], corpus, rng)
        t0 = time.perf_counter()
        try:
            decoded = decode_batch(payload)
        except WireError:
            outcomes["rejected"] += 1
        else:
            outcomes["decoded"] += 1
            skipped.update(decoded.skipped)
            # Whatever the decoder lets through must not break the index either.
            index.apply(f"p{i % 3}", "m", 0, decoded.batch.events)
        slowest = max(slowest, time.perf_counter() - t0)
        outcomes[op] += 1
    elapsed = time.perf_counter() - started
    index.match("m", None, list(range(64)), ["p0", "p1", "p2"])
    numbers = {"payloads": TOTAL, "seconds": round(elapsed, 2), "slowest_ms": round(slowest * 1e3, 3),
               **outcomes, **{f"skipped_{k}": v for k, v in skipped.items()}}
    for k, v in numbers.items():
        record_property(k, v)
    print(f"\nFUZZ-WIRE {numbers}")
    assert outcomes["decoded"] + outcomes["rejected"] == TOTAL
    # The mix really exercises both paths and every skip reason.
    assert outcomes["rejected"] > TOTAL // 20 and outcomes["decoded"] > TOTAL // 10
    assert {"unknown_tag", "unknown_field", "malformed_event"} <= set(skipped)
    assert slowest < 1.0, "one payload took a second: a hang in the making"


@pytest.mark.timeout(60)
async def test_every_rejection_is_counted_end_to_end_over_zmq():
    """Mutated payloads published on a real PUB socket: kvgate's subscriber counts each undecodable
    batch (errors{type=decode}) and each skipped event (events_skipped{reason}), and stays up."""
    rng = random.Random(SEED + 1)
    corpus = [encode_batch(_valid_batch(rng), g) for g in GENERATIONS for _ in range(20)]
    payloads = [_mutate(corpus[i % len(corpus)], corpus, rng)[1] for i in range(2000)]
    expect_rejected = 0
    expect_skipped: Counter[str] = Counter()
    for p in payloads:
        try:
            expect_skipped.update(decode_batch(p).skipped)
        except WireError:
            expect_rejected += 1
    pub_port, replay_port = free_port(), free_port()
    publisher = EventPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", buffer_steps=4000)
    metrics = KVEventMetrics()
    index = PrefixIndex()
    manager = SubscriberManager(index, SubscriberOptions(replay_timeout=0.5, reconnect_initial=0.05,
                                                         reconnect_max=0.2), metrics)
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", pub_port, replay_port)])
        for _ in range(200):
            if manager.status()[0]["connected"]:
                break
            await asyncio.sleep(0.02)
        for p in payloads:
            publisher.publish_payload(p)
        publisher.publish([BlockStored((1,), None, tuple(range(16)), 16, None, "GPU", None)])  # a good one last

        def value(name, **labels):
            return metrics.registry.get_sample_value(name, labels) or 0.0

        deadline = time.monotonic() + 30
        while manager.status()[0]["last_seq"] != len(payloads) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        status = manager.status()[0]
        assert status["last_seq"] == len(payloads), status
        assert value("kvgate_kvevents_errors_total", type="decode") == expect_rejected
        for reason, n in expect_skipped.items():
            assert value("kvgate_kvevents_events_skipped_total", reason=reason) == n, reason
        assert status["drops"] == 0 and status["connected"]
        assert index.match("m", None, list(range(16)), ["p"])["p"].blocks == 1
    finally:
        await manager.aclose()
        publisher.close()


def _fast_shape_batch(rng: random.Random, hashes_seen: list[int]) -> EventBatch:
    """Batches in the native fast path's shape (int or bytes hashes, one medium, LoRA or not), chained on
    earlier blocks so that stores and removals really land."""
    events = []
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, 3)
        hashes = tuple(rng.choice((rng.getrandbits(64), -rng.getrandbits(63), rng.randbytes(32))) for _ in range(n))
        if rng.random() < 0.6 or not hashes_seen:
            parent = rng.choice(hashes_seen) if hashes_seen and rng.random() < 0.5 else None
            lora_id, lora_name = rng.choice(((None, None), (None, "adapter"), (3, None)))
            events.append(BlockStored(hashes, parent, tuple(rng.randrange(3) for _ in range(n * 4)), 4,
                                      lora_id, rng.choice((None, "GPU")), lora_name))
            hashes_seen.extend(hashes)
        else:
            events.append(BlockRemoved(tuple(rng.choice(hashes_seen) for _ in range(n)), rng.choice((None, "GPU"))))
    return EventBatch(rng.random() * 1e9, tuple(events), rng.choice((None, 0)))


def _logical(stats: dict) -> dict:
    """stats() without the tables' sizes: the two paths grow their tables at different moments."""
    return {k: v for k, v in stats.items() if k != "table_bytes"}


def test_native_batch_path_agrees_with_decoder_on_30k_mutated_payloads():
    """apply_payload (one native pass over the bytes) either declines a payload or leaves the index
    exactly as decode_batch + apply would: same stats, same matches. Never accepts what the decoder
    rejects."""
    rng = random.Random(SEED + 1)
    seen: list = []
    corpus = [encode_batch(_fast_shape_batch(rng, seen), g) for g in GENERATIONS for _ in range(80)]
    native, general = PrefixIndex(max_entries=2_000), PrefixIndex(max_entries=2_000)
    taken: Counter[str] = Counter()
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(4, 40))] for _ in range(20)]
    for i in range(30_000):
        # intact batches must take the native path while the index has few media (mutations invent
        # medium names; beyond 8 media tables every batch takes the general path)
        intact = i % 3 == 0 and len(native.stats()["keys_by_medium"]) <= 8
        payload = corpus[i % len(corpus)] if intact else _mutate(corpus[i % len(corpus)], corpus, rng)[1]
        pod = f"p{i % 3}"
        try:
            decoded = decode_batch(payload)
        except WireError:
            decoded = None
        done = native.apply_payload(pod, "m", 0, payload)
        if done is None:
            taken["declined"] += 1
            taken["intact_declined"] += intact
            if decoded is not None:
                native.apply(pod, "m", 0, decoded.batch.events)
        else:
            taken["native"] += 1
            taken["intact_native"] += intact
            assert decoded is not None, payload  # the native path never accepts what the decoder rejects
            assert not decoded.skipped, (payload, decoded.skipped)
            assert (done.stored, done.removed) == (
                sum(type(e) is BlockStored for e in decoded.batch.events),
                sum(type(e) is BlockRemoved for e in decoded.batch.events))
        if decoded is not None:
            general.apply(pod, "m", 0, decoded.batch.events)
        if i % 500 == 499:
            assert _logical(native.stats()) == _logical(general.stats()), i
            for p in prompts:
                for lora in (None, "adapter", "#lora_id=3"):
                    assert native.match("m", lora, p, ["p0", "p1", "p2"]) == general.match("m", lora, p, ["p0", "p1", "p2"])
    assert _logical(native.stats()) == _logical(general.stats())
    print(f"\nNATIVE-FUZZ {dict(taken)}")
    assert taken["intact_native"] > 5 * taken["intact_declined"] and taken["declined"] > 10_000, taken


def test_native_runs_agree_with_batch_by_batch_on_mutated_payloads():
    """apply_run over bursts of intact and mutated payloads takes only batches apply_payload would
    take, stops before the others (applied one by one here), and leaves the index exactly as applying
    every batch one by one does: same stats, same matches."""
    from array import array

    from kvcache.native import native as _native

    rng = random.Random(SEED + 2)
    seen: list = []
    corpus = [encode_batch(_fast_shape_batch(rng, seen), g) for g in GENERATIONS for _ in range(80)]
    runs, single = PrefixIndex(max_entries=2_000), PrefixIndex(max_entries=2_000)
    bounds, counts = array("d", (1e-4,)), array("q", bytes(16))
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(4, 40))] for _ in range(20)]
    taken = Counter()

    def one(ix: PrefixIndex, pod: str, payload: bytes) -> None:
        if ix.apply_payload(pod, "m", 0, payload) is None:
            try:
                ix.apply(pod, "m", 0, decode_batch(payload).batch.events)
            except WireError:
                pass

    for burst in range(3_000):
        pod = f"p{burst % 3}"
        messages = [(1000 + j, corpus[rng.randrange(len(corpus))] if rng.random() < 0.7
                     else _mutate(corpus[rng.randrange(len(corpus))], corpus, rng)[1]) for j in range(rng.randint(1, 8))]
        i = 0
        while i < len(messages):
            r = runs.apply_run(pod, "m", 0, messages, i, messages[i][0], 4, 16, bounds, counts)
            assert r.error is None
            for _seq, payload in messages[i:i + r.batches]:
                assert _native.scan_batch(payload) is not None, payload
            taken["run"] += r.batches
            i += r.batches
            if not r.batches:
                one(runs, pod, messages[i][1])
                taken["single"] += 1
                i += 1
        for _, payload in messages:
            one(single, pod, payload)
        if burst % 300 == 299:
            assert _logical(runs.stats()) == _logical(single.stats()), burst
            for p in prompts:
                for lora in (None, "adapter", "#lora_id=3"):
                    assert runs.match("m", lora, p, ["p0", "p1", "p2"]) == single.match("m", lora, p, ["p0", "p1", "p2"])
    assert _logical(runs.stats()) == _logical(single.stats())
    # both paths exercised (a mutation that makes a store of another group or kind sends the model's later
    # batches down the general path: kvcache.index, several groups)
    assert sum(counts) == taken["run"] and taken["run"] > 1000 and taken["single"] > 1000, taken


def test_split_batch_cuts_only_what_the_decoder_reads_the_same_on_20k_mutated_payloads():
    """split_batch on mangled bytes: declines, or gives parts the native path takes whose events, in
    order (a cut event's pieces joined back), are the ones the decoder reads from the whole (same
    timestamp and rank in each part)."""
    from kvcache.native import native as _native

    rng = random.Random(SEED + 3)
    seen: list = []
    corpus = [encode_batch(_fast_shape_batch(rng, seen), g) for g in GENERATIONS for _ in range(80)]
    taken: Counter[str] = Counter()
    for i in range(20_000):
        payload = corpus[i % len(corpus)] if i % 3 == 0 else _mutate(corpus[i % len(corpus)], corpus, rng)[1]
        parts = _native.split_batch(payload, rng.choice((1, 2, 5)))
        if parts is None:
            taken["declined"] += 1
            continue
        taken["split"] += 1
        whole = decode_batch(payload).batch  # never splits what the decoder rejects
        decoded = [decode_batch(p).batch for p in parts]
        assert merged([e for d in decoded for e in d.events]) == merged(whole.events), payload
        same = {(repr(d.ts), d.data_parallel_rank) for d in decoded}  # repr: a NaN timestamp is one too
        assert same == {(repr(whole.ts), whole.data_parallel_rank)}
        assert all(_native.scan_batch(p) is not None for p in parts)
    assert taken["split"] > 2_000 and taken["declined"] > 2_000, taken
