"""The simulated engine's Responses, Messages and pooling APIs and their render endpoints: vLLM's shapes, the
response store (previous_response_id on the engine that stored it, a 404 in vLLM's shape elsewhere), and
prompts that are the chats vLLM builds for them."""
from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from sim.engine import EngineConfig
from sim.server import SimOptions, SimServer
from helpers import free_ports

ENGINE = EngineConfig(block_size=16, num_blocks=256, ttft_overhead_s=0.001, prefill_s_per_token=0.00001,
                      tpot_base_s=0.001, tpot_per_seq_s=0.0001)
TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}]


async def _start(name: str) -> SimServer:
    kv, replay = free_ports(2)
    server = SimServer(SimOptions(model="sim-model", name=name, port=0, engine=ENGINE, kv_events_port=kv,
                                  replay_port=replay, max_tokens_default=4))
    await server.start()
    return server


@pytest.fixture
async def sims() -> AsyncIterator[tuple[SimServer, SimServer]]:
    a, b = await _start("sim-a"), await _start("sim-b")
    yield a, b
    await a.stop()
    await b.stop()


@pytest.fixture
async def one() -> AsyncIterator[SimServer]:
    a = await _start("sim-a")
    yield a
    await a.stop()


async def _post(url: str, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        return await c.post(path, json=body)


async def _render(url: str, path: str, body: dict) -> list[int]:
    r = await _post(url, path, body)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


async def test_responses_store_and_previous_response_id(sims: tuple[SimServer, SimServer]) -> None:
    a, b = sims
    first = {"model": "sim-model", "instructions": "Be brief.", "input": "Name a colour.", "tools": TOOLS,
             "max_output_tokens": 3}
    r = await _post(a.url, "/v1/responses", first)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "completed"
    answer = body["output"][0]["content"][0]["text"]
    assert body["usage"]["output_tokens"] == 3
    # The prompt is the render endpoint's tokens, token for token (the usage counts them).
    assert body["usage"]["input_tokens"] == len(await _render(a.url, "/v1/responses/render", first))

    follow = {"model": "sim-model", "input": "And another?", "previous_response_id": body["id"], "tools": TOOLS,
              "instructions": "Be brief.", "max_output_tokens": 2}
    r2 = await _post(a.url, "/v1/responses", follow)
    assert r2.status_code == 200, r2.text
    # The stored conversation, spelled out, renders to the same prompt the previous id gave.
    explicit = {"model": "sim-model", "instructions": "Be brief.", "tools": TOOLS, "input": [
        {"type": "message", "role": "user", "content": "Name a colour."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And another?"}]}]}
    assert r2.json()["usage"]["input_tokens"] == len(await _render(a.url, "/v1/responses/render", explicit))

    # Another engine never stored it: vLLM's 404; the stateless render refuses the field with 400.
    r3 = await _post(b.url, "/v1/responses", follow)
    assert r3.status_code == 404
    assert r3.json() == {"error": {"message": f"Response with id '{body['id']}' not found.",
                                   "type": "invalid_request_error", "param": "response_id", "code": 404}}
    r4 = await _post(a.url, "/v1/responses/render", follow)
    assert r4.status_code == 400 and r4.json()["error"]["param"] == "previous_response_id"
    # store: false keeps nothing
    r5 = await _post(a.url, "/v1/responses", {**first, "store": False})
    r6 = await _post(a.url, "/v1/responses", {**follow, "previous_response_id": r5.json()["id"]})
    assert r6.status_code == 404


async def test_responses_stream_events(one: SimServer) -> None:
    a = one
    async with httpx.AsyncClient(base_url=a.url, timeout=10) as c:
        async with c.stream("POST", "/v1/responses", json={"model": "sim-model", "input": "hi", "stream": True,
                                                           "max_output_tokens": 3}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[len("event: "):] async for line in r.aiter_lines() if line.startswith("event: ")]
    assert events[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added"]
    assert events.count("response.output_text.delta") == 3
    assert events[-1] == "response.completed"


async def test_messages_shapes_stream_and_errors(one: SimServer) -> None:
    a = one
    body = {"model": "sim-model", "max_tokens": 3, "system": [{"type": "text", "text": "You help."}],
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "Find it."},
                         {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                                           {"type": "tool_use", "id": "t1", "name": "lookup",
                                                            "input": {"word": "x"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": "found"}]}]}
    r = await _post(a.url, "/v1/messages", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["type"] == "message" and out["role"] == "assistant" and out["content"][0]["type"] == "text"
    assert out["usage"]["output_tokens"] == 3
    assert out["usage"]["input_tokens"] == len(await _render(a.url, "/v1/messages/render", body))
    async with httpx.AsyncClient(base_url=a.url, timeout=10) as c:
        async with c.stream("POST", "/v1/messages", json={**body, "stream": True}) as s:
            events = [line[len("event: "):] async for line in s.aiter_lines() if line.startswith("event: ")]
    assert events == ["message_start", "content_block_start", "ping", *["content_block_delta"] * 3,
                      "content_block_stop", "message_delta", "message_stop"]
    bad = await _post(a.url, "/v1/messages", {"model": "sim-model", "messages": []})
    assert bad.status_code == 400
    assert bad.json()["type"] == "error" and bad.json()["error"]["type"] == "invalid_request_error"


async def test_chat_reasoning_effort_and_pooling(one: SimServer) -> None:
    a = one
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    plain = await _render(a.url, "/v1/chat/completions/render", chat)
    off = await _render(a.url, "/v1/chat/completions/render", {**chat, "reasoning_effort": "none"})
    assert off[:len(plain)] == plain and len(off) > len(plain)  # the template's empty think block
    r = await _post(a.url, "/v1/embeddings", {"model": "sim-model", "input": ["one", "two words"]})
    assert r.status_code == 200, r.text
    data = r.json()
    assert [d["index"] for d in data["data"]] == [0, 1] and data["usage"]["prompt_tokens"] > 0
    for path, req in (("/pooling", {"input": "x"}), ("/classify", {"input": "x"}),
                      ("/score", {"text_1": "a", "text_2": ["b", "c"]}),
                      ("/rerank", {"query": "a", "documents": ["b", "c"]})):
        rr = await _post(a.url, path, {"model": "sim-model", **req})
        assert rr.status_code == 200, (path, rr.text)
    bad = await _post(a.url, "/v1/embeddings", {"model": "sim-model", "input": 3})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
