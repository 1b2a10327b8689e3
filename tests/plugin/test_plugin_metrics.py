"""The gateway's lock-free request metrics expose exactly what prometheus_client's own would."""
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from plugin.metrics import _LATENCY_BUCKETS, GatewayMetrics, LoopCounter, LoopHistogram, _LoopGauge


def _fill(counter, histogram, unlabelled, gauge):
    counter.labels("chat", "routed").inc()
    counter.labels("chat", "routed").inc(2.5)
    counter.labels("other", "passthrough").inc()
    # on a bound, between bounds, below the first, above the last
    for v in (0.0001, 0.0002, 0.003, 0.5, 7.0):
        histogram.labels("kv-sync").observe(v)
        unlabelled.observe(v)
    histogram.labels("random").observe(0.01)
    gauge.inc()
    gauge.inc()
    gauge.dec()


def _without_created_values(text: str) -> list[str]:
    return [re.sub(r"^(\S*_created\S*) \S+$", r"\1 T", line) for line in text.splitlines()]


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics])
def test_exposition_matches_prometheus_client(generate):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    _fill(Counter("kvgate_t_requests", "requests", ["kind", "outcome"], registry=theirs),
          Histogram("kvgate_t_seconds", "seconds", ["strategy"], buckets=_LATENCY_BUCKETS, registry=theirs),
          Histogram("kvgate_t_plain_seconds", "plain", buckets=_LATENCY_BUCKETS, registry=theirs),
          Gauge("kvgate_t_open", "open", registry=theirs))
    _fill(LoopCounter("kvgate_t_requests", "requests", ["kind", "outcome"], registry=ours),
          LoopHistogram("kvgate_t_seconds", "seconds", ["strategy"], buckets=_LATENCY_BUCKETS, registry=ours),
          LoopHistogram("kvgate_t_plain_seconds", "plain", [], buckets=_LATENCY_BUCKETS, registry=ours).labels(),
          _LoopGauge("kvgate_t_open", "open", registry=ours))
    mine = _without_created_values(generate(ours).decode())
    assert mine == _without_created_values(generate(theirs).decode())
    assert 'kvgate_t_seconds_bucket{le="0.0002",strategy="kv-sync"} 2.0' in mine
    assert 'kvgate_t_requests_total{kind="chat",outcome="routed"} 3.5' in mine


def test_labels_are_checked_and_counters_only_go_up():
    c = LoopCounter("kvgate_t_c", "c", ["a", "b"], registry=None)
    with pytest.raises(ValueError):
        c.labels("only-one")
    with pytest.raises(ValueError):
        c.labels("x", "y").inc(-1)
    assert c.labels(1, "y") is c.labels("1", "y")  # values are strings, as prometheus_client makes them


def test_gateway_metrics_register_once_and_names_are_unique():
    registry = CollectorRegistry()
    m = GatewayMetrics(registry)
    m.requests.labels("chat", "routed").inc()
    m.tokenize_seconds.observe(0.001)
    assert registry.get_sample_value("kvgate_requests_total", {"kind": "chat", "outcome": "routed"}) == 1
    assert registry.get_sample_value("kvgate_tokenize_seconds_count") == 1
    assert registry.get_sample_value("kvgate_active_streams") == 0
    with pytest.raises(ValueError):  # a second set on the same registry collides, as prometheus_client's would
        GatewayMetrics(registry)
