"""Watched routes across replicas: a real Envoy spreading its ext_proc streams over two `kvgate serve` replicas
that share a real redis-server; on the watched routes (here every request: runtime key kvgate.watch_percent 100)
a response's watch stream lands on either replica, and the one that did not route the request tells the one
that did through Redis (plugin.watch)."""
from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from bench.gateway import metric
from devkit.stack import Stack, wait_for_port
from helpers import GatewayEnv, envoy_pool, free_port, stack_fixture, start_kvgate, wait_until

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]

MODEL = "m"
REQUESTS = 16


class Env(GatewayEnv):
    def __init__(self, stack: Stack):
        super().__init__(stack)
        pods = stack.engines(2, model=MODEL, extra=["--tpot-ms", "5", "--ttft-overhead-ms", "2"])
        _, redis_url = stack.redis()
        pods_file = stack.pods_file(pods)
        self.replicas = [start_kvgate(stack, pods_file, {
            "KVGATE_REDIS_URL": redis_url, "KVGATE_GATEWAY_ID": f"kvgate{g}", "KVGATE_OBSERVE_SAMPLE": "0",
            "KVGATE_WATCH_WAIT_S": "1"},
            name=f"kvgate{g}", wait=False) for g in range(2)]
        for r in self.replicas:
            stack.ready(r.proc, ("127.0.0.1", r.grpc_port))
            wait_for_port("127.0.0.1", r.http_port, timeout=10)
        self.kvgate = self.replicas[0].proc
        self.pods = pods
        listen = free_port()
        self.envoy = stack.envoy(listen_port=listen, extproc_port=self.replicas[0].grpc_port, watch_percent=100,
                                 more_extproc_ports=[r.grpc_port for r in self.replicas[1:]], pool=envoy_pool(pods))
        wait_for_port("127.0.0.1", listen, timeout=10)
        self.url = f"http://127.0.0.1:{listen}"

    def total(self, name: str, **labels: str) -> float:
        """A counter summed over both replicas."""
        return sum(metric(r.metrics(), name, **labels) for r in self.replicas)


env = stack_fixture(Env)


def test_a_response_read_on_the_other_replica_reaches_the_routing_one_through_redis(env):
    bodies = []
    with httpx.Client(base_url=env.url, timeout=30) as client:
        for i in range(REQUESTS):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"watched across replicas {i}"}],
                    "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                bodies.append(b"".join(r.iter_bytes()))
    completion = sum(json.loads(line[6:])["usage"]["completion_tokens"] for raw in bodies
                     for line in raw.decode().splitlines() if line.startswith("data: {") and '"choices":[]' in line)
    assert completion == 6 * REQUESTS
    # every response's end word applied where it was routed, whichever replica read it
    assert wait_until(lambda: env.total("kvgate_watch_waits_total", outcome="ended") == REQUESTS, timeout=10,
                      detail=lambda: [r.metrics() for r in env.replicas])
    assert env.total("kvgate_watch_streams_total", outcome="read") == REQUESTS
    assert env.total("kvgate_watch_words_total", word="e", outcome="applied") == REQUESTS
    assert env.total("kvgate_watch_words_total", word="f", outcome="applied") == REQUESTS
    # Envoy spreads the two streams of a request independently: 1 in 2**16 to see none go through Redis
    sent = env.total("kvgate_watch_words_total", word="e", outcome="sent")
    assert sent >= 1 and sent + env.total("kvgate_watch_words_total", word="e", outcome="local") == REQUESTS
    assert env.total("kvgate_watch_waits_total", outcome="expired") == 0
    assert env.total("kvgate_requests_observed_total", source="usage") == REQUESTS
    # (both pods' series: a metric's sum over the samples with these labels)
    assert env.total("kvgate_request_completion_tokens_total", model=MODEL) == completion
    assert env.total("kvgate_request_ttft_seconds_count", model=MODEL) == REQUESTS


def _stream(url: str, i: int, first: threading.Event, out: list) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"a long answer {i}"}], "max_tokens": 120,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        raw = b""
        for chunk in r.iter_bytes():
            raw += chunk
            first.set()
        out.append((r.status_code, raw.count(b'"delta":{"content":"'), raw.rstrip().endswith(b"data: [DONE]")))


def test_the_replica_reading_the_watch_streams_dying_fails_no_request(env):
    """The routing filter on replica 0 alone and the watch filter on replica 1 alone (a cluster each); replica 1
    SIGKILLed while 8 streamed chats run: every chat completes whole (the watch filter fails open), replica 0's
    Watches of them close after their wait, counted expired; replica 1 back, a watched request is read again."""
    a, b = env.replicas
    listen = free_port()
    env.stack.envoy(listen_port=listen, extproc_port=a.grpc_port, pool=envoy_pool(env.pods), watch_percent=100,
                    watch_extproc_ports=[b.grpc_port], name="envoy_split")
    url = f"http://127.0.0.1:{listen}"
    expired = metric(a.metrics(), "kvgate_watch_waits_total", outcome="expired")
    out: list = []
    firsts = [threading.Event() for _ in range(8)]
    threads = [threading.Thread(target=_stream, args=(url, i, firsts[i], out)) for i in range(8)]
    for t in threads:
        t.start()
    for e in firsts:
        assert e.wait(10)
    b.proc.kill()
    for t in threads:
        t.join(30)
    assert out == [(200, 120, True)] * 8
    assert wait_until(lambda: metric(a.metrics(), "kvgate_watch_waits_total", outcome="expired") - expired == 8,
                      timeout=10)
    assert wait_until(lambda: a.debug()["watch"]["waiting"] == 0)
    b.proc = env.stack.restart(b.proc, env=b.env, ready_port=("127.0.0.1", b.grpc_port))
    ended = metric(a.metrics(), "kvgate_watch_waits_total", outcome="ended")

    def read_again() -> bool:  # until Envoy's health checks see replica 1 back, its watch streams fail open
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "again"}], "max_tokens": 2})
        assert r.status_code == 200
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if metric(a.metrics(), "kvgate_watch_waits_total", outcome="ended") > ended:
                return True
            time.sleep(0.05)
        return False
    assert wait_until(read_again, timeout=20)
