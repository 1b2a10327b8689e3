"""Kubernetes discovery against a local aiohttp server speaking the API's pod list and watch."""
from __future__ import annotations

import asyncio
import copy
import json

import pytest
from aiohttp import web

from routing.errors import DiscoveryError
from routing.discovery.k8s import KubernetesConfig, KubernetesSource, pod_from_object
from routing.discovery.kube import ApiConfig
from routing.metrics import RoutingMetrics
from routing.pods import KVEventsEndpoint
from routing.registry import PodRegistry
from helpers import serve_app, wait_until_async

NS = "llm"


def k8s_pod(name, *, ip="10.1.0.1", phase="Running", ready=True, labels=None, annotations=None, uid=None):
    base_labels = {"model.aibrix.ai/name": "llama"}
    base_labels.update(labels or {})
    return {
        "metadata": {"name": name, "namespace": NS, "uid": uid or f"uid-{name}", "labels": base_labels,
                     "annotations": annotations or {}, "resourceVersion": "0"},
        "status": {"phase": phase, "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


class FakeAPI:
    """Pods in one namespace; list returns them with a resourceVersion, watch streams events."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.rv = 10
        self.watchers: list[asyncio.Queue] = []
        self.lists = 0
        self.watches = 0
        self.gone_on_next_watch = False
        self.auth: list[str | None] = []
        self.selectors: list[str] = []

    def _stamp(self, obj) -> dict:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return obj

    def put(self, obj, *, announce=True) -> None:
        kind = "MODIFIED" if obj["metadata"]["name"] in self.pods else "ADDED"
        obj = self._stamp(obj)
        self.pods[obj["metadata"]["name"]] = obj
        if announce:
            self.send({"type": kind, "object": obj})

    def delete(self, name) -> None:
        obj = self._stamp(self.pods.pop(name))
        self.send({"type": "DELETED", "object": obj})

    def send(self, event) -> None:
        for q in self.watchers:
            q.put_nowait(event)

    def end_watches(self) -> None:
        for q in self.watchers:
            q.put_nowait(None)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        self.selectors.append(request.query.get("labelSelector", ""))
        if request.query.get("watch") != "1":
            self.lists += 1
            return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": str(self.rv)},
                                      "items": list(self.pods.values())})
        self.watches += 1
        if self.gone_on_next_watch:
            self.gone_on_next_watch = False
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired"}, status=410)
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        q: asyncio.Queue = asyncio.Queue()
        self.watchers.append(q)
        try:
            while (event := await q.get()) is not None:
                line = (json.dumps(event) + "\n").encode()
                # split lines across chunks to exercise the client's line reassembly
                await resp.write(line[: len(line) // 2])
                await resp.write(line[len(line) // 2:])
        finally:
            self.watchers.remove(q)
        return resp


@pytest.fixture
async def api():
    fake = FakeAPI()
    app = web.Application()
    app.router.add_get(f"/api/v1/namespaces/{NS}/pods", fake.handle)
    runner, port = await serve_app(app, shutdown_timeout=0.1)
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    fake.end_watches()
    await runner.cleanup()


def source(api, tmp_path, **kw) -> tuple[KubernetesSource, RoutingMetrics]:
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    metrics = RoutingMetrics()
    cfg = KubernetesConfig(namespace=NS, api=ApiConfig(api_url=api.url, token_file=str(token), backoff_min_s=0.01,
                                                       backoff_max_s=0.05), **kw)
    return KubernetesSource(cfg, metrics=metrics, environ={}), metrics


def test_pod_from_object():
    obj = k8s_pod("a", labels={"model.aibrix.ai/port": "8100", "model.aibrix.ai/kv-events-enabled": "true",
                               "model.aibrix.ai/lora-id": "sql"},
                  annotations={"kvgate.io/dp-size": "4", "kvgate.io/kv-events-replay-port": "none",
                               "model.aibrix.ai/lora-id": "chat,sql"})
    pod = pod_from_object(obj)
    assert (pod.name, pod.address, pod.port, pod.model, pod.ready) == ("a", "10.1.0.1", 8100, "llama", True)
    assert pod.kv_events == KVEventsEndpoint(5557, None, 4)
    assert pod.lora == ("sql", "chat")
    assert pod_from_object(obj, qualify=True).name == "llm/a"
    assert pod_from_object(k8s_pod("b", ready=False)).ready is False
    assert pod_from_object(k8s_pod("c", phase="Pending")) is None
    assert pod_from_object(k8s_pod("d", ip=None)) is None
    terminating = k8s_pod("e")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_from_object(terminating) is None
    no_model = k8s_pod("f")
    del no_model["metadata"]["labels"]["model.aibrix.ai/name"]
    assert pod_from_object(no_model) is None
    assert pod_from_object(k8s_pod("g", labels={"model.aibrix.ai/kv-events-enabled": "true"})).kv_events == \
        KVEventsEndpoint()
    with pytest.raises(DiscoveryError, match="llm/h kvgate.io/dp-size"):
        pod_from_object(k8s_pod("h", labels={"model.aibrix.ai/kv-events-enabled": "true"},
                                annotations={"kvgate.io/dp-size": "many"}))
    with pytest.raises(DiscoveryError, match="model.aibrix.ai/port"):
        pod_from_object(k8s_pod("i", labels={"model.aibrix.ai/port": "99999"}))


def test_in_cluster_settings(tmp_path):
    ns_file = tmp_path / "namespace"
    ns_file.write_text("prod\n")
    src = KubernetesSource(KubernetesConfig(api=ApiConfig(namespace_file=str(ns_file),
                                                                  ca_file=str(tmp_path / "none"))),
                           environ={"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"})
    assert src.namespace == "prod"
    assert src.source.startswith("Kubernetes https://[fd00::1]:6443/api/v1/namespaces/prod/pods")
    with pytest.raises(DiscoveryError, match="KUBERNETES_SERVICE_HOST"):
        KubernetesSource(KubernetesConfig(), environ={})


async def test_list_then_watch(api, tmp_path):
    api.put(k8s_pod("a", ip="10.1.0.1", labels={"model.aibrix.ai/kv-events-enabled": "true"},
                    annotations={"kvgate.io/dp-size": "2"}))
    api.put(k8s_pod("b", ip=None, phase="Pending"))
    api.put(k8s_pod("c", ip="10.1.0.3", ready=False))
    src, metrics = source(api, tmp_path)
    reg = PodRegistry()
    changes = []
    reg.add_listener(lambda added, removed: changes.append((sorted(p.name for p in added),
                                                             sorted(p.name for p in removed))))
    await src.start(reg)
    try:
        assert sorted(p.name for p in reg.pods()) == ["a", "c"]
        assert [p.name for p in reg.ready_pods("llama")] == ["a"]
        assert reg.get("a").kv_events == KVEventsEndpoint(dp_size=2)
        assert api.auth[0] == "Bearer tok-1" and api.selectors[0] == "model.aibrix.ai/name"
        assert await wait_until_async(lambda: api.watchers)

        api.put(k8s_pod("b", ip="10.1.0.2"))  # scheduled, running, ready
        assert await wait_until_async(lambda: reg.get("b") is not None and reg.get("b").ready)
        api.put(k8s_pod("c", ip="10.1.0.3", ready=True))  # readiness only: no listener call
        assert await wait_until_async(lambda: reg.get("c").ready)
        api.delete("a")
        assert await wait_until_async(lambda: reg.get("a") is None)
        assert changes == [(["a", "c"], []), (["b"], []), ([], ["a"])]

        rv_before = src.resource_version
        api.send({"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "999"}}})
        assert await wait_until_async(lambda: src.resource_version == "999")
        assert rv_before != "999"

        api.put(k8s_pod("d", annotations={"kvgate.io/dp-size": "zero"},
                        labels={"model.aibrix.ai/kv-events-enabled": "true"}))  # bad: skipped, counted
        api.put(k8s_pod("e", ip="10.1.0.5"))
        assert await wait_until_async(lambda: reg.get("e") is not None)
        assert reg.get("d") is None and src.skipped == 1
        assert metrics.registry.get_sample_value("kvgate_discovery_errors_total", {"source": "kubernetes"}) == 1
    finally:
        await src.stop()


async def test_gone_means_list_again_and_missed_events_are_repaired(api, tmp_path):
    api.put(k8s_pod("a"))
    src, _ = source(api, tmp_path)
    reg = PodRegistry()
    await src.start(reg)
    try:
        assert await wait_until_async(lambda: api.watchers)
        api.put(k8s_pod("z", ip="10.1.0.26"), announce=False)  # an event the watch never delivered
        api.send({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})
        assert await wait_until_async(lambda: reg.get("z") is not None)
        assert api.lists == 2

        api.gone_on_next_watch = True  # 410 as the HTTP status of the watch request itself
        api.pods.pop("a")
        api.end_watches()  # the server ends the watch (its timeoutSeconds)
        assert await wait_until_async(lambda: reg.get("a") is None)
        assert api.lists == 3 and api.watches >= 3

        watches = api.watches
        api.end_watches()  # a normal end: watch again from the same resourceVersion, no list
        assert await wait_until_async(lambda: api.watches > watches and api.watchers)
        assert api.lists == 3
    finally:
        await src.stop()


async def test_first_list_failure_raises_naming_the_source(tmp_path):
    cfg = KubernetesConfig(namespace=NS, api=ApiConfig(api_url="http://127.0.0.1:1", request_timeout_s=2))
    with pytest.raises(DiscoveryError, match="Kubernetes http://127.0.0.1:1/api/v1/namespaces/llm/pods"):
        await KubernetesSource(cfg, environ={}).start(PodRegistry())
