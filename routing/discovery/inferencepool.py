"""InferencePool discovery (Gateway API Inference Extension, inference.networking.k8s.io/v1):
watch one InferencePool and the pods its selector matches; every (pod IP, target port) is an
endpoint. The models an endpoint serves (its base model and LoRA adapters) come from the
engine's own `/v1/models`, fetched when the endpoint appears and refreshed periodically.

A pod is an endpoint while it is Running with an IP and not being deleted; it is `ready` while
its Ready condition is True. An engine whose `/v1/models` cannot be read (an API key on it, say)
is still routable when its pod carries the model label `model.aibrix.ai/name` (adapters:
`model.aibrix.ai/lora-id`, as for label discovery); otherwise it waits until its models are known. KV events: the label `model.aibrix.ai/kv-events-enabled: "true"` or
the annotation `kvgate.io/kv-events-pub-port` turns them on (ports and data-parallel size from the
`kvgate.io/*` annotations, as for label discovery); with several target ports, the endpoint on the
i-th port publishes on the annotated ports + i.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import httpx

from routing.errors import DiscoveryError
from routing.discovery.k8s import (KV_EVENTS_LABEL, LORA_LABEL, MODEL_LABEL, PUB_PORT_ANNOTATION, _int,
                         kv_events_from_annotations, role_from_labels)
from routing.discovery.kube import Api, ApiConfig, ListWatch
from routing.metrics import RoutingMetrics
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry

log = logging.getLogger(__name__)

GROUP_VERSION = "inference.networking.k8s.io/v1"


@dataclass(frozen=True)
class InferencePoolConfig:
    name: str
    namespace: str = ""  # empty: the service account's namespace
    api: ApiConfig = field(default_factory=ApiConfig)
    models_refresh_s: float = 30.0  # KVGATE_POOL_MODELS_REFRESH_S
    models_timeout_s: float = 2.0


@dataclass(frozen=True)
class PoolSpec:
    selector: tuple[tuple[str, str], ...]  # matchLabels, sorted
    ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.selector)


def pool_spec(obj: Mapping[str, Any]) -> PoolSpec:
    """The selector and target ports of an InferencePool object; DiscoveryError for unusable content."""
    meta = obj.get("metadata") or {}
    where = f"InferencePool {meta.get('namespace', '')}/{meta.get('name', '')}"
    spec = obj.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not labels:
        raise DiscoveryError(f"{where}: spec.selector.matchLabels is empty")
    ports = tuple(_int((p or {}).get("number"), f"{where} spec.targetPorts", 1, 65535)
                  for p in spec.get("targetPorts") or [])
    if not ports:
        raise DiscoveryError(f"{where}: spec.targetPorts is empty")
    return PoolSpec(tuple(sorted((str(k), str(v)) for k, v in labels.items())), ports)


@dataclass(frozen=True)
class Member:
    """A pod the pool's selector matches, while it can take traffic at all."""

    name: str
    ip: str
    ready: bool
    kv_events: KVEventsEndpoint | None
    labelled: tuple[str, tuple[str, ...]] | None = None  # models from the pod's labels, if it has them
    role: str = "both"  # prefill/decode role and group from its labels (k8s.role_from_labels)
    roleset: str = ""


def member_from_object(obj: Mapping[str, Any]) -> Member | None:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running" or meta.get("deletionTimestamp"):
        return None
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    where = f"pod {meta.get('namespace', '')}/{meta.get('name', '')}"
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    kv = None
    if str(labels.get(KV_EVENTS_LABEL, "")).lower() == "true" or PUB_PORT_ANNOTATION in annotations:
        kv = kv_events_from_annotations(annotations, where)
    labelled = None
    if labels.get(MODEL_LABEL):
        raw = ",".join(x for x in (labels.get(LORA_LABEL, ""), annotations.get(LORA_LABEL, "")) if x)
        labelled = (str(labels[MODEL_LABEL]), tuple(dict.fromkeys(x.strip() for x in raw.split(",") if x.strip())))
    role, roleset = role_from_labels(labels)
    return Member(name=meta.get("name") or "", ip=ip, ready=ready, kv_events=kv, labelled=labelled, role=role,
                  roleset=roleset)


def parse_models(body: Any) -> tuple[str, tuple[str, ...]]:
    """(base model, LoRA adapters) from an OpenAI-style `/v1/models` answer as vLLM gives it: the
    adapters name their base model in `parent`; the base model has none."""
    data = body.get("data") if isinstance(body, Mapping) else None
    if not isinstance(data, list) or not data:
        raise ValueError("no models listed")
    ids = [(str(m.get("id") or ""), m.get("parent")) for m in data if isinstance(m, Mapping)]
    bases = [i for i, parent in ids if i and not parent]
    if not bases:
        raise ValueError("no base model (every entry names a parent)")
    return bases[0], tuple(i for i, parent in ids if i and parent)


class InferencePoolSource:
    """Keeps a PodRegistry equal to the pool's endpoints whose models are known."""

    def __init__(self, config: InferencePoolConfig, *, metrics: RoutingMetrics | None = None,
                 environ: Mapping[str, str] | None = None, client: httpx.AsyncClient | None = None) -> None:
        if not config.name:
            raise DiscoveryError("InferencePool discovery: KVGATE_INFERENCEPOOL_NAME is empty")
        self._cfg = config
        self._metrics = metrics or RoutingMetrics()
        self._api = Api(config.api, environ)
        self.namespace = self._api.namespace(config.namespace)
        if not self.namespace:
            raise DiscoveryError("InferencePool discovery: KVGATE_K8S_NAMESPACE is empty and there is no "
                                 "service account namespace")
        self._client = client
        self._own_client = client is None
        self.spec: PoolSpec | None = None
        self._found = asyncio.Event()
        self._members: dict[str, Member] = {}  # by pod uid (or name)
        self._models: dict[tuple[str, int], tuple[str, tuple[str, ...]]] = {}  # (ip, port) -> base, adapters
        self._fetching: set[tuple[str, int]] = set()
        self._registry: PodRegistry | None = None
        self._pods: ListWatch | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._fetches: set[asyncio.Task] = set()
        base = f"/apis/{GROUP_VERSION}/namespaces/{self.namespace}/inferencepools"
        self._pool = ListWatch(self._api, base, {"fieldSelector": f"metadata.name={config.name}"},
                               what=f"InferencePool {self.namespace}/{config.name}", on_list=self._pool_list,
                               on_event=self._pool_event, on_error=self._count_error)

    @property
    def source(self) -> str:
        return f"InferencePool {self.namespace}/{self._cfg.name} at {self._api.url}"

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, registry: PodRegistry) -> None:
        """Returns once the pool is found, its pods listed and their models asked for: discovery synced.
        Waits (logging) while the pool does not exist yet."""
        self._registry = registry
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._cfg.models_timeout_s)
        try:
            await self._pool.list()
        except Exception as e:
            await self.stop()
            raise DiscoveryError(f"{self.source}: first list failed: {type(e).__name__}: {e}") from None
        self._tasks["pool"] = asyncio.create_task(self._pool.run(), name="kvgate-inferencepool")
        while not self._found.is_set():
            try:
                await asyncio.wait_for(self._found.wait(), 30)
            except asyncio.TimeoutError:
                log.warning("%s: not found yet; waiting for it", self.source)
        while True:  # the pods' first list (restarted if the pool's selector changed meanwhile)
            task = self._tasks["pods-start"]
            try:
                await asyncio.shield(task)
                break
            except asyncio.CancelledError:
                if self._tasks.get("pods-start") is task:
                    raise
        self._tasks["models"] = asyncio.create_task(self._refresh_models(), name="kvgate-pool-models")

    async def stop(self) -> None:
        tasks = list(self._tasks.values()) + list(self._fetches)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        await self._api.close()
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- the pool -------------------------------------------------------------------------------

    def _pool_list(self, items: list[dict]) -> None:
        if not items:
            log.warning("%s: no such InferencePool", self.source)
            return
        self._pool_event("MODIFIED", items[0])

    def _pool_event(self, kind: str, obj: dict) -> None:
        if kind == "DELETED":
            log.warning("%s: deleted; keeping its last pods until it is back", self.source)
            return
        try:
            spec = pool_spec(obj)
        except DiscoveryError as e:
            self._count_error()
            log.error("%s", e)
            return
        if spec == self.spec:
            return
        log.info("%s: selector %s, target ports %s", self.source, spec.label_selector, list(spec.ports))
        self.spec = spec
        self._watch_pods(spec)
        self._found.set()

    def _watch_pods(self, spec: PoolSpec) -> None:
        """(Re)start the pods' list+watch for the pool's selector."""
        for key in ("pods-start", "pods"):
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()
        self._pods = ListWatch(self._api, f"/api/v1/namespaces/{self.namespace}/pods",
                               {"labelSelector": spec.label_selector}, what=f"pods of {self.source}",
                               on_list=self._pods_list, on_event=self._pods_event, on_error=self._count_error)
        self._tasks["pods-start"] = asyncio.create_task(self._start_pods(self._pods))

    async def _start_pods(self, watch: ListWatch) -> None:
        while True:
            try:
                await watch.list()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._count_error()
                log.warning("%s: list failed (%s); retrying", watch.what, e)
                await asyncio.sleep(self._cfg.api.backoff_min_s)
        await self._fetch_missing()
        self._tasks["pods"] = asyncio.create_task(watch.run(), name="kvgate-pool-pods")

    # -- the pods -------------------------------------------------------------------------------

    @staticmethod
    def _key(obj: Mapping[str, Any]) -> str:
        meta = obj.get("metadata") or {}
        return meta.get("uid") or meta.get("name") or ""

    def _member(self, obj: Mapping[str, Any]) -> Member | None:
        try:
            return member_from_object(obj)
        except DiscoveryError as e:
            self._count_error()
            log.error("skipping %s", e)
            return None

    def _pods_list(self, items: list[dict]) -> None:
        members = {}
        for obj in items:
            m = self._member(obj)
            if m is not None:
                members[self._key(obj)] = m
        self._members = members
        self._publish()

    async def _pods_event(self, kind: str, obj: dict) -> None:
        key = self._key(obj)
        m = self._member(obj) if kind != "DELETED" else None
        before = self._members.get(key)
        if m is None:
            self._members.pop(key, None)
        else:
            self._members[key] = m
        if m != before:
            self._publish()
            if m is not None:
                self._spawn_fetches()

    # -- models ---------------------------------------------------------------------------------

    def _endpoints(self) -> list[tuple[str, int]]:
        ports = self.spec.ports if self.spec else ()
        return [(m.ip, port) for m in self._members.values() for port in ports]

    async def _fetch(self, ip: str, port: int) -> bool:
        """The endpoint's models into the table; True if they changed."""
        host = f"[{ip}]" if ":" in ip else ip
        assert self._client is not None
        try:
            resp = await self._client.get(f"http://{host}:{port}/v1/models", timeout=self._cfg.models_timeout_s)
            resp.raise_for_status()
            models = parse_models(resp.json())
        except Exception as e:
            log.debug("models of %s:%d unknown (%s: %s)", ip, port, type(e).__name__, e)
            return False
        changed = self._models.get((ip, port)) != models
        self._models[(ip, port)] = models
        return changed

    async def _fetch_missing(self) -> None:
        missing = [e for e in self._endpoints() if e not in self._models and e not in self._fetching]
        if not missing:
            return
        self._fetching.update(missing)
        try:
            results = await asyncio.gather(*(self._fetch(*e) for e in missing))
        finally:
            self._fetching.difference_update(missing)
        if any(results):
            self._publish()

    def _spawn_fetches(self) -> None:
        task = asyncio.create_task(self._fetch_missing())
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)

    async def _refresh_models(self) -> None:
        """Every models_refresh_s: every endpoint's models again (adapters load and unload at run time),
        dropping what belongs to endpoints that left."""
        while True:
            await asyncio.sleep(self._cfg.models_refresh_s)
            current = set(self._endpoints())
            for gone in [e for e in self._models if e not in current]:
                del self._models[gone]
            results = await asyncio.gather(*(self._fetch(*e) for e in current))
            if any(results):
                self._publish()

    # -- the registry ---------------------------------------------------------------------------

    def pods(self) -> list[Pod]:
        """Every endpoint whose models are known, as routing Pods."""
        if self.spec is None:
            return []
        ports = self.spec.ports
        out = []
        for m in self._members.values():
            for i, port in enumerate(ports):
                models = self._models.get((m.ip, port)) or m.labelled
                if models is None:
                    continue
                kv = m.kv_events
                if kv is not None and i:
                    kv = replace(kv, pub_port=kv.pub_port + i,
                                 replay_port=None if kv.replay_port is None else kv.replay_port + i)
                out.append(Pod(name=m.name if len(ports) == 1 else f"{m.name}:{port}", address=m.ip, port=port,
                               model=models[0], lora=models[1], kv_events=kv, ready=m.ready, role=m.role,
                               roleset=m.roleset))
        return out

    def _publish(self) -> None:
        if self._registry is None:
            return
        pods = {p.name: p for p in self.pods()}  # a name reused by a new pod: the latest wins
        self._registry.replace(pods.values())
        self._metrics.discovery_pods.set(len(pods))

    def _count_error(self) -> None:
        self._metrics.discovery_errors.labels("inferencepool").inc()
