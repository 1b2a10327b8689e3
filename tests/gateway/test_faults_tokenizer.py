"""Tokenizer endpoint down or slow: kvgate routes on load alone, counts the fallback, and the
client never sees a 5xx. Real Envoy, real `kvgate serve` (KVGATE_TOKENIZER_URL pointing at a dead
port, then at a server that answers too late), a real simulated engine."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from devkit.stack import Stack, free_port, wait_for_port
from helpers import QUICK_STOP

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "m"
TIMEOUT_S = 0.4


class _Slow(BaseHTTPRequestHandler):
    delay_s = 3.0

    def do_POST(self):  # noqa: N802
        time.sleep(self.delay_s)
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
        port = free_port()
        stack.sim(name="sim0", port=port, model=MODEL, extra=["--tpot-ms", "2"])
        port1 = free_port()
        stack.sim(name="sim1", port=port1, model=MODEL, extra=["--tpot-ms", "2"])
        pods_file = stack.pods_file([{"name": n, "address": "127.0.0.1", "port": p, "model": MODEL}
                                     for n, p in (("sim0", port), ("sim1", port1))])
        grpc_port, http_port = free_port(), free_port()
        env = {"KVGATE_PODS_FILE": str(pods_file), "KVGATE_GRPC_PORT": str(grpc_port),
               "KVGATE_HTTP_PORT": str(http_port), "KVGATE_TOKENIZER_TIMEOUT_S": str(TIMEOUT_S),
               "KVGATE_TOKENIZER_URL": f"http://127.0.0.1:{free_port()}", **QUICK_STOP}  # nobody listens there
        kvgate = stack.kvgate(env=env, grpc_port=grpc_port)
        listen = free_port()
        stack.envoy(listen_port=listen, extproc_port=grpc_port, pool=[("127.0.0.1", port), ("127.0.0.1", port1)])

        def use_tokenizer(url: str) -> None:
            nonlocal kvgate
            env["KVGATE_TOKENIZER_URL"] = url
            kvgate = stack.restart(kvgate, env=env, ready_port=("127.0.0.1", grpc_port))
            wait_for_port("127.0.0.1", http_port, timeout=10)

        with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:
            client.metrics_url = f"http://127.0.0.1:{http_port}/metrics"
            client.use_tokenizer = use_tokenizer
            client.slow_url = f"http://127.0.0.1:{slow.server_address[1]}"
            yield client
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
    t0 = time.monotonic()
    responses = _requests(gw)
    elapsed = time.monotonic() - t0
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
    assert _metric(gw.metrics_url, "timeout") >= before + 4
    # Each request waited about the budget, not the server's 3 s (a loose bound: 4 requests).
    assert elapsed < 4 * 3.0, elapsed
