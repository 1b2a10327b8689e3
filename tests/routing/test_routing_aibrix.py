"""AIBrix's strategy names on crafted fleet states (each picks what its behaviour says), weighted mixes
weighing as written, and session affinity: a session stays on its pod and moves when the pod is down,
not ready or saturated, remembered with a TTL and shared through Redis."""
from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import time

import pytest

from routing.errors import UnknownStrategyError
from routing.metrics import RoutingMetrics
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.fairness import TokenCounter
from routing.scheduling.scoring import RouteRequest
from routing.scheduling.sessions import SessionStore, token_target
from routing.scheduling.strategies import STRATEGIES, parse_mix
from routing.state.engine_metrics import EngineLoad, EngineMetrics, parse_engine_metrics, with_rates

AIBRIX_NAMES = ("random", "least-request", "power-of-two", "throughput", "least-kv-cache", "least-gpu-cache",
                "least-busy-time", "least-utilization", "least-latency", "prefix-cache", "session-affinity",
                "vtc-basic", "slo")


def pods(*names):
    return [Pod(n, f"10.0.0.{i + 1}", 8000, "m") for i, n in enumerate(names)]


def fleet(loads: dict[str, EngineLoad] | None = None, names=("a", "b", "c"), **kw):
    reg = PodRegistry(pods(*names))
    engines = EngineMetrics(reg, interval_s=60)
    for name, load in (loads or {}).items():  # scraped now (a parametrized load is made at collection)
        engines.put(name, dataclasses.replace(load, at=time.monotonic()))
    metrics = RoutingMetrics()
    return Router(reg, default_strategy="least-request", engines=engines, seed=3, metrics=metrics, **kw), reg, metrics


def load(waiting=0.0, running=0.0, kv=0.1, **kw) -> EngineLoad:
    return EngineLoad(waiting=waiting, running=running, kv_usage=kv, at=time.monotonic(), **kw)


async def picks(r: Router, strategy: str, n: int = 1, **kw) -> list[str]:
    out = []
    for i in range(n):
        d = await r.pick(RouteRequest("m", strategy=strategy, request_id=str(i), **kw))
        out.append(d.pod.name)
        await r.release(d)
    return out


def test_every_aibrix_name_is_a_strategy():
    assert set(AIBRIX_NAMES) <= set(STRATEGIES)
    for name in ("kv-sync", "round-robin"):  # kvgate's own stay
        assert name in STRATEGIES


@pytest.mark.parametrize("strategy, loads, expected", [
    # least KV cache used (vLLM exports GPU usage only: both names read it)
    ("least-kv-cache", {"a": load(kv=0.7), "b": load(kv=0.2), "c": load(kv=0.5)}, "b"),
    ("least-gpu-cache", {"a": load(kv=0.3), "b": load(kv=0.6), "c": load(kv=0.9)}, "a"),
    # fewest requests in the engine, running + waiting, by its own numbers
    ("least-busy-time", {"a": load(running=4, waiting=3), "b": load(running=6), "c": load(running=8)}, "b"),
    # requests and KV cache, equally: c is neither the least busy nor the emptiest, but best on both together
    ("least-utilization", {"a": load(running=0, kv=0.9), "b": load(running=8, kv=0.1), "c": load(running=2, kv=0.3)},
     "c"),
    # least token throughput: 2 x prompt + generation tokens/s
    ("throughput", {"a": load(token_rate=(100.0, 50.0)), "b": load(token_rate=(10.0, 300.0)),
                    "c": load(token_rate=(200.0, 0.0))}, "a"),
    # lowest TTFT + 100 x TPOT
    ("least-latency", {"a": load(ttft_mean=0.5, tpot_mean=0.01), "b": load(ttft_mean=0.05, tpot_mean=0.02),
                       "c": load(ttft_mean=0.2, tpot_mean=0.005)}, "c"),
])
async def test_engine_metric_strategies_pick_what_their_metric_says(strategy, loads, expected):
    r, _, _ = fleet(loads)
    assert await picks(r, strategy, 5) == [expected] * 5


async def test_least_request_and_power_of_two_weigh_running_requests():
    r, _, _ = fleet()
    for pod, n in {"a": 5, "b": 0, "c": 9}.items():
        r._counts.add(pod, n)
    assert await picks(r, "least-request", 3) == ["b"] * 3
    # power of two: of two drawn, the one running fewer: never the busiest, the least busy most often
    seen = collections.Counter(await picks(r, "power-of-two", 300))
    assert "c" not in seen and seen["b"] > seen["a"] > 0


async def test_random_spreads():
    r, _, _ = fleet()
    assert set(await picks(r, "random", 100)) == {"a", "b", "c"}


async def test_vtc_basic_steers_heavy_users_away_from_light_ones():
    r, _, _ = fleet()
    tokens = list(range(900))
    # a light user stays on the first pod in name order while the heavy one moves along as it is served
    first = await picks(r, "vtc-basic", 1, user="light", token_ids=tokens[:10])
    heavy = await picks(r, "vtc-basic", 6, user="heavy", token_ids=tokens)
    assert first == ["a"]
    assert heavy[0] == "a" and heavy[-1] == "c"
    assert await picks(r, "vtc-basic", 1, user="light", token_ids=tokens[:10]) == ["a"]
    # no user: load alone decides
    r._counts.add("a", 3)
    r._counts.add("b", 3)
    assert await picks(r, "vtc-basic", 1, token_ids=tokens[:10]) == ["c"]


def test_token_counter_decays_over_its_window():
    now = [0.0]
    c = TokenCounter(window_s=100.0, clock=lambda: now[0])
    c.add("u", 1000)
    c.add("v", 3000)
    assert c.get("u") == pytest.approx(1000) and c.mean() == pytest.approx(2000)
    now[0] = 100.0
    assert c.get("u") == pytest.approx(1000 / 2.718281828, rel=1e-6)
    now[0] = 10_000.0  # far beyond: a rebase keeps the values finite
    c.add("u", 10)
    assert c.get("u") == pytest.approx(10, rel=1e-3) and c.get("v") < 1e-9


def test_rates_from_two_scrapes():
    text = ("# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{model_name=\"m\"} %d\n"
            "# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{model_name=\"m\"} %d\n"
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            "vllm:time_to_first_token_seconds_sum{model_name=\"m\"} %f\n"
            "vllm:time_to_first_token_seconds_count{model_name=\"m\"} %d\n")
    before = with_rates(parse_engine_metrics(text % (1000, 500, 10.0, 100), at=1.0), None)
    assert before.tokens == (1000.0, 500.0) and before.token_rate is None and before.ttft_mean == pytest.approx(0.1)
    after = with_rates(parse_engine_metrics(text % (3000, 600, 14.0, 110), at=3.0), before)
    assert after.token_rate == (1000.0, 50.0)
    assert after.ttft_mean == pytest.approx(0.4)  # the requests since the last scrape: 4 s over 10
    quiet = with_rates(parse_engine_metrics(text % (3000, 600, 14.0, 110), at=4.0), after)
    assert quiet.token_rate == (0.0, 0.0) and quiet.ttft_mean == pytest.approx(0.4)  # none since: the last known


# ---- weighted mixes ------------------------------------------------------------------------

def test_parse_mix_as_aibrix_writes_it():
    assert parse_mix("least-request") is None
    assert parse_mix("prefix-cache:2,least-request:1") == (("prefix-cache", 2), ("least-request", 1))
    assert parse_mix("prefix-cache:2, least-request") == (("prefix-cache", 2), ("least-request", 1))
    assert parse_mix("prefix-cache:0,least-request:3") == (("least-request", 3),)
    assert parse_mix("least-request:1,slo:2") == (("slo", 1),)  # slo stands alone, as in AIBrix
    for bad, why in (("fastest:1", "unknown strategy"), ("least-request:x", "integer"), ("least-request:-1", "0 to"),
                     ("least-request:0", "above 0"), ("least-request:1,", "expected"), (":2", "expected"),
                     ("least-request:2000000", "0 to")):
        with pytest.raises(ValueError, match=why):
            parse_mix(bad)


async def test_a_mix_weighs_each_strategy_by_its_share():
    # b has the emptiest KV cache, a runs the fewest requests
    r, _, _ = fleet({"a": load(kv=0.9), "b": load(kv=0.0), "c": load(kv=0.5)})
    r._counts.add("b", 8)
    r._counts.add("c", 8)
    # least-request: a 1, b 0, c 0 (8 running: a full load point); least-kv-cache: a 0.1, b 1, c 0.5
    assert await picks(r, "least-kv-cache:1,least-request:3") == ["a"]  # a 0.775, b 0.25
    assert await picks(r, "least-kv-cache:3,least-request:1") == ["b"]  # a 0.325, b 0.75
    mix = r._strategy("least-kv-cache:3,least-request:1")
    assert {sc.name: w for sc, w in mix.scorers} == {"kv-util": 0.75, "load": 0.25}
    # a member's own scorers weigh by their share of it: prefix-cache is approx-prefix 3, load 2
    mixed = r._strategy("prefix-cache:2,least-request:1")
    assert {sc.name: round(w, 4) for sc, w in mixed.scorers} == {"approx-prefix": 0.4, "load": 0.6}
    assert [f.name for f in mixed.filters] == ["load-guard"]
    assert mixed.needs_tokens
    d = await r.pick(RouteRequest("m", strategy="prefix-cache:2, least-request:1"))
    assert d.strategy == "prefix-cache:2,least-request:1"  # one canonical name, one metrics label


async def test_a_mix_as_default_and_bad_mixes_refused():
    reg = PodRegistry(pods("a", "b"))
    r = Router(reg, default_strategy="least-request:2,random:1", seed=0)
    assert r.default_strategy == "least-request:2,random:1"
    assert (await r.pick(RouteRequest("m"))).strategy == "least-request:2,random:1"
    for bad in ("least-request:2,fastest", "least-request:x", "least-latency:1,random:1"):  # no engines: no latency
        with pytest.raises(UnknownStrategyError, match="unknown routing strategy"):
            await r.pick(RouteRequest("m", strategy=bad))
    with pytest.raises(UnknownStrategyError):
        Router(reg, default_strategy="least-request:2,fastest:1")


def test_the_variable_takes_names_and_mixes_and_says_what_is_wrong():
    from plugin.config import ConfigError, Settings
    env = {"KVGATE_PODS": "p=127.0.0.1:1/m"}
    for name in AIBRIX_NAMES + ("prefix-cache:2,least-request:1",):
        assert Settings.from_env({**env, "KVGATE_ROUTING_STRATEGY": name}).routing_strategy == name
    for bad, why in (("fastest", "expected one of"), ("prefix-cache:2,fastest", "'fastest': unknown strategy"),
                     ("least-request:1.5", "integer")):
        with pytest.raises(ConfigError, match=f"KVGATE_ROUTING_STRATEGY=.*{why}"):
            Settings.from_env({**env, "KVGATE_ROUTING_STRATEGY": bad})


# ---- session affinity ----------------------------------------------------------------------

def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def outcomes(metrics: RoutingMetrics) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in metrics.sessions.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}


def test_session_tokens_name_pods_as_aibrix_and_llm_d_write_them():
    fleet_pods = pods("a", "b")
    assert [p.name for p in token_target(b64("10.0.0.2:8000"), fleet_pods)] == ["b"]  # AIBrix: ip:port
    assert [p.name for p in token_target(b64("default/a"), fleet_pods)] == ["a"]  # llm-d: namespace/name
    assert token_target(b64("10.9.9.9:8000"), fleet_pods) == []
    assert token_target("chat-42", fleet_pods) == []  # not base64: an opaque key


async def test_a_session_stays_on_its_pod_and_moves_when_it_is_down_or_saturated():
    r, reg, metrics = fleet({n: load() for n in "abc"})
    first = (await picks(r, "session-affinity", 1, session="chat-1"))[0]
    # busier than the others, the session's pod keeps it
    r._counts.add(first, 6)
    assert await picks(r, "session-affinity", 5, session="chat-1") == [first] * 5
    # other sessions go to the least loaded
    assert first not in await picks(r, "session-affinity", 1, session="chat-2")
    # saturated (its engine queueing): the session moves, and stays where it moved
    r._engines.put(first, load(waiting=9))
    moved = (await picks(r, "session-affinity", 1, session="chat-1"))[0]
    assert moved != first
    r._engines.put(first, load())
    assert await picks(r, "session-affinity", 2, session="chat-1") == [moved] * 2
    # its new pod not ready: it moves again
    reg.replace([Pod(p.name, p.address, p.port, p.model, ready=p.name != moved) for p in reg.pods()])
    again = (await picks(r, "session-affinity", 1, session="chat-1"))[0]
    assert again not in (moved,)
    assert outcomes(metrics) == {"new": 2, "kept": 7, "saturated": 1, "unavailable": 1}


async def test_a_session_token_picks_its_pod_in_any_strategy_that_weighs_it():
    r, _, _ = fleet({n: load() for n in "abc"})
    r._counts.add("c", 3)
    aibrix, llmd = b64("10.0.0.3:8000"), b64("ns/c")
    assert await picks(r, "session-affinity", 2, session=aibrix) == ["c", "c"]
    assert await picks(r, "session-affinity", 2, session=llmd) == ["c", "c"]
    # weighed in a mix: the session against load, as written
    assert await picks(r, "session-affinity:1,least-request:1", 1, session=aibrix) == ["c"]
    assert await picks(r, "session-affinity:1,least-request:9", 1, session=aibrix) != ["c"]
    # an unreachable engine's pod is no candidate: the token's pod gets no preference
    r._engines._down.add("c")
    assert await picks(r, "session-affinity", 3, session=aibrix) != ["c"] * 3


def test_session_store_is_bounded_and_forgets_after_its_ttl():
    now = [0.0]
    store = SessionStore(ttl_s=10.0, capacity=2, clock=lambda: now[0])
    store.put("s1", "a")
    store.put("s2", "b")
    store.put("s3", "c")  # s1, least recently used, goes
    assert (store.get("s1"), store.get("s2"), store.get("s3"), len(store)) == (None, "b", "c", 2)
    now[0] = 9.0
    store.put("s2", "b")  # a request renews its TTL
    now[0] = 11.0
    assert (store.get("s2"), store.get("s3")) == ("b", None)
    store.forget_pod("b")
    assert store.get("s2") is None


async def test_sessions_are_shared_between_gateways_through_redis(redis_server):
    from redis.asyncio import Redis
    clients = [Redis.from_url(redis_server.url) for _ in range(2)]
    # Redis operations given 2 s (not the 50 ms a gateway allows): this test is about sharing, and a loaded CI
    # machine once took longer than 50 ms for the second client's first get (its connection opened then)
    stores = [SessionStore(60.0, redis=c, recheck_s=0.0, op_timeout_s=2.0) for c in clients]
    routers = []
    for store in stores:
        r, _, _ = fleet({n: load() for n in "abc"}, sessions=store)
        routers.append(r)
    try:
        first = (await picks(routers[0], "session-affinity", 1, session="chat-9"))[0]
        await stores[0].flush()
        routers[1]._counts.add(first, 5)  # the other gateway sees that pod busy, yet follows the session
        assert await picks(routers[1], "session-affinity", 2, session="chat-9") == [first] * 2
        # moved by the second gateway (saturated there), the first follows
        routers[1]._engines.put(first, load(kv=0.95))
        moved = (await picks(routers[1], "session-affinity", 1, session="chat-9"))[0]
        await stores[1].flush()
        assert moved != first
        assert await picks(routers[0], "session-affinity", 1, session="chat-9") == [moved]
    finally:
        for c in clients:
            await c.aclose()


async def test_a_dead_redis_leaves_sessions_local():
    from redis.asyncio import Redis
    client = Redis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.05)
    store = SessionStore(60.0, redis=client, recheck_s=0.0)
    r, _, _ = fleet({n: load() for n in "abc"}, sessions=store)
    try:
        first = (await picks(r, "session-affinity", 1, session="s"))[0]
        r._counts.add(first, 4)
        assert await picks(r, "session-affinity", 2, session="s") == [first] * 2
        assert store.redis_errors >= 1
    finally:
        await client.aclose()


async def test_a_request_cancelled_while_its_session_is_read_ends_though_the_client_swallowed_it():
    from helpers import SwallowingRedis
    client = SwallowingRedis(b"b")
    store = SessionStore(60.0, redis=client, recheck_s=0.0, op_timeout_s=30.0)
    task = asyncio.create_task(store.load("chat-1"))
    while client.gets == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)
