"""Prometheus metrics of the routing layer, created on a registry the caller passes."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from routing.learning.profiles import EngineProfiles


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


class _ReadAtScrape:
    """A collector whose samples are read when Prometheus scrapes, registered on `registry` when one is given."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        if registry is not None:
            registry.register(self)

    def describe(self) -> list[Metric]:
        return []  # collected on demand: no samples at registration time

    def collect(self) -> Iterable[Metric]:
        raise NotImplementedError  # each collector's own


class AdmissionCollector(_ReadAtScrape):
    """Admission (KVGATE_ADMISSION_MAX_RUNNING) as it went, read from Admission.stats() at scrape time:
    requests by outcome, those waiting now, the seconds waited (a wait adds to the request's time to
    first token: their rate over the rate of every outcome but at_once is the mean wait), the limiter's
    failures and the limit."""

    def __init__(self, stats: Callable[[], dict], max_running: int, registry: CollectorRegistry | None = None) -> None:
        self._stats = stats
        self._max_running = max_running
        super().__init__(registry)

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


class CostModelCollector(_ReadAtScrape):
    """The cost model's per-engine answers (routing.learning.profiles, learned from observed responses), read at
    scrape time for every pod `pods()` names: the prefill rate it prices uncached tokens at, the TTFT overhead
    and decode step it expects at 1 and 8 running, and how far its TTFT predictions were off (from the pod's
    first prediction observed; decayed means). A rate or overhead far from its neighbours' says why the
    strategies that read them (`slo`, the `ttft` scorer; the `prefix` scorer's admission wait reads the decode
    step) send a pod less; a bad estimate drifts back to the priors while nothing observes the pod, so a dip
    that heals is the design working. An AIBrix GPU profile, where one applies, overrides these per request and
    is not shown."""

    RUNNING = ("1", "8")

    def __init__(self, profiles: EngineProfiles, pods: Callable[[], Iterable[str]],
                 registry: CollectorRegistry | None = None) -> None:
        self._profiles = profiles
        self._pods = pods
        super().__init__(registry)

    def collect(self) -> Iterable[Metric]:
        p = self._profiles
        rate = GaugeMetricFamily("kvgate_cost_model_prefill_tokens_per_second", "Uncached prompt tokens a second the "
                                 "cost model expects the pod to prefill (learned, else KVGATE_ROUTING_PREFILL_TOKENS_"
                                 "PER_S)", labels=("pod",))
        overhead = GaugeMetricFamily("kvgate_cost_model_ttft_overhead_seconds", "Seconds of a request's TTFT the cost "
                                     "model expects beyond its queue and own prefill, with `running` requests on the "
                                     "pod (learned, else the prior)", labels=("pod", "running"))
        step = GaugeMetricFamily("kvgate_cost_model_decode_step_seconds", "Seconds a decode step takes with `running` "
                                 "requests on the pod, as the cost model expects (learned, else the prior)",
                                 labels=("pod", "running"))
        error = GaugeMetricFamily("kvgate_cost_model_ttft_error_seconds", "Observed minus predicted TTFT of the "
                                  "requests routed by the cost model to the pod: its decayed mean (`mean`) and mean "
                                  "absolute value (`mean_abs`)", labels=("pod", "stat"))
        for pod in sorted(set(self._pods())):
            rate.add_metric((pod,), p.prefill_rate(pod))
            for n in self.RUNNING:
                overhead.add_metric((pod, n), p.ttft_overhead(pod, float(n)))
                step.add_metric((pod, n), p.step_time(pod, float(n)))
            err = p.ttft_error(pod)
            if err is not None:
                error.add_metric((pod, "mean"), err[0])
                error.add_metric((pod, "mean_abs"), err[1])
        return [rate, overhead, step, error]
