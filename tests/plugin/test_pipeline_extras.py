"""Block extras through the pipeline (plugin.pipeline): a salt or opaque prompt embeddings reach the router's
request from the parse step; a chat with media parts is rendered by the engine (one call: token ids, identifiers,
placeholders) and its extras reach the router; without a render, or when it fails, the blocks are opaque and the
tokenizer still gives the ids; plain requests carry none and never render; requests are counted by extras kind."""
from __future__ import annotations

import json

from kvcache.blockkeys import BlockExtras, MediaItem
from plugin.pipeline import RequestContext, build
from tokenizer.types import Rendered, RenderedMedia, TokenizerError

from test_plugin_extproc import FakeRouter, InstantTokenizer, gateway

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


class FakeRender:
    """The engine's render: records (model, body, base_url), answers `answer` or raises it."""

    def __init__(self, answer: Rendered | Exception) -> None:
        self.answer = answer
        self.calls: list[tuple[str, bytes, str | None]] = []
        self.paths: list[str] = []

    async def __call__(self, model: str, body: bytes, path: str, *, base_url: str | None = None) -> Rendered:
        self.calls.append((model, body, base_url))
        self.paths.append(path)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def context(fields: dict, path: str = "/v1/chat/completions") -> RequestContext:
    ctx = RequestContext()
    ctx.request_id, ctx.path, ctx.kind = "rid-1", path, "chat"
    ctx.body = json.dumps({"model": "m", **fields}).encode()
    return ctx


def media_chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, {**IMAGE, "uuid": "u1"},
                                                      IMAGE]}], **fields}


def kinds(gw) -> dict[str, float]:
    """kvgate_request_extras_total by kind, the kinds counted at least once."""
    return {s.labels["kind"]: s.value for m in gw.metrics.request_extras.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}


async def test_a_plain_request_carries_no_extras_and_is_not_counted():
    router, render = FakeRouter(), FakeRender(Rendered([1]))
    gw = gateway(router, InstantTokenizer(), render=render)
    for fields, path in (({"prompt": "hi"}, "/v1/completions"), ({"messages": [{"role": "user", "content": "hi"}]},
                                                                 "/v1/chat/completions")):
        await build(gw).run(context(fields, path))
    assert [p.extras for p in router.picks] == [None, None] and [p.token_ids for p in router.picks] == [[4, 5, 6]] * 2
    assert render.calls == [] and kinds(gw) == {}


async def test_a_salt_reaches_the_router_with_the_tokenizers_ids():
    router = FakeRouter()
    gw = gateway(router, InstantTokenizer())
    ctx = context({"prompt": "hi", "cache_salt": "tenant-1"}, "/v1/completions")
    await build(gw).run(ctx)
    assert router.picks[0].extras == BlockExtras(cache_salt="tenant-1") and router.picks[0].token_ids == [4, 5, 6]
    assert kinds(gw) == {"salted": 1}
    assert ctx.extras is None  # dropped with the body once the pipeline ran


async def test_prompt_embeds_reach_the_router_opaque():
    router = FakeRouter()
    gw = gateway(router, InstantTokenizer())
    await build(gw).run(context({"prompt_embeds": "AAAA"}, "/v1/completions"))
    assert router.picks[0].extras == BlockExtras(opaque=True) and router.picks[0].token_ids == []
    assert kinds(gw) == {"opaque": 1}


async def test_a_media_chat_is_rendered_once_and_its_items_reach_the_router():
    router = FakeRouter()
    render = FakeRender(Rendered([1, 2, 9, 9, 9, 9, 9, 9, 3], (RenderedMedia("image", "u1", 2, 3),
                                                               RenderedMedia("image", "h2", 5, 3))))
    tokenizer = InstantTokenizer()
    gw = gateway(router, tokenizer, render=render)
    ctx = context(media_chat(cache_salt="s"))
    body = ctx.body
    await build(gw).run(ctx)
    assert render.calls == [("m", body, "http://10.0.0.7:8000")]  # the client's body, to a ready pod of the model
    pick = router.picks[0]
    assert pick.token_ids == [1, 2, 9, 9, 9, 9, 9, 9, 3]  # the engine's ids, not the tokenizer's
    assert pick.extras == BlockExtras(cache_salt="s", media=(MediaItem("u1", 2, 3), MediaItem("h2", 5, 3)))
    assert kinds(gw) == {"salted": 1, "media": 1}


async def test_a_render_that_cannot_name_an_item_makes_the_request_opaque():
    router = FakeRouter()
    render = FakeRender(Rendered([1, 9, 9, 9, 9, 9, 9], (RenderedMedia("image", None, 1, 3),
                                                         RenderedMedia("image", None, 4, 3))))
    gw = gateway(router, InstantTokenizer(), render=render)
    await build(gw).run(context(media_chat()))
    # the first image has a uuid, the second neither uuid nor hash: no block of the prompt is claimed
    assert router.picks[0].extras == BlockExtras(opaque=True) and router.picks[0].token_ids == [1, 9, 9, 9, 9, 9, 9]
    assert kinds(gw) == {"media": 1, "opaque": 1}


async def test_a_failed_render_leaves_the_request_opaque_with_the_tokenizers_ids():
    router = FakeRouter()
    render = FakeRender(TokenizerError("HTTP 404"))
    gw = gateway(router, InstantTokenizer(), render=render)
    await build(gw).run(context(media_chat(cache_salt="s")))
    assert len(render.calls) == 1
    assert router.picks[0].extras == BlockExtras(cache_salt="s", opaque=True)
    assert router.picks[0].token_ids == [4, 5, 6]
    assert kinds(gw) == {"salted": 1, "media": 1, "opaque": 1}


async def test_without_a_render_a_media_chat_is_opaque():
    router = FakeRouter()
    gw = gateway(router, InstantTokenizer())
    await build(gw).run(context(media_chat()))
    assert router.picks[0].extras == BlockExtras(opaque=True) and router.picks[0].token_ids == [4, 5, 6]
    router, gw = FakeRouter(), gateway(None, None)  # no tokenizer either: routed on load, still opaque
    gw.router = router
    await build(gw).run(context(media_chat()))
    assert router.picks[0].extras == BlockExtras(opaque=True) and router.picks[0].token_ids is None


async def test_a_strategy_without_tokens_never_renders():
    router, render = FakeRouter(needs_tokens=False), FakeRender(Rendered([1]))
    gw = gateway(router, InstantTokenizer(), render=render)
    await build(gw).run(context(media_chat(cache_salt="s")))
    assert render.calls == [] and router.picks[0].token_ids is None
    assert router.picks[0].extras == BlockExtras(cache_salt="s")
