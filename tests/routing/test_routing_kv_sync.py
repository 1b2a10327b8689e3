"""kv-sync's policy per scenario, on the real PrefixIndex fed with KV events: a flushed family
re-warms one engine, eviction is followed exactly, a new engine is used when load warrants, new
families are dealt evenly over the pods, and
gateway replicas (each its own Router and state, sharing the index and the counts) agree on a
family nobody holds."""
from __future__ import annotations

import ast
import random
import re

import pytest

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.index import PrefixIndex
from routing.state.counts import LocalCounts
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.scoring import RouteRequest
from routing.scheduling.strategies import StrategyConfig
from helpers import Clock

BS = 16
MODEL = "m"


class Engines:
    """Publishes what simulated engines would: one engine hash per distinct prefix block, shared
    by every pod of the model (as vLLM's engines agree on hashes)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._hash: dict[tuple[int, ...], int] = {}

    def _hashes(self, tokens: list[int]) -> tuple[int, ...]:
        return tuple(self._hash.setdefault(tuple(tokens[:(i + 1) * BS]), len(self._hash) + 1)
                     for i in range(len(tokens) // BS))

    def store(self, pod: str, tokens: list[int]) -> None:
        hs = self._hashes(tokens)
        self.index.apply(pod, MODEL, 0, [BlockStored(hs, None, tuple(tokens[:len(hs) * BS]), BS)])

    def evict(self, pod: str, tokens: list[int], keep_blocks: int) -> None:
        self.index.apply(pod, MODEL, 0, [BlockRemoved(self._hashes(tokens)[keep_blocks:])])

    def flush(self, pod: str) -> None:
        self.index.apply(pod, MODEL, 0, [AllBlocksCleared()])


def family(seed: int, context_blocks: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 60000) for _ in range(context_blocks * BS)]


def prompt(context: list[int], question: int) -> list[int]:
    rng = random.Random(f"q{question}")
    return context + [rng.randrange(1000, 60000) for _ in range(3 * BS)]



def fleet(names=("a", "b", "c"), replicas: int = 1):
    """Routers (one per gateway replica) sharing one index, one pod registry and one count."""
    index = PrefixIndex()
    clock = Clock()
    registry = PodRegistry([Pod(n, f"10.0.0.{i + 1}", 8000, MODEL) for i, n in enumerate(names)])
    counts = LocalCounts()
    routers = [Router(registry, default_strategy="kv-sync", counts=counts, index=index, seed=g,
                      config=StrategyConfig(clock=clock)) for g in range(replicas)]
    return routers, Engines(index), clock, registry


def full(engines: Engines, pods: str = "abc") -> None:
    """Every engine of `pods` has evicted: its cache is full (routing.scheduling.scorers.CacheRoom), so a copy
    of a prefix costs what it evicts on any of them alike."""
    for i, pod in enumerate(pods):
        filler = family(900 + i, context_blocks=4)
        engines.store(pod, filler)
        engines.evict(pod, filler, keep_blocks=3)


async def pick(router: Router, tokens: list[int], release: bool = True) -> str:
    d = await router.pick(RouteRequest(MODEL, tokens))
    if release:
        await router.release(d)
    return d.pod.name


async def hold(router: Router, counts: dict[str, int]) -> None:
    for pod, n in counts.items():
        router._counts.add(pod, n)


async def test_flushed_family_rewarms_one_engine_instead_of_scattering():
    """The family lived on `a`; `a` is flushed. Until the index shows where its prefix is again,
    every conversation of the family goes back to `a` (one miss re-warms it), though `a` runs a
    couple more requests than the others and the ties of load alone would scatter them."""
    (r,), engines, clock, _ = fleet()
    ctx = family(1)
    engines.store("a", prompt(ctx, 0))
    assert await pick(r, prompt(ctx, 1)) == "a"
    engines.flush("a")
    await hold(r, {"a": 2})
    got = []
    for q in range(2, 8):
        clock.t += 1.0  # earlier prefills done; their events not seen yet
        got.append(await pick(r, prompt(ctx, q)))
    assert got == ["a"] * 6
    # once the index shows the prefix elsewhere (say another gateway's pick warmed b), it decides
    engines.store("b", prompt(ctx, 9))
    assert await pick(r, prompt(ctx, 10)) == "b"


async def test_a_flushed_family_goes_home_behind_its_neighbours_recomputing():
    """`a` held three families and is flushed. The first to come back recomputes there. Its prefix costs
    the same prefill anywhere, so what draws a family away from home is only the wait there: a whole prompt's
    prefill still ahead of it (the second) sends it elsewhere, half of one (the third) does not, where at
    half the home's weight it did (bench bakeoff's flush-rotate: a quarter of a reset engine's tenants moved
    for good to wherever the wait was shortest at that moment)."""
    (r,), engines, clock, _ = fleet()
    first, second, third = family(1), family(2), family(3)
    for ctx in (first, second, third):
        engines.store("a", prompt(ctx, 0))
        assert await pick(r, prompt(ctx, 1)) == "a"
    engines.flush("a")
    clock.t += 1.0
    assert await pick(r, prompt(first, 2)) == "a"  # nobody holds it: home, nothing waiting there yet
    assert await pick(r, prompt(second, 2)) != "a"  # behind the first's whole prefill: moves
    # half of each of those prefills done (StrategyConfig's 10,000 tokens/s): half a prompt ahead on a
    clock.t += len(prompt(first, 2)) / 2 / StrategyConfig().prefill_tokens_per_s
    assert await pick(r, prompt(third, 2)) == "a"


async def test_eviction_is_followed_exactly_and_a_family_evicted_everywhere_stays_together():
    (r,), engines, clock, _ = fleet()
    full(engines)
    ctx = family(2)
    engines.store("a", prompt(ctx, 0))
    assert await pick(r, prompt(ctx, 1)) == "a"
    # a evicts most of the family's blocks while c holds them all: c, though a was its last pod
    engines.store("c", prompt(ctx, 2))
    engines.evict("a", prompt(ctx, 0), keep_blocks=3)
    assert await pick(r, prompt(ctx, 3)) == "c"
    # evicted everywhere: back to the pod it was last sent to, every time
    engines.evict("a", prompt(ctx, 0), keep_blocks=0)
    engines.evict("c", prompt(ctx, 2), keep_blocks=0)
    got = set()
    for q in range(4, 10):
        clock.t += 1.0
        got.add(await pick(r, prompt(ctx, q)))
    assert got == {"c"}


async def test_a_new_engine_is_used_when_load_warrants():
    (r,), engines, clock, registry = fleet()
    held = {name: family(10 + i) for i, name in enumerate("abc")}
    for name, ctx in held.items():
        engines.store(name, prompt(ctx, 0))
    await hold(r, {"a": 12, "b": 12, "c": 12})
    registry.replace(registry.pods() + [Pod("d", "10.0.0.9", 8000, MODEL)])
    # families nobody holds go to the idle newcomer, whatever their rendezvous order says, until
    # its load nears the others'
    new = []
    for i in range(6):
        clock.t += 1.0  # the newcomer's earlier prefills are done: its running requests decode
        new.append(await pick(r, prompt(family(100 + i), 0), release=False))
    assert new == ["d"] * 6
    # a family held by a busy-but-not-overloaded engine stays there: its cache is worth more
    assert await pick(r, prompt(held["b"], 1)) == "b"
    # a family whose pod is overloaded (the load guard) goes to the newcomer, not to another warm pod
    await hold(r, {"c": StrategyConfig().guard_abs_slack})
    clock.t += 1.0
    assert await pick(r, prompt(held["c"], 1)) == "d"


async def test_new_families_are_placed_where_the_fewest_families_live():
    """Families nobody holds, arriving one at a time at equal loads, are dealt evenly over the pods
    (rendezvous order alone would give some pods several more than others: their caches and batches
    overfill and load then moves requests off their prefix). Each family then stays where it was
    placed."""
    (r,), engines, clock, _ = fleet(("a", "b", "c", "d"))
    engines.store("a", family(999))  # the engines have published: the index knows their block size
    placed = {}
    for f in range(40):
        clock.t += 1.0  # the earlier prefills are done
        placed[f] = await pick(r, prompt(family(2000 + f), 0))
    per_pod = {p: list(placed.values()).count(p) for p in "abcd"}
    assert per_pod == {"a": 10, "b": 10, "c": 10, "d": 10}, per_pod
    for f in range(0, 40, 7):  # not held yet (no events): each family goes back to its pod
        clock.t += 1.0
        assert await pick(r, prompt(family(2000 + f), 1)) == placed[f]


async def test_gateway_replicas_agree_on_families_nobody_holds():
    """Two replicas, each with its own scorers' state, share the index and the running counts.
    Requests dealt to them in turn: each family nobody holds lands on one pod, whichever replica
    picks, before any event shows where it went (two at once, then two more once the first
    prefills are done)."""
    routers, engines, clock, _ = fleet(("a", "b", "c", "d"), replicas=2)
    engines.store("a", family(999))  # the engines have published: the index knows their block size
    placed = {}
    for f in range(40):
        ctx = family(1000 + f)
        pods = set()
        for turn in range(4):
            clock.t += turn % 2 == 0  # turns 0 and 2: the earlier prefills are done
            pods.add(await pick(routers[turn % 2], prompt(ctx, turn), release=False))
        assert len(pods) == 1, (f, pods)
        placed[f] = pods.pop()
        for router in routers:  # those requests finish; the next family starts from equal loads
            for name, n in router._counts.local().items():
                router._counts.add(name, -n)
    # the families still spread over the pods (rendezvous order, not one favourite)
    assert len(set(placed.values())) == 4
    # and after a flush of the pod holding one, both replicas send it back there
    ctx = family(1000)
    engines.store(placed[0], prompt(ctx, 0))
    engines.flush(placed[0])
    clock.t += 1.0
    assert {await pick(router, prompt(ctx, 9)) for router in routers} == {placed[0]}


@pytest.mark.parametrize("replicas", [1, 2])
async def test_hot_family_still_spreads(replicas):
    """A burst of one family nobody holds: affinity keeps it together only while the pod is not
    much busier than the rest; the load guard's bound holds (the peers' hot-spot failure)."""
    routers, engines, clock, _ = fleet(("a", "b", "c", "d"), replicas=replicas)
    engines.store("a", family(999))
    ctx = family(7)
    got = [await pick(routers[i % replicas], prompt(ctx, i), release=False) for i in range(80)]
    per_pod = {p: got.count(p) for p in "abcd"}
    assert min(per_pod.values()) > 0, per_pod
    assert max(per_pod.values()) - min(per_pod.values()) <= 2 * 16, per_pod


TEMPLATE = family(0, context_blocks=1)  # the opening every prompt of the deployment begins with (a chat template's)


def tenant(t: int) -> list[int]:
    return TEMPLATE + family(500 + t, context_blocks=20)


async def warm(router: Router, engines: Engines, clock, tenants: int = 12) -> dict[int, str]:
    """Each tenant's first conversation, one at a time, each prefilled (its blocks stored) before the next, then
    a second one each, which follows the index there: the model's opening is learnt (routing.scheduling.family;
    the first few prompts, before it is known, are keyed on their first block) and every tenant has a home."""
    homes = {}
    for t in range(tenants):
        clock.t += 1.0
        homes[t] = await pick(router, prompt(tenant(t), 0))
        engines.store(homes[t], prompt(tenant(t), 0))
    for t in range(tenants):
        clock.t += 1.0
        assert await pick(router, prompt(tenant(t), 1)) == homes[t]
    return homes


async def test_tenants_behind_a_shared_template_are_families_of_their_own():
    """Every prompt begins with the same template block, which every engine holds: a tenant evicted everywhere
    but for it goes back to its own pod (not where load or backlog is least), and the tenants keep their
    different homes (keyed on the first block, they were one family)."""
    (r,), engines, clock, _ = fleet()
    homes = await warm(r, engines, clock)
    assert len(set(homes.values())) == 3  # placed over the pods
    for t in range(12):
        engines.evict(homes[t], prompt(tenant(t), 0), keep_blocks=1)  # all but the template
    for name in "abc":
        engines.store(name, TEMPLATE)
    await hold(r, {homes[0]: 2})  # its home busier than the others (2 running)
    got = []
    for q in range(2, 6):
        clock.t += 1.0
        got.append(await pick(r, prompt(tenant(0), q)))
    assert got == [homes[0]] * 4
    for t in range(1, 12):
        clock.t += 1.0
        assert await pick(r, prompt(tenant(t), 9)) == homes[t], t


async def test_replicas_agree_on_a_family_the_index_shows_on_two_pods():
    """Held alike on two pods (a copy made while one was busy): both replicas send it to the same one, so the
    other copy ages out instead of both living on."""
    routers, engines, clock, _ = fleet(replicas=2)
    for router in routers:
        await warm(router, engines, clock)
    ctx = TEMPLATE + family(888, context_blocks=20)
    engines.store("b", prompt(ctx, 0))
    engines.store("c", prompt(ctx, 0))
    got = set()
    for q in range(1, 9):
        clock.t += 1.0
        got.add(await pick(routers[q % 2], prompt(ctx, q)))
    assert len(got) == 1 and got <= {"b", "c"}, got


async def test_a_near_call_goes_to_the_pod_holding_the_family():
    """The tenant's home kept only its system prompt's first blocks (the rest evicted) and runs a few more requests
    than the others: the prefix it holds weighs about as much as that load, and the family tips the call there,
    where its next requests will find the prompt again (without it, load sent it off to make a second copy)."""
    (r,), engines, clock, _ = fleet()
    homes = await warm(r, engines, clock)
    home = homes[0]
    for name in "abc":
        engines.store(name, TEMPLATE)
    full(engines)
    engines.evict(home, prompt(tenant(0), 0), keep_blocks=2)  # the template and the tenant's first block
    await hold(r, {home: 4})
    clock.t += 1.0
    assert await pick(r, prompt(tenant(0), 7)) == home


async def test_each_pick_is_explained_at_debug_level(caplog):
    """KVGATE_LOG_LEVEL=debug: one line per pick with each scorer's scores, the index's matched blocks and the
    running counts (what took this session a patch to see); nothing at info."""
    import logging
    (r,), engines, clock, _ = fleet()
    ctx = family(3)
    engines.store("b", prompt(ctx, 0))
    with caplog.at_level(logging.INFO, logger="routing.scheduling.scoring"):
        await pick(r, prompt(ctx, 1))
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="routing.scheduling.scoring"):
        await hold(r, {"a": 2})
        assert await pick(r, prompt(ctx, 2)) == "b"
    (line,) = [rec.getMessage() for rec in caplog.records]
    assert line.startswith("pick ") and "(kv-sync): b;" in line  # b holds the 40-block context
    assert "'prefix': {" in line and "'load': {" in line and "'a': 0.75" in line  # a's load score at 2 running
    assert "blocks matched {'a': 0, 'b': 40, 'c': 0} of 43" in line and "running {'a': 2, 'b': 0, 'c': 0}" in line
    assert "held or computing as matched" in line and re.search(r"family [0-9a-f]{16}$", line)  # the tenant, traceable
    # a pod computing the prompt for a running request of this gateway: its holdings beside the index's
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="routing.scheduling.scoring"):
        running = await r.pick(RouteRequest(MODEL, prompt(family(5), 0)))
        await r.pick(RouteRequest(MODEL, prompt(family(5), 1)))
    line = caplog.records[-1].getMessage()
    held = ast.literal_eval(re.search(r"held or computing (\{.*?\});", line).group(1))
    assert held == {p: 40 if p == running.pod.name else 0 for p in "abc"}


async def test_a_tenants_burst_follows_its_first_request_before_any_event():
    """vLLM caches a scheduled request's prompt blocks before computing them, so a request sent where another
    with its prefix is running hits them; the index learns them only from the events, a queue and a prefill
    later. A burst of one tenant's conversations goes where its first request is (one copy of its system
    prompt), not where the prefill backlog is least (a copy on every engine)."""
    (r,), engines, clock, _ = fleet()
    engines.store("c", family(999))  # the engines have published: the index knows their block size
    ctx = family(3)
    first = await r.pick(RouteRequest(MODEL, prompt(ctx, 0)))
    burst = [await r.pick(RouteRequest(MODEL, prompt(ctx, q))) for q in (1, 2)]
    assert [d.pod.name for d in burst] == [first.pod.name] * 2
    assert [d.matched_blocks for d in burst] == [0, 0]  # what the index says (the Decision reports it)
    # its engine's cache cleared (AllBlocksCleared): what the running requests were computing is theirs alone
    engines.flush(first.pod.name)
    moved = await r.pick(RouteRequest(MODEL, prompt(ctx, 3)))
    assert moved.pod.name != first.pod.name
    for d in (first, *burst, moved):
        await r.release(d)
    # none running: a prompt nobody holds goes by load and the family's placement alone
    clock.t += 10.0
    assert await pick(r, prompt(ctx, 4)) == moved.pod.name  # the family's last pod


async def test_slo_predicts_the_hit_on_the_pod_computing_the_prompt():
    """The one cost model: slo's predicted TTFT counts a pod's running prompts as held too (what it would wait
    for there is the queue, not the prefix again)."""
    (r,), engines, clock, _ = fleet()
    engines.store("c", family(999))  # the index knows the block size
    ctx = family(4)
    first = await r.pick(RouteRequest(MODEL, prompt(ctx, 0), strategy="slo"))
    scorer = next(sc for sc, _ in r._strategies["slo"].scorers if sc.name == "slo")
    await r.pick(RouteRequest(MODEL, prompt(ctx, 1), strategy="slo"))
    ttft = {pod: pred[0] for pod, pred in scorer.last.items()}
    others = [t for pod, t in ttft.items() if pod != first.pod.name]
    # there: the first's prefill queued (43 blocks), then 3 blocks of its own; elsewhere all 43, no queue;
    # counting the prefix again there would predict about twice the others'
    assert ttft[first.pod.name] < 1.25 * min(others)


async def test_an_slo_pick_asks_the_index_once():
    """slo's cost model and kv-sync's prefix score, which slo weighs among its safe pods, read the same answer."""
    (r,), engines, _, _ = fleet()
    ctx = family(5)
    engines.store("b", prompt(ctx, 0))
    calls = []
    match = engines.index.match

    def counted(*args, **kw):
        calls.append(args[3])
        return match(*args, **kw)
    engines.index.match = counted
    d = await r.pick(RouteRequest(MODEL, prompt(ctx, 1), strategy="slo"))
    assert d.pod.name == "b" and d.matched_blocks > 0
    assert len(calls) == 1, calls


async def test_a_tenants_burst_dealt_over_two_replicas_follows_its_first_request():
    """Envoy deals a burst over the replicas: with their running prompts shared (routing.state.prompt_relay;
    LocalRelay here, Redis in a deployment) the other replica's requests go where the first is computing."""
    from routing.state.prompt_relay import LocalRelay

    async def burst(shared: bool) -> tuple[str, list[str]]:
        (r0, r1), engines, _, _ = fleet(replicas=2)
        if shared:
            relay = LocalRelay()
            relay.join("gw0", r0.prompts)
            relay.join("gw1", r1.prompts)
        engines.store("c", family(999))  # the index knows the block size
        ctx = family(3)
        first = await r0.pick(RouteRequest(MODEL, prompt(ctx, 0)))
        # r1 has placed a family of its own there: a new family goes where it has placed none (the affinity)
        await r1.release(await r1.pick(RouteRequest(MODEL, prompt(family(10), 0)),
                                       subset=frozenset((first.pod.endpoint,))))
        others = [await r1.pick(RouteRequest(MODEL, prompt(ctx, q))) for q in (1, 2, 3)]
        return first.pod.name, [d.pod.name for d in others]

    first, others = await burst(shared=True)
    assert others == [first] * 3
    first, others = await burst(shared=False)  # each replica saw its own half
    assert others != [first] * 3


async def test_the_other_replicas_hear_of_a_pick_only_where_its_pod_lacks_more_than_two_blocks_of_the_prompt():
    """The pick tells its running prompt the index's count for its pod: a prompt the pod holds but for its last
    blocks (routing.state.prompts' UNTOLD_BLOCKS) is kept from the relay, a family new to every pod is told."""
    (r,), engines, _, _ = fleet()
    heard: list[list] = []
    r.prompts.listener = heard.append
    ctx = family(6)
    engines.store("b", prompt(ctx, 0))
    d = await r.pick(RouteRequest(MODEL, prompt(ctx, 0)))  # again: b holds every full block of it
    assert d.pod.name == "b" and heard[-1] == ["keep", d.ticket]
    await r.release(d)
    d = await r.pick(RouteRequest(MODEL, prompt(family(7), 0)))  # nobody holds any of it
    assert heard[-1][:2] == ["add", d.ticket]
    await r.release(d)
    assert [c[0] for c in heard] == ["keep", "add", "end"]


def test_cache_room_is_known_once_a_pods_engine_has_evicted_and_is_there_after_a_reset_until_it_evicts():
    from routing.scheduling.scorers import CacheRoom
    cache = {"a": (10, 0, 0), "b": (10, 0, 0)}  # blocks held, removals, resets
    room = CacheRoom(lambda pods: {p: cache[p] for p in pods if p in cache})
    assert room.rooms(["a", "b", "c"]) == {}  # filling: no size shown
    cache["a"] = (40, 0, 0)
    cache["b"] = (0, 0, 1)  # b reset half full: that says nothing of its size
    assert room.rooms(["a", "b"]) == {}
    cache["a"] = (36, 3, 0)  # a evicted: full, whatever it holds (running requests' blocks are in no event)
    assert room.rooms(["a", "b"]) == {"a": 0}
    assert room.sizes() == {"a": 40}
    cache["a"] = (0, 3, 1)  # reset: its blocks are free
    assert room.rooms(["a"]) == {"a": 40}
    cache["a"] = (30, 3, 1)
    assert room.rooms(["a"]) == {"a": 10}
    cache["a"] = (38, 4, 1)  # evicting again: full
    assert room.rooms(["a"]) == {"a": 0}
    cache["a"] = (44, 4, 1)  # more than it was seen holding: the cache is that large
    assert room.rooms(["a"]) == {"a": 0} and room.sizes() == {"a": 44}
    room.forget("a")
    assert room.rooms(["c"]) == {} and room.sizes() == {}


async def test_a_prompt_nobody_holds_goes_where_caching_it_evicts_nothing():
    """Every engine's cache is full (each has evicted) and `a`'s was just reset: a prompt no engine holds
    costs a prefill anywhere, but on `b` or `c` its blocks evict as many of other prefixes. It goes to
    `a`, though `a` runs two requests more (which alone decides it while no cache has shown its size:
    nor does a reset, before any eviction); once `a` is full again, it goes elsewhere."""
    async def place(full: bool) -> tuple[str, str]:
        (r,), engines, clock, _ = fleet()
        for i, pod in enumerate("abc"):
            engines.store(pod, prompt(family(100 + i), 0))
        await pick(r, prompt(family(300), 0))  # a pick sees how much each pod holds
        clock.t += 1.0
        for i, pod in enumerate("abc"):
            ctx = family(100 + i)
            if full:
                engines.evict(pod, prompt(ctx, 0), keep_blocks=42)  # one block out: the size shown
        engines.flush("a")
        await hold(r, {"a": 2})
        first = await pick(r, prompt(family(200), 0))
        engines.store("a", prompt(family(201), 0))  # a refilled
        clock.t += 1.0
        then = await pick(r, prompt(family(202), 0))
        return first, then

    first, then = await place(full=True)
    assert first == "a" and then in ("b", "c")
    # a cache reset before it was ever full says nothing of its size: load decides
    first, _ = await place(full=False)
    assert first in ("b", "c")
    (r,), engines, _, _ = fleet()
    engines.store("a", prompt(family(100), 0))
    await pick(r, prompt(family(300), 0))
    engines.evict("a", prompt(family(100), 0), keep_blocks=40)
    await pick(r, prompt(family(301), 0))
    sizes = {p["name"]: p.get("cache_size_blocks") for p in r.debug_snapshot()["pods"]}
    assert sizes == {"a": 43, "b": None, "c": None}  # /debug: the size a's cache showed
