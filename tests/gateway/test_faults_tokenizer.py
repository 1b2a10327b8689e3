"""Tokenizer endpoint down or slow: kvgate routes on load alone, counts the fallback, and the
client never sees a 5xx. Real Envoy, real `kvgate serve` (KVGATE_TOKENIZER_URL pointing at a dead
port, then at a server that answers too late), a real simulated engine."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from devkit.stack import Stack, wait_for_port
from helpers import free_port, free_ports, start_kvgate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "m"
TIMEOUT_S = 0.4


class _Slow(BaseHTTPRequestHandler):
    """A tokenizer that answers only once released (at the module's end): a request that did not give
    up at kvgate's budget would hang until the client's 30 s timeout and fail the test."""
    released = threading.Event()

    def do_POST(self):  # noqa: N802
        self.released.wait(60)
        body = b'{"count": 1, "tokens": [1], "max_model_len": 100}'
        try:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # kvgate gave up and closed the connection

    def log_message(self, *args):
        pass


def _metric(url: str, reason: str) -> float:
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith("kvgate_tokenizer_fallbacks_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def gw():
    slow = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    with Stack() as stack:
        port, port1, nobody = free_ports(3)
        stack.sim(name="sim0", port=port, model=MODEL, extra=["--tpot-ms", "2"])
        stack.sim(name="sim1", port=port1, model=MODEL, extra=["--tpot-ms", "2"])
        pods_file = stack.pods_file([{"name": n, "address": "127.0.0.1", "port": p, "model": MODEL}
                                     for n, p in (("sim0", port), ("sim1", port1))])
        kvgate = start_kvgate(stack, pods_file, {"KVGATE_TOKENIZER_TIMEOUT_S": str(TIMEOUT_S),
                                                 "KVGATE_TOKENIZER_URL": f"http://127.0.0.1:{nobody}"})  # no one there
        listen = free_port()
        stack.envoy(listen_port=listen, extproc_port=kvgate.grpc_port, pool=[("127.0.0.1", port), ("127.0.0.1", port1)])

        def use_tokenizer(url: str) -> None:
            kvgate.env["KVGATE_TOKENIZER_URL"] = url
            kvgate.proc = stack.restart(kvgate.proc, env=kvgate.env, ready_port=("127.0.0.1", kvgate.grpc_port))
            wait_for_port("127.0.0.1", kvgate.http_port, timeout=10)

        with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:
            client.metrics_url = kvgate.metrics_url
            client.use_tokenizer = use_tokenizer
            client.slow_url = f"http://127.0.0.1:{slow.server_address[1]}"
            yield client
    _Slow.released.set()
    slow.shutdown()


def _requests(gw, n: int = 4) -> list[httpx.Response]:
    out = []
    for i in range(n):
        if i % 2:
            out.append(gw.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "user", "content": f"question {i}"}]}))
        else:
            out.append(gw.post("/v1/completions", json={"model": MODEL, "prompt": f"prompt {i}", "max_tokens": 2}))
    return out


def test_tokenizer_down_routes_on_load_alone(gw):
    before = _metric(gw.metrics_url, "error") + _metric(gw.metrics_url, "timeout")
    responses = _requests(gw)
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
    assert {r.headers["x-kvgate-strategy"] for r in responses} == {"kv-sync"}
    assert all(r.headers["x-kvgate-pod"] in ("sim0", "sim1") for r in responses)
    assert _metric(gw.metrics_url, "error") + _metric(gw.metrics_url, "timeout") >= before + 4


def test_token_id_prompts_need_no_tokenizer(gw):
    before = _metric(gw.metrics_url, "error") + _metric(gw.metrics_url, "timeout")
    r = gw.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1})
    assert r.status_code == 200
    assert _metric(gw.metrics_url, "error") + _metric(gw.metrics_url, "timeout") == before


def test_tokenizer_slow_times_out_within_budget_and_routes_on_load(gw):
    gw.use_tokenizer(gw.slow_url)
    before = _metric(gw.metrics_url, "timeout")
    responses = _requests(gw)  # the server never answers in time: each is routed once kvgate gives up
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
    # Each request waited kvgate's budget and no longer: its timeout fired, counted once per request.
    assert _metric(gw.metrics_url, "timeout") >= before + 4, {"error": _metric(gw.metrics_url, "error")}
