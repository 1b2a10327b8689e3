"""What vLLM hands a chat template: the conversation, the tools and the template's keyword arguments.

vLLM does not render the request's messages as they arrive. Its chat path (the OpenAI chat endpoint and
`/tokenize` alike) first rebuilds each message, then calls the tokenizer's `apply_chat_template` with
`tokenize=False` and tokenizes the text with `add_special_tokens=False`. The rules followed here, as read
from vLLM's chat_utils, renderers/hf.py, renderers/params.py and the tokenize protocol (recent releases):

- Messages. Each becomes {role, content} plus, when present: `tool_calls` (assistant, when not null),
  `reasoning` and `reasoning_content` (assistant, from `reasoning`), `tool_call_id` (tool), `name` (a
  string), `task` (a string) and `tools` (developer). Every other field of the message is dropped.
- Content. A string is one text part; null is no part. Text-like parts (`text`, `input_text`,
  `output_text`, `refusal`, `thinking`, or a bare string) are kept, text/refusal parts without text are
  skipped. In the "string" content format the texts are joined with newlines; in the "openai" format
  (chosen when the template loops over a message's content) they stay a list of {"type": "text", "text"}.
  A tool message whose parts are all text becomes their newline join in either format.
  Media parts (images, audio, video, embeddings) need the engine's processor: refused here (ValueError),
  so such requests are left to the engine.
- Tool calls. Validated by vLLM's request model (OpenAI's TypedDict: `id`, `function` {`arguments`, `name`},
  `type`, in that order, other keys dropped; a call missing one is refused). An assistant message's empty
  `tool_calls` list is dropped; each call's `arguments` string is parsed as JSON (unparsable: {}).
- Tools. Each is the dump of vLLM's pydantic model: {"type", "function": {"name", "description",
  "parameters", extra fields...}, extra fields...}, unset fields as null, declared fields first.
- Keyword arguments. {"tools": tools} under the request's `chat_template_kwargs` (values null or "auto"
  dropped), under `add_generation_prompt` and `continue_final_message`: the request's own fields win.
  `chat_template` and `tokenize` inside `chat_template_kwargs` are refused (vLLM refuses the first
  without --trust-request-chat-template; the second changes what the template returns).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")
_MEDIA_PARTS = ("image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds",
                "video_url", "prompt_embeds")
_UNSET = (None, "auto")


class ChatRefused(ValueError):
    """The request has something the local path does not render (media, bad shapes)."""


def conversation(messages: Any, content_format: str = "string") -> list[dict[str, Any]]:
    """vLLM's conversation for `messages` ("string" or "openai" content format)."""
    if not isinstance(messages, (list, tuple)):
        raise ChatRefused("messages must be a list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatRefused(f"messages[{i}] is not an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatRefused(f"messages[{i}].role must be a string")
        texts = _texts(i, message.get("content"))
        msg: dict[str, Any] = {"role": role}
        if content_format == "openai":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None and (parsed := _tool_calls(i, calls)):  # an empty list is dropped
                msg["tool_calls"] = parsed
            if message.get("reasoning") is not None:
                msg["reasoning"] = message["reasoning"]
                msg["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(texts)
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def _texts(index: int, content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, (list, tuple)):
        raise ChatRefused(f"messages[{index}].content must be a string, null or a list of parts")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatRefused(f"messages[{index}].content[{j}] is not a part object")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get("thinking" if kind == "thinking" else ("refusal" if kind == "refusal" else "text"))
            if text is None:
                continue  # vLLM skips a text or refusal part without its text
            if not isinstance(text, str):
                raise ChatRefused(f"messages[{index}].content[{j}]: the text must be a string")
            texts.append(text)
        elif kind in _MEDIA_PARTS or (kind is None and any(k in part for k in _MEDIA_PARTS)):
            raise ChatRefused(f"messages[{index}].content[{j}]: a {kind or 'media'} part needs the engine's "
                              "multimodal processor; it is not tokenized locally")
        else:
            raise ChatRefused(f"messages[{index}].content[{j}]: unsupported part type {kind!r}")
    return texts


def _tool_calls(index: int, calls: Any) -> list[dict[str, Any]]:
    """As vLLM's request model validates them (OpenAI's tool-call TypedDict: `id`, `function` with
    `arguments` and `name`, `type`, in that order, other keys dropped), then with the arguments parsed."""
    if not isinstance(calls, (list, tuple)):
        raise ChatRefused(f"messages[{index}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if (not isinstance(fn, Mapping) or not isinstance(call.get("id"), str) or call.get("type") != "function"
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str)):
            raise ChatRefused(f"messages[{index}].tool_calls[{j}] needs a string id, type \"function\" and a "
                              "function with string name and arguments")
        try:
            arguments = json.loads(fn["arguments"])  # any JSON value, as vLLM assigns it
        except ValueError:
            arguments = {}
        out.append({"id": call["id"], "function": {"arguments": arguments, "name": fn["name"]}, "type": "function"})
    return out


def tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM's pydantic models dump them."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatRefused("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise ChatRefused(f"tools[{i}] needs a function object")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str):
            raise ChatRefused(f"tools[{i}].function.name must be a string")
        if tool.get("type", "function") != "function":
            raise ChatRefused(f"tools[{i}].type must be \"function\"")
        dumped_fn = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        dumped_fn.update((k, v) for k, v in fn.items() if k not in dumped_fn)
        dumped = {"type": "function", "function": dumped_fn}
        dumped.update((k, v) for k, v in tool.items() if k not in dumped)
        out.append(dumped)
    return out


def template_kwargs(tools: list[dict[str, Any]] | None, chat_template_kwargs: Any, add_generation_prompt: bool,
                    continue_final_message: bool) -> dict[str, Any]:
    """The keyword arguments vLLM passes to apply_chat_template (besides conversation and chat_template)."""
    extra = chat_template_kwargs or {}
    if not isinstance(extra, Mapping):
        raise ChatRefused("chat_template_kwargs must be an object")
    for name in ("chat_template", "tokenize"):
        if name in extra:
            raise ChatRefused(f"chat_template_kwargs.{name} is not rendered locally")
    if add_generation_prompt and continue_final_message:
        raise ChatRefused("cannot set both continue_final_message and add_generation_prompt")
    kwargs: dict[str, Any] = {} if tools is None else {"tools": tools}
    kwargs.update((k, v) for k, v in extra.items() if not _unset(v))
    kwargs["add_generation_prompt"] = add_generation_prompt
    kwargs["continue_final_message"] = continue_final_message
    return kwargs


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


@lru_cache(maxsize=64)
def content_format(template: str) -> str:
    """"openai" when the template loops over a message's content (`for part in message['content']`, with
    `messages` and the loop variable followed through plain assignments), else "string"."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes as n
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    try:
        ast = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"

    def base(node: n.Node) -> n.Node:
        # Through filters, tests and slices to the expression they apply to.
        while True:
            if isinstance(node, (n.Filter, n.Test)) and node.node is not None:
                node = node.node
            elif isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
                node = node.node
            else:
                return node

    def is_name(node: n.Node, names: set[str]) -> bool:
        node = base(node)
        return isinstance(node, n.Name) and node.name in names

    def is_content_of(node: n.Node, names: set[str]) -> bool:
        node = base(node)
        if isinstance(node, n.Getattr):
            return node.attr == "content" and is_name(node.node, names)
        if isinstance(node, n.Getitem):
            return isinstance(node.arg, n.Const) and node.arg.value == "content" and is_name(node.node, names)
        return False

    lists = _aliases(ast, {"messages"}, is_name)
    items = {t.name for loop in ast.find_all(n.For) if is_name(loop.iter, lists)
             for t in [loop.target] if isinstance(t, n.Name)}
    items = _aliases(ast, items, is_name)
    return "openai" if any(is_content_of(loop.iter, items) for loop in ast.find_all(n.For)) else "string"


def _aliases(ast: Any, names: set[str], is_name: Any) -> set[str]:
    import jinja2.nodes as n

    names = set(names)
    changed = True
    while changed:
        changed = False
        for assign in ast.find_all(n.Assign):
            if isinstance(assign.target, n.Name) and assign.target.name not in names and is_name(assign.node, names):
                names.add(assign.target.name)
                changed = True
    return names


def _generation_tag_parse(self: Any, parser: Any) -> Any:
    import jinja2.nodes as n

    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return n.Scope(body).set_lineno(lineno)


def _make_generation_tag() -> type:
    import jinja2.ext

    return type("_GenerationTag", (jinja2.ext.Extension,), {"tags": {"generation"}, "parse": _generation_tag_parse})


_GenerationTag = _make_generation_tag()
