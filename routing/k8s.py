"""Kubernetes pod discovery: list + watch pods by label selector through the API server.

A pod enters the registry when it has the model label, an IP, phase Running and no
deletion timestamp; it is `ready` (routable) when its Ready condition is True too.
Labels (AIBrix's): `model.aibrix.ai/name` (base model), `model.aibrix.ai/port` (default
8000), `model.aibrix.ai/kv-events-enabled` ("true"), `model.aibrix.ai/lora-id`
(comma-separated adapters; the same key as an annotation also counts, since label values
cannot hold commas). Annotations (ours): `kvgate.io/dp-size`, `kvgate.io/kv-events-pub-port`,
`kvgate.io/kv-events-replay-port` ("none" for no replay socket).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp

from routing.discovery import kv_events_from_mapping
from routing.errors import DiscoveryError
from routing.metrics import RoutingMetrics
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry

log = logging.getLogger(__name__)

MODEL_LABEL = "model.aibrix.ai/name"
PORT_LABEL = "model.aibrix.ai/port"
KV_EVENTS_LABEL = "model.aibrix.ai/kv-events-enabled"
LORA_LABEL = "model.aibrix.ai/lora-id"
DP_SIZE_ANNOTATION = "kvgate.io/dp-size"
PUB_PORT_ANNOTATION = "kvgate.io/kv-events-pub-port"
REPLAY_PORT_ANNOTATION = "kvgate.io/kv-events-replay-port"

_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_MAX_LINE = 16 << 20


@dataclass(frozen=True)
class KubernetesConfig:
    api_url: str = ""  # empty: in-cluster, https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    namespace: str = ""  # empty: the service account's namespace (all namespaces if none)
    label_selector: str = MODEL_LABEL
    token_file: str = f"{_SA_DIR}/token"
    ca_file: str = f"{_SA_DIR}/ca.crt"
    namespace_file: str = f"{_SA_DIR}/namespace"
    watch_timeout_s: int = 300
    request_timeout_s: float = 10.0
    backoff_min_s: float = 0.5
    backoff_max_s: float = 10.0


class _Gone(Exception):
    """The resourceVersion is too old (HTTP 410): list again."""


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
    return kv_events_from_mapping(spec, where)


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
    return Pod(
        name=f"{meta.get('namespace')}/{name}" if qualify else name,
        address=ip,
        port=_int(labels.get(PORT_LABEL, 8000), f"{where} {PORT_LABEL}", 1, 65535),
        model=model,
        lora=lora,
        kv_events=kv,
        ready=ready,
    )


class KubernetesSource:
    def __init__(self, config: KubernetesConfig = KubernetesConfig(), *, metrics: RoutingMetrics | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._cfg = config
        self._metrics = metrics or RoutingMetrics()
        api = config.api_url
        if not api:
            host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise DiscoveryError("Kubernetes discovery: KVGATE_K8S_API_URL is empty and KUBERNETES_SERVICE_HOST "
                                     "is unset (not in a cluster?)")
            api = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self._api = api.rstrip("/")
        ns = config.namespace
        if not ns and os.path.exists(config.namespace_file):
            with open(config.namespace_file, encoding="utf-8") as f:
                ns = f.read().strip()
        self.namespace = ns
        self._path = f"/api/v1/namespaces/{ns}/pods" if ns else "/api/v1/pods"
        self._objects: dict[str, Pod] = {}  # by uid (or name) -> pod, only those that can take traffic
        self._registry: PodRegistry | None = None
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self.resource_version = ""
        self.lists = 0
        self.errors = 0
        self.skipped = 0

    @property
    def source(self) -> str:
        return f"Kubernetes {self._api}{self._path}?labelSelector={self._cfg.label_selector}"

    def _headers(self) -> dict[str, str]:
        try:
            with open(self._cfg.token_file, encoding="utf-8") as f:  # re-read: bound tokens rotate
                token = f.read().strip()
        except OSError:
            return {}
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _ssl(self) -> ssl.SSLContext | None:
        if self._api.startswith("https://") and os.path.exists(self._cfg.ca_file):
            return ssl.create_default_context(cafile=self._cfg.ca_file)
        return None

    async def start(self, registry: PodRegistry) -> None:
        self._registry = registry
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl() or True))
        try:
            await self._list()
        except Exception as e:
            await self._session.close()
            raise DiscoveryError(f"{self.source}: first list failed: {type(e).__name__}: {e}") from None
        self._task = asyncio.create_task(self._run(), name="kvgate-k8s-pods")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

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

    async def _list(self) -> None:
        assert self._session is not None
        async with self._session.get(self._api + self._path, params={"labelSelector": self._cfg.label_selector},
                                     headers=self._headers(),
                                     timeout=aiohttp.ClientTimeout(total=self._cfg.request_timeout_s)) as resp:
            if resp.status != 200:
                raise DiscoveryError(f"{self.source}: list answered HTTP {resp.status}: {(await resp.text())[:200]}")
            body = await resp.json(content_type=None)
        objects: dict[str, Pod] = {}
        for item in body.get("items") or []:
            pod = self._pod(item)
            if pod is not None:
                objects[self._key(item)] = pod
        self._objects = objects
        self.resource_version = (body.get("metadata") or {}).get("resourceVersion", "")
        self.lists += 1
        self._publish()

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise DiscoveryError(f"{self.source}: watch error {obj.get('code')}: {obj.get('message')}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.resource_version = rv
        if kind == "BOOKMARK":
            return
        key = self._key(obj)
        pod = self._pod(obj) if kind in ("ADDED", "MODIFIED") else None
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("ignoring watch event of type %r", kind)
            return
        before = self._objects.get(key)
        if pod is None:
            self._objects.pop(key, None)
        else:
            self._objects[key] = pod
        if before != pod:
            self._publish()

    async def _watch(self) -> None:
        assert self._session is not None
        params = {"labelSelector": self._cfg.label_selector, "watch": "1", "allowWatchBookmarks": "true",
                  "resourceVersion": self.resource_version, "timeoutSeconds": str(self._cfg.watch_timeout_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._cfg.request_timeout_s,
                                        sock_read=self._cfg.watch_timeout_s + 30)
        async with self._session.get(self._api + self._path, params=params, headers=self._headers(),
                                     timeout=timeout) as resp:
            if resp.status == 410:
                raise _Gone()
            if resp.status != 200:
                raise DiscoveryError(f"{self.source}: watch answered HTTP {resp.status}: {(await resp.text())[:200]}")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._apply(json.loads(line))
                if len(buf) > _MAX_LINE:
                    raise DiscoveryError(f"{self.source}: watch line longer than {_MAX_LINE} bytes")

    async def _run(self) -> None:
        backoff = self._cfg.backoff_min_s
        relist = False
        while True:
            try:
                if relist:
                    await self._list()
                    relist = False
                started = asyncio.get_running_loop().time()
                await self._watch()  # ends when the server closes the watch (timeoutSeconds): watch again
                if asyncio.get_running_loop().time() - started < 1.0:  # a server ending watches at once: no busy loop
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self._cfg.backoff_max_s)
                else:
                    backoff = self._cfg.backoff_min_s
            except asyncio.CancelledError:
                raise
            except _Gone:
                log.info("pod watch: resourceVersion %s expired, listing again", self.resource_version)
                relist = True
            except Exception as e:
                self.errors += 1
                self._metrics.discovery_errors.labels("kubernetes").inc()
                log.warning("pod watch failed (%s: %s); retrying in %.1fs", type(e).__name__, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._cfg.backoff_max_s)
                relist = True
