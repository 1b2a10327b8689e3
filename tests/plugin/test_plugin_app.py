"""`kvgate serve`'s wiring (plugin.app.App) in process: the pods, the running counts and the router
it builds from the settings, through the same functions the routing tests use (build_counts)."""
from __future__ import annotations

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
