"""Prometheus metrics of the routing layer, created on a registry the caller passes."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.decisions = Counter("kvgate_routing_decisions_total", "Pods picked, by strategy.",
                                 ["strategy"], registry=r)
        self.guard_excluded = Counter("kvgate_routing_load_guard_excluded_total",
                                      "Candidate pods set aside by the load guard.", ["strategy"], registry=r)
        self.scorer_errors = Counter("kvgate_routing_scorer_errors_total",
                                     "Scorer failures (the scorer counted 0 for that request).", ["scorer"],
                                     registry=r)
        self.index_busy = Counter("kvgate_routing_index_busy_total",
                                  "Prefix index reads given up after waiting for the event ingestion (a growing "
                                  "table being rehashed): the request was routed as if no pod held its prompt.",
                                  registry=r)
        self.discovery_errors = Counter("kvgate_discovery_errors_total",
                                        "Pod lists rejected or watch failures; the last good list is kept.",
                                        ["source"], registry=r)
        self.discovery_pods = Gauge("kvgate_discovery_pods", "Pods known to discovery.", registry=r)
        self.redis_errors = Counter("kvgate_counts_redis_errors_total",
                                    "Redis operations of the shared running counts that failed.", ["op"],
                                    registry=r)
        self.redis_up = Gauge("kvgate_counts_redis_up",
                              "1 while the shared running counts reach Redis, 0 when local only.", registry=r)
        self.sessions = Counter("kvgate_routing_session_total",
                                "Requests with a session, by what session affinity did: kept (its pod preferred and "
                                "picked), overruled (preferred, another picked), new, unavailable (its pod down, not "
                                "ready or set aside: no preference), saturated (its pod saturated: no preference).",
                                ["outcome"], registry=r)
        self.scrape_errors = Counter("kvgate_engine_metrics_scrape_errors_total",
                                     "Failed scrapes of an engine's /metrics.", registry=r)


class AdmissionCollector:
    """Admission (KVGATE_ADMISSION_MAX_RUNNING) as it went, read from Admission.stats() at scrape time:
    requests by outcome, those waiting now, the seconds waited (a wait adds to the request's time to
    first token: their rate over the rate of every outcome but at_once is the mean wait), the limiter's
    failures and the limit."""

    def __init__(self, stats: Callable[[], dict], max_running: int, registry: CollectorRegistry | None = None) -> None:
        self._stats = stats
        self._max_running = max_running
        if registry is not None:
            registry.register(self)

    def describe(self) -> list[Metric]:
        return []  # collected on demand: no samples at registration time

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        outcomes = CounterMetricFamily(
            "kvgate_admission_requests", "Requests through admission, by outcome: at_once (a pod had room), "
            "after_wait (admitted after waiting in its model's queue), timed_out (answered 429 after the wait), "
            "cancelled (the client left while it waited)", labels=("outcome",))
        for outcome in ("at_once", "after_wait", "timed_out", "cancelled"):
            outcomes.add_metric((outcome,), stats[outcome])
        waiting = GaugeMetricFamily("kvgate_admission_waiting", "Requests waiting for room on a pod now",
                                    value=stats["waiting"])
        waited = CounterMetricFamily("kvgate_admission_wait_seconds", "Seconds requests waited for room on a pod, "
                                     "in all (each waiting request's own wait)", value=stats["wait_seconds"])
        errors = CounterMetricFamily("kvgate_admission_limiter_errors", "Failed Redis operations of the admission "
                                     "counts the replicas share (from the first of an outage until Redis answers "
                                     "this replica admits on its own requests alone, the limit holding per replica)",
                                     value=stats["limiter_errors"])
        limit = GaugeMetricFamily("kvgate_admission_max_running", "Requests a pod may run, over every replica "
                                  "(KVGATE_ADMISSION_MAX_RUNNING)", value=self._max_running)
        return [outcomes, waiting, waited, errors, limit]
