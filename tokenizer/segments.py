"""Cut text at added tokens, where a tokenizer provably never merges across.

A Hugging Face fast tokenizer (the `tokenizers` library) encodes a text in this order:
  1. the added vocabulary cuts the raw text at every occurrence of an added token
     (leftmost-longest match), emitting each added token as its id;
  2. every remaining piece, on its own, goes through the normalizer, the
     pre-tokenizer and the model (BPE, Unigram, WordPiece, WordLevel);
  3. the post-processor adds special tokens around the whole (when asked).
Step 2 is a pure function of the piece's text when (a) added tokens are matched on
the raw text with no stripping or word-boundary rules (normalized, lstrip, rstrip
and single_word all false), (b) no pre-tokenizer looks at where the piece sits
in the input (Metaspace's prepend_scheme "first" does), (c) the model is
deterministic (no BPE dropout), and (d) there is no truncation or padding. Then,
writing pieces(T) = p1 a1 p2 a2 ... for T cut at added tokens,
  encode(T) = post(enc(p1) + [id(a1)] + enc(p2) + [id(a2)] + ...)
where enc(p) = encode(p, add_special_tokens=False) since p contains no added token
(so it is cut into itself). Empty pieces are never emitted by step 1, so they
contribute nothing. `Segmenter.from_local` checks (a)-(d) on the loaded tokenizer
and refuses otherwise. The post-processor's additions are known exactly only for
None, ByteLevel, TemplateProcessing, Bert and Roberta processors; for any other,
prompts with add_special_tokens are not segmented.

A chat request is rendered with the same template the engine uses, and vLLM then
encodes the rendered text with add_special_tokens=False, so the identity above
gives the engine's tokens from per-piece tokens that can be cached and shared.
"""
from __future__ import annotations

import json
import re
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizer.types import ChatInput, PromptInput, TokenizeInput

if TYPE_CHECKING:  # local.py builds its word cache with this module's post-processor reading
    from tokenizer.local import LocalTokenizer

Piece = str | int  # plain text to tokenize, or the id of an added token

_CONTEXT_FREE_PRE_TOKENIZERS = {
    "ByteLevel", "Whitespace", "WhitespaceSplit", "Split", "Punctuation", "Digits", "Metaspace",
    "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit", "Sequence",
}


class NotSegmentable(ValueError):
    """This tokenizer's configuration does not allow exact cutting at added tokens."""


@dataclass(frozen=True, slots=True)
class SpecialAffixes:
    """What the post-processor adds around a single sequence when add_special_tokens is true."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()


NO_AFFIXES = SpecialAffixes()  # a chat's and a prompt's without special tokens (frozen: shared)


class Segmenter:
    """Cuts prompts and rendered chats into plain pieces and added-token ids, exactly."""

    def __init__(self, local: LocalTokenizer, added: dict[str, int], affixes: SpecialAffixes | None) -> None:
        self._local = local
        self._added = added
        self._affixes = affixes
        # Leftmost-longest: the search finds the leftmost position where some added token starts, and the
        # pattern (a trie of the tokens, longer continuations tried first) takes the longest one there.
        self._pattern = re.compile(_trie_pattern(added)) if added else None
        # When every added token starts with one character (ChatML's and Llama's `<`), candidates are found by
        # str.find and the pattern only tried there: Llama 3.1's 256 added tokens made re's own scan of a
        # 3,300-character chat 10-14 us, the find and a match at each `<` 5 us.
        firsts = {a[0] for a in added}
        self._first = firsts.pop() if len(firsts) == 1 else None
        # Any added token separates pieces batched into one backend call.
        self.separator: tuple[str, int] | None = min(added.items(), key=lambda kv: kv[1]) if added else None

    @classmethod
    def from_local(cls, local: LocalTokenizer) -> Segmenter:
        """Raises NotSegmentable with the reason when the identity in the module docstring may not hold."""
        hf = local.hf
        if getattr(hf, "split_special_tokens", False):
            raise NotSegmentable("split_special_tokens is set: special tokens are not cut out")
        backend = hf.backend_tokenizer
        if getattr(backend, "encode_special_tokens", False):
            raise NotSegmentable("encode_special_tokens is set: special tokens are not cut out")
        spec = json.loads(backend.to_str())
        added: dict[str, int] = {}
        for tok in spec.get("added_tokens") or []:
            flags = [f for f in ("normalized", "lstrip", "rstrip", "single_word") if tok.get(f)]
            if flags:
                raise NotSegmentable(f"added token {tok.get('content')!r} has {', '.join(flags)}")
            if tok.get("content"):  # an empty added token never matches
                added[tok["content"]] = int(tok["id"])
        if spec.get("truncation") or spec.get("padding"):
            raise NotSegmentable("truncation or padding is enabled")
        _check_pre_tokenizer(spec.get("pre_tokenizer"))
        model = spec.get("model") or {}
        if model.get("dropout"):
            raise NotSegmentable("BPE dropout makes encoding random")
        return cls(local, added, _affixes(spec.get("post_processor"), added))

    @property
    def local(self) -> LocalTokenizer:
        return self._local

    def split(self, text: str) -> list[Piece]:
        """Non-empty plain pieces (str) and added-token ids (int), in order."""
        if self._pattern is None:
            return [text] if text else []
        pieces: list[Piece] = []
        added = self._added
        pos = 0
        first = self._first
        if first is not None:
            find, match = text.find, self._pattern.match
            at = find(first)
            while at >= 0:
                m = match(text, at)
                if m is None:
                    at = find(first, at + 1)
                    continue
                if at > pos:
                    pieces.append(text[pos:at])
                token = m.group()
                pieces.append(added[token])
                pos = at + len(token)
                at = find(first, pos)
        else:
            for m in self._pattern.finditer(text):
                if m.start() > pos:
                    pieces.append(text[pos:m.start()])
                pieces.append(added[m.group()])
                pos = m.end()
        if pos < len(text):
            pieces.append(text[pos:])
        return pieces

    def pieces(self, item: TokenizeInput) -> tuple[list[Piece], SpecialAffixes] | None:
        """The pieces whose tokens, concatenated inside the affixes, are `item`'s tokens; None when unknown.

        Raises ValueError for a chat the template refuses.
        """
        if isinstance(item, ChatInput):
            return self.split(self._local.render_chat(item)), NO_AFFIXES
        if not isinstance(item, PromptInput) or item.text is None:
            return None
        if not item.add_special_tokens:
            return self.split(item.text), NO_AFFIXES
        if self._affixes is None:
            return None
        return self.split(item.text), self._affixes


def _trie_pattern(tokens: Iterable[str]) -> str:
    """A regular expression matching exactly `tokens`, the longest of them where several match at one
    position: their trie, each node's continuations tried before ending there (a greedy `?`). re tries
    a plain alternation's branches one after another at every candidate position; down the trie only
    the branches for the next character are."""
    trie: dict = {}
    for token in tokens:
        node = trie
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = None  # a token ends here

    # Built bottom-up without recursion (an added token may be long): a node's pattern after its children's.
    done: dict[int, str] = {}
    todo = [trie]
    while todo:
        node = todo[-1]
        waiting = [child for ch, child in node.items() if ch and id(child) not in done]
        if waiting:
            todo.extend(waiting)
            continue
        todo.pop()
        branches = [re.escape(ch) + done[id(child)] for ch, child in sorted(node.items()) if ch]
        if not branches:
            done[id(node)] = ""
            continue
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" in node:  # a token ends here too: the longer ones first
            body = (body if len(branches) > 1 else "(?:" + body + ")") + "?"
        done[id(node)] = body
    return done[id(trie)]


def join_pieces(pieces: Sequence[Piece], tokens: dict[str, Sequence[int]], affixes: SpecialAffixes) -> Sequence[int]:
    """The ids of `pieces` inside the affixes: an array of 32-bit ids, into which a piece's ids held
    as such an array (the tokenizer cache keeps them so) are copied as bytes, without a Python int
    per id; a list if some id does not fit 32 bits (a backend's odd answer, passed on as it is)."""
    try:
        return _join_into(array("I", affixes.prefix), pieces, tokens, affixes.suffix)
    except (OverflowError, TypeError):
        return _join_into(list(affixes.prefix), pieces, tokens, affixes.suffix)


def _join_into(out: Any, pieces: Sequence[Piece], tokens: dict[str, Sequence[int]], suffix: Sequence[int]) -> Any:
    append, extend = out.append, out.extend
    for p in pieces:
        if isinstance(p, int):
            append(p)
        else:
            extend(tokens[p])
    extend(suffix)
    return out


def _check_pre_tokenizer(pre: Any) -> None:
    if pre is None:
        return
    kind = pre.get("type")
    if kind not in _CONTEXT_FREE_PRE_TOKENIZERS:
        raise NotSegmentable(f"pre-tokenizer {kind!r} is not known to be context free")
    if kind == "Metaspace" and pre.get("prepend_scheme", "always") == "first":
        raise NotSegmentable("Metaspace prepend_scheme 'first' depends on the piece's position")
    for inner in pre.get("pretokenizers") or []:
        _check_pre_tokenizer(inner)


def _affixes(post: Any, added: dict[str, int]) -> SpecialAffixes | None:
    if post is None:
        return SpecialAffixes()
    kind = post.get("type")
    if kind == "ByteLevel":
        return SpecialAffixes()
    if kind == "Sequence":
        found = [a for p in post.get("processors") or [] if (a := _affixes(p, added)) != SpecialAffixes()]
        if any(a is None for a in found) or len(found) > 1:
            return None
        return found[0] if found else SpecialAffixes()
    if kind in ("BertProcessing", "RobertaProcessing"):
        return SpecialAffixes(prefix=(int(post["cls"][1]),), suffix=(int(post["sep"][1]),))
    if kind == "TemplateProcessing":
        specials = post.get("special_tokens") or {}
        prefix: list[int] = []
        suffix: list[int] = []
        seen_a = False
        for entry in post.get("single") or []:
            if "Sequence" in entry:
                if entry["Sequence"].get("id") != "A" or seen_a:
                    return None
                seen_a = True
            elif "SpecialToken" in entry:
                ids = (specials.get(entry["SpecialToken"]["id"]) or {}).get("ids")
                if ids is None:
                    return None
                (suffix if seen_a else prefix).extend(int(i) for i in ids)
            else:
                return None
        return SpecialAffixes(tuple(prefix), tuple(suffix)) if seen_a else None
    return None
