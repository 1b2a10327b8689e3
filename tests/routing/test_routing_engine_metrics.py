"""Engine metrics scraped from a real HTTP /metrics on loopback feed the queue and kv-util scorers."""
from __future__ import annotations

from aiohttp import web

from routing.state.engine_metrics import EngineMetrics
from routing.metrics import RoutingMetrics
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.scoring import RouteRequest
from routing.scheduling.strategies import StrategyConfig
from helpers import serve_app, wait_until_async


def vllm_text(waiting: int, usage: float) -> str:
    return ("# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} 2\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage}\n')


async def serve(text: str):
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return await serve_app(app, shutdown_timeout=0.1)


async def test_scrape_and_route_on_engine_load():
    busy, busy_port = await serve(vllm_text(12, 0.9))
    idle, idle_port = await serve(vllm_text(0, 0.1))
    dead_port = 1  # nothing listens: a counted scrape error, neutral scores
    reg = PodRegistry([Pod("busy", "127.0.0.1", busy_port, "m"), Pod("idle", "127.0.0.1", idle_port, "m"),
                       Pod("dead", "127.0.0.1", dead_port, "m")])
    metrics = RoutingMetrics()
    engines = EngineMetrics(reg, interval_s=0.05, timeout_s=2, metrics=metrics)
    cfg = StrategyConfig(weights={"least-request": {"load": 0, "queue": 1, "kv-util": 1}})
    r = Router(reg, default_strategy="least-request", engines=engines, config=cfg, metrics=metrics, seed=0)
    await r.start()
    try:
        await wait_until_async(lambda: engines.get("busy") is not None and engines.get("idle") is not None
                               and metrics.registry.get_sample_value("kvgate_engine_metrics_scrape_errors_total"),
                               timeout=10)  # the dead one's scrape comes last in its round
        assert engines.get("busy").waiting == 12 and engines.get("idle").kv_usage == 0.1
        assert engines.get("dead") is None
        assert metrics.registry.get_sample_value("kvgate_engine_metrics_scrape_errors_total") >= 1
        picks = {(await r.pick(RouteRequest("m"))).pod.name for _ in range(5)}
        assert picks == {"idle"}
        by_name = {p["name"]: p for p in r.debug_snapshot()["pods"]}
        assert by_name["busy"]["engine"]["waiting"] == 12 and by_name["dead"]["engine"] == {"unreachable": True}
    finally:
        await r.close()
        await busy.cleanup()
        await idle.cleanup()


async def test_each_round_spreads_its_scrapes_over_the_interval():
    """Eight engines, one page server: the first round at once (at start: every pod's state known within it, a dead
    one's included), then within a round the scrapes start an eighth of the interval apart (all at once they queued
    ahead of the requests' decisions), and every engine is scraped every round."""
    import time

    seen: list[tuple[float, str]] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append((time.monotonic(), request.query.get("pod", "")))
        return web.Response(text=vllm_text(0, 0.1))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, port = await serve_app(app, shutdown_timeout=0.1)
    reg = PodRegistry([Pod(f"p{i}", "127.0.0.1", port, "m") for i in range(8)])
    interval = 0.4
    engines = EngineMetrics(reg, interval_s=interval, timeout_s=2)
    await engines.start()
    try:
        await wait_until_async(lambda: len(seen) >= 24, timeout=10)
        first = [t for t, _ in seen[:8]]
        assert first[-1] - first[0] < interval * 7 / 8 * 0.7, first  # at start: at once
        second = [t for t, _ in seen[8:16]]
        span = second[-1] - second[0]  # arrivals, so each gap also carries the machine's jitter: the span, not a gap
        assert interval * 7 / 8 * 0.7 <= span <= interval * 3, second  # all at once: a few ms
        assert second[0] - first[0] >= interval * 0.75  # the next round an interval after this one began (less a connect)
        third = [t for t, _ in seen[16:24]]
        assert third[0] - second[0] >= interval * 0.75
        assert all(engines.get(f"p{i}") is not None for i in range(8))
    finally:
        await engines.close()
        await runner.cleanup()
