"""Malformed HTTP bodies through the real Envoy -> kvgate -> engine path: each gets its documented
status, kvgate never answers 5xx for a client's mistake, and the gateway keeps serving.

Extends tests/gateway/test_gateway_envoy.py::test_errors_are_openai_json (which covers invalid JSON, bad
UTF-8 at the start, missing/numeric model, empty messages, a negative token id, unknown model,
no ready pod, unknown strategy, one 413) and tests/plugin/test_plugin_request.py (the parser alone).
Status source: kvgate refuses what routing must read (README "Configuration", plugin/request.py);
every other field is the engine's to judge, so those rows expect the engine's 400 or 200.
"""
from __future__ import annotations

import json
import random

import httpx
import pytest

from devkit.stack import Stack
from helpers import envoy_pool, free_port, start_kvgate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "m"
LIMIT = 65536


@pytest.fixture(scope="module")
def gw():
    with Stack() as stack:
        pods = stack.engines(1, model=MODEL, extra=["--tpot-ms", "2", "--ttft-overhead-ms", "1"])
        kvgate = start_kvgate(stack, stack.pods_file(pods), {"KVGATE_MAX_BODY_BYTES": str(LIMIT)})
        listen = free_port()
        stack.envoy(listen_port=listen, extproc_port=kvgate.grpc_port, pool=envoy_pool(pods))
        with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:
            client.kvgate_log = kvgate.proc.log_path
            client.metrics_url = kvgate.metrics_url
            yield client


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
NEST = 20_000

# (id, path, body, expected status, kvgate's error code or None when the engine answers)
CASES = [
    # Not a JSON object at all.
    ("empty body", C, b"", 400, "invalid_json"),
    ("json null", C, b"null", 400, "invalid_json"),
    ("json number", CH, b"123", 400, "invalid_json"),
    ("json string", C, b'"model"', 400, "invalid_json"),
    ("json array", CH, b"[]", 400, "invalid_json"),
    ("truncated", C, b'{"model": "m", "prompt": "x"', 400, "invalid_json"),
    ("trailing garbage", C, b'{"model": "m", "prompt": "x"} {}', 400, "invalid_json"),
    ("nul bytes", C, b'\x00\x00\x00\x00', 400, "invalid_json"),
    # Not UTF-8, in the middle of a string (the shared table covers a bad first byte).
    ("bad utf-8 in a string", C, b'{"model": "m", "prompt": "caf\xe9"}', 400, "invalid_json"),
    ("overlong utf-8", C, b'{"model": "m", "prompt": "\xc0\xaf"}', 400, "invalid_json"),
    # json.loads(bytes) decodes with surrogatepass, so kvgate routes this one; the engine refuses it.
    ("utf-8 encoded surrogate", C, b'{"model": "m", "prompt": "\xed\xa0\x80"}', 400, None),
    # Deeply nested, inside an otherwise valid request.
    ("nested arrays", C, b"[" * NEST + b"]" * NEST, 400, "invalid_json"),
    ("nested in a field", C, b'{"model": "m", "prompt": "x", "x": ' + b"[" * NEST + b"]" * NEST + b"}", 400,
     "invalid_json"),
    ("nested objects", CH, b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, "invalid_json"),
    # Wrong types of the fields routing reads.
    ("model list", C, _j({"model": ["m"], "prompt": "x"}), 400, None),
    ("model blank", C, _j({"model": "  ", "prompt": "x"}), 400, None),
    ("model null", C, _j({"model": None, "prompt": "x"}), 400, "missing_model"),
    ("stream string", C, _j({"model": MODEL, "prompt": "x", "stream": "true"}), 400, None),
    ("prompt object", C, _j({"model": MODEL, "prompt": {"text": "x"}}), 400, None),
    ("prompt float ids", C, _j({"model": MODEL, "prompt": [1.5, 2]}), 400, None),
    ("prompt bool ids", C, _j({"model": MODEL, "prompt": [True, 2]}), 400, None),
    ("prompt nested too deep", C, _j({"model": MODEL, "prompt": [[[1]]]}), 400, None),
    ("messages object", CH, _j({"model": MODEL, "messages": {"role": "user"}}), 400, None),
    ("message string", CH, _j({"model": MODEL, "messages": ["hi"]}), 400, None),
    ("message role int", CH, _j({"model": MODEL, "messages": [{"role": 1, "content": "x"}]}), 400, None),
    ("message content number", CH, _j({"model": MODEL, "messages": [{"role": "user", "content": 5}]}), 400, None),
    ("tools string", CH, _j({"model": MODEL, "messages": MSG, "tools": "none"}), 400, None),
    ("template kwargs list", CH, _j({"model": MODEL, "messages": MSG, "chat_template_kwargs": []}), 400, None),
    # Empty messages and prompts.
    ("messages empty", CH, _j({"model": MODEL, "messages": []}), 400, None),
    ("message empty object", CH, _j({"model": MODEL, "messages": [{}]}), 400, None),
    ("prompt empty list", C, _j({"model": MODEL, "prompt": []}), 400, None),
    ("prompt empty string", C, _j({"model": MODEL, "prompt": ""}), 400, None),  # the engine: no tokens
    # Token ids out of range: kvgate refuses outside 32 bits, the engine outside its vocabulary.
    ("token id 2^31", C, _j({"model": MODEL, "prompt": [1, 2**31]}), 400, "token_id_out_of_range"),
    ("token id 10^30", C, _j({"model": MODEL, "prompt": [10**30]}), 400, "token_id_out_of_range"),
    ("token id -1 nested", C, _j({"model": MODEL, "prompt": [[1, -1]]}), 400, "token_id_out_of_range"),
    ("token id past vocab", C, _j({"model": MODEL, "prompt": [1, 2_000_000], "max_tokens": 1}), 400, None),
    # Unknown and odd fields: not kvgate's business, the engine ignores them.
    ("unknown fields", C, _j({"model": MODEL, "prompt": "x", "max_tokens": 1, "kvgate": {"pod": "sim9"},
                              "x-gateway-destination-endpoint": "127.0.0.1:1"}), 200, None),
    ("unknown message fields", CH, _j({"model": MODEL, "max_tokens": 1,
                                       "messages": [{"role": "user", "content": "x", "extra": [1]}]}), 200, None),
    ("duplicate model key", C, b'{"model": "nope", "model": "m", "prompt": "x", "max_tokens": 1}', 200, None),
    ("escaped lone surrogate", C, b'{"model": "m", "prompt": "a\\ud800b", "max_tokens": 1}', 400, None),
    # Huge: a prompt over KVGATE_MAX_BODY_BYTES, and one just under it.
    ("over the body limit", C, _j({"model": MODEL, "prompt": "word " * (LIMIT // 5)}), 413, "request_too_large"),
    ("just under the limit", C, _j({"model": MODEL, "prompt": "w " * ((LIMIT - 200) // 2), "max_tokens": 1}), 200,
     None),
]


@pytest.mark.parametrize("name, path, body, status, code", CASES, ids=[c[0] for c in CASES])
def test_malformed_body_gets_its_status_and_the_gateway_keeps_serving(gw, name, path, body, status, code):
    r = gw.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:300]
    if status != 200:
        err = r.json()["error"]
        assert err["message"]
        if code is not None:  # kvgate's own answer
            assert set(err) == {"message", "type", "code", "param"} and err["code"] == code
    assert r.status_code < 500
    ok = gw.post(C, json={"model": MODEL, "prompt": "still serving", "max_tokens": 1})
    assert ok.status_code == 200


def test_random_bodies_never_get_a_kvgate_5xx(gw):
    """Seeded random and mutated bodies: whatever the answer, kvgate raises no internal error."""
    rng = random.Random(9)
    seeds = [_j({"model": MODEL, "prompt": "hello", "max_tokens": 1}),
             _j({"model": MODEL, "messages": MSG, "max_tokens": 1, "stream": True})]
    statuses = []
    for _i in range(150):
        b = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        r = gw.post(rng.choice((C, CH)), content=bytes(b), headers={"content-type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code < 500 or r.status_code == 503 and "no_ready_pod" in r.text, (bytes(b), r.text[:200])
    metrics = httpx.get(gw.metrics_url, timeout=5).text
    assert 'code="internal_error"' not in metrics
    assert "Traceback" not in gw.kvgate_log.read_text(errors="replace")
    assert statuses.count(200) > 0 and statuses.count(400) > 0
