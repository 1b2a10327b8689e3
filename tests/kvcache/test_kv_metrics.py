"""Every kvgate_kvevents_ metric is actually updated by real ingestion."""
from __future__ import annotations

from bisect import bisect_left

import msgpack
from prometheus_client import CollectorRegistry, Histogram

from kvcache.metrics import PROCESSING_BOUNDS, BatchHistogram, KVEventMetrics
from kvcache.ingest import SubscriberManager
from kvcache.stream import EndpointSpec
from helpers import wait_until_async
from kv_engines import FAST, Engine, RecordingSink

EXPECTED = {
    "connections", "disconnections", "reconnect_attempts", "batches_received", "events_received", "events_applied",
    "events_skipped", "duplicate_batches", "processing_seconds", "missed_batches", "state_drops", "replay_requests",
    "replay_successes", "replay_failures", "errors", "connection_status", "last_sequence",
}


def sample_values(registry: CollectorRegistry) -> dict[str, float]:
    """Family name (without prefix) -> largest sample value (counters' _created samples excluded)."""
    out: dict[str, float] = {}
    for family in registry.collect():
        name = family.name.removeprefix("kvgate_kvevents_")
        assert name != family.name, f"{family.name} lacks the kvgate_kvevents_ prefix"
        values = [s.value for s in family.samples if not s.name.endswith("_created")]
        out[name] = max(values, default=0.0)
    return out


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value("kvgate_kvevents_" + name, labels) or 0.0


async def test_every_metric_is_updated():
    registry = CollectorRegistry()
    metrics = KVEventMetrics(registry)
    assert set(sample_values(registry)) <= EXPECTED
    sink = RecordingSink()
    manager = SubscriberManager(sink, FAST, metrics)
    e = Engine(generation="0.25", buffer_steps=3)
    live_only = Engine(replay=False, pod="q")
    try:
        manager.sync([e.spec, live_only.spec])
        await wait_until_async(lambda: all(s["connected"] for s in manager.status()))
        assert value(registry, "connection_status", pod="p", rank="0") == 1

        e.publish(1, 2)
        await wait_until_async(lambda: sink.hashes() == [1, 2])
        e.pub.resend(1)  # a duplicate
        e.pub.drop_next(1)
        e.publish(3, 4)  # gap repaired by replay
        await wait_until_async(lambda: sink.hashes() == [1, 2, 3, 4])
        e.pub.publish_payload(msgpack.packb([1.0, [["Mystery"]], 0]))  # a skipped event
        e.pub.send_raw([b"garbage"])  # a bad frame: an error
        await wait_until_async(lambda: manager.status()[0]["last_seq"] == 4)
        e.pub.drop_next(5)
        e.publish(*range(5, 11))  # seqs 5..10, 5..9 lost live, the buffer holds 8..10 only
        await wait_until_async(lambda: sink.hashes()[-3:] == [8, 9, 10])
        assert value(registry, "missed_batches_total", pod="p", rank="0") == 3

        e.pub.stop()  # disconnection, then reconnect attempts against a closed port
        await wait_until_async(lambda: value(registry, "reconnect_attempts_total", pod="p", rank="0") >= 1)
        assert value(registry, "connection_status", pod="p", rank="0") == 0
        e.pub.start()
        await wait_until_async(lambda: value(registry, "connections_total", pod="p", rank="0") >= 2)
        e.publish(20, 21)  # the restarted engine's seqs 0, 1
        await wait_until_async(lambda: sink.hashes()[-2:] == [20, 21])
        assert value(registry, "last_sequence", pod="p", rank="0") == 1

        values = sample_values(registry)
        assert set(values) == EXPECTED
        assert [name for name, v in values.items() if v <= 0] == []
        assert value(registry, "replay_failures_total", pod="q", rank="0", reason="no_endpoint") >= 1
        assert value(registry, "events_applied_total", type="BlockStored") == len(sink.hashes())
        assert value(registry, "processing_seconds_count") >= len(sink.hashes())
    finally:
        await manager.aclose()
        e.pub.close()
        live_only.pub.close()


async def test_removed_endpoint_gauges_are_forgotten():
    registry = CollectorRegistry()
    manager = SubscriberManager(RecordingSink(), FAST, KVEventMetrics(registry))
    spec = EndpointSpec("gone", "m", "127.0.0.1", 1, None, 0)
    try:
        manager.sync([spec])
        assert registry.get_sample_value("kvgate_kvevents_connection_status", {"pod": "gone", "rank": "0"}) == 0
        manager.sync([])
        assert registry.get_sample_value("kvgate_kvevents_connection_status", {"pod": "gone", "rank": "0"}) is None
    finally:
        await manager.aclose()


def test_default_registry_is_a_fresh_one():
    a, b = KVEventMetrics(), KVEventMetrics()  # no duplicate-registration error: not the global REGISTRY
    assert a.registry is not b.registry


def test_the_bulk_counted_histogram_exposes_what_prometheus_clients_own_would() -> None:
    """kvgate_kvevents_processing_seconds is counted in bulk (per-bucket counts once per flush) and exposed
    by a collector of ours: the same samples as a prometheus_client Histogram given each observation."""
    seconds = [0.0, 1e-5, 3e-5, 2e-4, 2e-4, 0.007, 0.5, 0.6, 3.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = BatchHistogram("h", "doc", PROCESSING_BOUNDS, ours)
    reference = Histogram("h", "doc", buckets=PROCESSING_BOUNDS, registry=theirs)
    counts = [0] * (len(PROCESSING_BOUNDS) + 1)
    for s in seconds[:5]:
        counts[bisect_left(PROCESSING_BOUNDS, s)] += 1
    bulk.add(counts, sum(seconds[:5]))
    for s in seconds[5:]:
        bulk.observe(s)
    for s in seconds:
        reference.observe(s)

    def samples(registry: CollectorRegistry) -> list:
        return [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples
                if not s.name.endswith("_created")]

    assert samples(ours) == samples(theirs)
    assert [s.name for m in ours.collect() for s in m.samples if s.name.endswith("_created")] == ["h_created"]
