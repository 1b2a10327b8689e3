"""RemoteTokenizer.render_chat against an aiohttp stand-in for vLLM's POST /v1/chat/completions/render on
loopback: the client's body goes as it came with `return_mm_kwargs: false`, the answer (vLLM's GenerateRequest:
`token_ids`, `features` {`mm_hashes`, `mm_placeholders`, `kwargs_data`}) becomes token ids and media items in
prompt order; retries as /tokenize's; malformed answers are TokenizerErrors."""
from __future__ import annotations

import json

import pytest
from aiohttp import web

from helpers import serve_app
from tokenizer.remote import RemoteOptions, RemoteTokenizer, parse_render_response
from tokenizer.types import Rendered, RenderedMedia, TokenizerError

MODEL = "vlm"
FAST = RemoteOptions(total_timeout_s=2.0, attempt_timeout_s=1.0, max_retries=3, backoff_base_s=0.001, backoff_max_s=0.005)
PAD = 32000  # the stand-in's image placeholder token

BODY = {"model": MODEL, "stream": True, "cache_salt": "s", "mm_processor_kwargs": {"max_pixels": 64},
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "two pictures"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "cat"},
            {"type": "input_audio", "input_audio": {"data": "BBBB", "format": "wav"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,CCCC"}}]}]}


def vllm_like(seen: list, script: list | None = None) -> web.Application:
    """Renders as vLLM's shape does: 3 text tokens, then per media part its placeholders (4 per image, 2 per
    audio clip), then 2 tokens; hashes per modality in order (an image's uuid as its hash)."""

    async def render(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((await request.read(), body))
        if script:
            status = script.pop(0)
            return web.json_response({"error": {"message": "busy"}}, status=status)
        tokens, hashes, places = [1, 2, 3], {}, {}
        for part in body["messages"][0]["content"]:
            kind = part["type"]
            if kind == "text":
                continue
            modality, n = ("image", 4) if kind == "image_url" else ("audio", 2)
            hashes.setdefault(modality, []).append(part.get("uuid") or f"{modality}-hash-{len(tokens)}")
            places.setdefault(modality, []).append({"offset": len(tokens), "length": n})
            tokens += [PAD] * n
        tokens += [7, 8]
        kwargs = None if body.get("return_mm_kwargs") is False else {m: ["<tensor>"] * len(h) for m, h in hashes.items()}
        return web.json_response({"request_id": "r", "token_ids": tokens, "model": MODEL, "stream": False,
                                  "sampling_params": {"max_tokens": 16}, "cache_salt": body.get("cache_salt"),
                                  "features": {"mm_hashes": hashes, "mm_placeholders": places,
                                               "kwargs_data": kwargs}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions/render", render)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner, port = await serve_app(app, shutdown_timeout=0.2)
    return runner, f"http://127.0.0.1:{port}"


async def test_render_sends_the_body_as_it_came_and_reads_media_in_prompt_order() -> None:
    seen: list = []
    runner, url = await serve(vllm_like(seen))
    remote = RemoteTokenizer(options=FAST)
    raw = json.dumps(BODY).encode()
    try:
        got = await remote.render_chat(MODEL, b"  \n" + raw, base_url=url + "/")
    finally:
        await remote.aclose()
        await runner.cleanup()
    assert got == Rendered([1, 2, 3, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, 7, 8], (
        RenderedMedia("image", "cat", 3, 4), RenderedMedia("audio", "audio-hash-7", 7, 2),
        RenderedMedia("image", "image-hash-9", 9, 4)))
    sent_bytes, sent = seen[0]
    assert sent == {"return_mm_kwargs": False, **BODY}  # every field the client sent, media kwargs included
    assert sent_bytes.startswith(b'{"return_mm_kwargs":false,') and sent_bytes.endswith(raw[1:])


async def test_render_retries_busy_engines_and_does_not_retry_a_refusal() -> None:
    seen: list = []
    runner, url = await serve(vllm_like(seen, script=[503, 429]))
    remote = RemoteTokenizer({MODEL: url}, options=FAST)
    try:
        got = await remote.render_chat(MODEL, json.dumps(BODY).encode())
        assert len(seen) == 3 and len(got.media) == 3
        seen.clear()
        runner2, url2 = await serve(vllm_like(seen, script=[404]))
        other = RemoteTokenizer({MODEL: url2}, options=FAST)
        try:
            with pytest.raises(TokenizerError, match="HTTP 404"):
                await other.render_chat(MODEL, json.dumps(BODY).encode())
            assert len(seen) == 1
        finally:
            await other.aclose()
            await runner2.cleanup()
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_render_of_a_body_that_is_not_an_object_is_refused_before_sending() -> None:
    remote = RemoteTokenizer({MODEL: "http://127.0.0.1:9"}, options=FAST)
    with pytest.raises(TokenizerError, match="not a JSON object"):
        await remote.render_chat(MODEL, b"[1, 2]")
    await remote.aclose()


async def test_an_empty_object_gets_the_field_alone() -> None:
    # the splice keeps a body that is an empty object valid JSON (parse_body refuses such a body before)
    seen: list = []
    runner, url = await serve(vllm_like(seen))
    remote = RemoteTokenizer({MODEL: url}, options=FAST)
    try:
        with pytest.raises(TokenizerError):  # the stand-in cannot render no messages: a 500, retried, fails
            await remote.render_chat(MODEL, b"{ }")
    finally:
        await remote.aclose()
        await runner.cleanup()
    assert seen[0][0] == b'{"return_mm_kwargs":false}'


def test_parse_render_response_shapes() -> None:
    assert parse_render_response(b'{"token_ids": [1, 2], "features": null}') == Rendered([1, 2])
    assert parse_render_response(b'{"token_ids": [1, 2]}') == Rendered([1, 2])
    # a hash list shorter than the placeholders, a null or empty hash, hashes missing for a modality: None
    got = parse_render_response(json.dumps({"token_ids": list(range(20)), "features": {
        "mm_hashes": {"image": ["a", None], "video": [""]},
        "mm_placeholders": {"image": [{"offset": 8, "length": 2}, {"offset": 2, "length": 2},
                                      {"offset": 12, "length": 1}],
                            "audio": [{"offset": 5, "length": 3}], "video": [{"offset": 15, "length": 5}]}}}).encode())
    assert got.media == (RenderedMedia("image", None, 2, 2), RenderedMedia("audio", None, 5, 3),
                         RenderedMedia("image", "a", 8, 2), RenderedMedia("image", None, 12, 1),
                         RenderedMedia("video", None, 15, 5))


@pytest.mark.parametrize("answer,match", [
    (b"not json", "not JSON"), (b"[]", "token_ids"), (b'{"tokens": [1]}', "token_ids"),
    (b'{"token_ids": [1, true]}', "token_ids"), (b'{"token_ids": [1], "features": []}', "mm_placeholders"),
    (b'{"token_ids": [1], "features": {"mm_hashes": {}}}', "mm_placeholders"),
    (b'{"token_ids": [1], "features": {"mm_hashes": {"image": "h"}, "mm_placeholders": {"image": []}}}', "lists"),
    (b'{"token_ids": [1, 2], "features": {"mm_placeholders": {"image": [{"offset": 1, "length": 2}]}}}', "outside"),
    (b'{"token_ids": [1, 2], "features": {"mm_placeholders": {"image": [{"offset": -1, "length": 1}]}}}', "outside"),
    (b'{"token_ids": [1, 2], "features": {"mm_placeholders": {"image": [{"offset": 0}]}}}', "outside"),
    (b'{"token_ids": [1, 2], "features": {"mm_placeholders": {"image": [[0, 1]]}}}', "outside")])
def test_malformed_render_answers_are_tokenizer_errors(answer: bytes, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        parse_render_response(answer)
