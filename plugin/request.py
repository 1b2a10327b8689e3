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
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

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
    Only a body holding more than `limit` opening brackets is scanned: counting them is one C pass."""
    if body.count(b"[") + body.count(b"{") <= limit:
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


def parse_body(path: str, body: bytes, max_bytes: int) -> InferenceRequest:
    """Parse and check a /v1/completions or /v1/chat/completions body."""
    if len(body) > max_bytes:
        raise ClientError(413, f"request body is {len(body)} bytes; the limit is {max_bytes}",
                          code="request_too_large")
    if not body:
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    if nests_deeper_than(body, MAX_JSON_DEPTH):
        raise bad_request(f"request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels",
                          code="invalid_json")
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:  # not valid JSON either (the bound above is exact for valid JSON)
        raise bad_request(f"request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels",
                          code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    model = data.get("model")
    if model is None:
        raise bad_request("`model` is required", param="model", code="missing_model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("`model` must be a non-empty string", param="model")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be true or false", param="stream")
    item = _completion_item(data) if path == COMPLETIONS else _chat_item(data)
    return InferenceRequest(path=path, model=model, stream=stream, item=item)


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
    messages = data.get("messages")
    if messages is None:
        raise bad_request("`messages` is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"`messages[{i}]` must be an object with a string `role`", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"`messages[{i}].content` must be a string or a list of parts", param="messages")
    tools = data.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad_request("`tools` must be a list of objects", param="tools")
    template = data.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad_request("`chat_template` must be a string", param="chat_template")
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("`chat_template_kwargs` must be an object", param="chat_template_kwargs")
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = data.get(name, default)
        if not isinstance(value, bool):
            raise bad_request(f"`{name}` must be true or false", param=name)
        flags[name] = value
    return ChatInput(messages=tuple(messages), tools=tuple(tools) if tools else None, chat_template=template,
                     chat_template_kwargs=kwargs, **flags)
