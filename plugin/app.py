"""Wiring: Settings -> discovery, index, KV event subscriptions, tokenizer, router,
the ext_proc gRPC server and the HTTP port. Built once per process; nothing global."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvcache.index import PrefixIndex
from kvcache.metrics import KVEventMetrics
from kvcache.subscriber import EndpointSpec, SubscriberManager, SubscriberOptions
from plugin.config import Settings
from plugin.extproc import ExternalProcessor, Gateway
from plugin.http import build_http_app
from plugin.metrics import GatewayMetrics
from routing.counts import RunningCounts, build_counts
from routing.discovery import StaticSource
from routing.engine_metrics import EngineMetrics
from routing.k8s import KubernetesConfig, KubernetesSource
from routing.metrics import RoutingMetrics
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.strategies import StrategyConfig, parse_weights
from tokenizer.cache import CachedTokenizer, CacheOptions
from tokenizer.local import LocalBackend, LocalTokenizer
from tokenizer.remote import RemoteOptions, RemoteTokenizer
from tokenizer.segments import NotSegmentable, Segmenter
from tokenizer.types import Tokenizer

log = logging.getLogger("kvgate")


def endpoint_specs(pods: list[Pod]) -> list[EndpointSpec]:
    """One KV event subscription per (pod, data-parallel rank): rank r publishes on ports + r."""
    specs = []
    for pod in pods:
        ev = pod.kv_events
        if ev is None:
            continue
        for rank in range(ev.dp_size):
            replay = None if ev.replay_port is None else ev.replay_port + rank
            specs.append(EndpointSpec(pod=pod.name, model=pod.model, host=pod.address,
                                      pub_port=ev.pub_port + rank, replay_port=replay, rank=rank))
    return specs


def _tokenizer(settings: Settings, registry: CollectorRegistry) -> Tokenizer:
    """The configured backend behind the exact cache; the local files (if any) serve every model."""
    local = LocalTokenizer.from_path(settings.tokenizer_path) if settings.tokenizer_path else None
    if settings.tokenizer == "local":
        inner: Tokenizer = LocalBackend({}, default=local)
    else:
        timeout = settings.tokenizer_timeout_s
        inner = RemoteTokenizer(options=RemoteOptions(total_timeout_s=timeout,
                                                      attempt_timeout_s=min(timeout, max(timeout / 2, 0.25))),
                                registry=registry)
    if settings.tokenizer_cache_mb == 0:
        return inner
    segmenter = None
    if local is not None:
        try:
            segmenter = Segmenter.from_local(local)
        except NotSegmentable as e:  # still exact, just without piece caching
            log.warning("tokenizer cache: whole requests only (%s)", e)
    return CachedTokenizer(inner, default_segmenter=segmenter,
                           options=CacheOptions(max_bytes=settings.tokenizer_cache_mb << 20), registry=registry)


def pod_source(s: Settings, metrics: RoutingMetrics) -> StaticSource | KubernetesSource:
    """The discovery source the settings name."""
    if s.discovery == "kubernetes":
        return KubernetesSource(KubernetesConfig(api_url=s.k8s_api_url, namespace=s.k8s_namespace,
                                                 label_selector=s.k8s_label_selector), metrics=metrics)
    return StaticSource(s.pods_file, s.pods, poll_interval_s=s.pods_poll_s, metrics=metrics)


def running_counts(s: Settings, metrics: RoutingMetrics) -> RunningCounts:
    """Counts shared through KVGATE_REDIS_URL (heartbeat at a fifth of the key TTL), else in-process."""
    return build_counts(s.redis_url, s.gateway_id, ttl_s=s.redis_key_ttl_s, heartbeat_s=s.redis_key_ttl_s / 5,
                        metrics=metrics)


def strategy_config(s: Settings) -> StrategyConfig:
    return StrategyConfig(guard_abs_slack=s.routing_guard_slack, guard_rel_slack=s.routing_guard_ratio,
                          approx_block_size=s.prefix_cache_block_size, approx_capacity=s.prefix_cache_blocks,
                          prefill_tokens_per_s=s.routing_prefill_tokens_per_s, weights=parse_weights(s.routing_weights))


@dataclass
class App:
    settings: Settings
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        s = self.settings
        self.routing_metrics = RoutingMetrics(self.registry)
        self.pods = PodRegistry()
        self.source = pod_source(s, self.routing_metrics)
        self.index = PrefixIndex(max_entries=s.index_max_entries)
        self.subscriptions = SubscriberManager(self.index, SubscriberOptions(
            replay_timeout=s.kv_events_replay_timeout_s, reconnect_initial=s.kv_events_backoff_min_s,
            reconnect_max=s.kv_events_backoff_max_s, heartbeat_interval=s.kv_events_heartbeat_s,
            heartbeat_timeout=s.kv_events_heartbeat_timeout_s, rcv_hwm=s.kv_events_rcv_hwm,
            tick_budget=s.kv_events_tick_budget_s), KVEventMetrics(self.registry))
        self.counts = running_counts(s, self.routing_metrics)
        self.engines = EngineMetrics(self.pods, interval_s=s.engine_metrics_interval_s, metrics=self.routing_metrics)
        self.router = Router(self.pods, default_strategy=s.routing_strategy, counts=self.counts, index=self.index,
                             engines=self.engines, config=strategy_config(s), metrics=self.routing_metrics)
        self.tokenizer = _tokenizer(s, self.registry)
        self.gateway_metrics = GatewayMetrics(self.registry)
        self.processor = ExternalProcessor(Gateway(
            router=self.router, registry=self.pods, tokenizer=self.tokenizer, metrics=self.gateway_metrics,
            default_strategy=s.routing_strategy, max_body_bytes=s.max_body_bytes,
            tokenizer_timeout_s=s.tokenizer_timeout_s, tokenizer_url=s.tokenizer_url or None,
            target_pod_header=s.target_pod_header, reachable=lambda name: not self.engines.unreachable(name),
            cached_tokens=self.tokenizer.cached if isinstance(self.tokenizer, CachedTokenizer) else None))
        self.pods.add_listener(self._on_pods)
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self.health = health.aio.HealthServicer()

    def _on_pods(self, added: list[Pod], removed: list[Pod]) -> None:
        # Subscriptions and index entries follow pods in and out of discovery.
        for pod in removed:
            if self.pods.get(pod.name) is None:
                self.index.remove_pod(pod.name)
        self.subscriptions.sync(endpoint_specs(self.pods.pods()))
        log.info("pods: %d known (%s added, %s removed)", len(self.pods.pods()),
                 ", ".join(p.name for p in added) or "none", ", ".join(p.name for p in removed) or "none")

    def healthy(self) -> tuple[bool, str]:
        ready = sum(1 for p in self.pods.pods() if p.ready)
        return (ready > 0, f"{ready} ready pods")

    def debug(self) -> dict:
        snapshot = self.router.debug_snapshot(subscriptions=self.subscriptions.status())
        snapshot["settings"] = self.settings.redacted()
        return snapshot

    async def start(self) -> tuple[int, int]:
        s = self.settings
        await self.source.start(self.pods)
        self.subscriptions.sync(endpoint_specs(self.pods.pods()))
        await self.router.start()
        # so_reuseport off: a stale kvgate on the same port must not keep taking Envoy's streams.
        # Envoy's buffer limit bounds bodies; gRPC's default 4 MiB would turn larger valid ones into 500s.
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", -1),
                                              ("grpc.max_send_message_length", -1)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        grpc_port = self._grpc.add_insecure_port(_join(s.listen_host, s.grpc_port))
        if grpc_port == 0:
            raise OSError(f"KVGATE_GRPC_PORT: cannot listen on {_join(s.listen_host, s.grpc_port)}")
        await self._grpc.start()
        http_app = build_http_app(self.registry, healthy=self.healthy, debug=self.debug)
        self._http = web.AppRunner(http_app, access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, s.listen_host, s.http_port, reuse_port=False)
        await site.start()
        http_port = site._server.sockets[0].getsockname()[1] if site._server else s.http_port
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("envoy.service.ext_proc.v3.ExternalProcessor", health_pb2.HealthCheckResponse.SERVING)
        log.info("kvgate serving: ext_proc on %s, HTTP on %s:%d, strategy %s, %d pods",
                 _join(s.listen_host, grpc_port), s.listen_host, http_port, s.routing_strategy, len(self.pods.pods()))
        return grpc_port, http_port

    async def wait(self) -> None:
        assert self._grpc is not None
        await self._grpc.wait_for_termination()

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        await self.processor.drain()
        if self._http is not None:
            await self._http.cleanup()
        await self.subscriptions.aclose()
        await self.source.stop()
        await self.router.close()
        await self.tokenizer.aclose()


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
