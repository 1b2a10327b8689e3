"""What a request body says about its blocks' extra keys (plugin.request): `cache_salt` validated as vLLM validates
it (its messages, a 400 naming the parameter), prompt embeddings and unknown content parts opaque, a chat's media
parts with the uuids vLLM uses as identifiers, and media_extras pairing the engine's render with them."""
from __future__ import annotations

import json

import pytest

from kvcache.blockkeys import BlockExtras, MediaItem
from plugin.request import (CHAT, COMPLETIONS, MAX_CACHE_SALT_CHARS, ClientError, MediaPart, media_extras,
                            parse_body)
from tokenizer.types import ChatInput, PromptInput, Rendered, RenderedMedia

NOT_STRING = "Parameter 'cache_salt' must be a non-empty string if provided."
BAD_SALT = "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."


def parse(path: str, **fields):
    return parse_body(path, json.dumps({"model": "m", **fields}).encode(), 1 << 20)


def chat(*content, **fields):
    return parse(CHAT, messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": list(content)}],
                 **fields)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_plain_requests_carry_no_extras():
    for r in (parse(COMPLETIONS, prompt="hi"), parse(CHAT, messages=[{"role": "user", "content": "hi"}]),
              chat({"type": "text", "text": "a"}, "b", {"text": "c"}, {"type": "input_text", "text": "d"})):
        assert r.extras is None and r.media is None


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_salt_is_carried_on_both_paths(path):
    salt = "tenant-7:" + "x" * (MAX_CACHE_SALT_CHARS - 9)  # exactly 128 characters: allowed
    fields = {"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    r = parse(path, cache_salt=salt, **fields)
    assert r.extras == BlockExtras(cache_salt=salt) and r.media is None
    assert parse(path, cache_salt=None, **fields).extras is None  # null: no salt, as vLLM reads it


@pytest.mark.parametrize("salt,message", [
    ("", NOT_STRING), (5, NOT_STRING), (["a"], NOT_STRING), (True, NOT_STRING), ({}, NOT_STRING),
    ("x" * (MAX_CACHE_SALT_CHARS + 1), BAD_SALT), ("a@b", BAD_SALT), ("a/b", BAD_SALT), ("a\\b", BAD_SALT),
    ("a\x00b", BAD_SALT)])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_bad_salt_is_refused_with_vllms_message(path, salt, message):
    fields = {"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ClientError) as e:
        parse(path, cache_salt=salt, **fields)
    assert (e.value.status, e.value.message, e.value.param) == (400, message, "cache_salt")
    assert json.loads(e.value.to_json())["error"]["message"] == message


def test_prompt_embeds_make_a_completion_opaque_with_or_without_a_prompt():
    r = parse(COMPLETIONS, prompt_embeds="AAAA", cache_salt="s")
    assert r.extras == BlockExtras(opaque=True) and r.item == PromptInput(token_ids=())
    r = parse(COMPLETIONS, prompt="hi", prompt_embeds=["AAAA"])
    assert r.extras == BlockExtras(opaque=True) and r.item == PromptInput(text="hi")
    # empty embeddings are none at all (vLLM: "Either prompt or prompt_embeds must be provided and non-empty.")
    with pytest.raises(ClientError, match="`prompt` is required"):
        parse(COMPLETIONS, prompt_embeds=[])
    assert parse(COMPLETIONS, prompt="hi", prompt_embeds=[]).extras is None


def test_media_parts_are_listed_in_order_with_their_uuids():
    r = chat({"type": "text", "text": "look"}, {**IMAGE, "uuid": "img-1"},
             {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
             {"image_url": {"url": "http://x/y.png"}},  # no type: vLLM infers it from the key
             {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}, "uuid": ""}, cache_salt="s")
    assert r.media == (MediaPart("image", "img-1"), MediaPart("audio", None), MediaPart("image", None),
                       MediaPart("video", None))
    assert r.extras == BlockExtras(cache_salt="s")  # the media identifiers come from the engine's render
    assert isinstance(r.item, ChatInput) and r.item.messages[1]["content"][1]["uuid"] == "img-1"


def test_with_processor_kwargs_a_uuid_is_not_the_identifier():
    # vLLM hashes the uuid together with mm_processor_kwargs then: only the engine knows the identifier
    r = chat({**IMAGE, "uuid": "img-1"}, mm_processor_kwargs={"max_pixels": 1000})
    assert r.media == (MediaPart("image", None),)
    assert chat({**IMAGE, "uuid": "img-1"}, mm_processor_kwargs={}).media == (MediaPart("image", "img-1"),)


@pytest.mark.parametrize("part", [
    {"type": "prompt_embeds", "prompt_embeds": "AAAA"}, {"type": "file", "file": {"file_id": "f"}},
    {"mystery": 1}, 7])
def test_a_part_kvgate_cannot_key_makes_the_chat_opaque(part):
    r = chat(IMAGE, part, cache_salt="s")
    assert r.extras == BlockExtras(opaque=True) and r.media is None


def test_an_opaque_part_still_leaves_the_other_messages_checked():
    with pytest.raises(ClientError, match=r"messages\[1\]"):
        parse(CHAT, messages=[{"role": "user", "content": [{"type": "prompt_embeds"}]}, {"content": "no role"}])


def rendered(*items: tuple[str, str | None, int, int], n: int = 200) -> Rendered:
    return Rendered(list(range(n)), tuple(RenderedMedia(*i) for i in items))


def test_media_extras_take_the_engines_hashes():
    parts = (MediaPart("image", "u1"), MediaPart("image", None))
    got = media_extras("s", parts, rendered(("image", "h1", 10, 64), ("image", "h2", 80, 64)))
    # the engine's hash wins over a uuid (it is what the engine's blocks carry, whatever kwargs came along)
    assert got == BlockExtras(cache_salt="s", media=(MediaItem("h1", 10, 64), MediaItem("h2", 80, 64)))


def test_media_extras_fall_back_to_uuids_paired_by_modality_and_order():
    parts = (MediaPart("image", "i1"), MediaPart("audio", "a1"), MediaPart("image", "i2"))
    got = media_extras(None, parts, rendered(("image", None, 4, 10), ("audio", None, 20, 5), ("image", "h", 30, 10)))
    assert got == BlockExtras(media=(MediaItem("i1", 4, 10), MediaItem("a1", 20, 5), MediaItem("h", 30, 10)))


def test_media_extras_are_opaque_when_neither_hash_nor_uuid_says():
    # no uuid for the item
    assert media_extras("s", (MediaPart("image", None),), rendered(("image", None, 4, 10))) == \
        BlockExtras(cache_salt="s", opaque=True)
    # the engine found another number of images than the request has parts: uuids cannot be paired
    parts = (MediaPart("image", "i1"),)
    assert media_extras(None, parts, rendered(("image", None, 4, 10), ("image", "h", 30, 10))).opaque
    # an item of a modality the request had no part for
    assert media_extras(None, parts, rendered(("image", "h", 4, 10), ("audio", None, 30, 10))).opaque


def test_media_extras_without_media_or_salt_are_none():
    assert media_extras(None, (MediaPart("image", "u"),), Rendered([1, 2, 3])) is None
    assert media_extras("s", (MediaPart("image", "u"),), Rendered([1, 2, 3])) == BlockExtras(cache_salt="s")
