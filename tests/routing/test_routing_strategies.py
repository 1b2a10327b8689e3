"""Decision tables for every strategy, the load guard, burst spreading, errors, release."""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import pytest

from routing.state.engine_metrics import EngineLoad, EngineMetrics, parse_engine_metrics
from routing.errors import NoReadyPodError, UnknownModelError, UnknownStrategyError
from routing.metrics import RoutingMetrics
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.approx import ApproxPrefixTable
from routing.scheduling.scorers import ROUTED, ApproxPrefixScorer, PrecisePrefixScorer, PrefillBacklog
from routing.scheduling.scoring import LoadGuard, PickContext, RouteRequest, Scorer
from helpers import prefill_counts, wait_until_async
from routing.scheduling.strategies import NAMES, SCORERS, STRATEGIES, ScorerSpec, StrategyConfig, parse_weights

TOKENS = list(range(67))  # 4 blocks of 16 and 3 tokens (a hit never covers the last one)


@dataclass
class Match:
    blocks: int
    by_medium: dict
    total_blocks: int = 4


@dataclass
class FakeIndex:
    """Answers match() from a table pod -> (blocks, by_medium); records the calls."""

    table: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    fail: bool = False

    def match(self, model, lora, token_ids, pods):
        self.calls.append((model, lora, len(token_ids), tuple(pods)))
        if self.fail:
            raise RuntimeError("index exploded")
        return {p: Match(*self.table.get(p, (0, {}))) for p in pods}

    def stats(self):
        return {"entries": 3, "blocks_per_pod": {"a": 4}}


def pods(*names, model="m", **kw):
    return [Pod(n, f"10.0.0.{i + 1}", 8000, model, **kw) for i, n in enumerate(names)]


SLACK = StrategyConfig().guard_abs_slack


def router(strategy="kv-sync", index=None, pod_list=None, seed=1, **kw):
    reg = PodRegistry(pod_list if pod_list is not None else pods("a", "b", "c"))
    return Router(reg, default_strategy=strategy, index=index if index is not None else FakeIndex(), seed=seed, **kw)


async def hold(r: Router, counts: dict[str, int]):
    """Make pods look busy: pick them through the router's own counts."""
    for pod, n in counts.items():
        for _ in range(n):
            r._counts.add(pod, 1)


async def test_random_uses_only_ready_pods_of_the_model():
    reg_pods = pods("a", "b", "c") + [Pod("d", "10.0.0.9", 8000, "m", ready=False), Pod("e", "10.0.1.1", 8000, "other")]
    r = router("random", pod_list=reg_pods)
    seen = collections.Counter()
    for i in range(300):
        d = await r.pick(RouteRequest("m", request_id=str(i)))
        seen[d.pod.name] += 1
        await r.release(d)
    assert set(seen) == {"a", "b", "c"}
    assert min(seen.values()) > 50


async def test_round_robin_cycles_in_name_order():
    r = router("round-robin", pod_list=pods("c", "a", "b"))
    names = [(await r.pick(RouteRequest("m"))).pod.name for _ in range(6)]
    assert names == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize("running, expected", [
    ({"a": 2, "b": 1, "c": 3}, {"b"}),
    ({"a": 0, "b": 5, "c": 0}, {"a", "c"}),
    ({"a": 1, "b": 1, "c": 1}, {"a", "b", "c"}),
])
async def test_least_request_table(running, expected):
    got = set()
    for seed in range(12):
        r = router("least-request", seed=seed)
        await hold(r, running)
        got.add((await r.pick(RouteRequest("m"))).pod.name)
    assert got == expected


# (index table, running, tokens?) -> expected pod
KV_SYNC_TABLE = [
    ("full GPU hit wins at equal load", {"a": (4, {"GPU": 4})}, {}, True, "a"),
    ("GPU beats CPU for the same blocks", {"a": (4, {"CPU": 4}), "b": (4, {"GPU": 4})}, {}, True, "b"),
    ("CPU hit beats no hit", {"a": (4, {"CPU": 4})}, {}, True, "a"),
    ("longer prefix wins", {"a": (1, {"GPU": 1}), "b": (3, {"GPU": 3})}, {}, True, "b"),
    ("affinity beats a small load gap", {"a": (4, {"GPU": 4})}, {"a": 3}, True, "a"),
    ("load guard: hit pod a slack above least", {"a": (4, {"GPU": 4})}, {"a": SLACK}, True, None),
    ("partial hit loses to a big load gap", {"a": (1, {"GPU": 1})}, {"a": 7, "b": 0, "c": 0}, True, None),
    ("equal hits: the less loaded", {"a": (4, {"GPU": 4}), "b": (4, {"GPU": 4})}, {"a": 2}, True, "b"),
    ("no tokens: load only", {"a": (4, {"GPU": 4})}, {"a": 1, "c": 1}, False, "b"),
]


@pytest.mark.parametrize("case, table, running, with_tokens, expected", KV_SYNC_TABLE, ids=[c[0] for c in KV_SYNC_TABLE])
async def test_kv_sync_table(case, table, running, with_tokens, expected):
    for seed in range(6):
        index = FakeIndex(table)
        r = router("kv-sync", index=index, seed=seed)
        await hold(r, running)
        d = await r.pick(RouteRequest("m", TOKENS if with_tokens else None))
        if expected is None:  # anything but "a"
            assert d.pod.name in {"b", "c"}, case
        else:
            assert d.pod.name == expected, case
        if with_tokens:
            assert d.total_blocks == 4
            assert d.matched_blocks == table.get(d.pod.name, (0,))[0]
        else:
            assert index.calls == []


async def test_kv_sync_index_failure_falls_back_to_load_and_is_counted():
    metrics = RoutingMetrics()
    r = router("kv-sync", index=FakeIndex(fail=True), metrics=metrics)
    await hold(r, {"a": 2, "b": 2})
    d = await r.pick(RouteRequest("m", TOKENS))
    assert d.pod.name == "c"
    assert metrics.registry.get_sample_value("kvgate_routing_scorer_errors_total", {"scorer": "prefix"}) == 1


async def test_kv_sync_asks_the_index_for_base_model_and_adapter():
    index = FakeIndex({"b": (4, {"GPU": 4})})
    reg = pods("a", "b", model="base", lora=("ad1",)) + pods("z", model="other")
    r = router("kv-sync", index=index, pod_list=reg)
    d = await r.pick(RouteRequest("ad1", TOKENS))
    assert d.pod.name == "b"
    assert index.calls[-1][:2] == ("base", "ad1")
    await r.pick(RouteRequest("base", TOKENS))
    assert index.calls[-1][:2] == ("base", None)


async def test_prefix_cache_learns_from_its_own_decisions():
    r = router("prefix-cache", seed=3)
    first = await r.pick(RouteRequest("m", TOKENS))
    await r.release(first)
    # same prompt prefix, longer prompt: same pod
    again = await r.pick(RouteRequest("m", TOKENS + [999] * 20))
    assert again.pod.name == first.pod.name
    assert again.matched_blocks == 4 and again.total_blocks == 5
    await r.release(again)
    # the affinity pod busier by a few: still chosen; by the guard's slack: not
    await hold(r, {first.pod.name: 3})
    assert (await r.pick(RouteRequest("m", TOKENS))).pod.name == first.pod.name
    await hold(r, {first.pod.name: SLACK - 3})
    assert (await r.pick(RouteRequest("m", TOKENS))).pod.name != first.pod.name


async def test_prefix_cache_forgets_removed_pods():
    reg = PodRegistry(pods("a", "b"))
    r = Router(reg, default_strategy="prefix-cache", seed=0)
    first = await r.pick(RouteRequest("m", TOKENS))
    await r.release(first)
    reg.replace([p for p in reg.pods() if p.name != first.pod.name])
    d = await r.pick(RouteRequest("m", TOKENS))
    assert d.pod.name != first.pod.name and d.matched_blocks == 0


async def test_prefix_cache_learns_per_rank_and_forgets_a_removed_pods_ranks():
    dp = Pod("a", "10.0.0.1", 8000, "m", kv_events=KVEventsEndpoint(dp_size=2))
    reg = PodRegistry([dp])
    r = Router(reg, default_strategy="prefix-cache", seed=0)
    first = await r.pick(RouteRequest("m", TOKENS))
    await r.release(first)
    again = await r.pick(RouteRequest("m", TOKENS))
    await r.release(again)
    assert first.rank in (0, 1) and (again.rank, again.matched_blocks) == (first.rank, 4)
    reg.replace([])
    reg.replace([dp])
    d = await r.pick(RouteRequest("m", TOKENS))
    assert d.matched_blocks == 0


@pytest.mark.parametrize("strategy", ["kv-sync", "prefix-cache"])
async def test_burst_of_identical_requests_spreads(strategy):
    """100 identical requests at once: the hit pod takes more, but none runs away (load guard +
    counts taken at pick time)."""
    index = FakeIndex({"a": (4, {"GPU": 4})})
    # at one instant: kv-sync's prefill backlog drains with its clock (a stall of the test process mid-burst
    # would drain it; tests/routing/test_routing_index.py measured that)
    r = router(strategy, index=index, pod_list=pods("a", "b", "c", "d"), config=StrategyConfig(clock=lambda: 0.0))
    decisions = await asyncio.gather(*(r.pick(RouteRequest("m", TOKENS, request_id=str(i))) for i in range(100)))
    per_pod = collections.Counter(d.pod.name for d in decisions)
    # kv-sync sees that only `a` holds the prompt: load and backlog put the others to work; the
    # guess of prefix-cache counts every pod it sent the prompt to as holding it, and leaves a
    # fourth pod idle while the three stay below the guard's idle-pod bound (four slacks)
    assert len(per_pod) >= (4 if strategy == "kv-sync" else 3), per_pod
    # the guard's rule held at each pod's last pick; counts only grew since, so with the final counts
    # a pod is at most one request past it
    least = min(per_pod.values())
    for n in per_pod.values():
        others = (100 - n) / 3
        assert n - others < max(SLACK, 0.5 * others) + 1, per_pod
        assert n <= least + 2 * max(SLACK, 0.5 * least), per_pod
    assert max(per_pod.values()) <= 40, per_pod
    assert r.running() == dict(per_pod)
    await asyncio.gather(*(r.release(d) for d in decisions))
    assert r.running() == {}


# running counts -> pods the guard keeps (the defaults: slack 16, ratio 0.7, far 4 slacks)
GUARD_TABLE = [
    ("two pods: slack above the other is set aside", {"a": 16, "b": 0}, {"b"}),
    ("two pods: just under the slack stays", {"a": 15, "b": 0}, {"a", "b"}),
    ("one idle (just added) pod does not set aside the warm ones", {"a": 20, "b": 20, "c": 20, "d": 0},
     {"a", "b", "c", "d"}),
    ("a hot pod among equals is set aside", {"a": 30, "b": 10, "c": 10, "d": 10}, {"b", "c", "d"}),
    ("warm pods just under four slacks above a just-added one stay: it is filled by scores, not a burst",
     {"a": 63, "b": 63, "c": 63, "d": 0}, {"a", "b", "c", "d"}),
    ("warm pods four slacks above an idle one are set aside", {"a": 64, "b": 64, "c": 64, "d": 0}, {"d"}),
    ("the slack grows with the others' load", {"a": 70, "b": 50, "c": 50}, {"a", "b", "c"}),
    ("...but not without bound", {"a": 88, "b": 50, "c": 50}, {"b", "c"}),
    ("a single pod is always kept", {"a": 99}, {"a"}),
]


@pytest.mark.parametrize("case, running, kept", GUARD_TABLE, ids=[c[0] for c in GUARD_TABLE])
def test_load_guard_table(case, running, kept):
    ctx = PickContext(request=RouteRequest("m"), base_model="m", lora=None, running=running)
    got = LoadGuard().filter(ctx, pods(*running))
    assert (LoadGuard().abs_slack, LoadGuard().rel_slack) == (SLACK, StrategyConfig().guard_rel_slack)
    assert {p.name for p in got} == kept, case



def _guard_rule(guard: LoadGuard, running: dict[str, int]) -> set[str]:
    """The guard's rule as its docstring states it, pod by pod (no shortcut)."""
    if len(running) < 2:
        return set(running)
    slack = lambda x: max(guard.abs_slack, guard.rel_slack * x)  # noqa: E731
    least = min(running.values())
    kept = set()
    for name, load in running.items():
        others = (sum(running.values()) - load) / (len(running) - 1)
        if load - others < slack(others) and load < least + guard.far * slack(least):
            kept.add(name)
    return kept


@pytest.mark.parametrize("abs_slack, rel_slack", [(16, 0.7), (2, 0.5), (0, 0.7), (30, 0.1)])
def test_load_guard_matches_its_rule_on_random_loads(abs_slack, rel_slack):
    """The filter's shortcuts (no pod within one slack of the least is set aside) keep exactly the
    pods the rule keeps, on loads near and far apart."""
    import random
    rng = random.Random(abs_slack)
    guard = LoadGuard(abs_slack, rel_slack)
    for _ in range(2000):
        n = rng.randint(1, 6)
        spread = rng.choice((3, 20, 100))
        running = {f"p{i}": rng.randint(0, spread) for i in range(n)}
        ctx = PickContext(request=RouteRequest("m"), base_model="m", lora=None, running=running)
        assert {p.name for p in guard.filter(ctx, pods(*running))} == _guard_rule(guard, running), running

GUARD_QUEUED_TABLE = [
    # (case, running, engine says requests wait there (None: no fresh scrape), kept)
    ("a hot spot whose engine has nothing waiting is kept: its load costs nothing yet",
     {"a": 40, "b": 10, "c": 10}, {"a": False, "b": False, "c": False}, {"a", "b", "c"}),
    ("a hot spot whose engine has requests waiting is set aside",
     {"a": 40, "b": 10, "c": 10}, {"a": True, "b": False, "c": False}, {"b", "c"}),
    ("no fresh scrape: the rule alone decides", {"a": 40, "b": 10, "c": 10}, {}, {"b", "c"}),
    ("warm pods next to an idle newcomer stay while nothing waits on them",
     {"a": 64, "b": 64, "c": 64, "d": 0}, {"a": False, "b": True, "c": None, "d": False}, {"a", "d"}),
    ("a balanced fleet is never filtered, waiting or not", {"a": 40, "b": 39}, {"a": True, "b": True}, {"a", "b"}),
]


@pytest.mark.parametrize("case, running, waiting, kept", GUARD_QUEUED_TABLE, ids=[c[0] for c in GUARD_QUEUED_TABLE])
def test_load_guard_sets_aside_only_pods_with_requests_waiting(case, running, waiting, kept):
    ctx = PickContext(request=RouteRequest("m"), base_model="m", lora=None, running=running)
    guard = LoadGuard(queued=lambda pod: waiting.get(pod.name))
    assert {p.name for p in guard.filter(ctx, pods(*running))} == kept, case


async def test_kv_sync_keeps_a_warm_pod_its_engine_says_has_room():
    """The shared guard reads the engines' scraped queues: a pod holding the prompt and running 30 more
    than the others keeps the request while its engine has nothing waiting, and loses it once it has."""
    import time
    reg = PodRegistry(pods("a", "b", "c"))
    engines = EngineMetrics(reg, interval_s=60)
    index = FakeIndex({"a": (4, {"GPU": 4})})
    r = Router(reg, default_strategy="kv-sync", index=index, engines=engines, seed=0)
    for _ in range(30):
        r._counts.add("a", 1)
    for name in "abc":
        engines.put(name, EngineLoad(waiting=0, running=30 if name == "a" else 0, kv_usage=0.3, at=time.monotonic()))
    assert (await r.pick(RouteRequest("m", token_ids=TOKENS))).pod.name == "a"
    engines.put("a", EngineLoad(waiting=2, running=31, kv_usage=0.9, at=time.monotonic()))
    assert (await r.pick(RouteRequest("m", token_ids=TOKENS))).pod.name != "a"
    # without engine metrics (no scraping), the guard's rule alone: set aside
    plain = Router(PodRegistry(pods("a", "b", "c")), default_strategy="kv-sync", index=index, seed=0)
    for _ in range(31):
        plain._counts.add("a", 1)
    assert (await plain.pick(RouteRequest("m", token_ids=TOKENS))).pod.name != "a"


def test_prefill_backlog_drains_at_its_rate():
    now = [0.0]
    b = PrefillBacklog(10_000, clock=lambda: now[0])
    assert b.get("a") == 0
    b.add("a", 1000)
    now[0] = 0.05
    assert b.get("a") == pytest.approx(500)
    b.add("a", 300)  # piles on what is left
    assert b.get("a") == pytest.approx(800)
    now[0] = 1.0
    assert b.get("a") == 0 and b.get("b") == 0
    with pytest.raises(ValueError):
        PrefillBacklog(0)


def test_a_shared_prefill_backlog_piles_every_gateways_picks_from_the_shared_counter():
    """Two replicas' backlogs over one shared count (Redis between replicas): each sees the other's picks, a
    counter's history before it first looked is no backlog, and a counter that went back (a replica's share
    expired) is taken as it is now."""
    from routing.state.counts import LocalCounts
    now = [0.0]
    shared = LocalCounts()
    shared.add("a" + ROUTED, 50_000)  # routed before these replicas looked: long prefilled
    one = PrefillBacklog(10_000, clock=lambda: now[0], shared=shared)
    two = PrefillBacklog(10_000, clock=lambda: now[0], shared=shared)
    one.sync(), two.sync()
    assert one.get("a") == 0 and two.get("a") == 0
    one.add("a", 1000)
    two.sync()
    assert two.get("a") == pytest.approx(1000)  # the other replica's pick
    two.add("a", 500)
    one.sync(), two.sync()  # each pick syncs first: both see 1,500 at t = 0
    now[0] = 0.05
    assert one.get("a") == pytest.approx(1000) and two.get("a") == pytest.approx(1000)  # 500 drained since
    shared.add("a" + ROUTED, -51_000)  # a replica's share expired
    one.sync()
    assert one.get("a") == pytest.approx(1000)  # nothing added, nothing lost
    one.add("a", 200)
    one.sync()
    assert one.get("a") == pytest.approx(1200)
    shared.add("a" + ROUTED, 10_000_000)  # the others' view back after Redis was out of reach: history
    shared.add("b" + ROUTED, 700)  # a pod's first routed tokens: news
    one.sync()
    assert one.get("a") == pytest.approx(1200) and one.get("b") == pytest.approx(700)


async def test_kv_sync_replicas_sharing_the_prefill_counts_see_each_others_backlog():
    """Two Routers (gateway replicas) with one shared prefill count: a long prompt one sends to a pod is backlog
    the other weighs, so the next request goes to the other pod; each replica alone would pile onto it."""
    from routing.learning.predictor import OutputPredictor
    from routing.learning.profiles import EngineProfiles
    from routing.scheduling.slo import Capacity
    from routing.state.counts import LocalCounts
    now = [0.0]
    from kvcache.index import PrefixIndex
    from tests.routing.test_routing_kv_sync import Engines, family
    index = PrefixIndex()
    Engines(index).store("b", family(7))  # the engines have published (the index knows their block size)
    shared = LocalCounts()
    cap = Capacity(EngineProfiles(), OutputPredictor(), clock=lambda: now[0], prefill=shared)
    registry = PodRegistry(pods("a", "b"))
    running = LocalCounts()  # the running counts too, as through Redis
    routers = [Router(registry, default_strategy="kv-sync", index=index, seed=g, capacity=cap.replica(),
                      counts=running, config=StrategyConfig(clock=lambda: now[0])) for g in range(2)]
    await routers[1].release(await routers[1].pick(RouteRequest("m", token_ids=list(range(500, 520)))))  # it has read
    doc = list(range(1000, 9000))  # 8,000 tokens no pod holds
    first = await routers[0].pick(RouteRequest("m", token_ids=doc))
    await routers[0].release(first)  # not running any more, and its prefill not done: the backlog alone decides
    for k in range(5):  # five prompt families, each its own tie-break order between the pods
        d = await routers[1].pick(RouteRequest("m", token_ids=list(range(20_000 + 1000 * k, 20_300 + 1000 * k))))
        await routers[1].release(d)
        assert d.pod.name != first.pod.name
    assert shared.totals()[first.pod.name + ROUTED] >= 8000


async def test_kv_sync_weighs_prefill_backlog_against_cache_hits():
    """A pod holding 1 of 4 blocks saves 16 of 64 prompt tokens; each request sent there still
    leaves 48 tokens to prefill. With the clock frozen the backlog piles up and the next requests go
    to other pods once it outweighs the saving; with time to drain, every request takes the hit."""
    now = [0.0]
    cfg = StrategyConfig(clock=lambda: now[0])
    index = FakeIndex({"a": (1, {"GPU": 1})})
    r = router("kv-sync", index=index, config=cfg, seed=0)
    names = []
    for i in range(4):
        d = await r.pick(RouteRequest("m", TOKENS, request_id=str(i)))
        await r.release(d)  # equal running counts: only the backlog differs
        names.append(d.pod.name)
    # a: 2 x 48 + 0 < 2 x 64; then a: 96 + 48 = 144 > 128 = b or c; then the one of b, c not taken
    assert names[0] == "a" and set(names[1:3]) == {"b", "c"}, names
    assert names[3] == "a", names  # a: 144 < b, c: 128 + 64
    r = router("kv-sync", index=FakeIndex({"a": (1, {"GPU": 1})}), config=cfg, seed=0)
    for i in range(6):
        now[0] += 1.0
        d = await r.pick(RouteRequest("m", TOKENS, request_id=str(i)))
        await r.release(d)
        assert d.pod.name == "a"


async def test_release_is_idempotent():
    r = router("least-request")
    d = await r.pick(RouteRequest("m"))
    await r.release(d)
    await r.release(d)
    assert r.running() == {}
    d2 = await r.pick(RouteRequest("m"))
    assert r.running() == {d2.pod.name: 1}


async def test_errors_and_needs_tokens():
    r = router("kv-sync", pod_list=pods("a") + [Pod("x", "10.0.0.8", 8000, "cold", ready=False)])
    with pytest.raises(UnknownModelError):
        await r.pick(RouteRequest("nope"))
    with pytest.raises(NoReadyPodError):
        await r.pick(RouteRequest("cold"))
    with pytest.raises(UnknownStrategyError, match="known: random"):
        await r.pick(RouteRequest("m", strategy="fastest"))
    with pytest.raises(UnknownStrategyError):
        r.needs_tokens("fastest")
    assert {s: r.needs_tokens(s) for s in r.strategy_names()} == {
        "random": False, "round-robin": False, "least-request": False, "power-of-two": False,
        "session-affinity": False, "vtc-basic": True, "prefix-cache": True, "kv-sync": True, "slo": True,
        "pd": True, "pd-decode": True}
    assert r.needs_tokens(None) is True
    assert r.running() == {}


async def test_kv_sync_absent_without_index():
    r = Router(PodRegistry(pods("a")), default_strategy="least-request")
    assert "kv-sync" not in r.strategy_names()
    with pytest.raises(UnknownStrategyError):
        Router(PodRegistry(pods("a")), default_strategy="kv-sync")


VLLM_METRICS = """# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.7
"""


def test_parse_engine_metrics():
    load = parse_engine_metrics(VLLM_METRICS, at=1.0)
    assert (load.waiting, load.running, round(load.kv_usage, 3)) == (5.0, 7.0, 0.6)
    assert parse_engine_metrics("").kv_usage is None
    # each data-parallel rank's own numbers, by the `engine` label
    assert {e: (r.waiting, r.running, r.kv_usage) for e, r in load.ranks.items()} == {
        "0": (3.0, 7.0, 0.5), "1": (2.0, 0.0, 0.7)}
    assert parse_engine_metrics(VLLM_METRICS.replace('engine="1",', 'engine="0",')).ranks is None  # one engine


async def test_engine_metric_scorers_read_a_data_parallel_ranks_own_numbers():
    import time
    reg = PodRegistry([Pod("a", "10.0.0.1", 8000, "m", kv_events=KVEventsEndpoint(dp_size=2)),
                       Pod("b", "10.0.0.2", 8000, "m")])
    engines = EngineMetrics(reg, interval_s=60)
    now = time.monotonic()
    engines.put("a", parse_engine_metrics(VLLM_METRICS, at=now))  # rank 0: 3 waiting, rank 1: 2
    engines.put("b", EngineLoad(waiting=2.5, running=0, kv_usage=0.6, at=now))
    assert engines.get("a", 1).waiting == 2.0 and engines.get("a").waiting == 5.0 and engines.get("b", 0).waiting == 2.5
    cfg = StrategyConfig(weights=parse_weights("least-request:load=0,queue=1"))
    r = Router(reg, default_strategy="least-request", engines=engines, config=cfg, seed=0)
    d = await r.pick(RouteRequest("m"))
    assert (d.pod.name, d.rank) == ("a", 1)  # the shortest queue is one rank's, not the pod's sum


async def test_engine_metric_scorers_join_a_strategy_by_weights():
    import time
    reg = PodRegistry(pods("a", "b", "c"))
    engines = EngineMetrics(reg, interval_s=60)
    now = time.monotonic()
    engines.put("a", EngineLoad(waiting=9, running=4, kv_usage=0.9, at=now))
    engines.put("b", EngineLoad(waiting=0, running=4, kv_usage=0.95, at=now))
    engines.put("c", EngineLoad(waiting=0, running=4, kv_usage=0.2, at=now))
    cfg = StrategyConfig(weights=parse_weights("least-request:load=1,queue=2,kv-util=2"))
    r = Router(reg, default_strategy="least-request", engines=engines, config=cfg, seed=0)
    assert (await r.pick(RouteRequest("m"))).pod.name == "c"
    assert r.debug_snapshot()["strategies"]["weights"]["least-request"] == {"load": 1.0, "queue": 2.0, "kv-util": 2.0}


def test_parse_weights_rejects_bad_input():
    assert parse_weights("kv-sync:prefix=3,load=1,queue=0.5") == {"kv-sync": {"prefix": 3.0, "load": 1.0, "queue": 0.5}}
    for bad in ("fast:load=1", "kv-sync:speed=1", "kv-sync:load=x", "kv-sync:load=-1", "kv-sync"):
        with pytest.raises(ValueError, match="KVGATE_ROUTING_WEIGHTS"):
            parse_weights(bad)
    with pytest.raises(ValueError, match="engine metrics"):
        Router(PodRegistry(pods("a")), default_strategy="random",
               config=StrategyConfig(weights={"least-request": {"queue": 1}}))


async def test_debug_snapshot_is_json_and_complete():
    import json
    r = router("kv-sync")
    d = await r.pick(RouteRequest("m", TOKENS))
    snap = json.loads(json.dumps(r.debug_snapshot(subscriptions=[{"pod": "a", "state": "live"}])))
    assert [p["name"] for p in snap["pods"]] == ["a", "b", "c"]
    by_name = {p["name"]: p for p in snap["pods"]}
    assert by_name[d.pod.name]["running"] == 1
    assert by_name["a"]["blocks"] == 4
    assert snap["strategies"]["default"] == "kv-sync"
    assert snap["counts"]["backend"] == "local"
    assert snap["subscriptions"] == [{"pod": "a", "state": "live"}]


# ---- the framework: per-request state in the pick context, scorers and strategies from one table

def ctx_for(tokens):
    return PickContext(request=RouteRequest("m", tokens), base_model="m", lora=None, running={})


def test_learning_scorers_keep_per_request_state_in_the_pick_context():
    """Two requests scored before either is picked (two strategies' passes, or a future await):
    each pick records its own request's prompt against its own pod."""
    scorer = ApproxPrefixScorer(ApproxPrefixTable(block_size=16))
    first, second = ctx_for(TOKENS), ctx_for([7] * 64)
    ps = pods("a", "b")
    scorer.score(first, ps)
    scorer.score(second, ps)
    scorer.picked(first, ps[0])
    scorer.picked(second, ps[1])
    assert scorer.score(ctx_for(TOKENS), ps) == {"a": 1.0, "b": 0.0}
    assert scorer.score(ctx_for([7] * 64), ps) == {"a": 0.0, "b": 1.0}

    now = [0.0]
    backlog = PrefillBacklog(10_000, clock=lambda: now[0])
    precise = PrecisePrefixScorer(FakeIndex({"a": (4, {"GPU": 4})}), backlog=backlog)
    first, second = ctx_for(TOKENS), ctx_for(TOKENS)
    precise.score(first, ps)
    precise.score(second, ps)
    precise.picked(first, ps[1])  # b holds nothing: the whole prompt joins its backlog
    precise.picked(second, ps[0])  # a holds its 4 blocks: the 3 tokens after them
    assert backlog.get("b") == 67 and backlog.get("a") == 3


class PodWatcher(Scorer):
    """A scorer added through the table: prefers pod "b" and records pod changes."""

    name = "watcher"

    def __init__(self):
        self.changes = []

    def score(self, ctx, pods):
        return {p.name: 1.0 if p.name == "b" else 0.0 for p in pods}

    def pods_changed(self, added, removed):
        self.changes.append(([p.name for p in added], [p.name for p in removed]))


async def test_a_new_policy_is_a_scorer_in_the_table_plus_weights(monkeypatch):
    built = []
    monkeypatch.setitem(SCORERS, "watcher", ScorerSpec("watcher", lambda r: built.append(PodWatcher()) or built[-1],
                                                       (), "test"))
    cfg = StrategyConfig(weights=parse_weights("least-request:watcher=5"))
    reg = PodRegistry(pods("a", "b", "c"))
    r = Router(reg, default_strategy="least-request", config=cfg, seed=0)
    assert (await r.pick(RouteRequest("m"))).pod.name == "b"
    # the router tells every scorer about pod changes through the generic hook
    reg.replace([p for p in reg.pods() if p.name != "c"])
    assert built[0].changes == [([], ["c"])]
    assert r.debug_snapshot()["strategies"]["weights"]["least-request"] == {"load": 1.0, "watcher": 5.0}


async def test_strategies_and_weights_come_from_the_one_table():
    from plugin.config import ConfigError, Settings
    reg = PodRegistry(pods("a", "b", "c"))
    r = Router(reg, default_strategy="kv-sync", index=FakeIndex(), engines=EngineMetrics(reg, interval_s=60))
    assert r.strategy_names() == NAMES == tuple(STRATEGIES)
    for name in NAMES:
        assert Settings.from_env({"KVGATE_PODS": "p=127.0.0.1:1/m", "KVGATE_ROUTING_STRATEGY": name}).routing_strategy == name
    with pytest.raises(ConfigError, match="KVGATE_ROUTING_STRATEGY"):
        Settings.from_env({"KVGATE_PODS": "p=127.0.0.1:1/m", "KVGATE_ROUTING_STRATEGY": "fastest"})
    weighted = [n for n, spec in STRATEGIES.items() if spec.weighted]
    text = ";".join(f"{n}:" + ",".join(f"{sc}=0" for sc in SCORERS) for n in weighted)
    assert parse_weights(text) == {n: dict.fromkeys(SCORERS, 0.0) for n in weighted}


@pytest.mark.integration
async def test_kv_sync_backlog_reaches_the_other_replica_through_redis(redis_server):
    """The shipped wiring: each replica's prefill counts in Redis (plugin.app), kv-sync's backlog read from them."""
    from kvcache.index import PrefixIndex
    from routing.learning.predictor import OutputPredictor
    from routing.learning.profiles import EngineProfiles
    from routing.scheduling.slo import Capacity
    from tests.routing.test_routing_kv_sync import Engines, family
    async with prefill_counts(redis_server.url) as counts:
        now = [0.0]
        index = PrefixIndex()
        Engines(index).store("b", family(7))  # the engines have published (the index knows their block size)
        ra, rb = (Router(PodRegistry(pods("a", "b")), default_strategy="kv-sync", index=index, seed=0,
                         capacity=Capacity(EngineProfiles(), OutputPredictor(), clock=lambda: now[0], prefill=c),
                         config=StrategyConfig(clock=lambda: now[0])) for c in counts)
        await rb.release(await rb.pick(RouteRequest("m", token_ids=list(range(500, 520)))))  # b has read once
        doc = await ra.pick(RouteRequest("m", token_ids=list(range(1000, 9000))))
        await ra.release(doc)

        async def b_saw_the_document() -> bool:  # each pick of b's reads the others' shares for the next one
            if counts[1].totals().get(doc.pod.name + ROUTED, 0) >= 8000:
                return True
            await rb.release(await rb.pick(RouteRequest("m", token_ids=[1, 2, 3])))
            return False
        await wait_until_async(b_saw_the_document, timeout=5.0, interval=0.01,
                               what="replica b to see the document's routed tokens")
        chat = await rb.pick(RouteRequest("m", token_ids=list(range(20_000, 20_300))))
        assert chat.pod.name != doc.pod.name  # b keeps its chat off the 0.8 s of prefill a put there


def test_slo_chooses_among_safe_pods_with_the_operators_kv_sync_weights():
    """slo's choice among the pods safely within their targets is kv-sync's: KVGATE_ROUTING_WEIGHTS given for
    kv-sync reach it too (a scorer added, one removed, one reweighted), and slo's own entries come last."""
    import random
    from kvcache.index import PrefixIndex
    from routing.learning.predictor import OutputPredictor
    from routing.learning.profiles import EngineProfiles
    from routing.scheduling.slo import Capacity
    from routing.scheduling.strategies import build_strategies

    def weights(text: str) -> dict[str, dict[str, float]]:
        built = build_strategies(StrategyConfig(weights=parse_weights(text)), random.Random(0), index=PrefixIndex(),
                                 capacity=Capacity(EngineProfiles(), OutputPredictor()),
                                 engines=EngineMetrics(PodRegistry([]), interval_s=60))
        return {name: {type(sc).__name__: w for sc, w in built[name].scorers} for name in ("kv-sync", "slo")}

    plain = weights("")
    assert len(plain["slo"]) == len(plain["kv-sync"]) + 1
    tuned = weights("kv-sync:prefix=4,affinity=0,queue=1")
    assert tuned["slo"] == {**tuned["kv-sync"], "SLOScorer": 1000.0}
    assert "QueueScorer" in tuned["slo"] and tuned["slo"]["PrecisePrefixScorer"] == 4.0
    assert weights("kv-sync:slo=5")["slo"]["SLOScorer"] == 1000.0  # slo's own scorer is not kv-sync's to weigh
    own = weights("kv-sync:prefix=4;slo:prefix=2")
    assert own["slo"]["PrecisePrefixScorer"] == 2.0 and own["kv-sync"]["PrecisePrefixScorer"] == 4.0
