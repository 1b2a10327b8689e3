"""A `transformers` tokenizer loaded from a local directory, tokenizing as vLLM does.

Chat requests are rendered to text with the tokenizer's chat template, from the
conversation, tools and keyword arguments vLLM builds (tokenizer.vllm_chat), and
that text is tokenized without added special tokens, the way vLLM's chat and
/tokenize endpoints do it. The simulated engine's /tokenize uses this class, so
the gateway and the engine agree token for token.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizer import vllm_chat
from tokenizer.types import ChatInput, PromptInput, TokenizeInput, TokenizerError
from tokenizer.wordcache import NotFast, WordCachedEncoder

log = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 8192
# How many times more characters the word-cached encoder takes in the time the tokenizer takes (measured
# 4-7x on a new 3,100-character chat prompt, on three tokenizers): scales the size that leaves the event loop.
_FAST_SCALE = 6


class LocalTokenizer:
    """Synchronous tokenization with one local tokenizer; safe to call from several threads."""

    def __init__(self, hf_tokenizer: Any, *, source: str = "", fast: bool = True) -> None:
        """`fast`: encode ASCII text with tokenizer.wordcache where it reproduces this tokenizer exactly (checked
        at load); False keeps every call on the tokenizer itself (the simulated engine, the reference)."""
        self._tok = hf_tokenizer
        self.source = source
        # Fast tokenizers may mutate their Rust state while encoding (truncation/padding), so calls are serialised.
        self._lock = threading.Lock()
        self._fast: WordCachedEncoder | None = None
        if fast:
            try:
                self._fast = WordCachedEncoder.from_local(hf_tokenizer)
            except NotFast as e:
                log.info("tokenizer %s: every text through the tokenizer itself (no word cache: %s)", source or "", e)

    @property
    def word_cached(self) -> bool:
        """Whether ASCII text is encoded by the word-cached encoder (tokenizer.wordcache)."""
        return self._fast is not None

    @classmethod
    def from_path(cls, path: str | Path, *, fast: bool = True) -> LocalTokenizer:
        """Load from a local directory (tokenizer.json, tokenizer_config.json); never touches a hub."""
        from transformers import AutoTokenizer

        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(f"tokenizer path {str(directory)!r} is not a directory")
        try:
            tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # transformers raises many types for unusable files
            raise ValueError(f"cannot load a tokenizer from {str(directory)!r}: {e}") from e
        if not getattr(tok, "is_fast", False):
            raise ValueError(f"tokenizer at {str(directory)!r} is not a fast (tokenizer.json) tokenizer")
        return cls(tok, source=str(directory), fast=fast)

    @property
    def hf(self) -> Any:
        """The underlying transformers tokenizer (read-only use)."""
        return self._tok

    @property
    def max_model_len(self) -> int:
        n = getattr(self._tok, "model_max_length", None)
        return n if isinstance(n, int) and 0 < n < 10**9 else _DEFAULT_MAX_MODEL_LEN

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        if self._fast is not None:
            ids = self._fast.encode(text, add_special_tokens)
            if ids is not None:
                return ids
        try:
            with self._lock:
                return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception as e:  # e.g. lone surrogates, which the Rust tokenizer cannot take
            raise ValueError(f"cannot encode the text: {type(e).__name__}: {e}") from e

    def render_chat(self, item: ChatInput) -> str:
        """The chat template applied to `item` as vLLM applies it: the text vLLM would tokenize (see
        tokenizer.vllm_chat for the conversation, tools and keyword arguments it builds). Raises ValueError
        on input the template or these rules refuse (ChatRefused for media parts and bad shapes)."""
        tools = vllm_chat.tool_dicts(item.tools)
        kwargs = vllm_chat.template_kwargs(tools, item.chat_template_kwargs, item.add_generation_prompt,
                                           item.continue_final_message)
        template = self.template(item.chat_template, tools)
        messages = vllm_chat.conversation(item.messages, vllm_chat.content_format(template))
        try:
            with self._lock:
                text = self._tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
        except Exception as e:  # jinja2 errors, templates calling raise_exception, bad kwargs, ...
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ValueError("chat template did not render to a string")
        return text

    def template(self, requested: str | None, tools: list | None = None) -> str:
        """The template vLLM would use: the request's own, else the tokenizer's (its `tool_use` one when
        tools are given and it has named templates)."""
        if requested is not None:
            if not isinstance(requested, str):
                raise ValueError("chat_template must be a string")
            return requested
        try:
            return self._tok.get_chat_template(None, tools=tools)
        except Exception as e:  # no template in the files
            raise ValueError(f"no chat template: {e}") from e

    def encode_chat(self, item: ChatInput) -> list[int]:
        return self.encode_prompt(self.render_chat(item), add_special_tokens=False)

    def inline(self, item: TokenizeInput, offload_chars: int) -> bool:
        """Whether to encode `item` on the calling thread: smaller than `offload_chars` characters, or than
        _FAST_SCALE times that for ASCII text the word cache encodes (about the same time)."""
        size, ascii_ = _size_and_ascii(item)
        return size < (offload_chars * _FAST_SCALE if ascii_ and self._fast is not None else offload_chars)

    def encode(self, item: TokenizeInput) -> list[int]:
        """Either kind of input; ids given directly are returned as they are."""
        if isinstance(item, ChatInput):
            return self.encode_chat(item)
        if item.token_ids is not None:
            return list(item.token_ids)
        if item.text is None:
            raise ValueError("prompt has neither text nor token ids")
        return self.encode_prompt(item.text, item.add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        with self._lock:
            return list(self._tok.convert_ids_to_tokens(list(ids)))


def _size_and_ascii(item: TokenizeInput) -> tuple[int, bool]:
    """Rough size in characters, and whether the text is ASCII (message contents and prompt; tools and
    other fields are counted by their JSON, ASCII by construction)."""
    if isinstance(item, PromptInput):
        text = item.text or ""
        return len(text), text.isascii()
    size, ascii_ = 0, True
    try:
        for message in item.messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                size += len(content) + 16
                ascii_ = ascii_ and content.isascii()
            else:
                size += len(json.dumps(message, default=str))
                ascii_ = False  # parts, tool calls: not looked into
        if item.tools:
            size += len(json.dumps(item.tools, default=str))
    except (TypeError, ValueError):
        return 0, False
    return size, ascii_


class LocalBackend:
    """The Tokenizer protocol over LocalTokenizers, one per model (or `default` for every other
    model); inputs of at least `offload_chars` characters run off the event loop."""

    def __init__(
        self,
        tokenizers: Mapping[str, LocalTokenizer] | None = None,
        *,
        default: LocalTokenizer | None = None,
        offload_chars: int = 2048,
    ) -> None:
        self._tokenizers = dict(tokenizers or {})
        self._default = default
        self._offload_chars = offload_chars

    def get(self, model: str) -> LocalTokenizer | None:
        return self._tokenizers.get(model, self._default)

    async def tokenize(self, model: str, item: TokenizeInput, *, base_url: str | None = None) -> list[int]:
        tok = self.get(model)
        if tok is None:
            raise TokenizerError(f"no local tokenizer configured for model {model!r}")
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return list(item.token_ids)
        try:
            if tok.inline(item, self._offload_chars):
                return tok.encode(item)
            return await asyncio.to_thread(tok.encode, item)
        except ValueError as e:
            raise TokenizerError(f"cannot tokenize for model {model!r}: {e}") from e

    async def aclose(self) -> None:
        return None
