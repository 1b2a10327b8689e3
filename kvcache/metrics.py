"""Prometheus metrics of KV event ingestion (prefix `kvgate_kvevents_`).

Created on the registry passed in (a fresh one by default), never the global one.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_P = "kvgate_kvevents_"
_ENDPOINT = ("pod", "rank")


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
        self.processing = Histogram(_P + "processing_seconds", "decode and apply time per batch", registry=r,
                                    buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5))
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
