"""The gateway's own Prometheus metrics (request path), on a registry passed in."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._children: dict[tuple, object] = {}
        self.requests = Counter(
            "kvgate_requests", "Requests seen by the ext_proc server, by path kind and outcome",
            ["kind", "outcome"], registry=registry)
        self.decisions = Counter(
            "kvgate_routed_requests", "Requests routed, by strategy and chosen pod",
            ["strategy", "pod"], registry=registry)
        self.errors = Counter(
            "kvgate_request_errors", "Requests answered with an error by kvgate, by HTTP status and code",
            ["status", "code"], registry=registry)
        self.decision_seconds = Histogram(
            "kvgate_routing_decision_seconds", "Time from the request body to the routing answer, by strategy",
            ["strategy"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.tokenize_seconds = Histogram(
            "kvgate_tokenize_seconds", "Time spent tokenizing one request", buckets=_LATENCY_BUCKETS,
            registry=registry)
        self.tokenizer_fallbacks = Counter(
            "kvgate_tokenizer_fallbacks", "Requests routed on load alone because tokenization failed, by reason",
            ["reason"], registry=registry)
        self.prefix_blocks = Counter(
            "kvgate_prefix_blocks", "Prompt blocks of routed requests: total, and already cached on the chosen pod",
            ["kind"], registry=registry)
        self.active_streams = Gauge(
            "kvgate_active_streams", "ext_proc streams open now (one per HTTP request in flight)", registry=registry)
        self.released = Counter(
            "kvgate_requests_released", "Routed requests whose HTTP stream ended, by how it ended",
            ["how"], registry=registry)

    def child(self, metric, *labels: str):
        """`metric.labels(*labels)`, memoised: labels() costs a lock and a dict lookup per call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found
