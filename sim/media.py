"""Images in chat messages, as the simulated engine tokenizes them: each image becomes `tokens_per_image`
placeholder tokens in the prompt, and the engine gets a `MediaItem(identifier, offset, length)` per image.

How vLLM does it, and what is simplified here:
- A media content part (`{"type": "image_url", "image_url": {"url": ...}, "uuid": ...}`) becomes the model's
  placeholder string in the message text; in the "string" content format vLLM puts the placeholders of a
  message before its text, joined by newlines ("\\n".join(placeholders + [text]); only those the text does
  not hold itself, more there than images is refused); in the "openai" format the part stays in place for
  the template to render. Here the placeholder string is one special token the sim
  adds to its tokenizer (`PLACEHOLDER`), kept where vLLM keeps it; after tokenization each occurrence is
  expanded to `tokens_per_image` copies of that token's id (vLLM's processor expands it to the model's
  feature size; here the size is fixed).
- The identifier is the part's `uuid` when the client gives one (vLLM uses it as the item's hash), else a
  hash of the model name and the media's bytes, as a hex string (vLLM: blake3 of the model id and the
  decoded media; here sha256, the same length). Nothing is fetched: a `data:` URL's bytes are its decoded
  payload, any other URL's bytes are the URL itself (UTF-8).
- Only images (`image_url`); other media parts are refused with a 400.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvcache.blockkeys import MediaItem
from tokenizer.types import ChatInput

PLACEHOLDER = "<|sim_image|>"
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")
_OTHER_MEDIA = ("input_image", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds", "video_url",
                "prompt_embeds")


class MediaError(ValueError):
    """A media part the simulated engine refuses (the server answers 400)."""


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A prompt as the engine receives it: token ids and the media items whose placeholders they hold."""
    token_ids: list[int]
    media: tuple[MediaItem, ...] = ()


def has_media(item: ChatInput) -> bool:
    return any(_is_media(part) for m in item.messages if isinstance(m.get("content"), (list, tuple))
               for part in m["content"])


def image_identifier(model: str, part: Mapping[str, Any]) -> str:
    """The item's identifier: the part's `uuid`, else the hex hash of the model name and the image's bytes."""
    uuid = part.get("uuid")
    if uuid is not None:
        if not isinstance(uuid, str) or not uuid:
            raise MediaError("a media part's `uuid` must be a non-empty string")
        return uuid
    h = hashlib.sha256()
    h.update(model.encode() + b"\0image\0")
    h.update(_image_bytes(part))
    return h.hexdigest()


def _image_bytes(part: Mapping[str, Any]) -> bytes:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str) or not url:
        raise MediaError("an image_url part needs `image_url.url` (a data: or http(s) URL) or a `uuid`")
    if not url.startswith("data:"):
        return url.encode()
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("a data: URL needs a comma before its payload")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise MediaError(f"the data: URL's base64 payload is invalid: {e}") from e
    return urllib.parse.unquote_to_bytes(payload)


def with_placeholders(item: ChatInput, content_format: str, model: str) -> tuple[ChatInput, list[str]]:
    """`item` with each image part replaced by a PLACEHOLDER text part where vLLM puts the placeholder, and
    the images' identifiers in prompt order."""
    messages, identifiers = [], []
    for message in item.messages:
        content = message.get("content")
        if not isinstance(content, (list, tuple)) or not any(_is_media(p) for p in content):
            messages.append(message)
            continue
        placeholder = {"type": "text", "text": PLACEHOLDER}
        if content_format == "openai":
            parts: list[Any] = []
            for part in content:
                if _is_media(part):
                    identifiers.append(image_identifier(model, part))
                    parts.append(placeholder)
                else:
                    parts.append(part)
        else:  # vLLM: the placeholders the text lacks, then the text, joined by newlines
            media = [p for p in content if _is_media(p)]
            identifiers.extend(image_identifier(model, p) for p in media)
            rest = [p for p in content if not _is_media(p)]
            missing = len(media) - sum(_text(p).count(PLACEHOLDER) for p in rest)
            if missing < 0:
                raise MediaError(f"Found more '{PLACEHOLDER}' placeholders in input prompt than actual multimodal "
                                 "data items.")
            parts = [placeholder] * missing + rest
        messages.append({**message, "content": parts})
    return replace(item, messages=tuple(messages)), identifiers


def expand(token_ids: Sequence[int], placeholder_id: int, identifiers: Sequence[str],
           tokens_per_image: int) -> PromptTokens:
    """Each PLACEHOLDER token of `token_ids` becomes `tokens_per_image` of them, the i-th run the i-th image's."""
    found = sum(1 for t in token_ids if t == placeholder_id)
    if found != len(identifiers):
        raise MediaError(f"the prompt has {found} image placeholders ({PLACEHOLDER}) for {len(identifiers)} "
                         "images: the text must not contain the placeholder itself")
    out: list[int] = []
    media: list[MediaItem] = []
    for t in token_ids:
        if t == placeholder_id:
            media.append(MediaItem(identifiers[len(media)], len(out), tokens_per_image))
            out.extend([placeholder_id] * tokens_per_image)
        else:
            out.append(t)
    return PromptTokens(out, tuple(media))


def _is_media(part: Any) -> bool:
    if not isinstance(part, Mapping):
        return False
    kind = part.get("type")
    if kind == "image_url" or (kind is None and "image_url" in part):
        return True
    if kind in _OTHER_MEDIA or (kind is None and any(k in part for k in _OTHER_MEDIA)):
        raise MediaError(f"the simulated engine takes image_url media parts only, not {kind or 'this part'}")
    return False


def _text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS:
        return ""
    text = part.get({"thinking": "thinking", "refusal": "refusal"}.get(part["type"], "text"))
    return text if isinstance(text, str) else ""
