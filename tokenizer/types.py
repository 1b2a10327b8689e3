"""What to tokenize: a completion prompt or a chat request, as the engine receives it."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol, Union, runtime_checkable


@dataclass(frozen=True, slots=True)
class PromptInput:
    """A /v1/completions prompt: text to tokenize, or token ids given directly."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    add_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class ChatInput:
    """A /v1/chat/completions request's tokenization-relevant fields."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


TokenizeInput = Union[PromptInput, ChatInput]


@dataclass(frozen=True, slots=True)
class RenderedMedia:
    """One media item of a rendered prompt, as the engine processed it: its `modality` ("image", "audio", ...),
    the engine's hash of it (`identifier`; None when the engine gave none), and the placeholder tokens it fills,
    prompt positions [offset, offset + length)."""

    modality: str
    identifier: str | None
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Rendered:
    """The engine's rendering of a chat request (vLLM's /v1/chat/completions/render): the prompt's token ids and
    its media items in prompt order (by offset)."""

    token_ids: list[int]
    media: tuple[RenderedMedia, ...] = ()


class TokenizerError(Exception):
    """Tokenization failed (backend down, slow or refused); routing falls back to load only. `status`: the HTTP
    status of an engine's refusal (None for any other failure)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TokenizerTimeout(TokenizerError):
    """Tokenization gave up for want of time: its backend did not answer within the budget (counted as a timeout,
    like the caller's own deadline)."""


class Tokenizer(Protocol):
    async def tokenize(self, model: str, item: TokenizeInput, *, base_url: str | None = None) -> list[int]:
        """Token ids the engine serving `model` would see for `item`.

        `base_url` is a ready engine of that model, for backends that ask the engine.
        Raises TokenizerError on any failure.
        """
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class TokenizesNow(Protocol):
    """A tokenizer that can also answer without a wait: `tokenize_now` gives the ids when it can compute them
    on the calling thread (a cached request, a local encode), or None when it would have to wait (then the
    caller awaits `tokenize`). CachedTokenizer, LocalBackend and VerifiedTokenizer are such tokenizers."""

    def tokenize_now(self, model: str, item: TokenizeInput, *,
                     base_url: str | None = None) -> Sequence[int] | None: ...
