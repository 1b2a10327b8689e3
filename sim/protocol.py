"""vLLM's OpenAI-compatible request and response shapes, as the simulated engine
speaks them: parsing with clear 400s, and the JSON bodies and SSE chunks.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.blockkeys import MediaItem
from tokenizer.types import ChatInput, PromptInput

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


class ApiError(Exception):
    """A request the engine refuses; rendered in vLLM's OpenAI error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type_ = type_  # None: by the status, as vLLM's create_error_response defaults it

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.type_ or _ERROR_TYPES.get(self.status, "BadRequestError"),
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True, slots=True)
class ServedModels:
    base: str
    loras: tuple[str, ...] = ()

    def resolve(self, name: Any) -> str | None:
        """The LoRA adapter `name` selects (None: the base model); 404 for a model not served."""
        if name is None or name == self.base:
            return None
        if isinstance(name, str) and name in self.loras:
            return name
        raise ApiError(404, f"The model `{name}` does not exist.", "model")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: str  # "completion" | "chat"
    model: str  # as the client named it
    lora: str | None
    item: PromptInput | ChatInput
    max_tokens: int | None  # None: the server's default
    stream: bool
    include_usage: bool
    cache_salt: str | None = None
    kv_transfer: dict[str, Any] | None = None  # kv_transfer_params (sim.pd)


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    model: str | None
    lora: str | None
    item: PromptInput | ChatInput
    add_special_tokens: bool
    return_token_strs: bool


def _typed(body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise ApiError(400, f"`{key}` has the wrong type ({type(value).__name__})", key)
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _max_tokens(body: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = _typed(body, key, int, None)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"`{key}` must be at least 1, got {value}", key)
            return value
    return None


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = bool(options and _typed(options, "include_usage", bool, False))
    n = _typed(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, "the simulated engine generates one choice per request (n=1)", "n")
    return stream, include_usage


_SALT_FORBIDDEN = frozenset("@/\\\0")
_SALT_MAX_CHARS = 128


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's validate_cache_salt (vllm/entrypoints/generate/base/protocol.py, run before field validation on
    the chat and completion request models): absent or null is no salt; anything else must be a non-empty
    string of at most 128 characters without '@', '/', '\\' or NUL."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > _SALT_MAX_CHARS or any(c in _SALT_FORBIDDEN for c in salt):
        raise ApiError(400, "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                            "'@', '/', '\\\\', or NUL.", "cache_salt")
    return salt


def _kv_transfer(body: dict[str, Any]) -> dict[str, Any] | None:
    """`kv_transfer_params`: an object or null/absent (vLLM's `dict[str, Any] | None`); anything else a 400."""
    value = body.get("kv_transfer_params")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"kv_transfer_params: Input should be a valid dictionary (got {type(value).__name__})",
                       "kv_transfer_params")
    return value


def _prompt(value: Any, add_special_tokens: bool) -> PromptInput:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "the prompt must not be empty", "prompt")
        return PromptInput(text=value, add_special_tokens=add_special_tokens)
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return PromptInput(token_ids=tuple(value))
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(400, "the simulated engine takes one prompt per request", "prompt")
    raise ApiError(400, "`prompt` must be a non-empty string or a non-empty list of token ids", "prompt")


def reasoning_kwargs(kwargs: dict[str, Any] | None, effort: Any) -> dict[str, Any] | None:
    """vLLM's build_chat_params: a reasoning effort joins the template kwargs as `reasoning_effort`, and
    `enable_thinking` (effort != "none") unless the request's own kwargs set it."""
    if effort is None:
        return kwargs
    if not isinstance(effort, str):
        raise ApiError(400, "`reasoning_effort` must be a string", "reasoning_effort")
    out = dict(kwargs or {})
    out["reasoning_effort"] = effort  # the request field wins over its kwargs (merge_kwargs)
    out.setdefault("enable_thinking", effort != "none")
    return out



def _chat_input(body: dict[str, Any], generation: bool = False) -> ChatInput:
    """The chat of a body; `generation`: a chat completion's (its `reasoning_effort` joins the template
    kwargs, as vLLM's build_chat_params does; /tokenize has no such field)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "`messages` must be a non-empty list of message objects", "messages")
    tools = _typed(body, "tools", list, None)
    return ChatInput(
        messages=tuple(messages),
        tools=tuple(tools) if tools else None,
        chat_template=_typed(body, "chat_template", str, None),
        chat_template_kwargs=reasoning_kwargs(_typed(body, "chat_template_kwargs", dict, None),
                                              body.get("reasoning_effort") if generation else None),
        add_generation_prompt=_typed(body, "add_generation_prompt", bool, True),
        continue_final_message=_typed(body, "continue_final_message", bool, False),
    )


def parse_completion(body: Any, served: ServedModels) -> GenerationRequest:
    body = _object(body)
    salt = _cache_salt(body)
    lora = served.resolve(body.get("model"))
    if "prompt" not in body:
        raise ApiError(400, "`prompt` is required", "prompt")
    item = _prompt(body["prompt"], _typed(body, "add_special_tokens", bool, True))
    stream, include_usage = _stream(body)
    return GenerationRequest("completion", body.get("model") or served.base, lora, item,
                             _max_tokens(body, "max_tokens"), stream, include_usage, salt, _kv_transfer(body))


def parse_chat(body: Any, served: ServedModels) -> GenerationRequest:
    body = _object(body)
    salt = _cache_salt(body)
    lora = served.resolve(body.get("model"))
    item = _chat_input(body, generation=True)
    stream, include_usage = _stream(body)
    return GenerationRequest("chat", body.get("model") or served.base, lora, item,
                             _max_tokens(body, "max_completion_tokens", "max_tokens"), stream, include_usage, salt,
                             _kv_transfer(body))


def parse_tokenize(body: Any, served: ServedModels) -> TokenizeRequest:
    """vLLM's /tokenize: {"prompt", "add_special_tokens"=true} or {"messages", ..., "add_special_tokens"=false}."""
    body = _object(body)
    lora = served.resolve(body.get("model"))
    return_strs = _typed(body, "return_token_strs", bool, False)
    if "messages" in body:
        add_special = _typed(body, "add_special_tokens", bool, False)
        return TokenizeRequest(body.get("model"), lora, _chat_input(body), add_special, return_strs)
    if "prompt" not in body:
        raise ApiError(400, "either `prompt` or `messages` is required", "prompt")
    add_special = _typed(body, "add_special_tokens", bool, True)
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise ApiError(400, "`prompt` must be a string", "prompt")
    return TokenizeRequest(body.get("model"), lora, PromptInput(text=prompt, add_special_tokens=add_special),
                           add_special, return_strs)


# ---- responses -----------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def full_body(req: GenerationRequest, response_id: str, fingerprint: str, text: str,
              usage_: dict[str, Any]) -> dict[str, Any]:
    if req.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                                  "logprobs": None, "finish_reason": "length", "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                  "prompt_logprobs": None}
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": int(time.time()), "model": req.model,
            "choices": [choice], "usage": usage_, "system_fingerprint": fingerprint}


def chunk(req: GenerationRequest, response_id: str, created: int, fingerprint: str, *, text: str = "",
          first: bool = False, finish: bool = False, usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SSE chunk. With `usage_` only: the final usage chunk (empty choices)."""
    body: dict[str, Any] = {"id": response_id, "created": created, "model": req.model,
                            "system_fingerprint": fingerprint}
    if req.kind == "chat":
        body["object"] = "chat.completion.chunk"
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
    else:
        body["object"] = "text_completion"
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = "length" if finish else None
    choice["stop_reason"] = None
    if usage_ is not None:
        body["choices"] = []
        body["usage"] = usage_
    else:
        body["choices"] = [choice]
    return body


def render_body(request_id: str, model: str, token_ids: list[int], media: Sequence[MediaItem], max_tokens: int,
                cache_salt: str | None, stream: bool = False, include_usage: bool = False) -> dict[str, Any]:
    """One GenerateRequest as vLLM's render endpoints return it (vllm/entrypoints/serve/disagg/protocol.py):
    /v1/chat/completions/render answers one, /v1/completions/render a list of one per prompt. `features`
    is null without media, else per modality the items' hashes and placeholder ranges (`kwargs_data` null:
    the sim has no tensors, as vLLM's metadata-only answer). `sampling_params` is a subset of vLLM's dump."""
    features = None
    if media:
        features = {"mm_hashes": {"image": [m.identifier for m in media]},
                    "mm_placeholders": {"image": [{"offset": m.offset, "length": m.length} for m in media]},
                    "kwargs_data": None}
    sampling: dict[str, Any] = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [],
                "stop_token_ids": [], "max_tokens": max_tokens, "min_tokens": 0}
    return {"request_id": request_id, "token_ids": token_ids, "features": features, "sampling_params": sampling,
            "model": model, "stream": stream,
            "stream_options": {"include_usage": include_usage, "continuous_usage_stats": False} if stream else None,
            "cache_salt": cache_salt, "priority": 0,
            "kv_transfer_params": None}
