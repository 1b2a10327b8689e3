"""Kubernetes pod discovery: list + watch pods by label selector through the API server.

A pod enters the registry when it has the model label, an IP, phase Running and no
deletion timestamp; it is `ready` (routable) when its Ready condition is True too.
Labels (AIBrix's): `model.aibrix.ai/name` (base model), `model.aibrix.ai/port` (default
8000), `model.aibrix.ai/kv-events-enabled` ("true"), `model.aibrix.ai/lora-id`
(comma-separated adapters; the same key as an annotation also counts, since label values
cannot hold commas). Prefill/decode roles: AIBrix's `role-name` (`prefill` or `decode`; another role name serves
whole requests) grouped by `roleset-name`, or llm-d's `llm-d.ai/role` (`prefill`, `decode`, `both`; llm-d's
`prefill-decode` too). Annotations (ours): `kvgate.io/dp-size`, `kvgate.io/kv-events-pub-port`,
`kvgate.io/kv-events-replay-port` ("none" for no replay socket).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from routing.discovery.static import kv_events_from_fields
from routing.errors import DiscoveryError
from routing.discovery.kube import Api, ApiConfig, ListWatch
from routing.metrics import RoutingMetrics
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry

log = logging.getLogger(__name__)

MODEL_LABEL = "model.aibrix.ai/name"
PORT_LABEL = "model.aibrix.ai/port"
KV_EVENTS_LABEL = "model.aibrix.ai/kv-events-enabled"
LORA_LABEL = "model.aibrix.ai/lora-id"
ROLE_LABEL = "role-name"  # AIBrix StormService
ROLESET_LABEL = "roleset-name"
LLMD_ROLE_LABEL = "llm-d.ai/role"
DP_SIZE_ANNOTATION = "kvgate.io/dp-size"
PUB_PORT_ANNOTATION = "kvgate.io/kv-events-pub-port"
REPLAY_PORT_ANNOTATION = "kvgate.io/kv-events-replay-port"


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str = ""  # empty: the service account's namespace (all namespaces if none)
    label_selector: str = MODEL_LABEL
    api: ApiConfig = field(default_factory=ApiConfig)  # the API server's address, credentials, timeouts


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise DiscoveryError(f"{where}: expected an integer, got {value!r}") from None
    if not lo <= n <= hi:
        raise DiscoveryError(f"{where}: expected {lo}-{hi}, got {n}")
    return n


def kv_events_from_annotations(annotations: Mapping[str, Any], where: str) -> KVEventsEndpoint:
    """Where a pod publishes KV events, from its annotations (dp size, pub and replay ports; the
    defaults otherwise). Raises DiscoveryError for values that cannot be used."""
    spec: dict[str, Any] = {"dp_size": _int(annotations.get(DP_SIZE_ANNOTATION, 1), f"{where} {DP_SIZE_ANNOTATION}",
                                            1, 1024)}
    if PUB_PORT_ANNOTATION in annotations:
        spec["pub_port"] = _int(annotations[PUB_PORT_ANNOTATION], f"{where} {PUB_PORT_ANNOTATION}", 1, 65535)
    if REPLAY_PORT_ANNOTATION in annotations:
        raw = annotations[REPLAY_PORT_ANNOTATION]
        spec["replay_port"] = None if str(raw).lower() == "none" else _int(
            raw, f"{where} {REPLAY_PORT_ANNOTATION}", 1, 65535)
    return kv_events_from_fields(spec, where)


def role_from_labels(labels: Mapping[str, Any]) -> tuple[str, str]:
    """(role, roleset) from a pod's labels: llm-d's `llm-d.ai/role`, else AIBrix's `role-name` and `roleset-name`.
    A value that names neither prefill nor decode is a pod that serves whole requests ("both")."""
    raw = labels.get(LLMD_ROLE_LABEL) or labels.get(ROLE_LABEL) or ""
    role = str(raw).strip().lower()
    if role not in ("prefill", "decode"):
        role = "both"
    return role, str(labels.get(ROLESET_LABEL) or "").strip()


def pod_from_object(obj: Mapping[str, Any], *, qualify: bool = False) -> Pod | None:
    """The Pod for a Kubernetes pod object, or None while it cannot take traffic at all.
    Raises DiscoveryError for labels or annotations that cannot be used."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    name = meta.get("name") or ""
    where = f"pod {meta.get('namespace', '')}/{name}"
    model = labels.get(MODEL_LABEL)
    ip = status.get("podIP")
    if not model or not ip or status.get("phase") != "Running" or meta.get("deletionTimestamp"):
        return None
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    kv = None
    if str(labels.get(KV_EVENTS_LABEL, "")).lower() == "true":
        kv = kv_events_from_annotations(annotations, where)
    lora_raw = ",".join(x for x in (labels.get(LORA_LABEL, ""), annotations.get(LORA_LABEL, "")) if x)
    lora = tuple(dict.fromkeys(x.strip() for x in lora_raw.split(",") if x.strip()))
    role, roleset = role_from_labels(labels)
    return Pod(
        name=f"{meta.get('namespace')}/{name}" if qualify else name,
        address=ip,
        port=_int(labels.get(PORT_LABEL, 8000), f"{where} {PORT_LABEL}", 1, 65535),
        model=model,
        lora=lora,
        kv_events=kv,
        ready=ready,
        role=role,
        roleset=roleset,
    )


class KubernetesSource:
    """Pods by label selector: one `ListWatch` (routing.discovery.kube) over the pods collection; every change
    that alters a routable pod republishes the registry."""

    def __init__(self, config: KubernetesConfig = KubernetesConfig(), *, metrics: RoutingMetrics | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self._cfg = config
        self._metrics = metrics or RoutingMetrics()
        self._api = Api(config.api, environ)
        self.namespace = self._api.namespace(config.namespace)
        path = f"/api/v1/namespaces/{self.namespace}/pods" if self.namespace else "/api/v1/pods"
        self._watch = ListWatch(self._api, path, {"labelSelector": config.label_selector}, what=self.source_of(path),
                                on_list=self._on_list, on_event=self._on_event, on_error=self._on_error)
        self._objects: dict[str, Pod] = {}  # by uid (or name) -> pod, only those that can take traffic
        self._registry: PodRegistry | None = None
        self._task: asyncio.Task | None = None
        self.errors = 0
        self.skipped = 0

    def source_of(self, path: str) -> str:
        return f"Kubernetes {self._api.url}{path}?labelSelector={self._cfg.label_selector}"

    @property
    def source(self) -> str:
        return self._watch.what

    @property
    def resource_version(self) -> str:
        return self._watch.resource_version

    async def start(self, registry: PodRegistry) -> None:
        self._registry = registry
        try:
            await self._watch.list()
        except Exception as e:
            await self._api.close()
            raise DiscoveryError(f"{self.source}: first list failed: {type(e).__name__}: {e}") from None
        self._task = asyncio.create_task(self._watch.run(), name="kvgate-k8s-pods")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._api.close()

    # -- state ----------------------------------------------------------------------------------

    def _key(self, obj: Mapping[str, Any]) -> str:
        meta = obj.get("metadata") or {}
        return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"

    def _pod(self, obj: Mapping[str, Any]) -> Pod | None:
        try:
            return pod_from_object(obj, qualify=not self.namespace)
        except DiscoveryError as e:
            self.skipped += 1
            self._metrics.discovery_errors.labels("kubernetes").inc()
            log.error("skipping %s", e)
            return None

    def _publish(self) -> None:
        assert self._registry is not None
        pods = {p.name: p for p in self._objects.values()}  # a name reused by a new uid: the latest wins
        self._registry.replace(pods.values())
        self._metrics.discovery_pods.set(len(pods))

    def _on_list(self, items: list[dict]) -> None:
        objects: dict[str, Pod] = {}
        for item in items:
            pod = self._pod(item)
            if pod is not None:
                objects[self._key(item)] = pod
        self._objects = objects
        self._publish()

    def _on_event(self, kind: str, obj: dict) -> None:
        key = self._key(obj)
        pod = self._pod(obj) if kind != "DELETED" else None
        before = self._objects.get(key)
        if pod is None:
            self._objects.pop(key, None)
        else:
            self._objects[key] = pod
        if before != pod:
            self._publish()

    def _on_error(self) -> None:
        self.errors += 1
        self._metrics.discovery_errors.labels("kubernetes").inc()
