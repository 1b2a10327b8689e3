"""A second, independent way to tokenize a chat request as vLLM does, for the exactness tests.

Written apart from tokenizer.vllm_chat and tokenizer.local, from the same facts: vLLM's conversation rules
(only role, content, tool calls with parsed arguments, reasoning, tool_call_id, name; text parts joined
with newlines; tools as pydantic dumps with null for unset fields; the request's own add_generation_prompt
and continue_final_message over chat_template_kwargs), transformers' documented template environment
(a sandboxed jinja2 environment with trim_blocks, lstrip_blocks and loop controls, its own `tojson`,
`raise_exception` and `strftime_now`, the tokenizer's special tokens as variables, null-valued message
keys dropped, reasoning copied to `reasoning_content` and `thinking`, a continued final message cut at a
marker), and the `tokenizers` library's encoder on tokenizer.json (not transformers).
Text content only; the corpus in test_tokenizer_exact.py stays within it.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from tokenizer.types import ChatInput, PromptInput, TokenizeInput

_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


class Reference:
    def __init__(self, directory: Path) -> None:
        self.config = json.loads((Path(directory) / "tokenizer_config.json").read_text())
        self.encoder = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.env = env
        self._compiled: dict[str, jinja2.Template] = {}

    def specials(self) -> dict[str, str]:
        out = {}
        for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            value = self.config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
        return out

    def render(self, item: ChatInput) -> str:
        template = item.chat_template or self.config["chat_template"]
        openai = re.search(r"\{%-?\s*for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)", template) is not None
        messages = [_message(m, openai) for m in item.messages]
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        for i, m in enumerate(messages):
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                messages[i] = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        tools = None if item.tools is None else [_tool(t) for t in item.tools]
        kwargs = {"tools": tools} if tools is not None else {}
        kwargs.update((k, v) for k, v in (item.chat_template_kwargs or {}).items() if v is not None and v != "auto")
        kwargs["add_generation_prompt"] = item.add_generation_prompt
        tools = kwargs.pop("tools", None)
        generation = kwargs.pop("add_generation_prompt")
        kwargs.pop("continue_final_message", None)
        final = None
        if item.continue_final_message:
            final = messages[-1]["content"]
            messages[-1] = {**messages[-1], "content": final + _MARK}
        if template not in self._compiled:
            self._compiled[template] = self.env.from_string(template)
        text = self._compiled[template].render(messages=messages, tools=tools, documents=None,
                                                      add_generation_prompt=generation,
                                                      **{**self.specials(), **kwargs})
        if final is not None:
            at = text.rindex(_MARK.strip())
            text = text[:at] if text[at:at + len(_MARK)] == _MARK else text[:at].rstrip()
        return text

    def encode(self, item: TokenizeInput) -> list[int]:
        if isinstance(item, PromptInput):
            return self.encoder.encode(item.text, add_special_tokens=item.add_special_tokens).ids
        return self.encoder.encode(self.render(item), add_special_tokens=False).ids


def _message(m: dict[str, Any], openai: bool) -> dict[str, Any]:
    content = m.get("content")
    if content is None:
        texts = []
    elif isinstance(content, str):
        texts = [content]
    else:
        texts = [p if isinstance(p, str) else p["text"] for p in content]
    out: dict[str, Any] = {"role": m["role"],
                           "content": [{"type": "text", "text": t} for t in texts] if openai else "\n".join(texts)}
    if m["role"] == "assistant":
        if m.get("tool_calls"):  # validated as OpenAI's TypedDict: id, function {arguments, name}, type
            calls = []
            for call in m["tool_calls"]:
                try:
                    arguments = json.loads(call["function"]["arguments"])
                except ValueError:
                    arguments = {}
                calls.append({"id": call["id"], "function": {"arguments": arguments, "name": call["function"]["name"]},
                              "type": call["type"]})
            out["tool_calls"] = calls
        if m.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = m["reasoning"]
    if m["role"] == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        out["content"] = "\n".join(texts)
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _tool(t: dict[str, Any]) -> dict[str, Any]:
    f = t["function"]
    fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters"),
          **{k: v for k, v in f.items() if k not in ("name", "description", "parameters")}}
    return {"type": t.get("type", "function"), "function": fn, **{k: v for k, v in t.items() if k not in ("type", "function")}}
