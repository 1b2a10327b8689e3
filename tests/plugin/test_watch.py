"""Watching from a stream of its own (plugin.watch), as a unit: a watch stream's messages in, the routing
replica's Watch, the trackers and the counters out."""
from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from plugin.metrics import GatewayMetrics
from plugin.observe import Observer
from plugin.watch import END, FIRST, WatchRelay, _parse
from routing.pods import Pod
from routing.router import Decision
from helpers import Clock, sse, watch_chunk as chunk, watch_headers as headers

GW = "gw-a"


class Recorder:
    def __init__(self) -> None:
        self.calls: list = []

    def add_request_count(self, ctx, request_id, model):
        return 1

    def done_request_count(self, ctx, request_id, model, term):
        self.calls.append(("done", request_id))

    def done_request_trace(self, ctx, request_id, model, i, o, term):
        self.calls.append(("trace", request_id, i, o))


class Side:
    """One replica: its observer (trackers, metrics) and relay, on a test clock."""

    def __init__(self, gateway: str = GW, wait_s: float = 0.05, served=None) -> None:
        from routing.learning.tracking import TrackerRegistry
        self.clock = Clock(100.0)
        self.recorder = Recorder()
        self.registry = CollectorRegistry()
        self.firsts: list[str] = []
        self.observer = Observer(self.registry, TrackerRegistry((self.recorder,)), clock=self.clock,
                                 on_first_token=self.firsts.append)
        self.served_calls: list = []

        def on_served(decision, endpoint):
            self.served_calls.append(endpoint)
            return served
        self.relay = WatchRelay(gateway, served=on_served, served_metric=GatewayMetrics(self.registry).served,
                                registry=self.registry, wait_s=wait_s, clock=self.clock)

    def route(self, request_id: str, pod: Pod, prompt: int = 40):
        w = self.observer.start(request_id, "m", pod.name, tokens=list(range(prompt)))
        self.relay.expect(request_id, w, Decision(pod=pod, strategy="kv-sync"))
        return w

    def value(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def pod(name: str, port: int) -> Pod:
    return Pod(name=name, address="10.0.0.1", port=port, model="m")


def tokens(n: int) -> list[bytes]:
    return [sse({"choices": [{"index": 0, "delta": {"content": "x"}}]}) for _ in range(n)]


async def stream_of(messages, clock: Clock, step: float = 0.02):
    for m in messages:
        clock.t += step
        yield m
        await asyncio.sleep(0)


async def test_a_response_read_here_fills_in_the_routing_watch_and_its_trackers():
    side = Side()
    p0 = pod("p0", 8000)
    w = side.route("r1", p0)
    side.clock.t += 0.1
    usage = sse({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44}})
    body = [chunk(t) for t in tokens(4)] + [chunk(usage + b"data: [DONE]\n\n", end=True)]
    side.relay.routed_end("r1")  # the request's own stream ended first: the Watch waits for the end word
    await side.relay.read(headers(), "10.0.0.1:8000", stream_of(body, side.clock))
    assert set(side.firsts) == {"r1"}  # at the first token (and again, idempotent, at the end)
    assert side.recorder.calls == [("trace", "r1", 40, 4)]
    assert w.status == 200 and w.usage and w.completion_tokens == 4
    assert abs(w.ttft - 0.12) < 1e-9  # routed at 100.0, the first token read at 100.12 (one step after the headers)
    # first token to the last chunk (the usage's), 4 steps timed by the reading side, over 3 tokens after the first
    assert abs(w.tpot - 0.08 / 3) < 1e-9
    assert side.value("kvgate_watch_words_total", word=FIRST, outcome="local") == 1
    assert side.value("kvgate_watch_waits_total", outcome="ended") == 1
    assert side.relay.waiting == 0
    assert side.served_calls == []  # served by the picked pod: no count moves


async def test_no_end_word_closes_the_watch_as_cut_after_the_wait_and_a_late_word_is_dropped():
    side = Side(wait_s=0.05)
    w = side.route("r2", pod("p0", 8000))
    side.relay.routed_end("r2")
    assert side.firsts == ["r2"] and side.recorder.calls == []  # its prefill is over: the slo queue lets it go now
    await asyncio.sleep(0.15)
    assert side.recorder.calls == [("done", "r2")]  # done, without usage
    assert side.value("kvgate_watch_waits_total", outcome="expired") == 1
    assert side.value("kvgate_requests_observed_total", source="none") == 1
    side.relay.apply([END, "r2", 200, True, True, 40, 4, 0.1])
    assert side.value("kvgate_watch_words_total", word=END, outcome="unknown") == 1
    assert w.completion_tokens == 0 and side.recorder.calls == [("done", "r2")]


async def test_a_fallback_served_moves_the_count_when_the_first_word_names_it():
    fallback = pod("p1", 8001)
    side = Side(served=fallback)
    w = side.route("r3", pod("p0", 8000))
    side.relay.apply([FIRST, "r3", True, "10.0.0.1:8001"])
    assert side.served_calls == ["10.0.0.1:8001"] and w.pod == "p1"
    side.route("r3b", pod("p0", 8000))
    side.relay.apply([FIRST, "r3b", True, "10.0.0.1:8000"])  # the picked pod: nothing moves
    assert side.served_calls == ["10.0.0.1:8001"]
    assert side.value("kvgate_served_requests_total", endpoint="fallback") == 1
    assert side.value("kvgate_served_requests_total", endpoint="picked") == 1


async def test_a_failed_response_ends_its_watch_without_usage():
    side = Side()
    side.route("r4", pod("p0", 8000))
    await side.relay.read(headers("r4", status=503, ctype="application/json"), "",
                          stream_of([chunk(b'{"error": "busy"}', end=True)], side.clock))
    assert side.recorder.calls == [("done", "r4")]
    assert side.value("kvgate_requests_observed_total", source="none") == 1
    assert set(side.firsts) == {"r4"}  # the prefill queue lets it go at its end


async def test_a_stream_naming_no_request_or_replica_is_not_read():
    side = Side()
    side.route("r5", pod("p0", 8000))
    for msg in (headers(request_id=""), headers(gateway="")):
        await side.relay.read(msg, "", stream_of([chunk(b"data: {}\n\n", end=True)], side.clock))
    assert side.value("kvgate_watch_streams_total", outcome="unnamed") == 2
    assert side.relay.waiting == 1 and side.recorder.calls == []


async def test_words_for_another_replica_go_out_or_are_counted_when_they_cannot():
    side = Side()
    side.relay.send("gw-b", [END, "r6", 200, True, False, 0, 3, 0.1])  # no Redis
    assert side.value("kvgate_watch_words_total", word=END, outcome="unreachable") == 1
    sent: list = []

    async def publish(gateway, data):
        if gateway == "gw-down":
            raise ConnectionError("Redis is down")
        sent.append((gateway, json.loads(data)))
    side.relay.publish = publish
    side.relay.send("gw-b", [FIRST, "r6", True, ""])
    side.relay.send("gw-down", [FIRST, "r7", True, ""])
    await side.relay.aclose()
    assert sent == [("gw-b", [FIRST, "r6", True, ""])]
    assert side.value("kvgate_watch_words_total", word=FIRST, outcome="sent") == 1
    assert side.value("kvgate_watch_words_total", word=FIRST, outcome="failed") == 1


async def test_a_requests_end_word_leaves_after_its_first_word_is_published():
    """Each word is published by a task of its own, over the pool's connections: a first word held up (a busy
    connection) must not be overtaken by its request's end word, which ends the routing replica's wait and
    leaves the first word nothing to apply to (a CI run: 15 of 16 first words applied)."""
    side = Side()
    sent: list = []
    first_may_go = asyncio.Event()

    async def publish(gateway, data):
        word = json.loads(data)
        if word[0] == FIRST and word[1] == "r9":
            await first_may_go.wait()
        sent.append(word[:2])
    side.relay.publish = publish
    side.relay.send("gw-b", [FIRST, "r9", True, ""])
    side.relay.send("gw-b", [END, "r9", 200, True, False, 0, 3, 0.1])
    side.relay.send("gw-b", [FIRST, "r10", True, ""])  # another request's words do not wait for r9's
    await asyncio.sleep(0.01)
    assert sent == [[FIRST, "r10"]]
    first_may_go.set()
    await side.relay.aclose()
    assert sent == [[FIRST, "r10"], [FIRST, "r9"], [END, "r9"]]
    assert side.value("kvgate_watch_words_total", word=END, outcome="sent") == 1


async def test_a_word_from_redis_is_checked_before_it_is_applied():
    side = Side()
    w = side.route("r8", pod("p0", 8000))
    for bad in (b"", b"not json", b"{}", b'["f"]', b'["f","r8",1,""]', b'["e","r8",200,true,true,-1,4,0.1]',
                b'["e","r8",200,true,true,40,4]', b'["x","r8"]', b'\xff\xfe'):
        side.relay.apply_data(bad)
    assert side.value("kvgate_watch_words_total", word="?", outcome="bad") == 9
    assert side.relay.waiting == 1 and not w.last_at
    side.relay.apply_data(b'["f","r8",true,""]')
    side.relay.apply_data(b'["e","r8",200,true,false,0,5,0.08]')
    assert side.recorder.calls == [("trace", "r8", 40, 5)] and abs(w.tpot - 0.02) < 1e-9


def test_parse_takes_exactly_the_two_words():
    assert _parse(b'["f","r",false,"1.2.3.4:80"]') == [FIRST, "r", False, "1.2.3.4:80"]
    assert _parse(b'["e","r",200,false,true,1,2,0]') == [END, "r", 200, False, True, 1, 2, 0]
    assert _parse(b'["e","r",200,false,true,1,2,"0"]') is None
    assert _parse(b'["f",1,false,""]') is None


async def test_a_second_request_of_a_waiting_id_is_not_watched_from_a_stream_of_its_own():
    side = Side()
    first = side.route("dup", pod("p0", 8000))
    second = side.observer.start("dup", "m", "p0", tokens=[1, 2])
    assert not side.relay.expect("dup", second, Decision(pod=pod("p0", 8000), strategy="kv-sync"))
    assert side.value("kvgate_watch_waits_total", outcome="duplicate") == 1
    side.relay.apply([END, "dup", 200, True, False, 0, 3, 0.0])
    assert first.completion_tokens == 3 and second.completion_tokens == 0


@pytest.mark.parametrize("lean", [True, False], ids=["kvgate-client", "redis-py"])
async def test_words_cross_replicas_through_a_real_redis_and_again_after_it_restarts(redis_server, caplog, lean):
    """Two replicas' relays over a real redis-server (through kvgate's own client, as a redis:// URL is, and
    through redis-py, as rediss:// is): a word for the other replica reaches its Watch; with Redis down a word
    fails, counted, and the Watch it was for closes as cut after its wait; Redis back (same port, every key lost),
    each replica subscribes again and words flow."""
    from redis.asyncio import Redis

    from helpers import wait_until_async
    from plugin.watch import RedisWords
    from routing.state.resp import LeanRedis, lean_target
    caplog.set_level("INFO", logger="kvgate.watch")
    a, b = Side("gw-a"), Side("gw-b", wait_s=0.3)
    words = [RedisWords(LeanRedis(lean_target(redis_server.url)) if lean else Redis.from_url(redis_server.url),
                        side.relay, retry_s=0.1) for side in (a, b)]
    for w in words:
        w.start()
    try:
        async def subscribed() -> bool:  # the channel has its reader (PUBSUB NUMSUB)
            client = Redis.from_url(redis_server.url)
            try:
                counts = dict(await client.pubsub_numsub("kvgate:watch:gw-b"))
                return counts.get(b"kvgate:watch:gw-b", 0) == 1
            except OSError:
                return False
            finally:
                await client.aclose()

        async def delivered(side: Side, request_id: str) -> bool:
            w = side.route(request_id, pod("p0", 8000))
            a.relay.send("gw-b", [END, request_id, 200, True, True, 40, 5, 0.0])
            return await wait_until_async(lambda: w.completion_tokens == 5, timeout=5)

        assert await wait_until_async(subscribed, timeout=5)
        assert await delivered(b, "x1")
        redis_server.kill()
        lost = b.route("x2", pod("p0", 8000))
        b.relay.routed_end("x2")
        a.relay.send("gw-b", [END, "x2", 200, True, True, 40, 5, 0.0])
        assert await wait_until_async(lambda: a.value("kvgate_watch_words_total", word=END, outcome="failed") == 1,
                                      timeout=5)
        assert await wait_until_async(lambda: b.value("kvgate_watch_waits_total", outcome="expired") == 1, timeout=5)
        assert lost.completion_tokens == 0 and ("done", "x2") in b.recorder.calls
        redis_server.start()
        assert await wait_until_async(subscribed, timeout=10)
        assert await delivered(b, "x3")
        # told once while it failed (retried every 0.1 s), and once when it read again
        failed = [r for r in caplog.records if "failed" in r.getMessage() and r.levelname == "WARNING"
                  and r.name == "kvgate.watch" and "channel" in r.getMessage()]
        assert len({r.getMessage().split(" failed")[0] for r in failed}) == 2 and len(failed) == 2
        assert any("again" in r.getMessage() and r.levelname == "INFO" for r in caplog.records)
    finally:
        for w in words:
            await w.aclose()
        await a.relay.aclose()
        await b.relay.aclose()


def test_a_watch_stream_opened_by_a_request_message_is_counted_and_told_once(caplog):
    side = Side()
    with caplog.at_level("WARNING", logger="kvgate.watch"):
        side.relay.unread("request_headers")
        side.relay.unread("request_headers")
    assert side.value("kvgate_watch_streams_total", outcome="unread") == 2
    assert len([r for r in caplog.records if "request_header_mode SKIP" in r.getMessage()]) == 1
