"""A `transformers` tokenizer loaded from a local directory, tokenizing as vLLM does.

Chat requests are rendered to text with the tokenizer's chat template, from the
conversation, tools and keyword arguments vLLM builds (tokenizer.vllm_chat), and
that text is tokenized without added special tokens, the way vLLM's chat and
/tokenize endpoints do it. The simulated engine's /tokenize uses this class, so
the gateway and the engine agree token for token.

Plain chats (string contents, no tools, no continued final message, scalar template
keyword arguments) are rendered by `DirectRender`: transformers' own compiled template
run with exactly the variables `apply_chat_template` gives it, without the copies and
checks that change nothing for such input (about half of the render's time). Anything
else, and any error, goes through `apply_chat_template` itself.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
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
        self._direct: DirectRender | None = None
        if fast:
            try:
                self._fast = WordCachedEncoder.from_local(hf_tokenizer)
            except NotFast as e:
                log.info("tokenizer %s: every text through the tokenizer itself (no word cache: %s)", source or "", e)
            self._direct = DirectRender.for_tokenizer(self, source)

    @property
    def word_cached(self) -> bool:
        """Whether ASCII text is encoded by the word-cached encoder (tokenizer.wordcache)."""
        return self._fast is not None

    @classmethod
    def from_path(cls, path: str | Path, *, fast: bool = True) -> LocalTokenizer:
        """Load from a local directory (tokenizer.json, tokenizer_config.json); never touches a hub."""
        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(f"tokenizer path {str(directory)!r} is not a directory")
        try:
            tok = _load_hf(directory)
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

    @property
    def renders_directly(self) -> bool:
        """Whether plain chats are rendered by DirectRender (else every chat through apply_chat_template)."""
        return self._direct is not None

    def render_chat(self, item: ChatInput) -> str:
        """The chat template applied to `item` as vLLM applies it: the text vLLM would tokenize (see
        tokenizer.vllm_chat for the conversation, tools and keyword arguments it builds). Raises ValueError
        on input the template or these rules refuse (ChatRefused for media parts and bad shapes)."""
        tools = vllm_chat.tool_dicts(item.tools)
        kwargs = vllm_chat.template_kwargs(tools, item.chat_template_kwargs, item.add_generation_prompt,
                                           item.continue_final_message)
        template = self.template(item.chat_template, tools)
        messages = vllm_chat.conversation(item.messages, vllm_chat.content_format(template))
        if self._direct is not None:
            text = self._direct.render(template, messages, kwargs)
            if text is not None:
                return text
        return self.apply_template(template, messages, kwargs)

    def apply_template(self, template: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        """`template` rendered by transformers' apply_chat_template (tokenize=False); ValueError when it fails."""
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


# Message keys whose values apply_chat_template copies under other names (its reasoning aliases).
_REASONING_KEYS = frozenset(("reasoning_content", "thinking", "reasoning"))
_SCALARS = (str, int, float, bool)
_MAX_TEMPLATES = 32  # compiled templates (with their flattened globals) kept per tokenizer
_MAX_SAFE_ANSWERS = 4096  # (type, attribute) pairs whose sandbox check is remembered


class DirectRender:
    """A plain chat rendered as transformers' `apply_chat_template(..., tokenize=False)` renders it, without
    its per-call work that changes nothing for plain input.

    What apply_chat_template does (transformers 5, read from its source), and why each step is the identity
    here: it resolves the template again (get_chat_template, called here too); converts message objects to
    dicts and drops None values (the messages are vllm_chat's fresh dicts of strings); rebuilds everything
    the template sees from plain JSON types (already plain: strings and scalars only); copies reasoning under
    its aliases (no reasoning keys); marks a continued final message (not set); then renders its compiled
    template (`_compile_jinja_template`, the same object used here) with messages, tools=None,
    documents=None, add_generation_prompt and the special tokens map updated by the keyword arguments.
    jinja's Template.render merges the template's globals (a ChainMap, read key by key in Python) into that
    dict; here the globals are flattened once per template and the same context is built from the merged dict.
    `render` returns None for any other input, and on any error (apply_chat_template then gives the text or
    the error as it always did). At load, the tokenizer's own template is rendered both ways on a few plain
    chats; a difference and this is not used."""

    def __init__(self, hf: Any, compile_template: Callable[[str], Any], consumed: frozenset[str]) -> None:
        self._hf = hf
        self._compile = compile_template
        self._consumed = consumed  # keyword names apply_chat_template takes itself (never template variables)
        self._templates: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._special: dict[str, Any] | None = None  # the tokenizer's special tokens map, read once

    @classmethod
    def for_tokenizer(cls, local: LocalTokenizer, source: str = "") -> DirectRender | None:
        """None when transformers has no compiled-template function as read, or the self-check differs."""
        try:
            from transformers.utils import chat_template_utils as ctu

            compile_template = ctu._compile_jinja_template
            consumed = {"messages", "self"}
            for fn in (type(local.hf).apply_chat_template, ctu.render_jinja_template):
                consumed.update(inspect.signature(fn).parameters)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            log.info("tokenizer %s: every chat through apply_chat_template (%s)", source, e)
            return None
        direct = cls(local.hf, compile_template, frozenset(consumed))
        try:
            template = local.template(None)
        except ValueError:
            return direct  # no template of its own: requests' templates, checked by nothing but the tests
        for messages, kwargs in _self_check_chats():
            mine = direct.render(template, [dict(m) for m in messages], dict(kwargs))
            if mine is None:
                continue
            try:
                theirs = local.apply_template(template, [dict(m) for m in messages], dict(kwargs))
            except ValueError:
                theirs = None
            if mine != theirs:
                log.warning("tokenizer %s: its chat template renders otherwise than apply_chat_template when "
                            "rendered directly; every chat through apply_chat_template", source)
                return None
        return direct

    def render(self, template: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str | None:
        """The text, or None: not a plain chat, or the template failed."""
        if not messages or kwargs.get("continue_final_message") is not False or "tools" in kwargs:
            return None
        for message in messages:
            for key, value in message.items():
                if type(value) is not str or key in _REASONING_KEYS:
                    return None
        generation = kwargs["add_generation_prompt"]
        extra = {k: v for k, v in kwargs.items() if k != "add_generation_prompt" and k != "continue_final_message"}
        for key, value in extra.items():
            if type(value) not in _SCALARS or key in self._consumed:
                return None
        try:
            template = self._hf.get_chat_template(template, None)
            compiled, flat_globals = self._compiled(template)
            variables = dict(flat_globals)
            variables.update(messages=messages, tools=None, documents=None, add_generation_prompt=generation)
            special = self._special
            if special is None:  # transformers builds this map afresh at each read; nothing here changes it
                special = self._special = dict(self._hf.special_tokens_map)
            variables.update(special)
            variables.update(extra)
            # Template.new_context(variables, shared=True), with the flattened globals standing for the ChainMap
            # (Context only takes the set of their names from it, iterated in Python for a ChainMap).
            env = compiled.environment
            context = env.context_class(env, variables, compiled.name, compiled.blocks, globals=flat_globals)
            text = env.concat(compiled.root_render_func(context))
        except Exception:  # apply_chat_template raises its own error for it
            return None
        return text if isinstance(text, str) else None

    def _compiled(self, template: str) -> tuple[Any, dict[str, Any]]:
        hit = self._templates.get(template)
        if hit is None:
            compiled = _with_remembered_checks(self._compile(template), template)
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.clear()
            hit = self._templates[template] = (compiled, dict(compiled.globals))
        return hit


def _with_remembered_checks(compiled: Any, template: str) -> Any:
    """`compiled` (transformers' template) compiled again in an overlay of its environment (jinja's copy of
    its configuration: options, filters, globals, extensions) whose sandbox remembers which attributes are
    safe per (type, name); `compiled` itself when its environment is not jinja's ImmutableSandboxedEnvironment
    as it ships. jinja's answer depends on nothing else: underscores, a type's internal attributes
    (is_internal_attribute) and the mutating methods of list, dict, set and deque (modifies_known_mutable), all
    read from the name and isinstance checks of the object's type. Reading them costs a third of the render of
    Qwen3's template, asked a dozen times per chat."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = compiled.environment
    if type(env) is not ImmutableSandboxedEnvironment or "is_safe_attribute" in vars(env):
        return compiled
    overlay = env.overlay()
    overlay.__class__ = _rememberer()
    return overlay.from_string(template)


@functools.lru_cache(maxsize=None)
def _rememberer() -> type:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self: Any, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        answer = safe.get(key)
        if answer is None:
            answer = ImmutableSandboxedEnvironment.is_safe_attribute(self, obj, attr, value)
            if len(safe) >= _MAX_SAFE_ANSWERS:
                safe.clear()
            safe[key] = answer
        return answer

    return type("RememberingSandbox", (ImmutableSandboxedEnvironment,), {"is_safe_attribute": is_safe_attribute})


def _self_check_chats() -> list[tuple[list[dict[str, str]], dict[str, Any]]]:
    system = {"role": "system", "content": "You are a helpful assistant."}
    user = {"role": "user", "content": "What is 2+2? Answer briefly.\n\nThanks!"}
    answer = {"role": "assistant", "content": "4."}
    again = {"role": "user", "content": "  And 3+3?  "}
    plain = {"add_generation_prompt": True, "continue_final_message": False}
    return [([user], plain), ([system, user], plain), ([system, user, answer, again], plain),
            ([system, user, answer], {**plain, "add_generation_prompt": False}),
            ([user], {"enable_thinking": False, **plain}), ([{**user, "name": "ann"}], plain)]


# tokenizer_config.json classes AutoTokenizer resolves to transformers' generic fast tokenizer where no model config
# says otherwise (transformers 5: PreTrainedTokenizerFast is TokenizersBackend).
_GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _load_hf(directory: Path) -> Any:
    """transformers' AutoTokenizer on `directory`, or, where AutoTokenizer can only pick the generic fast class, that
    class without importing AutoTokenizer (its import costs ~0.9 s of CPU more at every start-up of kvgate and of
    the simulated engine): a directory with no model config (config.json, whose model type AutoTokenizer consults)
    whose tokenizer_config.json names a generic class and no custom code (auto_map). Anything else goes through
    AutoTokenizer. tests/tokenizer/test_tokenizer_local.py holds the two to the same tokenizer."""
    if not (directory / "config.json").exists():
        try:
            declared = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            declared = None
        if (isinstance(declared, dict) and declared.get("tokenizer_class") in _GENERIC_CLASSES
                and "auto_map" not in declared):
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


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
        ids = self.tokenize_now(model, item)
        if ids is not None:
            return ids
        tok = self.get(model)
        if tok is None:
            raise TokenizerError(f"no local tokenizer configured for model {model!r}")
        try:
            return await asyncio.to_thread(tok.encode, item)
        except ValueError as e:
            raise TokenizerError(f"cannot tokenize for model {model!r}: {e}") from e

    def tokenize_now(self, model: str, item: TokenizeInput, *, base_url: str | None = None) -> list[int] | None:
        """`tokenize`'s answer when it is encoded on the calling thread (an input below `offload_chars`);
        None when `tokenize` would wait (a worker thread, or no tokenizer for the model: it raises)."""
        tok = self.get(model)
        if tok is None:
            return None
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return list(item.token_ids)
        try:
            return tok.encode(item) if tok.inline(item, self._offload_chars) else None
        except ValueError as e:
            raise TokenizerError(f"cannot tokenize for model {model!r}: {e}") from e

    async def aclose(self) -> None:
        return None
