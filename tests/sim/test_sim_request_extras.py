"""The simulated engine's HTTP side for what a request adds to its blocks' hashes: `cache_salt` (validated as
vLLM validates it), images in chat messages (placeholder tokens, identifiers), vLLM's render endpoints, and the
model-shape options of `kvgate sim`. Real HTTP on 127.0.0.1; the engine's add_request is spied on."""
from __future__ import annotations

import argparse
import base64
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvcache.blockkeys import MediaItem
from sim import cli, media
from sim.engine import EngineConfig, EngineModel, GroupSpec
from sim.server import SimOptions, SimServer
from tokenizer import testdata
from tokenizer.local import LocalTokenizer
from tokenizer.types import ChatInput
from helpers import free_ports

ENGINE = EngineConfig(block_size=16, num_blocks=512, ttft_overhead_s=0.001, prefill_s_per_token=0.00001,
                      tpot_base_s=0.002, tpot_per_seq_s=0.0001)
N_IMAGE = 8
PNG = b"\x89PNG\r\n\x1a\n pretend image bytes"
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
HTTP_URL = "https://example.com/cat.png"


def image(url: str | None = None, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url"}
    if url is not None:
        part["image_url"] = {"url": url}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def hashed(data: bytes, model: str = "sim-model") -> str:
    """The identifier sim.media documents for an image without a uuid."""
    return hashlib.sha256(model.encode() + b"\0image\0" + data).hexdigest()


class Spy:
    """Every add_request call any EngineModel gets: (token ids, keyword arguments)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[list[int], dict[str, Any]]] = []
        real = EngineModel.add_request

        def add_request(engine: EngineModel, req_id: str, token_ids: Any, max_tokens: int, now: float,
                        lora: str | None = None, **kw: Any) -> None:
            self.calls.append((list(token_ids), kw))
            real(engine, req_id, token_ids, max_tokens, now, lora, **kw)

        monkeypatch.setattr(EngineModel, "add_request", add_request)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    return Spy(monkeypatch)


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    kv, replay = free_ports(2)
    server = SimServer(SimOptions(name="sim-x", port=0, engine=ENGINE, kv_events_port=kv, replay_port=replay,
                                  max_tokens_default=4, image_tokens=N_IMAGE))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(scope="module")
def tok_with_placeholder() -> LocalTokenizer:
    tok = LocalTokenizer.from_path(testdata.path(), fast=False)
    tok.hf.add_tokens([media.PLACEHOLDER], special_tokens=True)
    return tok


# ---- cache_salt ----------------------------------------------------------------------------------


async def test_cache_salt_reaches_the_engine_on_chat_and_completions(client: httpx.AsyncClient, spy: Spy) -> None:
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "cache_salt": "tenant-1"}
    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    completion = {"prompt": "hello", "max_tokens": 2, "cache_salt": "s" * 128}
    assert (await client.post("/v1/completions", json=completion)).status_code == 200
    unsalted = {"prompt": "hello", "max_tokens": 2, "cache_salt": None}
    assert (await client.post("/v1/completions", json=unsalted)).status_code == 200
    assert [kw["cache_salt"] for _, kw in spy.calls] == ["tenant-1", "s" * 128, None]


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
async def test_cache_salt_that_is_no_string_is_refused_like_vllm(client: httpx.AsyncClient, spy: Spy,
                                                                  salt: Any) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = await client.post(path, json={**body, "cache_salt": salt})
        assert r.status_code == 400
        assert r.json() == {"error": {"message": "Parameter 'cache_salt' must be a non-empty string if provided.",
                                      "type": "BadRequestError", "param": "cache_salt", "code": 400}}
    assert spy.calls == []


@pytest.mark.parametrize("salt", ["s" * 129, "a@b", "a/b", "a\\b", "a\0b"])
async def test_cache_salt_too_long_or_with_forbidden_characters_is_refused(client: httpx.AsyncClient, spy: Spy,
                                                                           salt: str) -> None:
    r = await client.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "cache_salt": salt})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', "
                   "or NUL.", "type": "BadRequestError", "param": "cache_salt", "code": 400}
    assert spy.calls == []


# ---- images ------------------------------------------------------------------------------------


def _runs(tokens: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `token_id`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tokens):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


async def test_images_become_placeholder_runs_and_media_items(sim: SimServer, client: httpx.AsyncClient, spy: Spy,
                                                              tok_with_placeholder: LocalTokenizer) -> None:
    content = [{"type": "text", "text": "what differs?"}, image(DATA_URL), image(HTTP_URL, uuid="cat-1")]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    (tokens, kw), = spy.calls
    ph = sim.image_token_id
    assert _runs(tokens, ph) == [(m.offset, m.length) for m in kw["mm_items"]]
    assert [m.length for m in kw["mm_items"]] == [N_IMAGE, N_IMAGE]
    assert [m.identifier for m in kw["mm_items"]] == [hashed(PNG), "cat-1"]  # the uuid wins
    # vLLM's string content format: the message's placeholders first, then its text, joined by newlines.
    text_only = [messages[0], {"role": "user", "content": f"{media.PLACEHOLDER}\n{media.PLACEHOLDER}\nwhat differs?"}]
    collapsed = [t for i, t in enumerate(tokens) if t != ph or i == 0 or tokens[i - 1] != ph]
    assert collapsed == tok_with_placeholder.encode_chat(ChatInput(messages=tuple(text_only)))
    assert r.json()["usage"]["prompt_tokens"] == len(tokens)
    # /tokenize answers the ids the engine got.
    t = await client.post("/tokenize", json={"messages": messages})
    assert t.status_code == 200 and t.json()["tokens"] == tokens


async def test_image_identifiers_follow_the_bytes_and_the_uuid(sim: SimServer, client: httpx.AsyncClient, spy: Spy,
                                                              tok_with_placeholder: LocalTokenizer) -> None:
    other_png = "data:image/png;base64," + base64.b64encode(PNG + b"!").decode()
    images = [image(DATA_URL), image(other_png), image(HTTP_URL), image(uuid="only-a-uuid"),
              image(DATA_URL, uuid="u-2")]
    for part in images:
        body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "describe"}]}],
                "max_tokens": 1}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    ids = [kw["mm_items"][0].identifier for _, kw in spy.calls]
    assert ids == [hashed(PNG), hashed(PNG + b"!"), hashed(HTTP_URL.encode()), "only-a-uuid", "u-2"]
    assert all(len(i) == 64 and int(i, 16) >= 0 for i in ids[:3])  # hex strings, like vLLM's hashes
    # No media: the engine gets no items; the same image twice: the same identifier, two runs.
    plain = {"messages": [{"role": "user", "content": "describe"}], "max_tokens": 1}
    assert (await client.post("/v1/chat/completions", json=plain)).status_code == 200
    twice = {"messages": [{"role": "user", "content": [image(DATA_URL), image(DATA_URL)]}], "max_tokens": 1}
    assert (await client.post("/v1/chat/completions", json=twice)).status_code == 200
    assert spy.calls[-2][1]["mm_items"] == ()
    first, second = spy.calls[-1][1]["mm_items"]
    assert first.identifier == second.identifier == hashed(PNG)
    assert second.offset == first.offset + N_IMAGE + 1  # images only: "\n".join(placeholders), no text after
    tokens, ph = spy.calls[-1][0], sim.image_token_id
    collapsed = [t for i, t in enumerate(tokens) if t != ph or i == 0 or tokens[i - 1] != ph]
    only = ({"role": "user", "content": f"{media.PLACEHOLDER}\n{media.PLACEHOLDER}"},)
    assert collapsed == tok_with_placeholder.encode_chat(ChatInput(messages=only))


@pytest.mark.parametrize("part, words", [
    ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "image_url media parts only"),
    (image("data:image/png;base64,@@@"), "base64"),
    (image("data:image/png;base64"), "comma"),
    ({"type": "image_url"}, "image_url.url"),
    (image(HTTP_URL, uuid=""), "uuid"),
])
async def test_bad_media_parts_are_refused(client: httpx.AsyncClient, spy: Spy, part: dict, words: str) -> None:
    for path in ("/v1/chat/completions", "/tokenize", "/v1/chat/completions/render"):
        r = await client.post(path, json={"messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 400, (path, r.text)
        assert words in r.json()["error"]["message"]
    assert spy.calls == []


async def test_a_placeholder_the_text_holds_is_used_not_added(sim: SimServer, client: httpx.AsyncClient,
                                                              spy: Spy) -> None:
    held = [{"type": "text", "text": f"look: {media.PLACEHOLDER} and say"}, image(DATA_URL)]
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": held}]})
    assert r.status_code == 200, r.text
    plain = [{"type": "text", "text": "look:  and say"}, image(DATA_URL)]
    assert (await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": plain}]})
            ).status_code == 200
    (in_text, kw), (in_front, kw_front) = spy.calls
    assert [(m.offset, m.length) for m in kw["mm_items"]] == _runs(in_text, sim.image_token_id)
    assert kw["mm_items"][0].offset > kw_front["mm_items"][0].offset  # where the text put it, not in front
    two = [{"type": "text", "text": media.PLACEHOLDER * 2}, image(DATA_URL)]
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": two}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (f"Found more '{media.PLACEHOLDER}' placeholders in input prompt than "
                                            "actual multimodal data items.")


# ---- render ------------------------------------------------------------------------------------

GENERATE_REQUEST_KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}


async def test_chat_render_returns_tokens_hashes_and_placeholders(sim: SimServer, client: httpx.AsyncClient,
                                                                  spy: Spy) -> None:
    messages = [{"role": "user", "content": [image(DATA_URL), image(HTTP_URL, uuid="cat-1"),
                                             {"type": "text", "text": "compare"}]}]
    body = {"model": "sim-model", "messages": messages, "max_completion_tokens": 5, "cache_salt": "t1"}
    r = await client.post("/v1/chat/completions/render", json=body, headers={"X-Request-Id": "abc"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == GENERATE_REQUEST_KEYS
    assert out["request_id"] == "chatcmpl-abc" and out["model"] == "sim-model" and out["cache_salt"] == "t1"
    assert out["sampling_params"]["max_tokens"] == 5 and out["priority"] == 0 and out["stream"] is False
    runs = _runs(out["token_ids"], sim.image_token_id)
    assert out["features"] == {
        "mm_hashes": {"image": [hashed(PNG), "cat-1"]},
        "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in runs]},
        "kwargs_data": None,
    }
    assert spy.calls == []  # rendering runs nothing on the engine
    # The render's token ids and items are what a generation hands the engine.
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    (tokens, kw), = spy.calls
    assert tokens == out["token_ids"] and kw["cache_salt"] == "t1"
    assert kw["mm_items"] == tuple(MediaItem(h, o, n) for h, (o, n) in zip(out["features"]["mm_hashes"]["image"],
                                                                          runs))


async def test_completions_render_is_a_list_and_text_has_no_features(client: httpx.AsyncClient,
                                                                    tok_with_placeholder: LocalTokenizer) -> None:
    r = await client.post("/v1/completions/render", json={"prompt": "hello there", "max_tokens": 3})
    assert r.status_code == 200, r.text
    (out,) = r.json()
    assert set(out) == GENERATE_REQUEST_KEYS
    assert out["token_ids"] == tok_with_placeholder.encode_prompt("hello there")
    assert out["features"] is None and out["cache_salt"] is None and out["sampling_params"]["max_tokens"] == 3
    chat = await client.post("/v1/chat/completions/render",
                             json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert chat.json()["features"] is None and chat.json()["stream"] is True
    bad = await client.post("/v1/completions/render", json={"prompt": "hi", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


# ---- model shapes ------------------------------------------------------------------------------


def _options(*argv: str) -> SimOptions:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.options_from_args(parser.parse_args(["--block-size", "16", *argv]))


@pytest.mark.parametrize("argv, groups, retention", [
    ((), (GroupSpec("full_attention", 16),), 0),
    (("--model-shape", "hybrid"),
     (GroupSpec("sliding_window", 16, sliding_window=128), GroupSpec("full_attention", 16)), 0),
    (("--model-shape", "hybrid", "--sliding-window", "64", "--retention", "dense"),
     (GroupSpec("sliding_window", 16, sliding_window=64), GroupSpec("full_attention", 16)), None),
    (("--model-shape", "mamba-hybrid", "--retention", "sparse"),
     (GroupSpec("full_attention", 16), GroupSpec("mamba", 64)), 0),
])
def test_cli_model_shape_gives_the_engine_its_groups(argv: tuple[str, ...], groups: tuple[GroupSpec, ...],
                                                     retention: int | None) -> None:
    server = SimServer(_options(*argv))
    assert server.engine_config.groups == groups
    assert server.engine_config.retention_interval == retention
    info = server.ready_info()
    assert info["groups"] == [{"kind": g.kind, "block_size": g.block_size, "sliding_window": g.sliding_window}
                              for g in groups]
    assert info["retention_interval"] == retention
    assert info["image"] == {"placeholder_token_id": server.image_token_id, "tokens_per_image": 64}


def test_without_shape_options_the_engine_config_is_kept() -> None:
    engine = EngineConfig(groups=(GroupSpec("mamba", 32),), retention_interval=None)
    server = SimServer(SimOptions(engine=engine))
    assert server.engine_config.groups == engine.groups and server.engine_config.retention_interval is None


@pytest.mark.parametrize("kw, words", [
    ({"model_shape": "moe"}, "model_shape must be one of dense, hybrid, mamba-hybrid"),
    ({"retention": "sometimes"}, "retention must be one of sparse, dense"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"image_tokens": 0}, "image_tokens"),
])
def test_bad_shape_options_are_refused(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SimOptions(**kw)


def test_cli_refuses_an_unknown_shape(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _options("--model-shape", "moe")
    assert "invalid choice: 'moe'" in capsys.readouterr().err
