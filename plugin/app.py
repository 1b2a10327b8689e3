"""Wiring: Settings -> discovery, index, KV event subscriptions, tokenizer, router,
the ext_proc gRPC server and the HTTP port. Built once per process; nothing global."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvcache.index import PrefixIndex
from kvcache.metrics import IndexCollector, KVEventMetrics
from kvcache.ingest import SubscriberManager
from kvcache.locking import LockedIndex
from kvcache.stream import EndpointSpec, SubscriberOptions
from plugin.config import Settings
from plugin.extproc import ExternalProcessor
from plugin.responses import ResponseStore, SharedResponseStore
from plugin.pipeline import Gateway, Sampler
from plugin.http import build_http_app
from plugin.metrics import GatewayMetrics
from plugin.observe import Observer
from plugin.pd import PDHandoff
from plugin import grpcserver
from plugin.tls import ServerKeys, server_keys
from plugin.watch import RedisWords, WatchRelay
from plugin.status import RecentErrors, RoutingMix
from routing.state.admission import Admission, Limiter, LocalLimiter, RedisLimiter
from routing.state.prompt_relay import PromptRelay
from routing.state.resp import shared_state_client
from routing.state.counts import LocalCounts, RedisCounts, RunningCounts, build_counts, default_gateway_id
from routing.discovery.static import StaticSource
from routing.state.engine_metrics import EngineLoad, EngineMetrics, Saturation
from routing.discovery.inferencepool import InferencePoolConfig, InferencePoolSource
from routing.discovery.k8s import KubernetesConfig, KubernetesSource
from routing.discovery.kube import ApiConfig
from routing.metrics import AdmissionCollector, CostModelCollector, RoutingMetrics
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.pd import STRATEGY as PD_STRATEGY, PDConfig, PDPlanner
from routing.router import Router
from routing.scheduling.sessions import SessionStore
from routing.scheduling.strategies import StrategyConfig, parse_weights
from routing.learning.profiles import EngineProfiles
from routing.scheduling.slo import Capacity, parse_targets
from routing.learning.predictor import OutputPredictor, PredictorSync
from routing.learning.tracking import TraceWindows, TraceWriter, TrackerRegistry
from tokenizer.cache import CachedTokenizer, CacheOptions
from tokenizer.hub import HubOptions
from tokenizer.hub import fetch as hub_fetch
from tokenizer.local import LocalBackend, LocalTokenizer
from tokenizer.remote import RemoteOptions, RemoteTokenizer
from tokenizer.segments import NotSegmentable, Segmenter
from tokenizer.types import Tokenizer, TokenizesNow
from tokenizer.verified import VerifiedTokenizer, VerifyOptions

log = logging.getLogger("kvgate")

# gRPC health services, as the Endpoint Picker protocol defines them. kvgate replicas are active-active
# (running counts shared through Redis), so there is no leader election: every synced replica is ready.
LIVENESS = "liveness"  # SERVING while the process answers gRPC, whatever the pods or discovery
# SERVING once discovery has synced and the KV event subscriptions are started; NOT_SERVING while draining
READINESS = ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "")


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


def _tokenizer(settings: Settings, registry: CollectorRegistry, known: Callable[[str], bool] | None = None
               ) -> tuple[Tokenizer, VerifiedTokenizer | None, RemoteTokenizer | None]:
    """The configured backend behind the exact cache, the verified local path when there is one, and the engines'
    tokenizer when one is asked (it also renders chats with media: their identifiers come from the engine).

    `auto` with tokenizer files (a directory for every model, or the hub per model) verifies local tokens
    against the engines' /tokenize (tokenizer.verified); without files, or with `remote`, the engines
    tokenize; `local` uses the directory alone. The cache's piece level (local rendering, pieces from the
    backend) needs the directory; with the verified path it serves a request only once that request's shape
    is verified, and its answers are sampled like the rest."""
    local = LocalTokenizer.from_path(settings.tokenizer_path) if settings.tokenizer_path else None
    verified = remote = None
    if settings.tokenizer == "local":
        inner: Tokenizer = LocalBackend({}, default=local)
    else:
        timeout = settings.tokenizer_timeout_s
        inner = remote = RemoteTokenizer(options=RemoteOptions(total_timeout_s=timeout,
                                                               attempt_timeout_s=min(timeout, max(timeout / 2, 0.25))),
                                         registry=registry)
        if settings.tokenizer == "auto" and (local is not None or settings.tokenizer_hub):
            hub = HubOptions(cache_dir=settings.tokenizer_cache_dir or None)
            verified = VerifiedTokenizer(
                inner, local=local, load=None if local is not None else partial(_from_hub, hub),
                options=VerifyOptions(verify_requests=settings.tokenizer_verify_requests,
                                      sample_rate=settings.tokenizer_sample_rate),
                registry=registry, known=known)
            inner = verified
            log.info("tokenizer: local files from %s, each model verified against the engines' /tokenize (%d requests "
                     "per shape, then %g%% sampled)", settings.tokenizer_path or "the hub, per model",
                     settings.tokenizer_verify_requests, settings.tokenizer_sample_rate * 100)
        else:
            log.info("tokenizer: the engines' /tokenize%s", "" if settings.tokenizer == "remote" else
                     " (no local files: set KVGATE_TOKENIZER_PATH or KVGATE_TOKENIZER_HUB to tokenize locally)")
    if settings.tokenizer_cache_mb == 0:
        return inner, verified, remote
    segmenter = None
    if local is not None:
        try:
            segmenter = Segmenter.from_local(local)
        except NotSegmentable as e:  # still exact, just without piece caching
            log.warning("tokenizer cache: whole requests only (%s)", e)
    cached = CachedTokenizer(inner, default_segmenter=segmenter,
                             options=CacheOptions(max_bytes=settings.tokenizer_cache_mb << 20), registry=registry,
                             trust=verified.trusts if verified is not None else None,
                             observe=verified.observe if verified is not None else None)
    if verified is not None:
        # Entries made from local tokens of a model found wrong are dropped (all of them: it is rare).
        verified.on_disagreement = lambda model: cached.clear()
        if local is None:  # files per model, from the hub: each model's pieces once its files are loaded
            verified.on_loaded = partial(_add_segmenter, cached)
    return cached, verified, remote


def _add_segmenter(cached: CachedTokenizer, model: str, local: LocalTokenizer) -> None:
    try:
        cached.set_segmenter(model, Segmenter.from_local(local))
    except NotSegmentable as e:
        log.warning("tokenizer cache: whole requests only for model %r (%s)", model, e)


def _from_hub(options: HubOptions, model: str) -> LocalTokenizer:
    return LocalTokenizer.from_path(hub_fetch(model, options))


def pod_source(s: Settings, metrics: RoutingMetrics) -> StaticSource | KubernetesSource | InferencePoolSource:
    """The discovery source the settings name."""
    if s.discovery == "inferencepool":
        return InferencePoolSource(InferencePoolConfig(
            name=s.inferencepool_name, namespace=s.k8s_namespace, api=ApiConfig(api_url=s.k8s_api_url),
            models_refresh_s=s.pool_models_refresh_s), metrics=metrics)
    if s.discovery == "kubernetes":
        return KubernetesSource(KubernetesConfig(namespace=s.k8s_namespace, label_selector=s.k8s_label_selector,
                                                 api=ApiConfig(api_url=s.k8s_api_url)), metrics=metrics)
    return StaticSource(s.pods_file, s.pods, poll_interval_s=s.pods_poll_s, metrics=metrics)


def running_counts(s: Settings, metrics: RoutingMetrics) -> RunningCounts:
    """Counts shared through KVGATE_REDIS_URL (heartbeat at a fifth of the key TTL; a pick reads the other
    gateways' counts in the background while its view is younger than the TTL, as long as totals() trusts
    them: no Redis round trip on the request path, however long the gateway was idle within it; writes
    batched every 5 ms; read only once another gateway has written since), else in-process."""
    return build_counts(s.redis_url, s.gateway_id, ttl_s=s.redis_key_ttl_s, heartbeat_s=s.redis_key_ttl_s / 5,
                        stale_ok_s=s.redis_key_ttl_s, write_interval_s=0.005, notified=True, metrics=metrics)


def strategy_config(s: Settings) -> StrategyConfig:
    return StrategyConfig(guard_abs_slack=s.routing_guard_slack, guard_rel_slack=s.routing_guard_ratio,
                          approx_block_size=s.prefix_cache_block_size, approx_capacity=s.prefix_cache_blocks,
                          prefill_tokens_per_s=s.routing_prefill_tokens_per_s, weights=parse_weights(s.routing_weights),
                          saturation=Saturation(s.saturation_queue, s.saturation_kv_usage))


def request_path_redis(url: str) -> Any:
    """A Redis client for calls a request waits on: an operation not answered within 0.2 s fails at once (no
    retry), and its caller goes on without Redis (sessions: local only; admission: this replica's own counts)."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    return Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))


def session_store(s: Settings) -> SessionStore:
    """Session -> pod: shared through Redis when KVGATE_REDIS_URL is set (a failing Redis: local only)."""
    redis = request_path_redis(s.redis_url) if s.redis_url else None
    return SessionStore(s.session_ttl_s, s.session_capacity, redis=redis, owns_redis=True)


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
            tick_budget=s.kv_events_tick_budget_s, coalesce=s.kv_events_coalesce_s), KVEventMetrics(self.registry))
        # The ingest thread applies batches under the subscriptions' lock; everything else reaches the
        # index through this view, under the same lock.
        self.shared_index = LockedIndex(self.index, self.subscriptions.lock,
                                        on_busy=self.routing_metrics.index_busy.inc)
        IndexCollector(self.shared_index.stats, self.registry)
        self.counts = running_counts(s, self.routing_metrics)
        self.engines = EngineMetrics(self.pods, interval_s=s.engine_metrics_interval_s, metrics=self.routing_metrics)
        self.predictor = OutputPredictor(window_s=s.predict_window_s, step_s=s.predict_step_s,
                                         cold=s.predict_cold_start, max_output=s.predict_max_output)
        self.profiles = EngineProfiles(prefill_tokens_per_s=s.routing_prefill_tokens_per_s)
        CostModelCollector(self.profiles, lambda: (p.name for p in self.pods.pods()), self.registry)
        self.engines.on_load = self._on_engine_load
        self.mix = RoutingMix()  # the status page's routing mix and cache shares per minute
        self.recent_errors = RecentErrors()  # the status page's recent warnings and errors (root logger, once started)
        # The prefill queue the slo strategy reads: exact and shared between replicas when responses are
        # observed (a request's tokens leave at its first token), else each replica's own estimate.
        self.prefill_counts: RunningCounts | None = None
        if s.observe_responses:
            # read and written like the running counts: a pick reads the others' shares in the background once
            # another gateway has written, the changes of a burst go out as one write every 5 ms
            self.prefill_counts = (RedisCounts(s.redis_url, s.gateway_id, key_prefix="kvgate:{prefill}:",
                                               ttl_s=s.redis_key_ttl_s, heartbeat_s=s.redis_key_ttl_s / 5,
                                               stale_ok_s=s.redis_key_ttl_s, write_interval_s=0.005, notified=True)
                                   if s.redis_url else LocalCounts())
        self.capacity = Capacity(self.profiles, self.predictor, targets=parse_targets(s.slo_targets),
                                 prefill=self.prefill_counts)
        self.router = Router(self.pods, default_strategy=s.routing_strategy, counts=self.counts, index=self.shared_index,
                             engines=self.engines, config=strategy_config(s), metrics=self.routing_metrics,
                             saturation=Saturation(s.saturation_queue, s.saturation_kv_usage),
                             max_fallbacks=s.fallback_endpoints, capacity=self.capacity, sessions=session_store(s))
        # every replica's running prompts (a tenant's burst dealt over the replicas is one burst), through Redis
        self.prompt_relay: PromptRelay | None = None
        if s.redis_url and self.router.prompts is not None:
            self.prompt_relay = PromptRelay(shared_state_client(s.redis_url), self.router.prompts,
                                            s.gateway_id or default_gateway_id(), registry=self.registry)
        self.tokenizer, self.verified_tokenizer, remote = _tokenizer(s, self.registry,
                                                                     known=lambda m: bool(self.pods.serving(m)))
        self.gateway_metrics = GatewayMetrics(self.registry)
        self.admission: Admission | None = None
        self._admission_redis = None
        if s.admission_max_running > 0:
            limiter: Limiter
            if s.redis_url:
                self._admission_redis = request_path_redis(s.redis_url)
                limiter = RedisLimiter(self._admission_redis, s.gateway_id, ttl_s=s.redis_key_ttl_s)
            else:
                limiter = LocalLimiter()
            self.admission = Admission(limiter, max_running=s.admission_max_running,
                                       max_wait_s=s.admission_max_wait_s, retry_after_s=s.admission_retry_after_s,
                                       deleted_keep_s=s.admission_deleted_keep_s)
            AdmissionCollector(self.admission.stats, s.admission_max_running, self.registry)
        self.trace_windows = TraceWindows(s.trace_write_interval_s)
        # The trace windows have one reader, the TraceWriter (to Redis): without Redis they are not kept.
        self.trackers = TrackerRegistry(((self.trace_windows,) if s.redis_url else ()) + (self.predictor, self.profiles))
        self.predictor_sync: PredictorSync | None = None
        self.profile_loader: asyncio.Task | None = None
        self.observer = (Observer(self.registry, self.trackers, slo_targets=self.capacity.targets_for,
                                  on_first_token=self.capacity.first_token)
                         if s.observe_responses else None)
        self.trace_writer: TraceWriter | None = None
        self.pd: PDHandoff | None = None
        if PD_STRATEGY in self.router.strategy_names():
            self.pd = PDHandoff(PDPlanner(self.router, self.pods, PDConfig(
                threshold_tokens=s.pd_threshold_tokens, prefill_timeout_s=s.pd_prefill_timeout_s)),
                self.gateway_metrics, admission=self.admission, profiles=self.profiles,
                strategies=frozenset(n for n in s.pd_strategies.split(",") if n))
        # Responses API response id -> pod (plugin.responses): shared through Redis when there is one.
        self.responses: ResponseStore | None = None
        if s.response_ids and s.redis_url:
            from redis.asyncio import Redis
            self.responses = SharedResponseStore(s.response_ids, Redis.from_url(s.redis_url),
                                                 ttl_s=s.response_id_ttl_s)
        elif s.response_ids:
            self.responses = ResponseStore(s.response_ids)
        # Watched routes (one message, the response read by a watch stream on any replica): their words between
        # replicas go through Redis (plugin.watch).
        self.relay = (WatchRelay(s.gateway_id or default_gateway_id(), served=self.router.served,
                                 served_metric=self.gateway_metrics.served, registry=self.registry,
                                 wait_s=s.watch_wait_s)
                      if self.observer is not None else None)
        self.relay_words: RedisWords | None = None
        if self.relay is not None and s.redis_url:
            self.relay_words = RedisWords(shared_state_client(s.redis_url), self.relay)
        self.processor = ExternalProcessor(Gateway(
            router=self.router, registry=self.pods, tokenizer=self.tokenizer, metrics=self.gateway_metrics,
            default_strategy=s.routing_strategy, max_body_bytes=s.max_body_bytes,
            tokenizer_timeout_s=s.tokenizer_timeout_s, tokenizer_url=s.tokenizer_url or None,
            target_pod_header=s.target_pod_header, reachable=lambda name: not self.engines.unreachable(name),
            cached_tokens=self.tokenizer.cached if isinstance(self.tokenizer, CachedTokenizer) else None,
            tokenize_ids=self.tokenizer.tokenize_ids if isinstance(self.tokenizer, CachedTokenizer) else None,
            # the cache's, else the local tokenizer's
            tokenize_now=self.tokenizer.tokenize_now if isinstance(self.tokenizer, TokenizesNow) else None,
            sheddable_objectives=frozenset(o.strip() for o in s.sheddable_objectives.split(",") if o.strip()),
            observer=self.observer, sampler=Sampler(s.observe_sample), admission=self.admission,
            render=remote.render if remote is not None else None,
            responses=self.responses, running=self.router.running, mix=self.mix, pd=self.pd, relay=self.relay))
        self.pods.add_listener(self._on_pods)
        self._grpc: grpc.aio.Server | grpcserver.Server | None = None
        self.grpc_port: int | None = None  # once serving
        self._http: web.AppRunner | None = None
        self.health = health.aio.HealthServicer()
        # KVGATE_GRPC_TLS: the credentials (a bad certificate file fails here, naming its variable)
        # (files: read again once renewed), or None
        self._tls = server_keys(s.grpc_tls, s.grpc_tls_cert, s.grpc_tls_key, registry=self.registry)
        # KVGATE_GRPC_HEALTH_PORT's server, once serving
        self._health_grpc: grpc.aio.Server | grpcserver.Server | None = None

    async def _load_profiles(self, client, interval_s: float = 10.0) -> None:
        """AIBrix's deployment profiles (`aibrix:profile_<model>_<deployment>`), re-read every 10 s."""
        while True:
            try:
                await self.profiles.load_gpu_profiles(client)
            except Exception as e:
                log.warning("reading GPU profiles from Redis failed: %s", e)
            await asyncio.sleep(interval_s)

    def _on_engine_load(self, pod: str, load: EngineLoad) -> None:
        self.profiles.observe_engine(pod, load)
        known = self.pods.get(pod)
        if load.prefix_cache is not None and known is not None:
            self.mix.engine(pod, known.model, *load.prefix_cache)

    def _on_pods(self, added: list[Pod], removed: list[Pod]) -> None:
        # Subscriptions and index entries follow pods in and out of discovery.
        for pod in removed:
            if self.pods.get(pod.name) is None:  # on the ingest thread, before the subscriptions below change
                self.subscriptions.run_locked(partial(self.index.remove_pod, pod.name),
                                              f"removing pod {pod.name} from the index")
        if self.admission is not None:
            self.admission.pods_removed([p.name for p in removed if self.pods.get(p.name) is None])
            self.admission.pods_added([p.name for p in added])
            try:
                asyncio.get_running_loop().create_task(self.admission.expire_deleted())
            except RuntimeError:  # no loop yet (discovery's first listing): nothing deleted to expire
                pass
        self.subscriptions.sync(endpoint_specs(self.pods.pods()))
        log.info("pods: %d known (%s added, %s removed)", len(self.pods.pods()),
                 ", ".join(p.name for p in added) or "none", ", ".join(p.name for p in removed) or "none")

    def healthy(self) -> tuple[bool, str]:
        ready = sum(1 for p in self.pods.pods() if p.ready)
        return (ready > 0, f"{ready} ready pods")

    def debug(self) -> dict:
        snapshot = self.router.debug_snapshot(subscriptions=self.subscriptions.status())
        snapshot["settings"] = self.settings.redacted()
        # engine profiles as learned: the slo strategy's TTFT overhead and how far its TTFT predictions are off
        snapshot["profiles"] = {pod: self.profiles.learned(pod) for pod in self.profiles.pods()}
        snapshot["tokenizer"] = {"mode": self.settings.tokenizer,
                                 "models": self.verified_tokenizer.status() if self.verified_tokenizer else {}}
        if self.admission is not None:  # requests by outcome, waiting for room on a pod now, seconds waited
            snapshot["admission"] = self.admission.stats()
        prompts = self.router.prompts
        if prompts is not None:  # running requests whose prompts are counted on their pods, this replica's and others'
            snapshot["running_prompts"] = {"requests": len(prompts), "shared": self.prompt_relay is not None,
                                           **({"peer_claims": self.prompt_relay.peer_claims}
                                              if self.prompt_relay is not None else {})}
        if self.relay is not None:  # routed requests whose Watch waits for the words of a watch stream
            snapshot["watch"] = {"waiting": self.relay.waiting, "gateway_id": self.relay.gateway_id}
        snapshot["routing_mix"] = self.mix.snapshot()
        snapshot["recent_errors"] = self.recent_errors.snapshot()
        snapshot["time"] = time.time()  # when this snapshot was taken (unix s)
        return snapshot

    async def set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in READINESS:
            await self.health.set(service, status)

    async def start(self) -> tuple[int, int]:
        """Serve gRPC (liveness SERVING, readiness not yet) and HTTP, then sync discovery, start the
        event subscriptions and the router: readiness SERVING."""
        s = self.settings
        logging.getLogger().addHandler(self.recent_errors)
        await self.set_ready(False)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self._grpc, grpc_port = await self._serve_grpc("KVGATE_GRPC_PORT", s.grpc_port, ext_proc=True, tls=self._tls)
        if s.grpc_health_port:
            # the health services alone, in plaintext: Kubernetes' gRPC probes speak no TLS
            self._health_grpc, _ = await self._serve_grpc("KVGATE_GRPC_HEALTH_PORT", s.grpc_health_port,
                                                          ext_proc=False, tls=None)
        self.grpc_port = grpc_port
        http_app = build_http_app(self.registry, healthy=self.healthy, debug=self.debug)
        self._http = web.AppRunner(http_app, access_log=None)
        await self._http.setup()
        await web.TCPSite(self._http, s.listen_host, s.http_port, reuse_port=False).start()
        addresses = self._http.addresses  # (host, port, ...) of each listening socket; port 0 is resolved here
        http_port = addresses[0][1] if addresses else s.http_port
        await self.source.start(self.pods)
        self.subscriptions.sync(endpoint_specs(self.pods.pods()))
        await self.router.start()
        if self.prompt_relay is not None:
            self.prompt_relay.start()
        if self.prefill_counts is not None:
            await self.prefill_counts.start()
        if self.admission is not None and isinstance(self.admission.limiter, RedisLimiter):
            self.admission.limiter.start()
        if self.relay_words is not None:
            self.relay_words.start()
            try:  # words published before this replica reads its channel are lost: a moment for the first try
                await asyncio.wait_for(self.relay_words.first_try.wait(), timeout=2.0)
            except asyncio.TimeoutError:
                log.warning("watch: no answer from Redis to the channel's subscription within 2 s; serving (words from "
                            "other replicas lost until it is read)")
        if s.redis_url and self.observer is not None:
            from redis.asyncio import Redis
            self.trace_writer = TraceWriter(self.trace_windows, Redis.from_url(s.redis_url))
            self.trace_writer.start()
            self.predictor_sync = PredictorSync(self.predictor, Redis.from_url(s.redis_url))
            self.predictor_sync.start()
            self.profile_loader = asyncio.get_running_loop().create_task(
                self._load_profiles(Redis.from_url(s.redis_url)))
        await self.set_ready(True)
        log.info("kvgate serving: ext_proc on %s (%s), HTTP on %s:%d, strategy %s, %d pods",
                 _join(s.listen_host, grpc_port), "plaintext" if self._tls is None else f"TLS, {s.grpc_tls}",
                 s.listen_host, http_port, s.routing_strategy, len(self.pods.pods()))
        return grpc_port, http_port

    async def _serve_grpc(self, variable: str, port: int, *, ext_proc: bool, tls: ServerKeys | None
                          ) -> tuple[grpc.aio.Server | grpcserver.Server, int]:
        """A gRPC server of KVGATE_GRPC_SERVER's kind on `port`: ext_proc and health, or health alone; TLS with
        `tls`'s certificate and key. (The server, the port it listens on); OSError naming `variable` when it
        cannot listen."""
        address = _join(self.settings.listen_host, port)
        try:
            if self.settings.grpc_server == "kvgate":
                return await self._kvgate_server(port, ext_proc, tls)
            return await self._grpcio_server(address, ext_proc, tls)
        except OSError as e:
            raise OSError(f"{variable}: cannot listen on {address}"
                          + ("" if tls is None else " with KVGATE_GRPC_TLS's certificate and key")
                          + (f" ({e.strerror or e})" if str(e) else "")) from None

    async def _kvgate_server(self, port: int, ext_proc: bool, tls: ServerKeys | None
                             ) -> tuple[grpcserver.Server, int]:
        # one count of protocol errors for both ports, registered by the ext_proc port's server (started first)
        ext_proc_server = self._grpc if isinstance(self._grpc, grpcserver.Server) else None
        server = grpcserver.Server(self.registry if ext_proc else None,
                                   None if ext_proc or ext_proc_server is None else ext_proc_server.protocol_errors,
                                   keepalive_s=self.settings.grpc_keepalive_s)
        if ext_proc:
            server.add(grpcserver.EXT_PROC_SERVICE, grpcserver.ext_proc_methods(self.processor))
        server.add(grpcserver.HEALTH_SERVICE, grpcserver.health_methods(self.health))
        port = await server.listen(self.settings.listen_host, port, None if tls is None else tls.context)
        return server, port

    async def _grpcio_server(self, address: str, ext_proc: bool, tls: ServerKeys | None
                             ) -> tuple[grpc.aio.Server, int]:
        """so_reuseport off: a stale kvgate on the same port must not keep taking Envoy's streams. Envoy's buffer
        limit bounds bodies; gRPC's default 4 MiB would turn larger valid ones into 500s. gRPC refuses new
        streams beyond 1,000 (3,000 at most) not yet taken by the event loop: a burst of new HTTP requests above
        that failed with 500 while the loop caught up. One stream per in-flight request, 10,000+ of them: let
        them queue instead."""
        keepalive_ms = round(self.settings.grpc_keepalive_s * 1000)
        options = [("grpc.so_reuseport", 0), ("grpc.keepalive_time_ms", keepalive_ms),
                   ("grpc.keepalive_timeout_ms", keepalive_ms), ("grpc.http2.max_pings_without_data", 0)]
        if ext_proc:
            options += [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                        ("grpc.server.max_pending_requests", 100_000),
                        ("grpc.server.max_pending_requests_hard_limit", 100_000)]
        server = grpc.aio.server(options=options)
        if ext_proc:
            pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = (server.add_insecure_port(address) if tls is None
                else server.add_secure_port(address, tls.grpcio_credentials()))
        if port == 0:
            raise OSError("")
        await server.start()
        return server, port

    async def wait(self) -> None:
        assert self._grpc is not None
        await self._grpc.wait_for_termination()

    async def drain(self, delay_s: float, timeout_s: float) -> None:
        """A graceful stop (SIGTERM, a rolling update): readiness NOT_SERVING while new streams are still
        served for `delay_s` (the data plane's health checks take them elsewhere meanwhile), then new
        streams are refused and in-flight ones get `timeout_s` to finish."""
        await self.set_ready(False)
        log.info("draining: readiness NOT_SERVING; new streams refused in %.1f s", delay_s)
        await asyncio.sleep(delay_s)
        await self.stop(timeout_s)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self._health_grpc is not None:
            await self._health_grpc.stop(0)
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        await self.processor.drain()
        if self.relay is not None:
            await self.relay.aclose()
        if self.relay_words is not None:
            await self.relay_words.aclose()
        if self.prompt_relay is not None:
            await self.prompt_relay.aclose()
        if self.pd is not None:
            await self.pd.aclose()
        if self._http is not None:
            await self._http.cleanup()
        await self.subscriptions.aclose()
        await self.source.stop()
        await self.router.close()
        if self.prefill_counts is not None:
            await self.prefill_counts.close()
        if self.admission is not None and isinstance(self.admission.limiter, RedisLimiter):
            await self.admission.limiter.aclose()
        if self.trace_writer is not None:
            await self.trace_writer.aclose()
        if self.predictor_sync is not None:
            await self.predictor_sync.aclose()
        if self.profile_loader is not None:
            self.profile_loader.cancel()
        if self.responses is not None:
            await self.responses.close()
        await self.tokenizer.aclose()
        logging.getLogger().removeHandler(self.recent_errors)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
