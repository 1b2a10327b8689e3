"""The simulated engine's other prompt-bearing APIs, as vLLM 0.33 serves them: the Responses API
(`/v1/responses`, with its response store and `previous_response_id`), Anthropic's Messages API
(`/v1/messages`), and the pooling endpoints (`/v1/embeddings`, `/pooling`, `/classify`, `/score`,
`/rerank`).

Each generation request becomes a chat (a `ChatInput`) the way vLLM turns it into one, written here from
vLLM's behaviour (vllm/entrypoints/openai/responses/utils.py `construct_input_messages`,
vllm/entrypoints/anthropic/serving.py `to_chat_completion_request`), for the subset of shapes the simulated
engine accepts (text, tools, tool calls and their results); anything else is refused with vLLM's error
shape. The chat is then rendered by the engine's chat template like any chat, so the cache model sees the
tokens the engine would. Errors: the OpenAI shape (sim.protocol.ApiError) on the Responses and pooling
APIs, Anthropic's (`{"type": "error", "error": {"type", "message"}}`) on /v1/messages.
"""
from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sim.protocol import ApiError, GenerationRequest, ServedModels, _cache_salt, _object, _typed, reasoning_kwargs
from tokenizer.types import ChatInput, PromptInput

# ---- Responses API ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    gen: GenerationRequest
    messages: tuple[dict[str, Any], ...]  # the conversation sent to the template (kept by the store)
    previous_response_id: str | None
    store: bool
    instructions: str | None
    tools: list[Any]


class ResponseStore:
    """vLLM's in-memory response store (VLLM_ENABLE_RESPONSES_API_STORE=1), bounded here: response id ->
    the conversation that produced it (without its instructions) and the assistant text it answered."""

    def __init__(self, limit: int = 10000) -> None:
        self._items: OrderedDict[str, tuple[tuple[dict[str, Any], ...], str]] = OrderedDict()
        self._limit = limit

    def get(self, response_id: str) -> tuple[tuple[dict[str, Any], ...], str] | None:
        return self._items.get(response_id)

    def put(self, response_id: str, messages: tuple[dict[str, Any], ...], output: str) -> None:
        self._items[response_id] = (messages, output)
        while len(self._items) > self._limit:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def not_found(response_id: str) -> ApiError:
    """vLLM's answer to an unknown previous_response_id (OpenAIServingResponses._make_not_found_error)."""
    return ApiError(404, f"Response with id '{response_id}' not found.", "response_id", "invalid_request_error")


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}: the simulated engine takes text parts only", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Response input items -> chat messages (function calls merged into the assistant message before)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not isinstance(call["id"], str) or not isinstance(item.get("name"), str) \
                    or not isinstance(item.get("arguments"), str):
                raise ApiError(400, f"input[{i}]: a function_call needs string call_id, name and arguments", "input")
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"input[{i}]: unknown role {role!r}", "input")
            text = _item_text(item.get("content"), f"input[{i}]")
            if role == "assistant" and prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                out.append({"role": role, "content": text})
        else:
            raise ApiError(400, f"Unsupported input item type: {kind}", "input")
    return out


def _response_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, "`tools` must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise ApiError(400, f"tools[{i}]: the simulated engine takes function tools with a name", "tools")
        out.append(tool)
    return out


def parse_responses(body: Any, served: ServedModels, store: ResponseStore | None) -> ResponsesCall:
    """A /v1/responses body -> the chat vLLM renders for it. `store` None: the stateless render endpoint,
    which refuses previous_response_id as vLLM's does; else an unknown previous id is a 404."""
    body = _object(body)
    salt = _cache_salt(body)
    lora = served.resolve(body.get("model"))
    items = body.get("input")
    if isinstance(items, str):
        new = [{"role": "user", "content": items}]
    elif isinstance(items, list):
        new = _input_messages(items)
    else:
        raise ApiError(400, "`input` must be a string or a list of input items", "input")
    instructions = _typed(body, "instructions", str, None)
    previous = _typed(body, "previous_response_id", str, None)
    history: list[dict[str, Any]] = []
    if previous is not None:
        if store is None:
            raise ApiError(400, "previous_response_id is not supported by the stateless render endpoint.",
                           "previous_response_id")
        stored = store.get(previous)
        if stored is None:
            raise not_found(previous)
        kept, output = stored
        history = [m for m in kept if m.get("role") != "system"]
        history.append({"role": "assistant", "content": output})
    conversation = history + new
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if not messages:
        raise ApiError(400, "`input` holds no message", "input")
    tools = _response_tools(body.get("tools"))
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    kwargs = _typed(body, "chat_template_kwargs", dict, None)
    reasoning = _typed(body, "reasoning", dict, None)
    effort = reasoning.get("effort") if reasoning else None
    kwargs = reasoning_kwargs(kwargs, effort)
    item = ChatInput(tuple(messages), tuple(chat_tools) if chat_tools else None, None, kwargs)
    stream = _typed(body, "stream", bool, False)
    max_tokens = _typed(body, "max_output_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"`max_output_tokens` must be at least 1, got {max_tokens}", "max_output_tokens")
    gen = GenerationRequest("responses", body.get("model") or served.base, lora, item, max_tokens, stream, False, salt)
    return ResponsesCall(gen, tuple(conversation), previous, _typed(body, "store", bool, True), instructions, tools)


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def response_body(call: ResponsesCall, response_id: str, text: str, usage: dict[str, Any], max_tokens: int,
                  status: str = "completed") -> dict[str, Any]:
    """vLLM's ResponsesResponse (the fields the OpenAI SDK reads, and the rest at their defaults)."""
    return {
        "id": response_id, "created_at": int(time.time()), "incomplete_details": None,
        "instructions": call.instructions, "metadata": None, "model": call.gen.model, "object": "response",
        "output": [{"id": f"msg_{uuid.uuid4().hex}", "content": [
            {"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
            "role": "assistant", "status": "completed", "type": "message"}] if status == "completed" else [],
        "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto", "tools": call.tools, "top_p": 1.0,
        "background": False, "max_output_tokens": max_tokens, "max_tool_calls": None,
        "previous_response_id": call.previous_response_id, "prompt": None, "reasoning": None,
        "service_tier": "auto", "status": status, "text": None, "top_logprobs": None, "truncation": "disabled",
        "usage": usage if status == "completed" else None, "user": None}


def response_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as vLLM writes them for the Responses and Messages APIs."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# ---- Anthropic Messages API ----------------------------------------------------------------------


class AnthropicError(ApiError):
    """An error in Anthropic's shape (vLLM's translate_error_response)."""

    _TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}

    def body(self) -> dict[str, Any]:
        kind = self._TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def _anthropic(err: ApiError) -> AnthropicError:
    return AnthropicError(err.status, err.message, err.param)


def _blocks_text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise AnthropicError(400, f"{where} must be a string or a list of content blocks")
    out = []
    for b in blocks:
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise AnthropicError(400, f"{where}: expected text blocks")
        if b["text"] and not b["text"].startswith("x-anthropic-billing-header"):
            out.append(b["text"])
    return "".join(out)


def parse_messages(body: Any, served: ServedModels) -> GenerationRequest:
    """An Anthropic /v1/messages body -> the chat vLLM renders for it (AnthropicServingMessages'
    conversion: the system text first, content blocks to parts, tool_use to tool calls, a user's
    tool_result to a tool message, tools' input_schema to function parameters)."""
    try:
        return _parse_messages(_object(body), served)
    except AnthropicError:
        raise
    except ApiError as e:
        raise _anthropic(e) from None


def _parse_messages(body: dict[str, Any], served: ServedModels) -> GenerationRequest:
    lora = served.resolve(body.get("model"))
    if not isinstance(body.get("model"), str):
        raise AnthropicError(400, "model: Field required")
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int:
        raise AnthropicError(400, "max_tokens: Field required (an integer)")
    if max_tokens < 1:
        raise AnthropicError(400, f"max_tokens: must be at least 1, got {max_tokens}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicError(400, "messages: a non-empty list is required")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = _blocks_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise AnthropicError(400, f"messages.{i}: role must be user or assistant")
        role, content = m["role"], m.get("content")
        if role == "system":
            text = _blocks_text(content, f"messages.{i}.content")
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise AnthropicError(400, f"messages.{i}.content must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        thinking: list[str] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise AnthropicError(400, f"messages.{i}.content.{j}.text: a string is required")
                if b["text"]:
                    texts.append(b["text"])
            elif kind == "thinking":
                thinking.append(str(b.get("thinking") or ""))
            elif kind == "redacted_thinking":
                pass
            elif kind == "tool_use":
                calls.append({"id": b.get("id") or "call_0", "type": "function",
                              "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result":
                result = b.get("content")
                if role == "user":
                    text = result if isinstance(result, str) else "\n".join(
                        p.get("text", "") for p in result or [] if isinstance(p, dict) and p.get("type") == "text")
                    out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "", "content": text or ""})
                else:
                    texts.append(f"Tool result: {result if result else ''}")
            else:
                raise AnthropicError(400, f"messages.{i}.content.{j}: the simulated engine takes text, thinking, "
                                          f"tool_use and tool_result blocks, not {kind!r}")
        msg: dict[str, Any] = {"role": role}
        if thinking:
            msg["reasoning"] = "".join(thinking)
        if calls:
            msg["tool_calls"] = calls
        if texts:
            msg["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
        if role == "user" and "content" not in msg:
            continue
        if "content" not in msg and not calls and not thinking:
            continue
        out.append(msg)
    tools = body.get("tools")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise AnthropicError(400, "tools: a list is required")
        chat_tools = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise AnthropicError(400, f"tools.{k}.name: a string is required")
            chat_tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description"), "parameters": t.get("input_schema")}})
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise AnthropicError(400, "stream: a boolean is required")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise AnthropicError(400, "chat_template_kwargs: an object is required")
    effort = None
    thinking_cfg = body.get("thinking")
    if isinstance(thinking_cfg, dict) and thinking_cfg.get("type") == "disabled":
        effort = "none"
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and output_config.get("effort") is not None:
        effort = output_config["effort"]
    kwargs = reasoning_kwargs(kwargs, effort)
    item = ChatInput(tuple(out), tuple(chat_tools) if chat_tools else None, None, kwargs)
    try:
        salt = _cache_salt(body)
    except ApiError as e:
        raise _anthropic(e) from None
    return GenerationRequest("messages", body["model"], lora, item, max_tokens, bool(stream), False, salt)


def message_body(req: GenerationRequest, message_id: str, text: str, prompt: int, completion: int,
                 cached: int) -> dict[str, Any]:
    """vLLM's AnthropicMessagesResponse."""
    return {"id": message_id, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
            "model": req.model, "stop_reason": "max_tokens", "stop_sequence": None,
            "usage": message_usage(prompt, completion, cached)}


def message_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "output_tokens": completion, "cache_creation_input_tokens": None,
            "cache_read_input_tokens": cached}


# ---- pooling -----------------------------------------------------------------------------------

POOLING_PATHS = ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank")


def pooling_inputs(path: str, body: Any, served: ServedModels) -> tuple[str | None, list[PromptInput]]:
    """The texts (or token ids) a pooling request embeds, as (lora, prompts); vLLM's 400s for bad bodies."""
    body = _object(body)
    lora = served.resolve(body.get("model"))
    if path in ("/score", "/rerank"):
        if path == "/rerank":
            query, docs = body.get("query"), body.get("documents")
            if not isinstance(query, str) or not isinstance(docs, list) or not docs \
                    or not all(isinstance(d, str) for d in docs):
                raise ApiError(400, "`query` (a string) and `documents` (a non-empty list of strings) are required",
                               "documents")
            return lora, [PromptInput(text=query + d) for d in docs]
        first, second = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
        firsts = [first] if isinstance(first, str) else first
        seconds = [second] if isinstance(second, str) else second
        if not isinstance(firsts, list) or not isinstance(seconds, list) or not firsts or not seconds \
                or not all(isinstance(t, str) for t in firsts + seconds):
            raise ApiError(400, "`text_1` and `text_2` (strings or lists of strings) are required", "text_1")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        return lora, [PromptInput(text=a + b) for a, b in zip(firsts, seconds)]
    value = body.get("input")
    if isinstance(value, str):
        return lora, [PromptInput(text=value)]
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return lora, [PromptInput(token_ids=tuple(value))]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return lora, [PromptInput(text=t) for t in value]
    raise ApiError(400, "`input` must be a string, a list of strings or a list of token ids", "input")


def vector(tokens: list[int], dims: int = 8) -> list[float]:
    """A deterministic unit-free embedding of a token sequence (the sim has no model)."""
    digest = hashlib.blake2b(json.dumps(tokens).encode(), digest_size=dims).digest()
    return [round(b / 255.0 - 0.5, 6) for b in digest]
