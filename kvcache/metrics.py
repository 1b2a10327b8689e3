"""Prometheus metrics of KV event ingestion (prefix `kvgate_kvevents_`).

Created on the registry passed in (a fresh one by default), never the global one.
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_P = "kvgate_kvevents_"
_ENDPOINT = ("pod", "rank")
PROCESSING_BOUNDS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5)  # s, per batch


def histogram_family(name: str, documentation: str, labelnames: Sequence[str], bounds: Sequence[float],
                     series: Iterable[tuple[Sequence[str], Sequence[float], float, float]]) -> HistogramMetricFamily:
    """The samples prometheus_client's Histogram gives (_bucket, _count, _sum, _created) for histograms
    counted elsewhere: `series` holds, per child, (label values, per-bucket counts (not cumulative; the
    last above every bound), sum, creation time). plugin.metrics' lock-free histograms use it too."""
    family = HistogramMetricFamily(name, documentation, labels=labelnames)
    for values, counts, total, created in series:
        cumulative, buckets = 0.0, []
        for bound, n in zip((*bounds, float("inf")), counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(values, buckets, total)
        family.samples.append(Sample(name + "_created", dict(zip(labelnames, values)), created))
    return family


class BatchHistogram:
    """An unlabelled histogram that takes observations counted elsewhere in bulk (`add`: per-bucket
    counts and their sum, once per flush instead of once per batch), exposed through prometheus_client's
    public collector interface with the samples its own Histogram would give (_bucket, _count, _sum,
    _created)."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float],
                 registry: CollectorRegistry | None) -> None:
        self._name, self._doc = name, documentation
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()  # a scrape reads while the ingest thread adds
        if registry is not None:
            registry.register(self)

    def add(self, counts: Sequence[int], total: float) -> None:
        """Adds `counts[i]` observations to bucket i (as `bounds`, plus one above them) summing to `total`."""
        if len(counts) != len(self._counts):
            raise ValueError(f"{len(counts)} bucket counts for a histogram of {len(self._counts)} buckets")
        with self._lock:
            for i, c in enumerate(counts):
                self._counts[i] += c
            self._sum += total

    def observe(self, seconds: float) -> None:
        i = bisect_left(self.bounds, seconds)  # the first bucket whose bound is >= it, as prometheus_client's
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._doc)]

    def collect(self) -> list[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        return [histogram_family(self._name, self._doc, (), self.bounds, [((), counts, total, self._created)])]


class KVEventMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = CollectorRegistry() if registry is None else registry
        self.registry = r
        self.connections = Counter(_P + "connections", "SUB connections established", _ENDPOINT, registry=r)
        self.disconnections = Counter(_P + "disconnections", "SUB connections lost", _ENDPOINT, registry=r)
        self.reconnect_attempts = Counter(_P + "reconnect_attempts", "SUB reconnection attempts (with backoff)",
                                          _ENDPOINT, registry=r)
        self.batches_received = Counter(_P + "batches_received", "event batches received, live or replayed",
                                        ("pod", "rank", "source"), registry=r)
        self.events_received = Counter(_P + "events_received", "events decoded, by type", ("type",), registry=r)
        self.events_applied = Counter(_P + "events_applied", "events applied to the index, by type", ("type",),
                                      registry=r)
        self.events_skipped = Counter(_P + "events_skipped",
                                      "events or fields skipped while decoding (unknown tag, unknown field, malformed)",
                                      ("reason",), registry=r)
        self.duplicates = Counter(_P + "duplicate_batches", "batches received twice (live after replay) and ignored",
                                  _ENDPOINT, registry=r)
        self.processing = BatchHistogram(_P + "processing_seconds", "decode and apply time per batch",
                                         PROCESSING_BOUNDS, r)
        self.missed = Counter(_P + "missed_batches",
                              "batches (sequence numbers) lost for good: neither received nor replayable",
                              _ENDPOINT, registry=r)
        self.state_drops = Counter(_P + "state_drops", "times a rank's blocks were dropped as untrustworthy",
                                   ("pod", "rank", "reason"), registry=r)
        self.replay_requests = Counter(_P + "replay_requests", "replay requests sent", _ENDPOINT, registry=r)
        self.replay_successes = Counter(_P + "replay_successes", "replays answered up to the end marker",
                                        _ENDPOINT, registry=r)
        self.replay_failures = Counter(_P + "replay_failures", "replays that failed (no endpoint, timeout)",
                                       ("pod", "rank", "reason"), registry=r)
        self.errors = Counter(_P + "errors", "errors by type (bad frames, undecodable batches, sink failures)",
                              ("type",), registry=r)
        self.connected = Gauge(_P + "connection_status", "1 while the SUB socket is connected", _ENDPOINT,
                               registry=r)
        self.last_seq = Gauge(_P + "last_sequence", "last sequence number applied", _ENDPOINT, registry=r)

    def forget(self, pod: str, rank: int) -> None:
        """Remove the gauges of an endpoint that is no longer subscribed."""
        for gauge in (self.connected, self.last_seq):
            try:
                gauge.remove(pod, str(rank))
            except KeyError:
                pass


class IndexCollector:
    """The prefix index's own counts, read from its stats() at scrape time (prefix `kvgate_index_`):
    what it skipped, by reason (malformed or unresolved blocks, KV cache groups of a kind it does not
    model, lookahead hashing, ...), its entries, its bound (KVGATE_INDEX_MAX_ENTRIES) and the entries
    evicted to stay within it, and each model's KV cache groups as it learnt them
    (`kvgate_index_kv_cache_group_info`, 1 per group; `modelled` "false": hits there are conservative).
    A busy index (stats() raising) leaves the scrape without these samples."""

    def __init__(self, stats: Callable[[], dict], registry: CollectorRegistry | None = None) -> None:
        self._stats = stats
        if registry is not None:
            registry.register(self)

    def describe(self) -> list[Metric]:
        return []  # collected on demand: no samples at registration time

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats()
        except Exception:
            return []
        skipped = CounterMetricFamily("kvgate_index_skipped", "blocks or events the prefix index skipped, by reason",
                                      labels=("reason",))
        for reason, n in sorted(stats.get("skipped", {}).items()):
            skipped.add_metric((reason,), n)
        entries = GaugeMetricFamily("kvgate_index_entries", "(block, pod-rank, medium) entries held")
        entries.add_metric((), stats.get("entries", 0))
        bound = GaugeMetricFamily("kvgate_index_max_entries", "entries the index holds at most; the least recent "
                                  "are evicted beyond it")
        bound.add_metric((), stats.get("max_entries", 0))
        evicted = CounterMetricFamily("kvgate_index_evicted_entries", "entries evicted to stay within the bound")
        evicted.add_metric((), stats.get("evicted_entries", 0))
        groups = GaugeMetricFamily("kvgate_index_kv_cache_group_info",
                                   "KV cache groups per model as the index learnt them from events",
                                   labels=("model", "group", "kind", "rule", "block_size", "modelled"))
        for model, shape in sorted(stats.get("kv_cache_groups", {}).items()):
            for g, d in sorted(shape["groups"].items()):
                groups.add_metric((model, str(g), str(d["kind"]), d["rule"], str(d["block_size"]),
                                   "true" if d["modelled"] else "false"), 1)
        return [skipped, entries, bound, evicted, groups]
