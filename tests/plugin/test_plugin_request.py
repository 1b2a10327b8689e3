"""Request bodies: every malformed class gets its documented status and error code."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
            "continue_final_message": True, "add_generation_prompt": False, "stream": None, "chat_template": "t"}
    r = parse_body(CHAT, _j(body), LIMIT)
    assert isinstance(r.item, ChatInput)
    assert (r.path, r.model, r.item.chat_template) == (CHAT, "m", "t")
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


# --- the decoding shortcut: json.loads' value or nothing, never another answer --------------------------------

_JSON_PIECES = [b"{", b"}", b"[", b"]", b'"', b"\\", b":", b",", b" ", b"\n", b"\x00", b"\xff", b"\xef\xbb\xbf",
                b"\xed\xa0\x80", b"1", b"-0.0", b"1e400", b"NaN", b"true", b"null", b'"a"', b'"\\u00e9"', b"\xc3\xa9",
                b'"model"', b'"m"', b'"prompt"', b'"x"']
_bodies = st.one_of(
    st.lists(st.sampled_from(_JSON_PIECES), max_size=30).map(b"".join),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                 lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
                 max_leaves=20).map(lambda v: json.dumps({"model": "m", "v": v}).encode()),
    st.binary(max_size=40))


def _outcome(decode, body: bytes):
    try:
        return "value", repr(decode(body))  # repr: NaN and -0.0 compare as themselves
    except ClientError as e:
        return "error", e.status, e.message, e.code, e.param


@settings(max_examples=800, deadline=None)
@given(body=_bodies, tail=st.sampled_from([b"", b" ", b"\r\n", b"x", b"}", b" {}"]))
def test_decoding_shortcut_gives_json_loads_value_or_defers(body: bytes, tail: bytes) -> None:
    """_decode_object answers only bodies json.loads reads as an object within the nesting bound, with
    json.loads' own value; every other body (UTF-16, a BOM, bad UTF-8, extra data, too deep) it leaves
    to _decode, whose answer (value or error) is then parse_body's."""
    from plugin.request import MAX_JSON_DEPTH, _decode, _decode_object, nests_deeper_than
    body += tail
    if not body:
        return
    fast = _decode_object(body)
    if fast is not None:
        assert type(fast) is dict and not nests_deeper_than(body, MAX_JSON_DEPTH)
        assert _outcome(_decode, body) == ("value", repr(fast)) == ("value", repr(json.loads(body)))


@pytest.mark.parametrize("body, answered", [
    (b'{"a": 1}', True), (b'{"a": 1} ', True), (b'{"a": 1}\n\t\r ', True), (b'{"a": "\xed\xa0\x80"}', True),
    (b'{"a": NaN, "b": -Infinity}', True), (b'{"a":' * 256 + b"1" + b"}" * 256, True),
    (b'{"a":' * 16 + b"1" + b"}" * 16 + b', "b": "[' + b"[" * 300 + b'"}', False),  # > 256 brackets, some in text
    (b'{"a": 1} x', False), (b'{"a": 1}{}', False), (b'{"a": "\xff"}', False), ('{"a": 1}'.encode("utf-16-le"), False),
    ('{"a": 1}'.encode("utf-32-le"), False), (b'\xef\xbb\xbf{"a": 1}', False), (b' {"a": 1}', False), (b"{", False),
    (b"{" * 300, False), (b'{"a":' * 257 + b"1" + b"}" * 257, False)])
def test_decoding_shortcut_on_its_edges(body: bytes, answered: bool) -> None:
    """The shortcut answers plain UTF-8 objects (trailing whitespace, lone surrogates, NaN and 256 levels
    included) and leaves the rest, whatever json.loads makes of them, to _decode."""
    from plugin.request import _decode, _decode_object
    fast = _decode_object(body)
    assert (fast is not None) == answered
    if answered:
        assert _outcome(_decode, body) == ("value", repr(fast))


@settings(max_examples=500, deadline=None)
@given(body=st.lists(st.sampled_from([b"[", b"{", b"]", b"}", b"a", b'"', b"\\", b"a" * 300, b"{" + b"a" * 600]),
                     max_size=400).map(b"".join),
       limit=st.integers(0, 300))
def test_bracket_bound_counts_exactly(body: bytes, limit: int) -> None:
    """Found one by one where sparse, counted where dense: the same answer as counting."""
    from plugin.request import _opening_brackets_at_most
    assert _opening_brackets_at_most(body, limit) == (body.count(b"[") + body.count(b"{") <= limit)


def test_chat_errors_name_the_first_bad_message() -> None:
    ok = {"role": "user", "content": "x"}
    cases = [([ok, {"content": "no role"}, 5], "`messages[1]` must be an object with a string `role`"),
             ([ok, ok, {"role": "user", "content": 3}, "x"], "`messages[2].content` must be a string or a list of parts"),
             ([ok, {"role": "user", "content": {}}, {"role": 1}], "`messages[1].content` must be a string or a list of parts"),
             (["x"], "`messages[0]` must be an object with a string `role`"),
             ([ok, {"role": True}], "`messages[1]` must be an object with a string `role`")]
    for messages, message in cases:
        e = _err(CHAT, _j({"model": "m", "messages": messages}))
        assert (e.status, e.message, e.param) == (400, message, "messages")
    assert parse_body(CHAT, _j({"model": "m", "messages": [ok, {"role": "a", "content": None},
                                                             {"role": "b", "content": [{"type": "text"}]}]}),
                      LIMIT).item.messages[2]["content"] == [{"type": "text"}]
    for name in ("add_generation_prompt", "continue_final_message"):
        for bad in (1, 0, "true", None):
            e = _err(CHAT, _j({"model": "m", "messages": [ok], name: bad}))
            assert (e.message, e.param) == (f"`{name}` must be true or false", name)
    e = _err(CHAT, _j({"model": "m", "messages": [ok], "tools": [{}, 1]}))
    assert (e.message, e.param) == ("`tools` must be a list of objects", "tools")
