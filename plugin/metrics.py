"""The gateway's own Prometheus metrics (request path), on a registry passed in.

The metrics updated on every request are plain numbers changed without a lock, on the
event loop's thread (the only one that serves requests), and turned into Prometheus
samples when scraped: a prometheus_client child takes a lock and a few checks per
update, several times per request. They expose the same series, names and types as
prometheus_client's Counter, Histogram and Gauge would (`_total`, `_created`, buckets).
"""
from __future__ import annotations

import time
from bisect import bisect_left
from typing import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcache.metrics import histogram_family

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value


class _LoopMetric:
    """A labelled metric whose children are updated from one thread without locks."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry | None) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str):
        child = self._children.get(values)
        if child is None:
            key = tuple(str(v) for v in values)  # only str keys are stored
            if len(key) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
        return child

    def _new_child(self):
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        return iter(self._families([]))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(list(self._children.items())))

    def _families(self, items) -> list[Metric]:
        raise NotImplementedError


class LoopCounter(_LoopMetric):
    """`prometheus_client.Counter` with labels, lock-free (one updating thread)."""

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def _families(self, items) -> list[Metric]:
        total = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, c in items:
            total.add_metric(values, c.value, created=c.created)
        return [total]


class LoopHistogram(_LoopMetric):
    """`prometheus_client.Histogram` with labels, lock-free (one updating thread)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry | None,
                 buckets: Sequence[float] = _LATENCY_BUCKETS) -> None:
        self._bounds = tuple(float(b) for b in buckets if b != float("inf"))
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def _families(self, items) -> list[Metric]:
        return [histogram_family(self._name, self._doc, self._labelnames, self._bounds,
                                 ((values, list(h.counts), h.sum, h.created) for values, h in items))]


class _LoopGauge:
    """An unlabelled gauge read from a plain number at scrape time."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry | None) -> None:
        self._name, self._doc = name, documentation
        self.value = 0.0
        if registry is not None:
            registry.register(self)

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def describe(self) -> Iterator[Metric]:
        return iter([GaugeMetricFamily(self._name, self._doc)])

    def collect(self) -> Iterator[Metric]:
        return iter([GaugeMetricFamily(self._name, self._doc, value=self.value)])


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        # Every request: lock-free, updated only from the event loop.
        self.requests = LoopCounter(
            "kvgate_requests", "Requests seen by the ext_proc server, by path kind and outcome",
            ["kind", "outcome"], registry=registry)
        self.decisions = LoopCounter(
            "kvgate_routed_requests", "Requests routed, by strategy and chosen pod",
            ["strategy", "pod"], registry=registry)
        self.decision_seconds = LoopHistogram(
            "kvgate_routing_decision_seconds", "Time from the request body to the routing answer, by strategy",
            ["strategy"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.tokenize_seconds = LoopHistogram(
            "kvgate_tokenize_seconds", "Time spent tokenizing one request", [], buckets=_LATENCY_BUCKETS,
            registry=registry).labels()
        self.prefix_blocks = LoopCounter(
            "kvgate_prefix_blocks", "Prompt blocks of routed requests: total, and already cached on the chosen pod",
            ["kind"], registry=registry)
        self.request_extras = LoopCounter(
            "kvgate_request_extras", "Requests whose blocks' hashes carry more than tokens and LoRA, by kind: salted "
            "(cache_salt), media (media parts), opaque (extra keys kvgate cannot know: prompt embeddings, unknown "
            "parts, media the engine did not render); a request counts under each kind it has",
            ["kind"], registry=registry)
        self.active_streams = _LoopGauge(
            "kvgate_active_streams", "ext_proc streams open now (one per HTTP request in flight)", registry=registry)
        self.one_message = LoopCounter(
            "kvgate_one_message_requests", "Requests Envoy sent in one message (its body, the headers kvgate reads as "
            "attributes: envoy/envoy.yaml's one-message routes); their responses are not watched", [],
            registry=registry).labels()
        self.served = LoopCounter(
            "kvgate_served_requests", "Routed requests by the endpoint the data plane reports served them: the "
            "picked pod, a fallback from the ranked list (the request's count moved there), or an unknown one",
            ["endpoint"], registry=registry)
        self.released = LoopCounter(
            "kvgate_requests_released", "Routed requests whose HTTP stream ended, by how it ended",
            ["how"], registry=registry)
        # Prefill/decode disaggregation (the `pd` strategy, plugin.pd).
        self.pd_requests = LoopCounter(
            "kvgate_pd_requests", "Requests routed with the pd strategy, by how they were served: disaggregated (a "
            "prefill leg, then the decode engine), aggregated (the decider: the decode engine lacked too little of "
            "the prompt), no_prefill_pod, fallback (the prefill leg failed on every engine tried: served whole)",
            ["mode"], registry=registry)
        self.pd_prefill = LoopCounter(
            "kvgate_pd_prefill_legs", "Prefill legs kvgate ran, by outcome: ok, refused (an HTTP error), timeout, "
            "unreachable (connect or transport error), invalid (no usable kv_transfer_params in the answer), cancelled "
            "(the client left), full (the engine runs its KVGATE_ADMISSION_MAX_RUNNING: not called), error (a defect "
            "of kvgate's, logged)", ["outcome"], registry=registry)
        self.pd_prefill_seconds = LoopHistogram(
            "kvgate_pd_prefill_seconds", "Time of the prefill legs that answered, from the call to the answer", [],
            buckets=_LATENCY_BUCKETS, registry=registry).labels()
        self.pd_in_flight = _LoopGauge(
            "kvgate_pd_prefill_in_flight", "Prefill legs kvgate is waiting on now", registry=registry)
        # Rare events: ordinary prometheus_client metrics.
        self.errors = Counter(
            "kvgate_request_errors", "Requests answered with an error by kvgate, by HTTP status and code",
            ["status", "code"], registry=registry)
        self.response_affinity = Counter(
            "kvgate_response_affinity", "Responses API requests with a previous_response_id, by outcome: routed (to "
            "the pod that stored it), unknown (an id this gateway did not learn), not_ready (that pod is not ready "
            "or outside the data plane's subset), not_eligible (not a candidate for the model); the last three are "
            "routed as any other request", ["outcome"], registry=registry)
        self.response_ids = Counter(
            "kvgate_response_ids_learned", "Responses API response ids learned from routed answers (id -> pod)",
            registry=registry)
        self.read_only = LoopCounter(
            "kvgate_read_only_requests", "Requests to the engines' read-only endpoints passed through by load, by "
            "path (/v1/models, /tokenize, /detokenize, /health, /version; every other path not routed: other)",
            ["path"], registry=registry)
        self.tokenizer_fallbacks = Counter(
            "kvgate_tokenizer_fallbacks", "Requests routed on load alone because tokenization failed, by reason",
            ["reason"], registry=registry)
