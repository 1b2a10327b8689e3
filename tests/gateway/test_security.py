"""Security on the real stack: clients cannot choose the upstream, reach none of the engines' admin
endpoints (only the paths of envoy/vllm-paths.yaml's allow-list reach an engine), bodies are bounded,
Redis AUTH and TLS work, and no secret (Authorization headers, Redis passwords) reaches kvgate's log,
/debug, /metrics or the status page. kvgate runs at log level debug here, its chattiest.

Extends tests/gateway/test_gateway_envoy.py (spoofed headers on the three routed paths, fail-closed when
kvgate is down) and tests/routing/test_routing_redis.py (AUTH at the RedisCounts level).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from helpers import GatewayEnv, free_port, make_tls_certs, stack_fixture, wait_until
from devkit.stack import Stack, StackError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "m"
REDIS_PASSWORD = "redis-pw-Zq7xK2"
BEARER = "secret-bearer-T0k3n-9f8e7d"
SPOOF_HEADERS = ("x-gateway-destination-endpoint", "target-pod", "x-envoy-original-dst-host", "x-kvgate-pod")


class Env(GatewayEnv):
    def __init__(self, stack: Stack) -> None:
        super().__init__(stack)
        self.redis, self.redis_url = stack.redis(password=REDIS_PASSWORD)
        self.sims = {}
        pods = []
        for name in ("sim0", "sim1"):
            port = free_port()
            stack.sim(name=name, port=port, model=MODEL, extra=["--tpot-ms", "2"])
            self.sims[name] = port
            pods.append({"name": name, "address": "127.0.0.1", "port": port, "model": MODEL})
        self.start_gateway(pods, {"KVGATE_LOG_LEVEL": "debug", "KVGATE_REDIS_URL": self.redis_url,
                                  "KVGATE_GATEWAY_ID": "sec-gw"},
                           client_timeout=60)
        self.evil = f"127.0.0.1:{self.canary_port}"
        self.overrides: dict[str, str] = {}

    def kvgate_with(self, **overrides: str) -> None:
        """kvgate with the module's settings and `overrides`: restarted only when the running one has others
        (each test states what it needs; no test pays for restoring the one before it)."""
        if overrides != self.overrides:
            self.restart_kvgate(**overrides)
            self.overrides = overrides

    def ok(self) -> bool:
        return self.client.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1}).status_code == 200


env = stack_fixture(Env)
# The tests that run kvgate with settings of their own (env.kvgate_with); every other test gets the
# module's settings back first, whatever ran before it.
OWN_SETTINGS = {"test_wrong_redis_password_degrades_to_local_counts_and_is_not_shown",
                "test_rediss_url_with_auth_over_tls", "test_credentials_in_the_tokenizer_url_are_not_shown"}


@pytest.fixture(autouse=True)
def _module_settings(request):
    if request.node.originalname not in OWN_SETTINGS:
        request.getfixturevalue("env").kvgate_with()


# --- clients cannot choose the upstream -----------------------------------------------------

ROUTES = [
    ("GET", "/v1/completions"), ("PUT", "/v1/completions"), ("DELETE", "/v1/chat/completions"),
    ("HEAD", "/v1/models"), ("POST", "/v1/models"), ("OPTIONS", "/v1/chat/completions"),
    ("POST", "/v1/completions?pod=evil"), ("POST", "/v1/completions/"), ("POST", "//v1/completions"),
    ("POST", "/V1/completions"), ("POST", "/v1/./completions"), ("POST", "/v1/completions%2F"),
    ("POST", "/v1/chat/completions#frag"), ("GET", "/health"), ("GET", "/metrics"), ("POST", "/tokenize"),
]


@pytest.mark.parametrize("method, path", ROUTES)
def test_spoofed_routing_headers_never_reach_a_host_outside_discovery(env, method, path):
    before = env.canary_hits()
    headers = {h: env.evil for h in SPOOF_HEADERS}
    body = b'{"model": "m", "prompt": "x", "max_tokens": 1}' if method in ("POST", "PUT", "DELETE") else None
    r = env.client.request(method, path, content=body, headers={**headers, "content-type": "application/json"})
    # Whatever the answer (routed, refused, unrouted), it never comes from the canary.
    assert "SimpleHTTP" not in r.headers.get("server", ""), (r.status_code, r.headers)
    assert env.canary_hits() == before, f"{method} {path} reached the canary ({r.status_code})"


def test_duplicate_and_mixed_case_spoofed_headers(env):
    before = env.canary_hits()
    raw = [("X-Gateway-Destination-Endpoint", env.evil), ("x-gateway-destination-endpoint", env.evil),
           ("TARGET-POD", env.evil), ("content-type", "application/json")]
    for path in ("/v1/completions", "/v1/models"):
        r = env.client.request("POST" if "compl" in path else "GET", path, headers=raw,
                               content=b'{"model": "m", "prompt": "x", "max_tokens": 1}' if "compl" in path else None)
        assert r.status_code == 200 and r.headers["x-kvgate-pod"] in env.sims
    assert env.canary_hits() == before


@pytest.mark.parametrize("body, headers, status", [
    ({"model": "sim0", "prompt": "x"}, {}, 404),  # a pod's name is not a model
    ({"model": "127.0.0.1:1", "prompt": "x"}, {}, 404),
    ({"model": MODEL, "prompt": "x"}, {"routing-strategy": "127.0.0.1:1"}, 400),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1, "pod": "127.0.0.1:1", "target_pod": "evil"}, {}, 200),
])
def test_requests_naming_pods_outside_discovery(env, body, headers, status):
    before = env.canary_hits()
    for name in ("evil", env.evil):
        body = {**body, "model": body["model"].replace("127.0.0.1:1", name)}
        r = env.client.post("/v1/completions", json=body, headers={**headers, "x-kvgate-pod": name})
        assert r.status_code == status, r.text[:200]
        if status == 200:
            assert r.headers["x-kvgate-pod"] in env.sims
    assert env.canary_hits() == before


# --- bodies are bounded ---------------------------------------------------------------------

@pytest.mark.parametrize("mib", [3, 5, 7.5])
def test_bodies_under_the_limit_are_routed(env, mib):
    """Up to KVGATE_MAX_BODY_BYTES (8 MiB by default) a body is routed; padding the engine ignores."""
    body = b'{"model": "m", "prompt": "x", "max_tokens": 1, "pad": "' + b"p" * int(mib * (1 << 20)) + b'"}'
    r = env.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    assert env.ok()


def _chunks():
    yield b'{"model": "m", "prompt": "'
    for _ in range(9):
        yield b"b" * (1 << 20)
    yield b'"}'


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_kvgate_limit_gets_413(env, chunked):
    body = _chunks() if chunked else b"".join(_chunks())
    r = env.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:200]
    assert env.ok()


def test_body_over_envoy_buffer_gets_413_and_the_gateway_keeps_serving(env):
    """Over Envoy's per-connection buffer (16 MiB): Envoy's own 413; kvgate never sees it."""
    huge = b'{"model": "m", "prompt": "' + b"a" * (17 << 20) + b'"}'
    r = env.client.post("/v1/chat/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert env.ok()


# --- Redis AUTH and TLS; no secret anywhere -------------------------------------------------

def _no_secret(env: Env, *secrets: str) -> None:
    log = env.kvgate.log_path.read_text(errors="replace")
    debug, metrics = env.debug_text(), env.metrics()
    page = httpx.get(f"http://127.0.0.1:{env.http_port}/", timeout=5).text  # the status page: /debug and log lines
    for secret in secrets:
        for where, text in (("log", log), ("/debug", debug), ("/metrics", metrics), ("the status page", page)):
            assert secret not in text, f"{secret[:6]}... appears in kvgate's {where}"


def test_redis_auth_is_used_and_the_password_never_shown(env):
    import redis as redis_py
    assert wait_until(lambda: '"redis_up": true' in env.debug_text())
    r = redis_py.Redis(host="127.0.0.1", port=int(env.redis_url.rsplit(":", 1)[1].split("/")[0]),
                       password=REDIS_PASSWORD)
    assert r.exists("kvgate:{running}:gw:sec-gw")  # written with AUTH
    r.close()
    assert env.ok()
    assert "***@127.0.0.1" in env.debug_text()  # the URL is shown, redacted
    _no_secret(env, REDIS_PASSWORD)


def test_authorization_headers_never_reach_logs_or_debug(env):
    secret_headers = {"authorization": f"Bearer {BEARER}", "x-api-key": BEARER + "-key",
                      "cookie": f"session={BEARER}-cookie", "proxy-authorization": f"Basic {BEARER}-proxy"}
    bodies = [
        ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 1}, 200),  # routed
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": [1, -1]}, 400),  # token id
    ]
    # Each request took its path through Envoy and kvgate (its status says which), or the check of
    # kvgate's log below would prove nothing.
    statuses = []
    for path, body, _ in bodies:
        r = env.client.post(path, json=body, headers={**secret_headers, "routing-strategy": "kv-sync"})
        statuses.append(r.status_code)
    assert statuses == [want for _, _, want in bodies]
    r = env.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                        headers={**secret_headers, "routing-strategy": f"evil-{BEARER}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "routing-strategy", r.text
    r = env.client.get("/v1/models", headers=secret_headers)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL]
    r = env.client.post("/v1/completions", content=b"{nope", headers=secret_headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    _no_secret(env, BEARER)


def test_wrong_redis_password_degrades_to_local_counts_and_is_not_shown(env):
    wrong = "wrong-pw-Yy81"
    url = env.redis_url.replace(REDIS_PASSWORD, wrong)
    env.kvgate_with(KVGATE_REDIS_URL=url)
    assert wait_until(env.ok, timeout=10)
    assert '"redis_up": false' in env.debug_text()
    _no_secret(env, wrong, REDIS_PASSWORD)


def _tls_redis(stack: Stack) -> tuple[int, Path]:
    certs = make_tls_certs(stack.workdir, "redis")
    port = free_port()
    stack.start("redis-tls", ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                              "--tls-cert-file", str(certs["cert"]), "--tls-key-file", str(certs["key"]),
                              "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no",
                              "--requirepass", REDIS_PASSWORD, "--save", "", "--appendonly", "no"],
                ready_port=("127.0.0.1", port))
    return port, certs["ca"]


def test_rediss_url_with_auth_over_tls(env):
    try:
        port, ca = _tls_redis(env.stack)
    except (FileNotFoundError, subprocess.CalledProcessError, StackError) as e:
        pytest.skip(f"no openssl or no TLS in redis-server: {e}")
    env.kvgate_with(KVGATE_REDIS_URL=f"rediss://:{REDIS_PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}")
    assert wait_until(lambda: '"redis_up": true' in env.debug_text(), timeout=10, detail=env.kvgate.log_tail)
    assert env.ok()
    assert "rediss://" in env.debug_text() and "***@127.0.0.1" in env.debug_text()
    _no_secret(env, REDIS_PASSWORD)


def test_credentials_in_the_tokenizer_url_are_not_shown(env):
    secret = "tok-secret-77Qa"
    env.kvgate_with(KVGATE_TOKENIZER_URL=f"http://tok-user:{secret}@127.0.0.1:{env.sims['sim0']}")
    assert wait_until(env.ok, timeout=10)
    _no_secret(env, secret)


# --- the public gateway is not the engines' admin port ----------------------------------------
# envoy/vllm-paths.yaml: every path vLLM 0.33 registers, `public` (the allow-list envoy/envoy.yaml routes to
# the pool) or `closed` (the gateway's own 404). An engine's answer carries Envoy's
# x-envoy-upstream-service-time and the sim's x-sim-name; the gateway's 404 neither.

VLLM_PATHS = yaml.safe_load((Path(__file__).resolve().parents[2] / "envoy" / "vllm-paths.yaml").read_text())
PROMPT = " ".join(f"word{i}" for i in range(300))  # many blocks: a prefix cache hit is hundreds of tokens


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x1", path)


def _raw(port: int, method: str, target: str) -> tuple[int, dict[str, str], bytes]:
    """`method target` over a socket as written (no client normalizes the path), with an empty JSON body."""
    body = b"{}" if method != "GET" else b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        while b"\r\n\r\n" not in data and (chunk := s.recv(65536)):
            data += chunk
        head, _, payload = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        # read what Content-Length says, not to the close: Envoy closes a second after its answer
        while len(payload) < int(headers.get("content-length", 0)) and (chunk := s.recv(65536)):
            payload += chunk
    return int(lines[0].split()[1]), headers, payload


def _prefix_hits(port: int) -> float:
    """The engine's vllm:prefix_cache_hits after one more request of PROMPT sent to it directly."""
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1},
                   timeout=10)
    assert r.status_code == 200, r.text
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total{"))


def _kvgate_passthrough(env: Env) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in env.metrics().splitlines()
               if line.startswith("kvgate_requests_total{") and 'passthrough' in line)


def _public(method: str, path: str) -> bool:
    return any(method in e["methods"] and re.fullmatch(re.sub(r"\{[^}]*\}", "[^/]+", e["path"]), path)
               for e in VLLM_PATHS["public"])


# each closed path with its methods, GET and POST (but GET /v1/responses/render: a stored response's id to vLLM)
CLOSED = [(m, _concrete(e["path"])) for e in VLLM_PATHS["closed"] for m in sorted({"GET", "POST", *e["methods"]})
          if not _public(m, e["path"])]
# the same paths written otherwise, and public paths with a method or suffix the allow-list does not take
VARIANTS = [("POST", "/reset_prefix_cache/"), ("POST", "/reset_prefix_cache?x=1"), ("POST", "//reset_prefix_cache"),
            ("POST", "/%72eset_prefix_cache"), ("POST", "/v1/completions/../../reset_prefix_cache"),
            ("POST", "/v1/completions/%2E%2E/%2E%2E/reset_prefix_cache"), ("POST", "/RESET_PREFIX_CACHE"),
            ("GET", "/metrics/"), ("POST", "/v1/responses/x1/../../../reset_prefix_cache"),
            ("GET", "/v1/responses/x1/cancel"), ("POST", "/v1/responses/x%2F..%2F..%2F..%2Freset_prefix_cache/cancel"),
            ("POST", "/"), ("GET", "/v1"), ("POST", "/v1/")]


def test_closed_paths_get_the_gateways_404_and_never_reach_an_engine(env):
    hits = {name: _prefix_hits(port) for name, port in env.sims.items()}  # PROMPT cached on both engines
    upstream, asked = env.envoy_counter("cluster.pool.upstream_rq_total"), _kvgate_passthrough(env)
    for method, target in CLOSED + VARIANTS:
        status, headers, payload = _raw(env.listen, method, target)
        assert status == 404, (method, target, status, payload[:200])
        assert headers["content-type"] == "application/json" and "x-sim-name" not in headers, (method, target)
        assert "x-envoy-upstream-service-time" not in headers, (method, target)
        error = json.loads(payload)["error"]
        assert error["code"] == "path_not_found" and set(error) == {"message", "type", "code", "param"}
    assert env.envoy_counter("cluster.pool.upstream_rq_total") == upstream  # no request went to an engine
    assert _kvgate_passthrough(env) == asked  # nor to kvgate
    # The engines' prefix caches are intact: PROMPT hits again on each ...
    for name, port in env.sims.items():
        again = _prefix_hits(port)
        assert again - hits[name] >= 256, (name, hits[name], again)
        hits[name] = again
    # ... and a reset sent straight to an engine, as the operator may, shows what the gateway prevented.
    port = env.sims["sim0"]
    assert httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache", timeout=5).status_code == 200
    assert _prefix_hits(port) == hits["sim0"]


def test_a_closed_paths_404_does_not_wait_for_the_body(env):
    """The gateway's 404 is answered on the headers: a client announcing 8 MiB it never sends is not held (nor is
    the body buffered: the buffer filter, there for the one-message routes, is off on the 404 route)."""
    with socket.create_connection(("127.0.0.1", env.listen), timeout=5) as s:
        s.sendall(b"POST /reset_prefix_cache HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 8388608\r\n\r\n{")
        assert s.recv(65536).split(b"\r\n", 1)[0] == b"HTTP/1.1 404 Not Found"  # within the 5 s timeout


PUBLIC_BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/score": {"model": MODEL, "queries": "a", "documents": "b"},
    "/v1/score": {"model": MODEL, "queries": "a", "documents": "b"},
    "/rerank": {"model": MODEL, "query": "a", "documents": ["b"]},
    "/v1/rerank": {"model": MODEL, "query": "a", "documents": ["b"]},
    "/v2/rerank": {"model": MODEL, "query": "a", "documents": ["b"]},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}
PUBLIC = [(m, e["path"]) for e in VLLM_PATHS["public"] for m in e["methods"]]


@pytest.mark.parametrize("method, path", PUBLIC, ids=[f"{m} {p}" for m, p in PUBLIC])
def test_public_paths_reach_an_engine(env, method, path):
    upstream = env.envoy_counter("cluster.pool.upstream_rq_total")
    body = None if method == "GET" else PUBLIC_BODIES.get(path, {"model": MODEL, "input": "hi"})
    r = env.client.request(method, _concrete(path), json=body)
    # whatever the engine makes of it (the sims serve some of these paths, 404 the others), it answered
    assert "x-envoy-upstream-service-time" in r.headers and "path_not_found" not in r.text, (r.status_code, r.text)
    assert env.envoy_counter("cluster.pool.upstream_rq_total") == upstream + 1


def test_an_opened_path_reaches_the_engines(env):
    """The operator's way to open a path (devkit.stack --open-path, a route above the 404): exact or a prefix."""
    listen = free_port()
    proc = env.stack.envoy(listen_port=listen, extproc_port=env.grpc_port, name="envoy-opened",
                           pool=[("127.0.0.1", port) for port in env.sims.values()],
                           open_paths=["/reset_prefix_cache", "/v1/load_lora_adapter*"])
    try:
        r = httpx.post(f"http://127.0.0.1:{listen}/reset_prefix_cache", timeout=10)
        assert r.status_code == 200 and r.headers["x-sim-name"] in env.sims  # the sim's own handler
        r = httpx.post(f"http://127.0.0.1:{listen}/v1/load_lora_adapter/x", json={}, timeout=10)
        assert r.status_code == 404 and "x-envoy-upstream-service-time" in r.headers  # the engine's 404
        assert "path_not_found" not in r.text
        status, _, payload = _raw(listen, "POST", "/sleep")
        assert status == 404 and json.loads(payload)["error"]["code"] == "path_not_found"
    finally:
        proc.stop()
