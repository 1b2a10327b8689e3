"""Prometheus metrics of the routing layer, created on a registry the caller passes."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


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
