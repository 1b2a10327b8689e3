"""`kvgate serve`'s wiring (plugin.app.App) in process: the pods, the running counts and the router
it builds from the settings, through the same functions the routing tests use (build_counts)."""
from __future__ import annotations

import asyncio

import redis as redis_py

from plugin.app import App
from plugin.config import Settings
from devkit.stack import Stack
from routing.router import RouteRequest
from helpers import free_ports, wait_until_async


def settings(**env: str) -> Settings:
    grpc_port, http_port = free_ports(2)
    return Settings.from_env({"KVGATE_PODS": "a=127.0.0.1:9001/m,b=127.0.0.1:9002/m",
                              "KVGATE_GRPC_PORT": str(grpc_port), "KVGATE_HTTP_PORT": str(http_port),
                              "KVGATE_ROUTING_STRATEGY": "least-request", **env})


async def test_app_routes_on_the_configured_pods_with_counts_shared_through_redis():
    with Stack() as stack:
        _, url = stack.redis()
        app = App(settings(KVGATE_REDIS_URL=url, KVGATE_GATEWAY_ID="app-gw", KVGATE_REDIS_KEY_TTL_S="2"))
        await app.start()
        r = redis_py.Redis.from_url(url, decode_responses=True)
        key = "kvgate:{running}:gw:app-gw"
        try:
            assert sorted(p.name for p in app.pods.pods()) == ["a", "b"]
            d = await app.router.pick(RouteRequest("m"))
            assert d.pod.name in {"a", "b"}
            # The pick is this gateway's count in Redis, under the configured gateway id and TTL.
            assert await wait_until_async(lambda: r.hget(key, d.pod.name) == "1", timeout=5,
                                          detail=lambda: r.hgetall(key))
            assert 0 < r.pttl(key) <= 2000
            await app.router.release(d)
            assert await wait_until_async(lambda: r.hget(key, d.pod.name) is None, timeout=5,
                                          detail=lambda: r.hgetall(key))
        finally:
            r.close()
            await app.stop(0)


async def test_app_without_redis_counts_in_process():
    app = App(settings())
    await app.start()
    try:
        assert app.router.debug_snapshot()["counts"]["backend"] == "local"
        d = await app.router.pick(RouteRequest("m"))
        assert app.router.running() == {d.pod.name: 1}
        await app.router.release(d)
        assert app.router.running() == {}
    finally:
        await app.stop(0)


async def test_two_apps_share_their_running_prompts_through_redis():
    with Stack() as stack:
        _, url = stack.redis()
        apps = [App(settings(KVGATE_REDIS_URL=url, KVGATE_GATEWAY_ID=f"gw-{i}", KVGATE_ROUTING_STRATEGY="kv-sync"))
                for i in (1, 2)]
        for app in apps:
            await app.start()
        try:
            one, two = (app.prompt_relay for app in apps)
            assert one is not None and two is not None
            for relay in (one, two):
                await relay.first_try.wait()
            # what RunningPrompts tells its listener when gw-1 routes a prompt (its keys known from the events)
            one._changed(["add", 1, "a", "a", 0, [11, 12, 13]])
            assert await wait_until_async(lambda: apps[1].debug()["running_prompts"]["peer_claims"] == 1, timeout=5)
            assert apps[0].debug()["running_prompts"] == {"requests": 0, "shared": True, "peer_claims": 0}
            one._changed(["end", 1])
            assert await wait_until_async(lambda: two.peer_claims == 0, timeout=5)
        finally:
            for app in apps:
                await app.stop(0)


async def test_a_peer_breaking_http2_at_either_grpc_port_counts_in_the_replicas_metric():
    """An HTTP/1 request (a load balancer's health check pointed at the wrong port, say) at the ext_proc port and
    at the plaintext health port: each counted under `preface` in the one kvgate_grpc_protocol_errors_total the
    replica exports, whose `preface` series is there from the start (its first error shows in increase())."""
    health_port, = free_ports(1)
    app = App(settings(KVGATE_GRPC_HEALTH_PORT=str(health_port)))
    await app.start()
    try:
        def preface_errors() -> float | None:
            return app.registry.get_sample_value("kvgate_grpc_protocol_errors_total", {"reason": "preface"})
        assert preface_errors() == 0
        for port in (app.grpc_port, health_port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: kvgate\r\n\r\n")
            assert await asyncio.wait_for(reader.read(), 5)  # a GOAWAY, then the close
            writer.close()
        assert preface_errors() == 2
    finally:
        await app.stop(0)
