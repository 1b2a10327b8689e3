"""Request bodies: every malformed class gets its documented status and error code."""
import json

import pytest

from plugin.request import CHAT, COMPLETIONS, ClientError, parse_body
from tokenizer.types import ChatInput, PromptInput

LIMIT = 1 << 20


def _err(path: str, body: bytes, limit: int = LIMIT) -> ClientError:
    with pytest.raises(ClientError) as info:
        parse_body(path, body, limit)
    return info.value


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        (COMPLETIONS, b"", 400, None),
        (COMPLETIONS, b"{not json", 400, None),
        (COMPLETIONS, b"\xff\xfe{}", 400, None),  # not UTF-8
        (COMPLETIONS, b"[1, 2]", 400, None),
        (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, None),  # deeply nested
        (COMPLETIONS, _j({"prompt": "hi"}), 400, "model"),
        (COMPLETIONS, _j({"model": 7, "prompt": "hi"}), 400, "model"),
        (COMPLETIONS, _j({"model": "", "prompt": "hi"}), 400, "model"),
        (COMPLETIONS, _j({"model": "m"}), 400, "prompt"),
        (COMPLETIONS, _j({"model": "m", "prompt": 5}), 400, "prompt"),
        (COMPLETIONS, _j({"model": "m", "prompt": []}), 400, "prompt"),
        (COMPLETIONS, _j({"model": "m", "prompt": ["a", 1]}), 400, "prompt"),
        (COMPLETIONS, _j({"model": "m", "prompt": [1, -2]}), 400, "prompt"),
        (COMPLETIONS, _j({"model": "m", "prompt": [1, 2**40]}), 400, "prompt"),
        (COMPLETIONS, _j({"model": "m", "prompt": [1, True]}), 400, "prompt"),
        (COMPLETIONS, _j({"model": "m", "prompt": [[1], []]}), 400, "prompt"),
        (COMPLETIONS, _j({"model": "m", "prompt": "x", "stream": "yes"}), 400, "stream"),
        (CHAT, _j({"model": "m"}), 400, "messages"),
        (CHAT, _j({"model": "m", "messages": []}), 400, "messages"),
        (CHAT, _j({"model": "m", "messages": "hi"}), 400, "messages"),
        (CHAT, _j({"model": "m", "messages": [{"content": "no role"}]}), 400, "messages"),
        (CHAT, _j({"model": "m", "messages": [{"role": "user", "content": 3}]}), 400, "messages"),
        (CHAT, _j({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}), 400, "tools"),
        (CHAT, _j({"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template": 1}), 400,
         "chat_template"),
        (CHAT, _j({"model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1}), 400,
         "add_generation_prompt"),
    ],
)
def test_malformed_bodies_are_400(path, body, status, param):
    err = _err(path, body)
    assert err.status == status
    assert err.param == param
    doc = json.loads(err.to_json())
    assert set(doc["error"]) == {"message", "type", "code", "param"}
    assert doc["error"]["message"]


def test_oversized_body_is_413():
    err = _err(COMPLETIONS, _j({"model": "m", "prompt": "x" * 5000}), limit=1024)
    assert err.status == 413 and err.code == "request_too_large"


def test_prompt_shapes():
    assert parse_body(COMPLETIONS, _j({"model": "m", "prompt": "hello"}), LIMIT).item == PromptInput(text="hello")
    assert parse_body(COMPLETIONS, _j({"model": "m", "prompt": ["a", "b"]}), LIMIT).item == PromptInput(text="a")
    assert parse_body(COMPLETIONS, _j({"model": "m", "prompt": [1, 2, 3]}), LIMIT).item == PromptInput(
        token_ids=(1, 2, 3))
    assert parse_body(COMPLETIONS, _j({"model": "m", "prompt": [[4, 5], [6]]}), LIMIT).item == PromptInput(
        token_ids=(4, 5))
    r = parse_body(COMPLETIONS, _j({"model": "m", "prompt": "x", "stream": True, "unknown_field": {"a": 1}}), LIMIT)
    assert r.stream is True and r.model == "m"


def test_chat_fields():
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "tools": [{"type": "function", "function": {"name": "f"}}], "chat_template_kwargs": {"x": 1},
            "continue_final_message": True, "add_generation_prompt": False, "stream": None}
    r = parse_body(CHAT, _j(body), LIMIT)
    assert isinstance(r.item, ChatInput)
    assert r.item.messages[1] == {"role": "user", "content": "u"}
    assert r.item.tools == ({"type": "function", "function": {"name": "f"}},)
    assert r.item.continue_final_message is True and r.item.add_generation_prompt is False
    assert r.item.chat_template_kwargs == {"x": 1}
    assert r.stream is False


def test_nesting_bound_is_kvgates_own_whatever_the_interpreter():
    """MAX_JSON_DEPTH levels pass, one more is invalid_json, on 3.11 (whose decoder would stop near
    1000 levels) and 3.13 (whose decoder has no bound) alike; brackets inside strings are text."""
    from plugin.request import MAX_JSON_DEPTH

    def body(depth: int) -> bytes:
        return b'{"model": "m", "prompt": "x", "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    assert parse_body(COMPLETIONS, body(MAX_JSON_DEPTH), LIMIT).model == "m"
    for depth in (MAX_JSON_DEPTH + 1, 900, 5000):
        e = _err(COMPLETIONS, body(depth))
        assert (e.status, e.code) == (400, "invalid_json") and f"deeper than {MAX_JSON_DEPTH}" in e.message
    objects = b'{"model": "m", "prompt": "x", "a": ' + b'{"a": ' * MAX_JSON_DEPTH + b"1" + b"}" * MAX_JSON_DEPTH + b"}"
    assert _err(CHAT, objects).code == "invalid_json"
    brackets_in_text = _j({"model": "m", "prompt": "[" * 5000 + '\\"{' * 100})
    assert parse_body(COMPLETIONS, brackets_in_text, LIMIT).item.text.startswith("[[[")
