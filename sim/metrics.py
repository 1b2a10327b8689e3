"""The simulated engine's /metrics: vLLM's metric names, read from the engine models at scrape time."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from sim.engine import EngineMetrics

_LABELS = ["model_name", "engine"]


class EngineCollector(Collector):
    """vLLM's gauges and counters, one series per data-parallel rank (label `engine`)."""

    def __init__(self, model: str, snapshot: Callable[[], Sequence[EngineMetrics]], block_size: int) -> None:
        self._model = model
        self._snapshot = snapshot
        self._block_size = block_size

    def collect(self) -> Iterator[Metric]:
        ranks = list(self._snapshot())
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=_LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=_LABELS)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=_LABELS)
        usage_old = GaugeMetricFamily("vllm:gpu_cache_usage_perc",
                                      "GPU KV-cache usage. 1 means 100 percent usage (name before vLLM 0.10).",
                                      labels=_LABELS)
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", labels=_LABELS)
        hits = CounterMetricFamily("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.", labels=_LABELS)
        prompt = CounterMetricFamily("vllm:prompt_tokens", "Number of prefill tokens processed.", labels=_LABELS)
        generation = CounterMetricFamily("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels=_LABELS)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*_LABELS, "finished_reason"])
        # vLLM's latency histograms; the simulator keeps only their sum and count (one +Inf bucket)
        ttft = HistogramMetricFamily("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                     "seconds.", labels=_LABELS)
        itl = HistogramMetricFamily("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                    "seconds.", labels=_LABELS)
        # the simulator's own (vLLM has none): what a test of admission limits reads
        peak = GaugeMetricFamily("sim:requests_live_peak", "Most requests live at once (waiting or running) since "
                                 "start.", labels=_LABELS)
        for rank, m in enumerate(ranks):
            labels = [self._model, str(rank)]
            running.add_metric(labels, m.running)
            waiting.add_metric(labels, m.waiting)
            usage.add_metric(labels, m.kv_usage)
            usage_old.add_metric(labels, m.kv_usage)
            queries.add_metric(labels, m.prefix_cache_queries)
            hits.add_metric(labels, m.prefix_cache_hits)
            prompt.add_metric(labels, m.prompt_tokens)
            generation.add_metric(labels, m.generation_tokens)
            success.add_metric([*labels, "length"], m.requests_finished)
            peak.add_metric(labels, m.peak_live)
            ttft.add_metric(labels, [("+Inf", float(m.ttft[1]))], sum_value=m.ttft[0])
            itl.add_metric(labels, [("+Inf", float(m.inter_token[1]))], sum_value=m.inter_token[0])
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        if ranks:
            info.add_metric([str(self._block_size), str(ranks[0].num_blocks), "True"], 1.0)
        yield from (running, waiting, usage, usage_old, queries, hits, prompt, generation, success, ttft, itl, info,
                    peak)


def engine_registry(collector: EngineCollector, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(collector)
    return registry
