"""OpenAI and Anthropic request bodies -> typed inference requests, with the client errors they can raise.

Only what routing needs is read (`model`, `stream`, the prompt or messages, and what the engine's block
hashes carry besides the tokens: `cache_salt`, media parts and their `uuid`s, prompt embeddings);
every other field is left to the engine, which sees the body unchanged.

Which tokens a request has is the engine's to say. A completion, and a chat whose fields vLLM's `/tokenize`
takes (messages, tools, template and its kwargs), are tokenized as that endpoint tokenizes them (locally
once verified against it). The rest name the engine's render endpoint (`InferenceRequest.render`, vLLM
0.33's scale-out render API): a chat with media parts, or with a field vLLM's chat renderer hands the
template and `/tokenize` has no room for (`reasoning_effort`, `documents`, `response_format`, a
`tool_choice` other than "auto" with tools: vLLM's build_chat_params; the Kimi K3 and Cohere renderers read
the last two), a `/v1/responses` body and a `/v1/messages` body (vLLM turns each into a chat by its own
rules; the render endpoints apply them). A Responses body with `previous_response_id` continues a
conversation the engine stored; no endpoint renders it (vLLM's render refuses the field), so it carries
no tokens and is routed to the engine that stored it (plugin.responses).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvcache.blockkeys import BlockExtras, MediaItem
from tokenizer.types import ChatInput, PromptInput, Rendered, TokenizeInput

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
MODELS = "/v1/models"
ROUTED_POST_PATHS = (COMPLETIONS, CHAT, RESPONSES, MESSAGES)
# The requests metric's `kind` label of each routed path.
KINDS = {COMPLETIONS: "completion", CHAT: "chat", RESPONSES: "responses", MESSAGES: "messages"}
# The engine's render endpoint for each: the same body in, vLLM's GenerateRequest (token ids, media) out.
RENDER_PATHS = {COMPLETIONS: "/v1/completions/render", CHAT: "/v1/chat/completions/render",
                RESPONSES: "/v1/responses/render", MESSAGES: "/v1/messages/render"}
# Pooling endpoints (one forward pass over the input, nothing cached worth routing to): by load.
POOLING_PATHS = frozenset(("/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                           "/v1/rerank", "/v2/rerank"))
# The engine's read-only endpoints a client may call through the gateway: by load, counted by path.
READ_ONLY = frozenset((("GET", MODELS), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"),
                       ("GET", "/version"), ("POST", "/v1/messages/count_tokens")))
# Chat fields vLLM's chat renderer hands the template that /tokenize cannot carry (see the module doc).
_RENDER_ONLY_CHAT_FIELDS = ("reasoning_effort", "documents", "response_format")

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

    def to_anthropic_json(self) -> bytes:
        """The error in Anthropic's shape, as vLLM answers /v1/messages (its translate_error_response)."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return json.dumps({"type": "error", "error": {"type": kind, "message": self.message}}).encode()


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ClientError:
    return ClientError(400, message, param=param, code=code)


# vLLM's cache_salt rules (vllm/entrypoints/generate/base/protocol.py, validate_cache_salt), its messages verbatim.
MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
_SALT_NOT_STRING = "Parameter 'cache_salt' must be a non-empty string if provided."
_SALT_BAD = "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."

# Chat content parts: text-like ones (tokens only), media ones by the modality vLLM files them under.
_TEXT_PARTS = frozenset(("text", "input_text", "output_text", "refusal", "thinking"))
_MEDIA_MODALITY = {"image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "image",
                   "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio", "video_url": "video"}
OPAQUE = BlockExtras(opaque=True)


@dataclass(frozen=True, slots=True)
class MediaPart:
    """A chat content part the engine's multimodal processor turns into placeholder tokens: its `modality`, and the
    client's `uuid` for it when the engine uses that as the item's identifier (None: no uuid, or the request has
    `mm_processor_kwargs`, with which vLLM hashes the uuid together with them)."""

    modality: str
    uuid: str | None


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    path: str
    model: str
    stream: bool
    item: TokenizeInput  # what the engine will tokenize (the first prompt of a batch)
    # What the prompt's block hashes carry besides tokens and LoRA, as far as the body tells: the salt, or opaque
    # (prompt embeddings, content parts kvgate does not know). None for a plain request (most of them).
    extras: BlockExtras | None = None
    # A chat's media parts in message order; their identifiers and placeholders come from the engine's render.
    media: tuple[MediaPart, ...] | None = None
    # The engine's render endpoint that gives this request's tokens (None: the tokenizer does); see the module doc.
    render: str | None = None
    # A Responses request continuing a stored conversation: routed to the engine that stored it.
    previous_response_id: str | None = None


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
    salt = data.get("cache_salt")
    if salt is not None:
        _check_salt(salt)
    if path == RESPONSES or path == MESSAGES:
        return _api_request(path, data, model, stream, salt)
    if path in POOLING_PATHS:
        return InferenceRequest(path, model, stream, NO_PROMPT)  # routed by load: nothing else is read
    if path == COMPLETIONS:
        embeds = data.get("prompt_embeds")
        if embeds is not None and embeds != [] and embeds != "":
            # vLLM hashes the embeddings into every block: nothing kvgate can compute
            return InferenceRequest(path, model, stream, _completion_item(data, embeds=True), OPAQUE)
        item: TokenizeInput = _completion_item(data)
        media = None
    else:
        item, media = _chat_item(data)
        if media is _OPAQUE_MEDIA:
            return InferenceRequest(path, model, stream, item, OPAQUE)
        if media is None and _render_only(data, item):
            return InferenceRequest(path, model, stream, item,
                                    BlockExtras(cache_salt=salt) if salt is not None else None, None, CHAT_RENDER)
    if salt is None and media is None:
        return InferenceRequest(path, model, stream, item)  # positional: the fields' order
    return InferenceRequest(path, model, stream, item, BlockExtras(cache_salt=salt) if salt is not None else None,
                            tuple(media) if media is not None else None,
                            CHAT_RENDER if media is not None else None)


CHAT_RENDER = RENDER_PATHS[CHAT]
NO_PROMPT = PromptInput()  # a request whose tokens only a render endpoint gives (no text, no ids)


def _render_only(data: dict[str, Any], item: ChatInput) -> bool:
    """Whether a chat (without media) has a field the template sees that /tokenize cannot carry."""
    for field in _RENDER_ONLY_CHAT_FIELDS:
        if data.get(field) is not None:
            return True
    choice = data.get("tool_choice")
    return item.tools is not None and choice is not None and choice != "auto"


def _api_request(path: str, data: dict[str, Any], model: str, stream: bool, salt: str | None) -> InferenceRequest:
    """A /v1/responses or /v1/messages body, checked as far as vLLM's request models refuse it with 400: its
    tokens come from the engine's render endpoint (no previous_response_id), else it is routed to the engine
    that stored the conversation."""
    extras = BlockExtras(cache_salt=salt) if salt is not None else None
    if path == MESSAGES:
        max_tokens = data.get("max_tokens")
        if max_tokens is None:
            raise bad_request("`max_tokens` is required", param="max_tokens")
        if type(max_tokens) is not int:
            raise bad_request("`max_tokens` must be an integer", param="max_tokens")
        messages = data.get("messages")
        if messages is None:
            raise bad_request("`messages` is required", param="messages")
        if type(messages) is not list:
            raise bad_request("`messages` must be a list", param="messages")
        for i, m in enumerate(messages):
            if type(m) is not dict or type(m.get("role")) is not str:
                raise bad_request(f"`messages[{i}]` must be an object with a string `role`", param="messages")
            content = m.get("content")
            if type(content) is not str and type(content) is not list:
                raise bad_request(f"`messages[{i}].content` must be a string or a list of content blocks",
                                  param="messages")
        system = data.get("system")
        if system is not None and type(system) is not str and type(system) is not list:
            raise bad_request("`system` must be a string or a list of content blocks", param="system")
        _check_list_of_objects(data, "tools")
        return InferenceRequest(path, model, stream, NO_PROMPT, extras, None, RENDER_PATHS[MESSAGES])
    value = data.get("input")
    if value is None:
        raise bad_request("`input` is required", param="input")
    if type(value) is not str and type(value) is not list:
        raise bad_request("`input` must be a string or a list of input items", param="input")
    if type(value) is list and not all(type(v) is dict for v in value):
        raise bad_request("`input` items must be objects", param="input")
    for field in ("instructions", "previous_response_id"):
        v = data.get(field)
        if v is not None and type(v) is not str:
            raise bad_request(f"`{field}` must be a string", param=field)
    store = data.get("store")
    if store is not None and store is not True and store is not False:
        raise bad_request("`store` must be true or false", param="store")
    _check_list_of_objects(data, "tools")
    previous = data.get("previous_response_id")
    if previous is not None:
        if data.get("previous_input_messages") is not None:
            raise bad_request("Only one of `previous_input_messages` and `previous_response_id` can be set.",
                              param="previous_response_id")
        return InferenceRequest(path, model, stream, NO_PROMPT, extras, None, None, previous)
    return InferenceRequest(path, model, stream, NO_PROMPT, extras, None, RENDER_PATHS[RESPONSES])


def _check_list_of_objects(data: dict[str, Any], field: str) -> None:
    value = data.get(field)
    if value is not None and not (type(value) is list and all(type(t) is dict for t in value)):
        raise bad_request(f"`{field}` must be a list of objects", param=field)


def _check_salt(salt: Any) -> None:
    """vLLM's validation of `cache_salt`: a non-empty string of at most 128 characters without '@', '/', '\\'
    or NUL; its messages on failure."""
    if type(salt) is not str or not salt:
        raise bad_request(_SALT_NOT_STRING, param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise bad_request(_SALT_BAD, param="cache_salt")


def media_extras(salt: str | None, parts: tuple[MediaPart, ...], rendered: Rendered) -> BlockExtras | None:
    """The block extras of a chat with media parts, from the engine's render of it: each item's identifier is the
    engine's hash; an item the engine gave none for takes its part's uuid (paired by modality and order, when the
    engine found as many items of that modality as the request has parts); an item with neither makes the whole
    request opaque. None when neither a salt nor a media item is left (the engine found no media)."""
    uuids: dict[str, list[str | None]] = {}
    for p in parts:
        uuids.setdefault(p.modality, []).append(p.uuid)
    found: dict[str, int] = {}
    for m in rendered.media:
        found[m.modality] = found.get(m.modality, 0) + 1
    seen: dict[str, int] = {}
    items = []
    for m in rendered.media:
        i = seen.get(m.modality, 0)
        seen[m.modality] = i + 1
        identifier = m.identifier
        if identifier is None:
            given = uuids.get(m.modality)
            if given is not None and len(given) == found[m.modality]:
                identifier = given[i]
            if identifier is None:
                return BlockExtras(cache_salt=salt, opaque=True)
        items.append(MediaItem(identifier, m.offset, m.length))
    if not items and salt is None:
        return None
    return BlockExtras(cache_salt=salt, media=tuple(items))


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    for t in value:
        # bool is an int subclass: refuse it explicitly.
        if type(t) is not int:
            raise bad_request(f"`{param}` must be a list of integer token ids", param=param)
        if t < 0 or t > MAX_TOKEN_ID:
            raise bad_request(f"`{param}` holds token id {t}, outside 0..{MAX_TOKEN_ID}", param=param,
                              code="token_id_out_of_range")
    return tuple(value)


def _completion_item(data: dict[str, Any], embeds: bool = False) -> PromptInput:
    prompt = data.get("prompt")
    add_special = data.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad_request("`add_special_tokens` must be true or false", param="add_special_tokens")
    if embeds and (prompt is None or prompt == "" or prompt == []):
        return PromptInput(token_ids=())  # embeddings alone: no token the router can read
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


def _chat_item(data: dict[str, Any]) -> tuple[ChatInput, list[MediaPart] | None]:
    """The chat's ChatInput, and its media parts (None: none; _OPAQUE_MEDIA: a part kvgate cannot key)."""
    # The values come from json.loads: exact dicts, lists, strs, ints, floats and bools, so `type(x) is`
    # tells what isinstance would (bool apart, which is tested as True or False).
    messages = data.get("messages")
    if messages is None:
        raise bad_request("`messages` is required", param="messages")
    if type(messages) is not list or not messages:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    media: list[MediaPart] | None = None
    for m in messages:
        if type(m) is not dict or type(m.get("role")) is not str:
            _check_messages(messages)
        content = m.get("content")
        if content is not None and type(content) is not str:
            if type(content) is not list:
                _check_messages(messages)
            if media is _OPAQUE_MEDIA:
                continue  # the other messages are still checked
            for part in content:
                if type(part) is dict and part.get("type") in _TEXT_PARTS or type(part) is str:
                    continue
                media = _media_part(part, media, data)
                if media is _OPAQUE_MEDIA:
                    break
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
    return ChatInput(tuple(messages), tuple(tools) if tools else None, template, kwargs, generation, final), media


# A chat with a part whose extra keys kvgate cannot know (prompt embeddings, a kind it does not know).
_OPAQUE_MEDIA: list[MediaPart] = []


def _media_part(part: Any, media: list[MediaPart] | None, data: dict[str, Any]) -> list[MediaPart] | None:
    """`media` with the non-text content part `part` added as a MediaPart; _OPAQUE_MEDIA for a part kvgate cannot
    key (embeddings, a kind it does not know: the engine may refuse it, but if it does not, its blocks carry keys
    kvgate cannot compute)."""
    kind = part.get("type") if type(part) is dict else None
    if kind is None and type(part) is dict:  # vLLM infers a part's kind from its keys
        if "text" in part:
            return media
        kind = next((k for k in _MEDIA_MODALITY if k in part), None)
    modality = _MEDIA_MODALITY.get(kind) if type(kind) is str else None
    if modality is None:
        return _OPAQUE_MEDIA
    uuid = part.get("uuid")
    if type(uuid) is not str or not uuid or data.get("mm_processor_kwargs"):
        uuid = None  # with processor kwargs vLLM hashes the uuid together with them: only the engine knows
    if media is None:
        media = []
    media.append(MediaPart(modality, uuid))
    return media


def _check_messages(messages: list[Any]) -> None:
    """Raise the error of the first message that is not an object with a string `role` and a string,
    list or null `content` (the check above, again, to name the message)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"`messages[{i}]` must be an object with a string `role`", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"`messages[{i}].content` must be a string or a list of parts", param="messages")
