"""The Responses, Messages and pooling APIs through the pipeline (plugin.request, plugin.pipeline,
plugin.responses): which endpoint gives a request's tokens (the engine's render endpoint for what /tokenize
cannot express), what happens when it fails or is missing, previous_response_id routed to the pod that stored
the conversation, pooling by load, and the client errors in each API's shape."""
from __future__ import annotations

import asyncio
import json

import pytest

from plugin.pipeline import PREVIOUS_RESPONSE, RequestContext, build
from plugin.request import CHAT_RENDER, ClientError, parse_body
from plugin.responses import READ_LIMIT, IdReader, ResponseStore
from routing.pods import Pod
from tokenizer.types import ChatInput, Rendered, TokenizerError

from test_pipeline_extras import FakeRender
from test_plugin_extproc import POD, FakeRouter, InstantTokenizer, gateway

OTHER = Pod("p1", "10.0.0.8", 8000, "m")
CHAT = [{"role": "user", "content": "hi"}]


class SubsetRouter(FakeRouter):
    def __init__(self) -> None:
        super().__init__()
        self.subsets: list = []

    async def pick(self, req, subset=None, sheddable=False):
        self.subsets.append(subset)
        return await super().pick(req, subset, sheddable)


def ctx_for(path: str, fields: dict) -> RequestContext:
    ctx = RequestContext()
    ctx.request_id, ctx.path, ctx.kind = "rid-1", path, "x"
    ctx.body = json.dumps({"model": "m", **fields}).encode()
    return ctx


def parse(path: str, fields: dict):
    return parse_body(path, json.dumps({"model": "m", **fields}).encode(), 1 << 20)


def test_which_requests_the_engine_renders():
    assert parse("/v1/responses", {"input": "hi"}).render == "/v1/responses/render"
    assert parse("/v1/messages", {"max_tokens": 3, "messages": CHAT}).render == "/v1/messages/render"
    continued = parse("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"})
    assert continued.render is None and continued.previous_response_id == "resp_1"
    tools = [{"type": "function", "function": {"name": "f"}}]
    # fields the template sees and /tokenize cannot carry
    for fields in ({"reasoning_effort": "low"}, {"response_format": {"type": "json_object"}},
                   {"documents": [{"text": "d"}]}, {"tools": tools, "tool_choice": "required"},
                   {"tools": tools, "tool_choice": "none"}):
        r = parse("/v1/chat/completions", {"messages": CHAT, **fields})
        assert r.render == CHAT_RENDER and isinstance(r.item, ChatInput), fields
    # the rest as today: /tokenize's (tool_choice "auto" is the default with tools; without tools it is ignored)
    for fields in ({}, {"tools": tools}, {"tools": tools, "tool_choice": "auto"}, {"tool_choice": "required"}):
        assert parse("/v1/chat/completions", {"messages": CHAT, **fields}).render is None, fields
    assert parse("/v1/embeddings", {"input": "x"}).render is None


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/responses", {}, "input"),
    ("/v1/responses", {"input": 3}, "input"),
    ("/v1/responses", {"input": ["x"]}, "input"),
    ("/v1/responses", {"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ("/v1/responses", {"input": "x", "store": "yes"}, "store"),
    ("/v1/responses", {"input": "x", "tools": {}}, "tools"),
    ("/v1/messages", {"messages": CHAT}, "max_tokens"),
    ("/v1/messages", {"max_tokens": "3", "messages": CHAT}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 3}, "messages"),
    ("/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": 3}]}, "messages"),
    ("/v1/messages", {"max_tokens": 3, "messages": CHAT, "system": 3}, "system"),
])
def test_bad_bodies_are_400s(path, fields, param):
    with pytest.raises(ClientError) as e:
        parse(path, fields)
    assert e.value.status == 400 and e.value.param == param
    shaped = json.loads(e.value.to_anthropic_json())
    assert shaped == {"type": "error", "error": {"type": "invalid_request_error", "message": e.value.message}}


async def test_responses_and_messages_take_the_render_endpoints_tokens():
    router, render = FakeRouter(), FakeRender(Rendered([7, 8, 9]))
    gw = gateway(router, InstantTokenizer(), render=render)
    await build(gw).run(ctx_for("/v1/responses", {"input": "hi"}))
    await build(gw).run(ctx_for("/v1/messages", {"max_tokens": 2, "messages": CHAT}))
    await build(gw).run(ctx_for("/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "none"}))
    assert render.paths == ["/v1/responses/render", "/v1/messages/render", CHAT_RENDER]
    assert [p.token_ids for p in router.picks] == [[7, 8, 9]] * 3


async def test_a_missing_render_endpoint_falls_back_and_is_not_asked_again_for_a_while():
    router, render = FakeRouter(), FakeRender(TokenizerError("HTTP 403", 403))
    gw = gateway(router, InstantTokenizer(), render=render)
    pipeline = build(gw)
    for _ in range(2):
        await pipeline.run(ctx_for("/v1/responses", {"input": "hi"}))
        await pipeline.run(ctx_for("/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "none"}))
    # asked once per endpoint; then a Responses body routes on load alone, a chat on the tokenizer's ids
    assert render.paths == ["/v1/responses/render", CHAT_RENDER]
    assert [p.token_ids for p in router.picks] == [None, [4, 5, 6], None, [4, 5, 6]]
    fallbacks = {s.labels["reason"]: s.value for m in gw.metrics.tokenizer_fallbacks.collect() for s in m.samples
                 if s.name.endswith("_total")}
    assert fallbacks == {"render_error": 1, "render_unavailable": 1}


async def test_a_continued_conversation_goes_to_the_pod_that_stored_it_while_it_is_ready():
    router = SubsetRouter()
    store = ResponseStore(2)
    gw = gateway(router, InstantTokenizer(), pods=(POD, OTHER), render=FakeRender(Rendered([1])), responses=store)
    store.learn("resp_a", "p1")
    pipeline = build(gw)
    d = await pipeline.run(ctx_for("/v1/responses", {"input": "more", "previous_response_id": "resp_a"}))
    assert router.subsets[-1] == frozenset({"10.0.0.8:8000"}) and d.strategy == PREVIOUS_RESPONSE
    assert router.picks[-1].token_ids is None  # no endpoint renders a continued conversation
    d = await pipeline.run(ctx_for("/v1/responses", {"input": "more", "previous_response_id": "resp_unknown"}))
    assert router.subsets[-1] is None and d.strategy == "kv-sync"
    gw.registry._pods = [POD, Pod("p1", "10.0.0.8", 8000, "m", ready=False)]
    d = await pipeline.run(ctx_for("/v1/responses", {"input": "more", "previous_response_id": "resp_a"}))
    assert router.subsets[-1] is None and d.strategy == "kv-sync"
    outcomes = {s.labels["outcome"]: s.value for m in gw.metrics.response_affinity.collect() for s in m.samples
                if s.name.endswith("_total")}
    assert outcomes == {"routed": 1, "unknown": 1, "not_ready": 1}


async def test_pooling_is_routed_by_load_without_tokens():
    router, render = FakeRouter(), FakeRender(Rendered([1]))
    gw = gateway(router, InstantTokenizer(), render=render)
    await build(gw).run(ctx_for("/v1/embeddings", {"input": "x"}))
    assert router.picks[-1].strategy == "least-request" and router.picks[-1].token_ids is None


def test_the_store_is_bounded_and_the_reader_finds_ids_across_chunks():
    store = ResponseStore(2)
    for i in range(3):
        store.learn(f"resp_{i}", "p")
    assert len(store) == 2 and store.pod_of("resp_0") is None and store.pod_of("resp_2") == "p"
    reader = IdReader()
    body = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_abc-1","x":1}}'
    assert reader.feed(body[:60]) is None and reader.feed(body[60:]) == "resp_abc-1" and reader.done
    other = IdReader()
    assert other.feed(b'{"id":"msg_1",' + b" " * READ_LIMIT) is None and other.done


async def test_replicas_share_learned_ids_through_redis_and_route_without_it():
    from redis.asyncio import Redis

    from helpers import RedisServer, wait_until_async
    from plugin.responses import SharedResponseStore

    server = RedisServer()
    server.start()
    try:
        # reads may take 2 s, not the request path's 50 ms: CI's saturated cores once held a GET 57 ms (a
        # dead Redis still answers at once: the connection is refused)
        a = SharedResponseStore(10, Redis.from_url(server.url), ttl_s=60, timeout_s=2.0)
        b = SharedResponseStore(10, Redis.from_url(server.url), ttl_s=60, timeout_s=2.0)
        a.learn("resp_x", "p1")

        async def shared() -> bool:
            return await b.lookup("resp_x") == "p1"

        await wait_until_async(shared, what="the id in Redis")
        assert b.pod_of("resp_x") == "p1"  # kept here too once read
        assert await b.lookup("resp_never") is None and b.errors == 0
        server.kill()
        assert await b.lookup("resp_gone") is None and b.errors == 1  # Redis down: no pod, quickly
        a.learn("resp_y", "p0")  # the write fails in the background; known here all the same
        assert await a.lookup("resp_y") == "p0"
        await a.close()
        await b.close()
        assert a.errors == 1
    finally:
        server.kill()


@pytest.mark.parametrize("kind,opening,delta,final", [
    ("responses", b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1","usage":null}}'
                  b'\n\n', b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n',
     b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":{"input_tokens":40,'
     b'"input_tokens_details":{"cached_tokens":0},"output_tokens":2,"total_tokens":42}}}\n\n'),
    ("messages", b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":0,'
                 b'"output_tokens":0}}}\n\nevent: ping\ndata: {"type":"ping"}\n\n',
     b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"text":"a"}}\n\n',
     b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":40,"output_tokens":2}}\n\n'),
])
def test_a_responses_or_messages_stream_times_its_first_token_event(kind, opening, delta, final):
    from prometheus_client import CollectorRegistry

    from helpers import Clock
    from plugin.observe import TOKEN_EVENTS, Observer

    clock = Clock()
    firsts: list[str] = []
    observer = Observer(CollectorRegistry(), clock=clock, on_first_token=firsts.append)
    w = observer.start("r1", "m", "p0", marker=TOKEN_EVENTS[kind])
    w.on_headers(200, "text/event-stream")
    clock.t += 0.01
    w.on_chunk(opening)  # no token yet
    assert not w.first_at and firsts == []
    clock.t += 0.09
    w.on_chunk(delta)
    clock.t += 0.02
    w.on_chunk(delta + final)
    assert firsts == ["r1"] and w.events == 2
    assert w.ttft == pytest.approx(0.1) and (w.prompt_tokens, w.completion_tokens) == (40, 2)


async def test_a_lookup_cancelled_while_redis_is_read_ends_though_the_client_swallowed_it():
    """redis-py 8.1's asyncio client can swallow a cancellation mid-call and answer (tests/routing/
    test_admission.py): the request whose client left must end all the same."""
    from helpers import SwallowingRedis
    from plugin.responses import SharedResponseStore

    client = SwallowingRedis(b"p1")
    store = SharedResponseStore(10, client, ttl_s=60, timeout_s=30.0)
    task = asyncio.create_task(store.lookup("resp_x"))
    while client.gets == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)
