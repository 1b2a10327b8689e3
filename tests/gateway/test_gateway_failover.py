"""The Endpoint Picker data path through a real Envoy (override_host over the pool, retries walking
kvgate's ranked list) and real `kvgate serve` processes, on loopback: failures a production fleet
sees (an engine SIGKILLed, more requests in flight than Envoy's default circuit breakers allow, a
kvgate replica SIGKILLed or stopped with SIGTERM) and bodies streamed in FULL_DUPLEX_STREAMED mode."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import pytest

from helpers import (Kvgate, Load, envoy_pool, free_port, free_ports, join_all, start_kvgate, start_threads,
                     wait_until)
from bench.gateway import start_envoy
from devkit.stack import Stack, render_envoy_config

pytestmark = pytest.mark.integration

MODEL = "m"


def envoy_stat(admin_port: int, name: str) -> int:
    text = httpx.get(f"http://127.0.0.1:{admin_port}/stats?filter=^{re.escape(name)}$", timeout=5).text
    m = re.search(rf"^{re.escape(name)}: (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url, timeout=5).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def start_kvgates(stack: Stack, n: int, pods_file, redis_url: str = "", **env: str) -> list[Kvgate]:
    """`n` kvgate replicas over `pods_file` (gateway ids gw0, gw1, ...), sharing `redis_url` if given."""
    redis = {"KVGATE_REDIS_URL": redis_url} if redis_url else {}
    return [start_kvgate(stack, pods_file, {"KVGATE_GATEWAY_ID": f"gw{i}", **env, **redis}, name=f"kvgate{i}")
            for i in range(n)]


@pytest.fixture(scope="module")
def engines():
    """Three engines (a token every 2 ms) for the module's tests, started once (each test starts its own
    kvgate replicas and Envoy); a test that kills one starts it again before it ends."""
    with Stack() as stack:
        yield stack, stack.engines(3, model=MODEL, extra=["--tpot-ms", "2"])


def test_engine_picked_next_is_sigkilled_and_the_next_40_requests_all_succeed(engines):
    engine_stack, pods = engines
    with Stack() as stack:
        # kvgate scrapes rarely here: it keeps picking the dead engine, so every request below takes
        # the fallback path (Envoy's retry to the next endpoint of kvgate's list). Every response
        # watched: the served endpoint is read from the response headers, which Envoy sends kvgate
        # only for watched responses (KVGATE_OBSERVE_SAMPLE; every request in two messages, as README says
        # for it: Envoy sends kvgate nothing of a one-message request's response; its watch stream cannot answer)
        gw, = start_kvgates(stack, 1, stack.pods_file(pods), KVGATE_ENGINE_METRICS_INTERVAL_S="60",
                            KVGATE_OBSERVE_SAMPLE="1")
        listen = free_port()
        stack.envoy(listen_port=listen, extproc_port=gw.grpc_port, pool=envoy_pool(pods), one_message_percent=0, watch_percent=0)
        body = {"model": MODEL, "prompt": "the same long shared prefix " * 20, "max_tokens": 2}
        with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:
            first = client.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            picked = first.headers["x-kvgate-pod"]
            # the prompt's blocks are on `picked` now: kvgate picks it again
            assert wait_until(lambda: client.post("/v1/completions", json=body).headers["x-kvgate-pod"] == picked)
            victim = next(p for p in engine_stack.procs if p.name == picked)
            victim.kill()
            try:
                statuses, served = [], []
                for _ in range(40):
                    r = client.post("/v1/completions", json=body)
                    statuses.append(r.status_code)
                    served.append(r.headers.get("x-kvgate-pod"))
            finally:  # back for the module's next tests
                port = next(p["port"] for p in pods if p["name"] == picked)
                engine_stack.restart(victim, ready_port=("127.0.0.1", port))
        assert statuses == [200] * 40, statuses
        assert picked not in served and set(served) <= {p["name"] for p in pods}
        # kvgate kept picking the dead engine at first (it holds the prefix) and learnt from Envoy which
        # endpoint served each such request instead (until the serving pod held the prefix too)
        assert metric(gw.metrics_url, "kvgate_served_requests_total", '{endpoint="fallback"}') >= 1


async def _hold_open(listen: int, n: int, deadline_s: float, odd: list[bytes] | None = None) -> tuple[list[int], int]:
    """`n` streamed completions at once over `n` connections; each is held open after its response
    headers until all `n` have theirs, then every connection closes. Returns (statuses, most open);
    the first few answers other than 200 (head and the start of the body) go into `odd`."""
    payload = json.dumps({"model": MODEL, "prompt": "hold", "max_tokens": 1000, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    all_started = asyncio.Event()
    statuses: list[int] = []
    open_now = 0
    most = 0

    async def one() -> None:
        nonlocal open_now, most
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        open_now += 1
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            statuses.append(int(head.split(b" ", 2)[1]))
            if statuses[-1] != 200 and odd is not None and len(odd) < 3:
                try:
                    odd.append(head + await asyncio.wait_for(reader.read(400), 2))
                except (asyncio.TimeoutError, OSError):
                    odd.append(head)
            most = max(most, open_now)
            if len(statuses) == n:
                all_started.set()
            await all_started.wait()
        finally:
            open_now -= 1
            writer.close()

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), deadline_s)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return statuses, most


def test_2000_requests_in_flight_at_once_get_no_5xx_from_circuit_breaking():
    n = 2000  # above Envoy's default of 1,024 per cluster
    with Stack() as stack:
        # slow engines: a token a second, so every stream stays open until the client lets go
        pods = stack.engines(2, model=MODEL, extra=["--tpot-ms", "1000", "--tpot-ms-per-seq", "0",
                                                     "--max-num-seqs", "2000", "--num-blocks", "8192"])
        gw, = start_kvgates(stack, 1, stack.pods_file(pods), KVGATE_ROUTING_STRATEGY="least-request",
                            KVGATE_LOG_LEVEL="warning")
        listen, admin = free_ports(2)
        config = render_envoy_config(listen_port=listen, admin_port=admin, extproc_port=gw.grpc_port,
                                     pool=envoy_pool(pods))
        # The shipped config gives kvgate 5 s per message; 2,000 streams opened at once on one replica of a machine
        # also running another suite and the sanitizers once took longer for 224 of them (504s from ext_proc,
        # no circuit breaker involved: the fresh-clone CI of afc2ca5). This test is about the circuit breakers.
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
        ext["message_timeout"] = "60s"
        start_envoy(stack, "envoy-2000", config, listen)
        odd: list[bytes] = []
        statuses, most = asyncio.run(_hold_open(listen, n, deadline_s=120, odd=odd))
        assert most == n  # all of them in flight at the same time
        # what answered otherwise, and Envoy's view of both clusters, should it happen
        why = (odd, {f"{c}.{s}": envoy_stat(admin, f"cluster.{c}.{s}") for c in ("pool", "kvgate")
                     for s in ("upstream_cx_connect_fail", "upstream_cx_connect_timeout", "upstream_rq_retry",
                               "upstream_rq_pending_overflow", "upstream_cx_overflow", "health_check.failure")})
        assert len(statuses) == n and set(statuses) == {200}, ({s: statuses.count(s) for s in set(statuses)}, why)
        for cluster in ("pool", "kvgate"):
            for stat in ("upstream_rq_pending_overflow", "upstream_cx_overflow", "upstream_rq_retry_overflow"):
                assert envoy_stat(admin, f"cluster.{cluster}.{stat}") == 0, (cluster, stat)


def short_completions(url: str, body: dict | None = None) -> Load:
    """8 clients sending short completions back to back through Envoy."""
    body = body or {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
    return Load(url, lambda client, worker, n: client.post("/v1/completions", json=body).status_code, workers=8)


def _two_replicas(stack: Stack, pods: list[dict], **env: str):
    pods = pods[:2]
    _, redis_url = stack.redis()
    gws = start_kvgates(stack, 2, stack.pods_file(pods), redis_url, **env)
    listen, admin = free_ports(2)
    stack.envoy(listen_port=listen, admin_port=admin, extproc_port=gws[0].grpc_port,
                more_extproc_ports=[gws[1].grpc_port], pool=envoy_pool(pods))
    return gws, f"http://127.0.0.1:{listen}", admin


def test_a_sigkilled_kvgate_replica_fails_no_request_that_starts_a_second_later(engines, record_property):
    with Stack() as stack:
        gws, url, admin = _two_replicas(stack, engines[1])
        with short_completions(url) as clients:
            assert wait_until(lambda: clients.done() >= 50, timeout=30)
            # both replicas take streams
            assert wait_until(lambda: all(metric(g.metrics_url, "kvgate_requests_total",
                                                 '{kind="completion",outcome="routed"}') > 0 for g in gws))
            gws[1].proc.kill()
            killed = time.monotonic()
            assert wait_until(lambda: clients.done(started_after=killed + 1.0) >= 100, timeout=60)
        late = clients.outcomes(started_after=killed + 1.0)
        assert late and all(o == 200 for o in late), {o: late.count(o) for o in set(late)}
        early = [o for t, _, o in clients.results if killed <= t < killed + 1.0]
        record_property("started_within_1s_of_the_kill", len(early))  # these may fail: not asserted
        record_property("failed_within_1s_of_the_kill", sum(o != 200 for o in early))
        assert envoy_stat(admin, "cluster.kvgate.health_check.failure") >= 1  # Envoy noticed, by health checks


def test_a_kvgate_replica_stopped_with_sigterm_drains_without_failing_a_request(engines):
    with Stack() as stack:
        gws, url, _ = _two_replicas(stack, engines[1], KVGATE_DRAIN_DELAY_S="1.5", KVGATE_DRAIN_TIMEOUT_S="20")
        long_body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 1000, "stream": True}
        in_flight: list[str] = []

        def long_request() -> None:  # seconds of tokens, over whichever replica Envoy gives the stream
            with httpx.Client(base_url=url, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json=long_body) as r:
                    text = "".join(r.iter_text())
                in_flight.append(f"{r.status_code} {'[DONE]' in text}")

        with short_completions(url) as clients:
            assert wait_until(lambda: clients.done() >= 100, timeout=30)
            longs = start_threads(long_request, [()] * 8, daemon=False)
            # the replica to stop holds some of the long streams now (8 spread over 2, and the short ones)
            assert wait_until(lambda: metric(gws[1].metrics_url, "kvgate_active_streams") >= 3)
            gws[1].proc.popen.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            assert gws[1].proc.popen.wait(30) == 0  # it exits by itself once its streams are done
            drained = time.monotonic() - stopped
            assert wait_until(lambda: sum(1 for t, _, _ in clients.results if t > stopped + 2) >= 50, timeout=60)
            join_all(longs, 60)
        assert in_flight == ["200 True"] * 8  # every in-flight stream completed, to its last event
        failed = clients.failures()
        assert not failed and len(clients.results) > 150, failed
        assert drained >= 1.5  # it served through the drain delay before refusing streams


def test_streamed_bodies_and_the_subset_hint_through_real_envoy(engines):
    pods = engines[1][:2]
    with Stack() as stack:
        gw, = start_kvgates(stack, 1, stack.pods_file(pods))
        listen, admin = free_ports(2)
        config = render_envoy_config(listen_port=listen, admin_port=admin, extproc_port=gw.grpc_port,
                                     pool=envoy_pool(pods))
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
        ext["processing_mode"].update(request_body_mode="FULL_DUPLEX_STREAMED", response_body_mode="FULL_DUPLEX_STREAMED",
                                      request_trailer_mode="SEND", response_trailer_mode="SEND")
        # A data plane's subset hint: here from a request header, into envoy.lb.subset_hint metadata
        # before ext_proc (which forwards that namespace to kvgate).
        hcm["http_filters"].insert(0, {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": "x-test-subset", "remove": True, "on_header_present": {
                "metadata_namespace": "envoy.lb.subset_hint", "key": "x-gateway-destination-endpoint-subset",
                "type": "STRING"}}]}})
        start_envoy(stack, "envoy-streamed", config, listen)
        names = {p["name"] for p in pods}
        with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30) as c:
            # a body large enough to reach kvgate in several chunks: gathered, routed, forwarded whole
            prompt = "a long prompt " * 4_000  # 56 kB
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-pod"] in names and r.json()["usage"]["prompt_tokens"] > 8_000
            # a token stream comes back through kvgate chunk by chunk, complete
            with c.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                    "stream": True}) as s:
                text = "".join(s.iter_text())
            assert s.status_code == 200 and s.headers["x-kvgate-pod"] in names
            assert text.count("data: ") == 22 and text.rstrip().endswith("data: [DONE]")
            assert c.get("/v1/models").status_code == 200
            # the subset hint: only the allowed engine serves; an endpoint outside the pool: 503
            for p in pods:
                for _ in range(3):
                    r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                               headers={"x-test-subset": f"127.0.0.1:{p['port']}"})
                    assert r.status_code == 200 and r.headers["x-kvgate-pod"] == p["name"]
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                       headers={"x-test-subset": "127.0.0.1:1"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_eligible_endpoint"
        assert metric(gw.metrics_url, "kvgate_requests_total", '{kind="completion",outcome="routed"}') == 7
