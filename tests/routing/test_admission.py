"""Admission (routing.state.admission): the atomic check-and-count (in process, and across two gateways on a
real redis-server), the fair per-model wait, 429 after the wait, and recently deleted pods' counts."""
from __future__ import annotations

import asyncio

import pytest

from routing.state.admission import Admission, LocalLimiter, RedisLimiter
from helpers import Clock, swallowed_wait, wait_until_async



async def test_limit_holds_a_waiter_gets_the_released_room_and_a_late_one_gets_none():
    adm = Admission(LocalLimiter(), max_running=2, max_wait_s=0.5)
    assert await adm.admit("m", ["a"]) == "a"
    assert await adm.admit("m", ["a", "b"]) == "a"
    waiter = asyncio.create_task(adm.admit("m", ["a"]))
    await asyncio.sleep(0)
    assert not waiter.done() and adm.waiting == 1
    await adm.release("a")
    assert await asyncio.wait_for(waiter, 1.0) == "a"
    assert adm.limiter.running() == {"a": 2}
    assert await adm.admit("m", ["a"]) is None  # waited 0.5 s, nothing released
    assert adm.waiting == 0


async def test_stats_count_each_request_by_how_it_was_admitted_and_the_time_waited():
    """What an operator reads (kvgate_admission_*): admitted at once, after a wait, or timed out (the 429),
    requests waiting now, and the seconds waited in all (the wait adds to their time to first token)."""
    adm = Admission(LocalLimiter(), max_running=1, max_wait_s=0.3)
    assert adm.stats() == {"at_once": 0, "after_wait": 0, "timed_out": 0, "cancelled": 0, "waiting": 0,
                           "wait_seconds": 0.0, "limiter_errors": 0, "limiter_failing": False}
    assert await adm.admit("m", ["a"]) == "a"
    waiter = asyncio.create_task(adm.admit("m", ["a"]))
    await wait_until_async(lambda: adm.waiting == 1)
    assert adm.stats()["waiting"] == 1
    await asyncio.sleep(0.1)
    await adm.release("a")
    assert await asyncio.wait_for(waiter, 1.0) == "a"
    assert await adm.admit("m", ["a"]) is None  # the pod stays full: waits 0.3 s, then times out
    left = asyncio.create_task(adm.admit("m", ["a"]))  # a client that leaves while it waits
    await wait_until_async(lambda: adm.waiting == 1)
    left.cancel()
    with pytest.raises(asyncio.CancelledError):
        await left
    stats = adm.stats()
    assert {k: stats[k] for k in ("at_once", "after_wait", "timed_out", "cancelled", "waiting")} == {
        "at_once": 1, "after_wait": 1, "timed_out": 1, "cancelled": 1, "waiting": 0}
    assert 0.4 <= stats["wait_seconds"] < 2.0  # ~0.1 s, the 0.3 s waited out, and the cancelled one's moment


async def test_waiting_models_take_turns_whatever_their_queue_lengths():
    adm = Admission(LocalLimiter(), max_running=1, max_wait_s=5.0)
    assert await adm.admit("big", ["p"]) == "p"
    order: list[str] = []

    async def one(model: str) -> None:
        pod = await adm.admit(model, ["p"])
        order.append(model)
        await asyncio.sleep(0)
        await adm.release(pod)

    tasks = [asyncio.create_task(one("big")) for _ in range(5)]
    await wait_until_async(lambda: adm.waiting == 5)  # big's five queue first
    tasks.append(asyncio.create_task(one("small")))
    await wait_until_async(lambda: adm.waiting == 6)
    await adm.release("p")
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert order.index("small") <= 1  # served first or second, not after big's five
    assert sorted(order) == ["big"] * 5 + ["small"]


async def test_the_collector_exports_the_stats_at_scrape_time():
    from prometheus_client import CollectorRegistry, generate_latest

    from routing.metrics import AdmissionCollector
    adm = Admission(LocalLimiter(), max_running=1, max_wait_s=0.05)
    registry = CollectorRegistry()
    AdmissionCollector(adm.stats, 1, registry)
    assert await adm.admit("m", ["a"]) == "a"
    assert await adm.admit("m", ["a"]) is None
    lines = generate_latest(registry).decode().splitlines()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}
    assert {k: v for k, v in samples.items() if k.startswith("kvgate_admission_requests_total")} == {
        'kvgate_admission_requests_total{outcome="at_once"}': 1.0,
        'kvgate_admission_requests_total{outcome="after_wait"}': 0.0,
        'kvgate_admission_requests_total{outcome="timed_out"}': 1.0,
        'kvgate_admission_requests_total{outcome="cancelled"}': 0.0}
    assert samples["kvgate_admission_waiting"] == 0 and samples["kvgate_admission_max_running"] == 1
    assert 0.05 <= samples["kvgate_admission_wait_seconds_total"] < 1.0


async def test_recently_deleted_pod_keeps_its_count_and_loses_it_after_the_window():
    clock = Clock()
    adm = Admission(LocalLimiter(), max_running=2, deleted_keep_s=30.0, clock=clock)
    await adm.admit("m", ["a"])
    await adm.admit("m", ["a"])
    adm.pods_removed(["a"])
    clock.t += 10
    assert adm.pods_added(["a"]) == ["a"]  # back within 30 s: still 2 running, still full
    assert await adm.limiter.try_acquire("a", 2) is False
    adm.pods_removed(["a"])
    clock.t += 31
    assert await adm.expire_deleted() == ["a"]
    assert adm.limiter.running() == {}


@pytest.mark.integration
async def test_two_gateways_never_admit_past_the_limit_in_redis(redis_server):
    from redis.asyncio import Redis
    ca, cb = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
    try:
        a, b = RedisLimiter(ca, "gw-a", ttl_s=1.0), RedisLimiter(cb, "gw-b", ttl_s=1.0)
        a.start()  # a heartbeats; b will stop (as if killed)
        got = await asyncio.gather(*(lim.try_acquire("p", 5) for _ in range(30) for lim in (a, b)))
        assert sum(got) == 5  # 60 concurrent attempts over two gateways: exactly the limit
        holder = a if a.running().get("p") else b
        await holder.release("p")
        assert await b.try_acquire("p", 5) and not await a.try_acquire("p", 5)
        # b's counts expire with its key: a may fill the pod up to the limit, and no further
        held_by_a = a.running().get("p", 0)
        # b's key expires about 1 s after its last write: until then a finds the pod full
        assert await wait_until_async(lambda: a.try_acquire("p", 5), timeout=5.0, interval=0.05)
        extra = [await a.try_acquire("p", 5) for _ in range(5)]
        assert a.running()["p"] == 5 and sum(extra) == 5 - held_by_a - 1
        await a.aclose()
    finally:
        await ca.aclose()
        await cb.aclose()


@pytest.mark.integration
async def test_a_failing_redis_leaves_each_gateway_its_own_limit_and_no_count_behind(redis_server):
    """Redis stopped (SIGSTOP: it neither answers nor loses its keys) with one request counted there: the
    gateway's first call times out (2 s here), and from then on it admits on its own requests alone, up to
    the limit, asking Redis nothing (a call would take the 2 s again) and raising nothing; the releases
    Redis missed are paid once its heartbeat finds it answering, so its counts come back to exactly what
    still runs, and admission is shared again."""
    import os
    import signal
    import time

    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    client = Redis.from_url(redis_server.url, socket_timeout=2.0, socket_connect_timeout=2.0,
                            retry=Retry(NoBackoff(), 0))
    check = Redis.from_url(redis_server.url, decode_responses=True)
    key = "kvgate:{admit}:gw:gw-a"
    lim = RedisLimiter(client, "gw-a", ttl_s=0.5)  # heartbeat every 0.1 s
    lim.start()
    adm = Admission(lim, max_running=2, max_wait_s=0.3)
    try:
        assert await adm.admit("m", ["p"]) == "p"  # counted in Redis
        assert await check.hgetall(key) == {"p": "1"}
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            assert await adm.admit("m", ["p"]) == "p"  # Redis times out: 1 of its own running, room for another
            assert lim.errors >= 1
            t0 = time.monotonic()
            assert await adm.admit("m", ["p"]) is None  # 2 of its own: full, waits 0.3 s (polling), 429
            await adm.release("p")  # the one Redis never counted: nothing to tell it
            await adm.release("p")  # the one it counted: owed
            assert time.monotonic() - t0 < 1.5, "a request waited on the failing Redis"
            assert lim.running() == {}
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        await wait_until_async(lambda: _is_empty(check.hgetall(key)), timeout=10)  # the owed release, paid
        await wait_until_async(lambda: not lim.failing, timeout=10)
        assert await adm.admit("m", ["p"]) == "p" and await check.hgetall(key) == {"p": "1"}  # shared again
    finally:
        await lim.aclose()
        await client.aclose()
        await check.aclose()


async def _is_empty(awaitable) -> bool:
    return not await awaitable


@pytest.mark.integration
async def test_models_take_turns_over_the_gateways_not_only_within_each(redis_server):
    """One pod, limit 2, both places held through gateway A. A's queue holds 4 requests of one model, B's
    2 of another (each gateway's own queue: one model). A's releases wake A's waiters at once, and B's
    only find room by polling: with turns kept per gateway A's model would take every room until its
    queue is empty. Kept in Redis, the turns alternate over the fleet: B's model is admitted first or second
    and again within the first four. Each holds its place 100 ms, so admissions come in pairs (the two rooms
    freed at once, then each holder's room), a pair's two apart by at most a poll: the order the tasks record
    may swap a pair's two (a loaded loop reads one reply a little later), never two pairs."""
    from redis.asyncio import Redis
    clients = [Redis.from_url(redis_server.url) for _ in range(2)]
    try:
        # Claims to a turn that outlast a loaded machine's stalls (with claims of 0.2 s, beside three busy loops,
        # a waiter's polls 20 ms apart let one lapse in 2 runs of 8, and the other model went meanwhile).
        a, b = (Admission(RedisLimiter(c, f"gw-{n}", ttl_s=5.0, want_s=5.0), max_running=2, max_wait_s=10.0,
                          poll_s=0.02) for n, c in zip("ab", clients))
        assert await a.admit("big", ["p"]) == "p" and await a.admit("big", ["p"]) == "p"  # held through A
        order: list[str] = []

        async def one(gw: Admission, model: str) -> None:
            pod = await gw.admit(model, ["p"])
            assert pod == "p"
            order.append(model)
            await asyncio.sleep(0.1)
            await gw.release(pod)

        tasks = [asyncio.create_task(one(a, "big")) for _ in range(4)]
        await wait_until_async(lambda: a.waiting == 4)
        tasks += [asyncio.create_task(one(b, "small")) for _ in range(2)]
        await wait_until_async(lambda: b.waiting == 2)
        await wait_until_async(lambda: clients[0].zscore("kvgate:{admit}:wanting", "small"))  # B's waiter claimed
        await a.release("p")
        await a.release("p")
        await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
        assert sorted(order) == ["big"] * 4 + ["small"] * 2
        assert order.index("small") <= 1 and order[:4].count("small") == 2, order  # alternating, not B's last
    finally:
        for c in clients:
            await c.aclose()


@pytest.mark.integration
async def test_a_model_whose_last_waiter_left_holds_no_room_for_its_turn(redis_server):
    """A waiter at B whose client leaves was its model's last: its claim to a turn goes with it, so a new
    request at A finding room is admitted at once (with the claim left to lapse, it would queue behind a
    model nobody waits for: up to want_s, here 5 s)."""
    from redis.asyncio import Redis
    clients = [Redis.from_url(redis_server.url, decode_responses=True) for _ in range(2)]
    wanting = "kvgate:{admit}:wanting"
    try:
        a, b = (Admission(RedisLimiter(c, f"gw-{n}", ttl_s=5.0, want_s=5.0), max_running=1, max_wait_s=10.0,
                          poll_s=0.02) for n, c in zip("ab", clients))
        assert await a.admit("y", ["p"]) == "p"  # the pod is full
        left = asyncio.create_task(b.admit("x", ["p"]))
        await wait_until_async(lambda: clients[0].zscore(wanting, "x"))  # x waits, and claims a turn
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        await wait_until_async(lambda: _is_none(clients[0].zscore(wanting, "x")))  # the claim went with it
        await a.release("p")
        assert await a.admit("y", ["p"]) == "p"
        assert a.stats()["at_once"] == 2 and a.stats()["after_wait"] == 0 and b.stats()["cancelled"] == 1
    finally:
        for c in clients:
            await c.aclose()


async def _is_none(awaitable) -> bool:
    return await awaitable is None


@pytest.mark.integration
async def test_burst_of_3x_capacity_over_two_gateways_never_exceeds_limits_loses_nothing_and_is_fair(redis_server):
    """4 pods x limit 4 = 16 running at most; 48 requests at once over 2 gateways (3x capacity), 40 of
    one model and 8 of another, each running 40 ms once admitted."""
    from redis.asyncio import Redis
    clients = [Redis.from_url(redis_server.url) for _ in range(2)]
    try:
        gws = [Admission(RedisLimiter(c, f"gw-{i}", ttl_s=5.0), max_running=4, max_wait_s=10.0, poll_s=0.02)
               for i, c in enumerate(clients)]
        pods = ["p0", "p1", "p2", "p3"]
        models = ["big"] * 40 + ["small"] * 8
        running = dict.fromkeys(pods, 0)
        peak = dict.fromkeys(pods, 0)
        done: list[str] = []
        admitted: list[str] = []  # models in the order their requests were admitted
        # The burst is all there before any room frees: the first admitted hold their pods until every
        # request is admitted or waiting in its queue. (A request is queued only once its first sweep over
        # the pods failed, 4 Redis round trips: on a loaded machine the last ones created, the small ones,
        # were still sweeping while the first releases went to the big ones already queued.)
        arrived = asyncio.Event()

        async def all_arrived() -> None:
            assert await wait_until_async(lambda: len(admitted) + sum(g.waiting for g in gws) == len(models),
                                          timeout=20, interval=0.005,
                                          detail=lambda: (admitted, [g.waiting for g in gws]))
            arrived.set()

        async def request(i: int, model: str) -> None:
            gw = gws[i % 2]
            order = pods[i % 4:] + pods[:i % 4]
            pod = await gw.admit(model, order)
            assert pod is not None, "a request was refused though the burst drains in well under the wait"
            admitted.append(model)
            running[pod] += 1
            peak[pod] = max(peak[pod], running[pod])
            await arrived.wait()
            await asyncio.sleep(0.04)
            running[pod] -= 1
            done.append(model)
            await gw.release(pod)

        await asyncio.wait_for(asyncio.gather(all_arrived(), *(request(i, m) for i, m in enumerate(models))), 30.0)
        assert len(done) == 48  # nothing lost
        assert max(peak.values()) <= 4  # no pod past its limit, counted over both gateways
        # Fairness by admission order, not by the clock (a loaded machine stretches every wait alike), over
        # the fleet. 16 are admitted at once, in whatever order the 48 first tries reach Redis (small ones
        # among them, sometimes); first come, first served would leave the small ones that wait to the
        # end (positions 40-47, mean 43.5). The models take turns over both gateways (kept in Redis), so a
        # small one waiting goes every other admission, whichever gateway frees the room: 17, 19, ... 31
        # (mean 24) when all 8 wait. On a loaded machine a waiter's polls delayed past its model's claim
        # (RedisLimiter's want_s) let the other model go meanwhile: 8 runs beside three busy loops here put
        # them no later than 38, mean at most 26.
        small = [i for i, m in enumerate(admitted) if m == "small"]
        assert len(small) == 8 and max(small) <= 41 and sum(small) / len(small) <= 32, admitted
    finally:
        for c in clients:
            await c.aclose()


def test_an_admission_says_whether_its_release_waits() -> None:
    """The request path releases inline only where nothing waits: the local limiter's counts live in this
    process, the Redis one's release is a round trip."""
    assert Admission(LocalLimiter(), max_running=1).releases_without_wait is True
    assert RedisLimiter.releases_without_wait is False


class _SwallowingLimiter(LocalLimiter):
    """A limiter whose shared store's client swallows a cancellation mid-call and answers all the same
    (helpers.swallowed_wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def try_acquire(self, pod: str, limit: int, model: str = "", waiter: bool = False,
                          more: bool = False) -> bool | None:
        self.calls += 1
        await swallowed_wait()
        return await super().try_acquire(pod, limit, model, waiter, more)


async def test_a_cancel_the_limiter_swallowed_still_ends_the_request_and_gives_its_place_back():
    limiter = _SwallowingLimiter()
    adm = Admission(limiter, max_running=4, max_wait_s=5.0)
    left = asyncio.create_task(adm.admit("m", ["a", "b"]))  # a client that leaves while its room is asked for
    await wait_until_async(lambda: limiter.calls == 1)
    left.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(left, 2.0)
    assert limiter.calls == 1  # not asked for the next pod
    assert limiter.running() in ({}, {"a": 0})  # the place the swallowed call got, given back


class _GatedTurns(LocalLimiter):
    """A limiter that shares turns (as RedisLimiter does) and holds each waiter's try until its own gate opens,
    recording what each asked: (model, waiter, more)."""

    shares_turns = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool, bool]] = []
        self.gates: list[asyncio.Event] = []  # one per waiter's try, in order
        self.withdrawn: list[str] = []

    async def try_acquire(self, pod: str, limit: int, model: str = "", waiter: bool = False,
                          more: bool = False) -> bool | None:
        self.calls.append((model, waiter, more))
        if waiter:
            gate = asyncio.Event()
            self.gates.append(gate)
            await gate.wait()
        return await super().try_acquire(pod, limit, model, waiter, more)

    def withdraw(self, model: str) -> None:
        self.withdrawn.append(model)


async def test_a_waiter_admitted_while_another_of_its_model_tries_says_the_replica_has_more():
    """A waiter is out of its model's queue while it tries, so the next one is the queue's first and polls too:
    both can be inside a try at once. Whichever is admitted must say this replica has more of its model
    (the Redis limiter then keeps the model's claim to a turn); told none, the claim went, and the other
    models took the turns until the one left behind claimed again (CI, 3.13: ['big', 'big', 'small', 'small',
    'big', 'big']; beside three busy loops: ['small', 'big', 'big', 'big', 'small', 'big'])."""
    limiter = _GatedTurns()
    adm = Admission(limiter, max_running=1, max_wait_s=5.0, poll_s=0.01)
    assert await adm.admit("m", ["p"]) == "p"  # the pod full
    first = asyncio.create_task(adm.admit("m", ["p"]))
    second = asyncio.create_task(adm.admit("m", ["p"]))
    await wait_until_async(lambda: len(limiter.gates) >= 2)  # both waiters inside a try at once
    await limiter.release("p")
    waiter_calls = [c for c in limiter.calls if c[1]]
    limiter.gates[1].set()  # the second's try first: it takes the room
    done, pending = await asyncio.wait([first, second], timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
    assert done == {second}, limiter.calls
    assert waiter_calls[1] == ("m", True, True), limiter.calls  # the first still waits: more of "m" here
    limiter.gates[0].set()
    await asyncio.sleep(0.05)
    assert not first.done() and limiter.withdrawn == []  # the first waits on (the pod full): the claim stays
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert limiter.withdrawn == ["m"]  # its last waiter gone: the claim goes


async def test_a_waiter_inside_its_try_still_waits_and_is_not_overtaken_by_a_new_request():
    """A waiter is out of its model's queue while it tries (its limiter's call may take a round trip): it still
    counts as waiting (stats, kvgate_admission_waiting), and a request that comes meanwhile queues behind it
    rather than trying at once for the room that waiter is asking for."""
    limiter = _GatedTurns()
    adm = Admission(limiter, max_running=1, max_wait_s=5.0, poll_s=0.01)
    assert await adm.admit("m", ["p"]) == "p"  # the pod full
    first = asyncio.create_task(adm.admit("m", ["p"]))
    await wait_until_async(lambda: len(limiter.gates) >= 1)  # the waiter inside its try
    assert adm.waiting == 1 and adm.stats()["waiting"] == 1
    await limiter.release("p")  # room, which the waiter inside its try is asking for
    late = asyncio.create_task(adm.admit("m", ["p"]))
    await asyncio.sleep(0.05)
    assert not late.done() and [c for c in limiter.calls[2:] if not c[1]] == []  # no try at once: it queued
    for gate in limiter.gates:
        gate.set()
    assert await asyncio.wait_for(first, 2.0) == "p"  # the room went to the waiter
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
