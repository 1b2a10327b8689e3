"""OpenAI request bodies -> typed inference requests, with the client errors they can raise.

Only what routing needs is read (`model`, `stream`, the prompt or messages);
every other field is left to the engine, which sees the body unchanged.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizer.types import ChatInput, PromptInput, TokenizeInput

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
ROUTED_POST_PATHS = (COMPLETIONS, CHAT)

# Token ids are 32-bit in every vLLM tokenizer; larger or negative ones are malformed.
MAX_TOKEN_ID = 2**31 - 1

# kvgate's own bound on the nesting of a JSON body, the same on every interpreter: 3.11's decoder
# fails past the recursion limit (about 1000 levels), 3.13's accepts any depth. OpenAI bodies nest a
# few levels; tool parameter schemas a few dozen.
MAX_JSON_DEPTH = 256
# A JSON string (escapes included) or a bracket: brackets inside strings are not structure.
_JSON_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


class ClientError(Exception):
    """A request kvgate refuses; becomes an OpenAI-style error with `status`."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 429's)

    def to_json(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type,
                                     "code": self.code, "param": self.param}}).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ClientError:
    return ClientError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    path: str
    model: str
    stream: bool
    item: TokenizeInput  # what the engine will tokenize (the first prompt of a batch)


def nests_deeper_than(body: bytes, limit: int) -> bool:
    """Whether the arrays and objects of a JSON text nest deeper than `limit` (exact for valid JSON).
    Only a body holding more than `limit` opening brackets is scanned."""
    if _opening_brackets_at_most(body, limit):
        return False
    depth = 0
    for m in _JSON_TOKENS.finditer(body):
        c = body[m.start()]
        if c == 0x5B or c == 0x7B:  # [ {
            depth += 1
            if depth > limit:
                return True
        elif c == 0x5D or c == 0x7D:  # ] }
            depth -= 1
    return False


def _opening_brackets_at_most(body: bytes, limit: int) -> bool:
    """Whether `body` holds at most `limit` bytes `[` and `{` (an upper bound on its nesting).
    Brackets sparser than one in 256 bytes (a chat's messages: one `{` each) are found one by one
    (memchr), which skips the text between them; denser ones are counted, a plain pass over every byte
    (about 1 us per 3 kB and per bracket kind), which is then the cheaper."""
    if len(body) <= limit:
        return True
    find = body.find
    seen = 0
    for bracket in (0x5B, 0x7B):  # [ {
        found = 0
        i = find(bracket)
        while i >= 0:
            found += 1
            if seen + found > limit:
                return False
            if found > 4 and i < found << 8:
                return body.count(b"[") + body.count(b"{") <= limit
            i = find(bracket, i + 1)
        seen += found
    return True


# The scanner json.loads itself uses (a decoder with every option at its default), called directly.
_scan_json = json.JSONDecoder().scan_once  # type: ignore[attr-defined]  # set in __init__; typeshed omits it
_JSON_WHITESPACE_END = json.decoder.WHITESPACE.match  # type: ignore[attr-defined]  # typeshed omits it


def _decode_object(body: bytes) -> Any:
    """json.loads(body) for a body that starts with `{`, within the nesting bound and valid: the same
    value, without the steps that cannot change it for such a body (detecting UTF-16 or UTF-32, the
    leading whitespace). None for any other body (an error included): `_decode` then takes it from the
    start, with its exact error."""
    if body[0] != 0x7B or len(body) < 2 or not body[1] or not _opening_brackets_at_most(body, MAX_JSON_DEPTH):
        return None  # not `{`, or `{` then a zero byte (json.loads reads that as UTF-16 or UTF-32)
    try:
        text = body.decode("utf-8", "surrogatepass")  # json.loads' decoding of a body it detects as UTF-8
        data, end = _scan_json(text, 0)
    except (ValueError, StopIteration, RecursionError):
        return None
    if end != len(text) and _JSON_WHITESPACE_END(text, end).end() != len(text):
        return None  # something after the object: json.loads' "Extra data"
    return data


def _decode(body: bytes) -> Any:
    """json.loads(body), bounded in nesting, its failures as client errors."""
    if nests_deeper_than(body, MAX_JSON_DEPTH):
        raise bad_request(f"request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels",
                          code="invalid_json")
    try:
        return json.loads(body)
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:  # not valid JSON either (the bound above is exact for valid JSON)
        raise bad_request(f"request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels",
                          code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None


def parse_body(path: str, body: bytes, max_bytes: int) -> InferenceRequest:
    """Parse and check a /v1/completions or /v1/chat/completions body."""
    size = len(body)
    if size > max_bytes:
        raise ClientError(413, f"request body is {size} bytes; the limit is {max_bytes}",
                          code="request_too_large")
    if not size:
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    data = _decode_object(body)
    if data is None:
        data = _decode(body)
        if type(data) is not dict:
            raise bad_request("request body must be a JSON object", code="invalid_json")
    model = data.get("model")
    if model is None:
        raise bad_request("`model` is required", param="model", code="missing_model")
    if type(model) is not str or not model.strip():
        raise bad_request("`model` must be a non-empty string", param="model")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    elif stream is not False and stream is not True:
        raise bad_request("`stream` must be true or false", param="stream")
    item = _completion_item(data) if path == COMPLETIONS else _chat_item(data)
    return InferenceRequest(path, model, stream, item)  # positional: the fields' order


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    for t in value:
        # bool is an int subclass: refuse it explicitly.
        if type(t) is not int:
            raise bad_request(f"`{param}` must be a list of integer token ids", param=param)
        if t < 0 or t > MAX_TOKEN_ID:
            raise bad_request(f"`{param}` holds token id {t}, outside 0..{MAX_TOKEN_ID}", param=param,
                              code="token_id_out_of_range")
    return tuple(value)


def _completion_item(data: dict[str, Any]) -> PromptInput:
    prompt = data.get("prompt")
    add_special = data.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad_request("`add_special_tokens` must be true or false", param="add_special_tokens")
    if prompt is None:
        raise bad_request("`prompt` is required", param="prompt")
    if isinstance(prompt, str):
        return PromptInput(text=prompt, add_special_tokens=add_special)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("`prompt` must be a string, a list of strings, or token ids (a list, or a list of lists)",
                          param="prompt")
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise bad_request("`prompt` mixes strings and other values", param="prompt")
        return PromptInput(text=first, add_special_tokens=add_special)
    if isinstance(first, list):
        if not all(isinstance(p, list) and p for p in prompt):
            raise bad_request("`prompt` as a list of lists must hold non-empty lists of token ids", param="prompt")
        ids = [_token_ids(p, "prompt") for p in prompt]
        return PromptInput(token_ids=ids[0])
    return PromptInput(token_ids=_token_ids(prompt, "prompt"))


def _chat_item(data: dict[str, Any]) -> ChatInput:
    # The values come from json.loads: exact dicts, lists, strs, ints, floats and bools, so `type(x) is`
    # tells what isinstance would (bool apart, which is tested as True or False).
    messages = data.get("messages")
    if messages is None:
        raise bad_request("`messages` is required", param="messages")
    if type(messages) is not list or not messages:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    for m in messages:
        if type(m) is not dict or type(m.get("role")) is not str:
            _check_messages(messages)
        content = m.get("content")
        if content is not None and type(content) is not str and type(content) is not list:
            _check_messages(messages)
    tools = data.get("tools")
    if tools is not None and not (type(tools) is list and all(type(t) is dict for t in tools)):
        raise bad_request("`tools` must be a list of objects", param="tools")
    template = data.get("chat_template")
    if template is not None and type(template) is not str:
        raise bad_request("`chat_template` must be a string", param="chat_template")
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None and type(kwargs) is not dict:
        raise bad_request("`chat_template_kwargs` must be an object", param="chat_template_kwargs")
    generation = data.get("add_generation_prompt", True)
    if generation is not True and generation is not False:
        raise bad_request("`add_generation_prompt` must be true or false", param="add_generation_prompt")
    final = data.get("continue_final_message", False)
    if final is not True and final is not False:
        raise bad_request("`continue_final_message` must be true or false", param="continue_final_message")
    # Positional, in the fields' order (keywords cost a dataclass __init__ a third more; test_chat_fields
    # checks every field).
    return ChatInput(tuple(messages), tuple(tools) if tools else None, template, kwargs, generation, final)


def _check_messages(messages: list[Any]) -> None:
    """Raise the error of the first message that is not an object with a string `role` and a string,
    list or null `content` (the check above, again, to name the message)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"`messages[{i}]` must be an object with a string `role`", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"`messages[{i}].content` must be a string or a list of parts", param="messages")
