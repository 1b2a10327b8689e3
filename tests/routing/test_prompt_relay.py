"""routing.state.prompt_relay: every gateway replica's running prompts, through Redis (a real redis-server
where it counts) or in one process (LocalRelay, bench routing's replicas)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from kvcache.events import AllBlocksCleared
from routing.state.prompt_relay import BadChanges, LocalRelay, PromptRelay, decode, encode
from routing.state.prompts import RunningPrompts

from helpers import RedisServer, wait_until_async
from test_prompts import MODEL, at, indexed, tokens

SYSTEM = tokens(1, 10, tail=0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class NoRedis:
    """A client whose every call fails, as a Redis that is down."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, channel: str, data: bytes) -> int:
        raise ConnectionError("refused")

    def pubsub(self, **kw):
        raise ConnectionError("refused")

    async def aclose(self) -> None:
        pass


def relay(gateway: str, clock=None, client=None) -> tuple[PromptRelay, RunningPrompts]:
    prompts = RunningPrompts(indexed())
    return PromptRelay(client or NoRedis(), prompts, gateway, ttl_s=30.0, clock=clock or Clock(),
                       registry=CollectorRegistry()), prompts


def count(r: PromptRelay, outcome: str) -> float:
    return r.changes.labels(outcome)._value.get()


def test_changes_round_trip_and_anything_else_is_a_bad_message():
    changes = [["add", 7, "a#1", "a", 1, [3, 2**64 - 1]], ["move", 7, "b", "b", 0], ["end", 7]]
    assert decode(encode("gw-a", changes)) == ("gw-a", changes)
    def wire(changes) -> bytes:
        return b"gw\n" + msgpack.packb(changes)
    for bad in (b"\xc1", b"gw", b"\n" + msgpack.packb([]), b"gw\n\xc1", b"\xff\xfe\n" + msgpack.packb([]),
                wire("x"), wire({"gw": 1}), wire([["add", 1, "a", "a", 0, []]]),  # no keys
                wire([["add", 1, "a", "a", 0, [-1]]]), wire([["add", 1, "a", "a", 0, [3, "4"]]]),
                wire([["add", 1, "a", "a", 0, list(range(8193))]]), wire([["move", 1, "a", "a"]]),
                wire([["end", "1"]]), wire([["drop", 1]]), wire([[]]), wire(["end"])):
        with pytest.raises(BadChanges):
            decode(bad)
    with pytest.raises(ValueError, match="one line"):
        PromptRelay(NoRedis(), RunningPrompts(indexed()), "gw\nx")


def test_a_peers_running_prompt_is_held_on_its_pod_until_it_ends_moves_or_expires(caplog):
    clock = Clock()
    a, mine = relay("gw-a", clock)
    theirs = RunningPrompts(indexed())
    told: list[list] = []
    theirs.listener = told.append
    first = SYSTEM + tokens(2, 3)
    theirs.add(4, "b", "b", 0, MODEL, None, first, None)  # gw-b's request, on b
    a.apply(encode("gw-b", told))
    second = SYSTEM + tokens(3, 2)
    assert mine.held(MODEL, None, second, None, at("a", "b", "c")) == {"b": 10}
    assert a.peer_claims == 1 and count(a, "applied") == 1
    a.apply(encode("gw-a", [["end", 4]]))  # its own changes: not applied again (it counted them itself)
    assert mine.held(MODEL, None, second, None, at("b")) == {"b": 10}
    theirs.moved(4, "c", "c", 0)  # gw-b's fallback served it on c
    theirs.remove(4)
    assert [c[0] for c in told] == ["add", "move", "end"]
    a.apply(encode("gw-b", told[1:2]))
    assert mine.held(MODEL, None, second, None, at("b", "c")) == {"c": 10}
    a.apply(encode("gw-b", told[2:]))
    assert mine.held(MODEL, None, second, None, at("b", "c")) == {} and a.peer_claims == 0
    # a restarted peer numbers its tickets again: the new claim replaces the old, nothing left behind
    a.apply(encode("gw-b", [["add", 1, "b", "b", 0, told[0][5]]]))
    a.apply(encode("gw-b", [["add", 1, "c", "c", 0, told[0][5][:4]]]))
    assert mine.held(MODEL, None, second, None, at("b", "c")) == {"c": 4}
    # no end came (a message lost, the peer gone): the claim ends after its TTL
    clock.t += 29.0
    a.expire()
    assert mine.held(MODEL, None, second, None, at("c")) == {"c": 4}
    clock.t += 2.0
    a.expire()
    assert mine.held(MODEL, None, second, None, at("c")) == {} and count(a, "expired") == 1
    with caplog.at_level(logging.DEBUG, logger="routing.state.prompt_relay"):
        a.apply(b"not msgpack")
        a.apply(b"gw-b\n" + msgpack.packb([["end", -1]]))
    assert count(a, "bad") == 2
    assert [r.levelname for r in caplog.records] == ["WARNING", "DEBUG"]  # told once, then counted


def test_a_peers_claim_ends_when_its_pods_cache_is_cleared():
    a, mine = relay("gw-a")
    keys = RunningPrompts(indexed())._keys(MODEL, None, SYSTEM, None)
    a.apply(encode("gw-b", [["add", 1, "b", "b", 0, keys]]))
    assert mine.held(MODEL, None, SYSTEM + [1], None, at("b")) == {"b": 10}
    mine._index.apply("b", MODEL, 0, [AllBlocksCleared()])
    assert mine.held(MODEL, None, SYSTEM + [1], None, at("b")) == {}


async def test_without_redis_the_changes_are_dropped_counted_and_nothing_else_breaks():
    a, mine = relay("gw-a")
    a.start()
    try:
        mine.add(1, "a", "a", 0, MODEL, None, SYSTEM + [1], None)
        assert await wait_until_async(lambda: count(a, "dropped") == 1, timeout=5)
        assert mine.held(MODEL, None, SYSTEM + [2], None, at("a")) == {"a": 10}  # its own, counted as before
        assert a.first_try.is_set()
    finally:
        await a.aclose()
    assert mine.listener is None


class Recording(NoRedis):
    """Publishes into a list; reads nothing."""

    async def publish(self, channel: str, data: bytes) -> int:
        self.published.append((channel, data))
        return 1


async def test_adds_leave_at_once_and_ends_with_the_next_message_or_shortly_after_and_kept_ones_never():
    client = Recording()
    prompts = RunningPrompts(indexed())
    r = PromptRelay(client, prompts, "gw-a", end_delay_s=0.3, registry=CollectorRegistry())
    r.start()
    try:
        sent = lambda: [decode(data)[1] for _, data in client.published]  # noqa: E731
        prompts.add(9, "a", "a", 0, MODEL, None, SYSTEM + [9], None, 10)  # a holds all its 10 full blocks: kept
        prompts.remove(9)
        prompts.add(1, "a", "a", 0, MODEL, None, SYSTEM + [1], None)
        assert await wait_until_async(lambda: len(sent()) == 1, timeout=5)
        prompts.remove(1)
        await asyncio.sleep(0.1)
        assert len(sent()) == 1  # the end waits
        prompts.add(2, "b", "b", 0, MODEL, None, SYSTEM + [2], None)
        assert await wait_until_async(lambda: len(sent()) == 2, timeout=5)
        assert [c[0] for c in sent()[1]] == ["add", "end"] and sent()[1][1] == ["end", 1]
        prompts.remove(2)
        started = time.monotonic()
        assert await wait_until_async(lambda: len(sent()) == 3, timeout=5)
        assert 0.2 < time.monotonic() - started < 1.0 and sent()[2] == [["end", 2]]
        assert client.published[0][0] == "kvgate:{prompts}" and count(r, "sent") == 4
        assert count(r, "kept") == 1 and all(c[1] != 9 for m in sent() for c in m)  # neither its add nor its end
    finally:
        await r.aclose()


class Hanging(NoRedis):
    """A Redis that takes the connection and never answers."""

    async def publish(self, channel: str, data: bytes) -> int:
        await asyncio.Event().wait()
        return 0


async def test_a_redis_that_never_answers_bounds_what_waits_and_the_publish():
    from routing.state import prompt_relay
    prompts = RunningPrompts(indexed())
    r = PromptRelay(Hanging(), prompts, "gw-a", registry=CollectorRegistry())
    r.start()
    try:
        prompts.add(1, "a", "a", 0, MODEL, None, SYSTEM + [1], None)
        await asyncio.sleep(0.05)  # that one is being published, and hangs
        for i in range(prompt_relay.MAX_PENDING + 10):
            r._changed(["add", 100 + i, "a", "a", 0, [1, 2]])
        half = prompt_relay.MAX_PENDING // 2  # full: the oldest half dropped, then 10 more waited
        assert len(r._pending) == half + 10 and count(r, "dropped") == half
        # the hung publish gives up after PUBLISH_TIMEOUT_S: its one change dropped, the next batch tried
        assert await wait_until_async(lambda: count(r, "dropped") == half + 1, timeout=5)
        assert not r._pending
    finally:
        await r.aclose()


def test_local_relay_shares_the_replicas_running_prompts():
    """The replicas' running prompts shared in one process (bench routing's), but a kept one (routing.state.prompts'
    UNTOLD_BLOCKS)."""
    relay_ = LocalRelay()
    one, two = RunningPrompts(indexed()), RunningPrompts(indexed())
    relay_.join("gw0", one)
    relay_.join("gw1", two)
    one.add(1, "b", "b", 0, MODEL, None, SYSTEM + [1], None)
    two.add(1, "c", "c", 0, MODEL, None, SYSTEM + tokens(5, 2), None)  # the same ticket number, another replica
    for prompts in (one, two):
        assert prompts.held(MODEL, None, SYSTEM + [9], None, at("b", "c")) == {"b": 10, "c": 10}
    one.moved(1, "a", "a", 0)
    one.remove(1)
    assert two.held(MODEL, None, SYSTEM + [9], None, at("a", "b", "c")) == {"c": 10}
    one.add(2, "b", "b", 0, MODEL, None, SYSTEM + [2], None, 9)  # b holds all but its last block: kept
    assert one.held(MODEL, None, SYSTEM, None, at("b")) == {"b": 10}
    assert two.held(MODEL, None, SYSTEM, None, at("b")) == {}


def _lean(url: str):
    from routing.state.resp import LeanRedis, lean_target
    return LeanRedis(lean_target(url))


def _redis_py(url: str):
    from redis.asyncio import Redis
    return Redis.from_url(url)


@contextlib.asynccontextmanager
async def two_replicas(client):
    """A redis-server and two started relays through it (gw-a, gw-b), each with its running prompts, subscribed."""
    server = RedisServer()
    server.start()
    a, mine = relay("gw-a", client=client(server.url), clock=time.monotonic)
    b, theirs = relay("gw-b", client=client(server.url), clock=time.monotonic)
    for r in (a, b):
        r._retry_s = 0.1
        r.start()
    try:
        for r in (a, b):
            await asyncio.wait_for(r.first_try.wait(), 5)
        await asyncio.sleep(0.1)  # both subscribed
        yield server, (a, mine), (b, theirs)
    finally:
        for r in (a, b):
            await r.aclose()
        server.kill()


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server (Debian) is installed by ./dev setup")
@pytest.mark.parametrize("client", [_lean, _redis_py], ids=["lean", "redis-py"])
async def test_two_replicas_share_their_running_prompts_through_redis_and_outlive_its_restart(client):
    async with two_replicas(client) as (server, (a, mine), (b, theirs)):
        theirs.add(1, "b", "b", 0, MODEL, None, SYSTEM + [1], None)
        second = SYSTEM + [2]
        assert await wait_until_async(lambda: mine.held(MODEL, None, second, None, at("b")) == {"b": 10}, timeout=5)
        theirs.remove(1)
        assert await wait_until_async(lambda: mine.held(MODEL, None, second, None, at("b")) == {}, timeout=5)
        assert count(b, "sent") == 2 and count(a, "applied") == 2
        server.kill()
        theirs.add(2, "c", "c", 0, MODEL, None, SYSTEM + [3], None)
        assert await wait_until_async(lambda: count(b, "dropped") >= 1, timeout=5)
        server.start()  # the same port: both read the channel again
        await asyncio.sleep(1.5)
        theirs.add(3, "a", "a", 0, MODEL, None, SYSTEM + [4], None)
        assert await wait_until_async(lambda: mine.held(MODEL, None, second, None, at("a")) == {"a": 10}, timeout=10)


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server (Debian) is installed by ./dev setup")
async def test_a_stopped_redis_drops_the_changes_meanwhile_and_the_relay_goes_on_once_it_answers():
    """Redis stopped (SIGSTOP: it holds the connections and answers nothing): the publish gives up after
    PUBLISH_TIMEOUT_S and its changes are counted dropped; once Redis answers again the next change reaches
    the other replica (over kvgate's own client, whose timed-out command closed its connection)."""
    import os
    import signal
    async with two_replicas(_lean) as (server, (a, mine), (b, theirs)):
        second = SYSTEM + [2]
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            theirs.add(1, "b", "b", 0, MODEL, None, SYSTEM + [1], None)
            assert await wait_until_async(lambda: count(b, "dropped") == 1, timeout=5)
            assert mine.held(MODEL, None, second, None, at("b")) == {}
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        theirs.add(2, "c", "c", 0, MODEL, None, SYSTEM + [3], None)
        assert await wait_until_async(lambda: mine.held(MODEL, None, second, None, at("c")) == {"c": 10}, timeout=10)
        assert count(b, "sent") == 1
