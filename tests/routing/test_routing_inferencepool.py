"""InferencePool discovery against a stand-in Kubernetes API server (tests/kube_api.py: list+watch,
resourceVersions, bookmarks, 410 Gone) and real simulated engines answering `/v1/models`, each on
its own loopback address at the pool's one target port."""
from __future__ import annotations

import asyncio
import sys

import pytest

from kube_api import KubeAPI, pod, pool
from devkit.stack import Stack, wait_for_port
from helpers import free_port, wait_until_async
from routing.errors import DiscoveryError
from routing.discovery.inferencepool import InferencePoolConfig, InferencePoolSource, parse_models, pool_spec
from routing.discovery.kube import ApiConfig
from routing.registry import PodRegistry

NS = "llm"
SEL = {"app": "vllm"}
IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


@pytest.fixture(scope="module")
def engines():
    """Three engines at one port, one per loopback address; the first also serves adapter `ad1`."""
    port = free_port()
    with Stack() as stack:
        for i, ip in enumerate(IPS):
            argv = [sys.executable, "-m", "plugin.cli", "sim", "--host", ip, "--port", str(port), "--model", "base",
                    "--name", f"e{i}", "--no-kv-events"] + (["--lora", "ad1"] if i == 0 else [])
            stack.start(f"e{i}", argv)
        for ip in IPS:
            wait_for_port(ip, port, timeout=30)
        yield port


@pytest.fixture
async def api():
    fake = KubeAPI(NS)
    fake.url = await fake.start()
    yield fake
    await fake.stop()


def make_source(api, **kw) -> InferencePoolSource:
    cfg = InferencePoolConfig(name="pool", namespace=NS, models_refresh_s=kw.pop("refresh", 30.0),
                              api=ApiConfig(api_url=api.url, token_file="/nonexistent", ca_file="/nonexistent",
                                            backoff_min_s=0.05, backoff_max_s=0.2, **kw))
    return InferencePoolSource(cfg)


def view(registry: PodRegistry) -> dict:
    return {p.name: (p.endpoint, p.model, p.lora, p.ready) for p in registry.pods()}


async def test_pool_pods_and_their_models_follow_joins_unready_and_leaves(api, engines):
    port = engines
    api.put("inferencepools", pool("pool", SEL, [port]))
    api.put("pods", pod("a", IPS[0], SEL))
    api.put("pods", pod("other", IPS[2], {"app": "web"}))  # not selected
    registry = PodRegistry()
    src = make_source(api)
    await src.start(registry)
    try:
        # synced when start returns: the pod, with the models its engine lists (base and adapter)
        assert view(registry) == {"a": (f"{IPS[0]}:{port}", "base", ("ad1",), True)}
        api.put("pods", pod("b", IPS[1], SEL, ready=False))  # joins, not ready yet
        assert await wait_until_async(lambda: "b" in view(registry))
        assert view(registry)["b"] == (f"{IPS[1]}:{port}", "base", (), False)
        api.put("pods", pod("b", IPS[1], SEL))  # turns ready
        assert await wait_until_async(lambda: view(registry)["b"][3])
        api.put("pods", pod("a", IPS[0], SEL, ready=False))  # turns unready
        assert await wait_until_async(lambda: not view(registry)["a"][3])
        api.delete("pods", "a")  # leaves
        assert await wait_until_async(lambda: "a" not in view(registry))
        api.put("pods", pod("b", IPS[1], {"app": "moved"}))  # relabelled out of the selector: leaves too
        assert await wait_until_async(lambda: view(registry) == {})
        api.put("pods", pod("c", IPS[2], SEL, phase="Pending"))  # not running: not an endpoint
        api.put("pods", pod("d", IPS[0], SEL))
        assert await wait_until_async(lambda: set(view(registry)) == {"d"})
    finally:
        await src.stop()


async def test_an_expired_watch_lists_again_and_misses_nothing(api, engines):
    port = engines
    api.put("inferencepools", pool("pool", SEL, [port]))
    api.put("pods", pod("a", IPS[0], SEL))
    registry = PodRegistry()
    src = make_source(api)
    await src.start(registry)
    try:
        assert await wait_until_async(lambda: api.count("pods", watch=True) == 1 and len(api.watches) == 2)
        lists = api.count("pods", watch=False)
        # bookmarks move the client's resourceVersion on: the next watch starts from there
        api.put("pods", pod("noise", IPS[2], {"app": "web"}))
        api.bookmark()
        assert await wait_until_async(lambda: src._pods.resource_version == str(api.rv))
        bookmarked = src._pods.resource_version
        api.end_watches()  # the server ends watches (timeoutSeconds): watched again, no list
        assert await wait_until_async(lambda: api.count("pods", watch=True) == 2)
        assert [q["resourceVersion"] for r, q in api.requests if r == "pods" and q.get("watch")][-1] == bookmarked
        assert api.count("pods", watch=False) == lists
        # the history is compacted and the open watch told it expired; a change made meanwhile is found by listing again
        api.compact()
        api.put("pods", pod("b", IPS[1], SEL))
        api.compact()
        api.expire_watches()
        assert await wait_until_async(lambda: "b" in view(registry))
        assert api.count("pods", watch=False) == lists + 1
        # a watch asked for from a version already compacted: 410 as an HTTP status, listed again too
        assert await wait_until_async(lambda: len(api.watches) == 2)
        lists = api.count("pods", watch=False)
        api.put("pods", pod("a", IPS[0], SEL, ready=False), unseen=True)  # the open watch lags behind it
        api.compact()
        api.end_watches()
        assert await wait_until_async(lambda: not view(registry)["a"][3])
        assert api.gone >= 1 and api.count("pods", watch=False) == lists + 1
    finally:
        await src.stop()


async def test_pool_changes_rewatch_pods_and_start_waits_for_the_pool(api, engines):
    port = engines
    api.put("pods", pod("a", IPS[0], SEL))
    api.put("pods", pod("b", IPS[1], {"app": "next"}))
    registry = PodRegistry()
    src = make_source(api)
    starting = asyncio.create_task(src.start(registry))
    try:
        # the pool's list came back empty and its watch is open: start waits for the pool
        await wait_until_async(lambda: api.count("inferencepools", watch=True) >= 1)
        assert not starting.done()  # no pool yet: discovery is not synced
        api.put("inferencepools", pool("pool", SEL, [port]))
        await asyncio.wait_for(starting, 10)
        assert set(view(registry)) == {"a"}
        api.put("inferencepools", pool("pool", {"app": "next"}, [port]))  # the selector changes
        assert await wait_until_async(lambda: set(view(registry)) == {"b"})
        api.put("inferencepools", pool("pool", {"app": "next"}, [port, free_port()]))  # a second target port
        # nothing answers /v1/models on the second port: only the first port's endpoint is routable
        assert await wait_until_async(lambda: set(view(registry)) == {f"b:{port}"})
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await src.stop()


def test_pool_spec_and_models_parsing_reject_what_cannot_be_used():
    assert pool_spec(pool("p", {"b": "2", "a": "1"}, [8000])).label_selector == "a=1,b=2"
    with pytest.raises(DiscoveryError, match="matchLabels"):
        pool_spec(pool("p", {}, [8000]))
    with pytest.raises(DiscoveryError, match="targetPorts"):
        pool_spec(pool("p", {"a": "1"}, []))
    body = {"data": [{"id": "ad1", "parent": "base"}, {"id": "base", "parent": None}]}
    assert parse_models(body) == ("base", ("ad1",))
    with pytest.raises(ValueError):
        parse_models({"data": [{"id": "ad1", "parent": "base"}]})
    with pytest.raises(ValueError):
        parse_models({"object": "list"})


async def test_kvgate_is_ready_only_once_its_inferencepool_is_found_and_listed(api, engines):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from plugin.app import App
    from plugin.config import Settings

    port = engines
    api.put("pods", pod("a", IPS[0], SEL))
    settings = Settings(discovery="inferencepool", inferencepool_name="pool", k8s_namespace=NS, k8s_api_url=api.url,
                        grpc_port=0, http_port=0, engine_metrics_interval_s=60)
    app = App(settings)
    starting = asyncio.create_task(app.start())
    try:
        assert await wait_until_async(lambda: app.grpc_port is not None)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def status(service):
                return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

            S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            assert await wait_until_async(lambda: api.count("inferencepools", watch=True) >= 1)
            assert (await status("liveness"), await status("readiness")) == (S, N)  # no pool yet
            api.put("inferencepools", pool("pool", SEL, [port]))
            await asyncio.wait_for(starting, 10)
            assert (await status("liveness"), await status("readiness")) == (S, S)
            assert [(p.name, p.endpoint, p.model, p.lora) for p in app.pods.pods()] == [
                ("a", f"{IPS[0]}:{port}", "base", ("ad1",))]
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await app.stop(0)


def test_each_target_port_is_an_endpoint_with_its_own_kv_event_ports():
    from routing.discovery.inferencepool import member_from_object

    obj = pod("a", "10.0.0.9", SEL)
    obj["metadata"]["annotations"] = {"kvgate.io/kv-events-pub-port": "6000", "kvgate.io/kv-events-replay-port": "7000"}
    member = member_from_object(obj)
    assert member is not None and member.kv_events.pub_port == 6000
    src = InferencePoolSource(InferencePoolConfig(name="pool", namespace=NS, api=ApiConfig(api_url="http://127.0.0.1:1")))
    src.spec = pool_spec(pool("pool", SEL, [8000, 8001]))
    src._members = {"uid-a": member}
    src._models = {("10.0.0.9", 8000): ("base", ()), ("10.0.0.9", 8001): ("base", ("ad1",))}
    pods = {p.name: p for p in src.pods()}
    assert set(pods) == {"a:8000", "a:8001"}
    assert (pods["a:8001"].endpoint, pods["a:8001"].lora) == ("10.0.0.9:8001", ("ad1",))
    assert [(p.kv_events.pub_port, p.kv_events.replay_port) for p in (pods["a:8000"], pods["a:8001"])] == [
        (6000, 7000), (6001, 7001)]
    # models the engine cannot be asked for: the pod's model labels stand in; neither: not routable yet
    labelled = pod("l", "10.0.0.7", {**SEL, "model.aibrix.ai/name": "base", "model.aibrix.ai/lora-id": "x"})
    src._members = {"uid-l": member_from_object(labelled), "uid-u": member_from_object(pod("u", "10.0.0.6", SEL))}
    assert [(p.name, p.model, p.lora) for p in src.pods()] == [("l:8000", "base", ("x",)), ("l:8001", "base", ("x",))]
    # a pod being deleted, or without an IP yet, is no endpoint
    gone = pod("b", "10.0.0.8", SEL)
    gone["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert member_from_object(gone) is None and member_from_object(pod("c", "", SEL)) is None
