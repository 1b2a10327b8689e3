"""A faster exact encoder for byte-level BPE tokenizers on ASCII text: words cached, the BPE run once per word.

Why: a `tokenizers` encode of a never-seen 3,100-character chat prompt costs ~1.2-2 ms on this project's
machine, ~80% of it in the pre-tokenizer (its regex engine pays microseconds per match), and a new prompt
misses every cache above it. The same tokens come from a Python regex split plus a dict of words.

A fast tokenizer (the `tokenizers` library) encodes a text without added tokens as
    encode(T) = concat(bpe(bytelevel(w)) for w in pretokenize(normalize(T)))
with the BPE model applied to each pre-token on its own. For ASCII text every Unicode normalizer is the
identity and the pre-tokenizer's regex classes (\\p{L}, \\p{N}, \\s) are plain ASCII sets, so the split is
done here: by a C scanner for the GPT-2, Llama 3 and Qwen 2 regexes (tokenizer/_scanner.c), else with
Python's `re` on the pattern translated to those sets; and bpe(bytelevel(w)) is asked
of the tokenizer's own BPE model (`Model.tokenize`) once per distinct word, then kept. Added tokens are cut out
first, as the tokenizer does (leftmost-longest, raw text; segments.Segmenter checks their flags allow it).
With the C scanner's regexes, a text's sentences (cut before the space of each ". ", where no pre-token
crosses) are also kept whole once seen twice, so a new text made of known sentences (a shared system prompt
behind a new first line) is joined from them instead of split word by word.

Only configurations where this identity is known to hold are taken (`WordCachedEncoder.from_local` says
why not otherwise): normalizer none or Unicode normal forms; pre-tokenizer ByteLevel (with or without its
regex, no prefix space) after any number of regex Splits with "isolated" behaviour; a BPE model without
dropout; no truncation or padding. At load the encoder is compared with the tokenizer on every ASCII
character in several contexts and on a mixed corpus; any difference and it is not used. Non-ASCII text
and add_special_tokens with an unknown post-processor go to the tokenizer itself (`encode` returns None).
"""
from __future__ import annotations

import json
import re
from typing import Any

try:
    from tokenizer import _scanner  # the C scanner, tokenizer/_scanner.c
except ImportError as e:  # pragma: no cover - a source tree without `pip install`
    raise ImportError(
        "kvgate's compiled module tokenizer._scanner is missing: install kvgate with a C compiler and "
        "Python headers available (`./dev test` or `pip install -e .`; on Debian: apt-get install gcc "
        f"python3-dev) ({e})"
    ) from e
from tokenizer.segments import NotSegmentable, SpecialAffixes, _affixes

_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Pre-tokenizer regexes the C scanner (tokenizer/_scanner.c) splits by, by its kind number.
NATIVE_KINDS = {_GPT2_PATTERN: 0, _LLAMA3_PATTERN: 1, _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"): 2}
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}  # the identity on ASCII
# The regex classes as the tokenizer's regex engine (Oniguruma, Unicode) reads them, restricted to ASCII:
# \s is Unicode White_Space (not \x1c-\x1f, which Python's \s takes).
_SPACE = "\\t\\n\\x0b\\x0c\\r "
_IN_CLASS = {"\\p{L}": "A-Za-z", "\\p{N}": "0-9", "\\s": _SPACE}
_ALONE = {"\\p{L}": "[A-Za-z]", "\\p{N}": "[0-9]", "\\s": f"[{_SPACE}]", "\\S": f"[^{_SPACE}]"}
_PASS_ESCAPES = set("rntfv\\'\"-.?*+()[]{}|^$/ ")
_MAX_WORDS = 200_000  # distinct words kept (then the cache starts over)
# Where a text is cut into sentences looked up whole (the C scanner's regexes only): before the space of
# every ". ". No pre-token of those regexes crosses such a cut, and the pre-tokens on either side are the
# same as when the text is split whole: the match covering the "." (a run of characters that are not
# letters, digits or whitespace, possibly after one space) cannot take a space after it, so a match ends
# at the cut, and the next starts there (no regex looks behind); and no alternative tried before the cut
# reads the space differently from the text's end: a letter run, a digit run, a run of other characters,
# [\r\n]* and the contractions all stop at either, a "non-letter then letters" alternative fails at
# either, and a whitespace run cannot reach over the ".". The BPE then runs on each pre-token alone.
_SENTENCE_CUT = ". "
_MAX_SENTENCE_CHARS = 8192  # longer sentences are encoded, not kept
_MAX_SENTENCE_BYTES = 16 * 1024 * 1024  # about what the kept sentences and their ids hold (then start over)
_SENTENCE_OVERHEAD = 150  # dict slot, str and list headers
_MAX_SEEN = 200_000  # hashes of sentences seen once remembered (then forgotten all at once)


class NotFast(ValueError):
    """This tokenizer's configuration is not one the word-cached encoder reproduces exactly."""


def ascii_pattern(onig: str) -> str:
    """`onig` (a tokenizer's pre-tokenizer regex) as a Python `re` pattern that matches the same on ASCII text.
    Raises NotFast for syntax not translated here."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(onig):
        c = onig[i]
        if c == "\\":
            esc = onig[i:i + 5] if onig.startswith("\\p{", i) or onig.startswith("\\P{", i) else onig[i:i + 2]
            table = _IN_CLASS if in_class else _ALONE
            if esc in table:
                out.append(table[esc])
            elif len(esc) == 2 and esc[1] in _PASS_ESCAPES:
                out.append(esc)
            else:
                raise NotFast(f"pre-tokenizer regex escape {esc!r} is not translated")
            i += len(esc)
            continue
        if c == "[":
            if in_class:
                raise NotFast("nested character class in the pre-tokenizer regex")
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        elif c == "(" and onig.startswith("(?", i) and not (
                onig.startswith("(?:", i) or onig.startswith("(?!", i) or onig.startswith("(?=", i)
                or onig.startswith("(?i:", i)):
            raise NotFast(f"pre-tokenizer regex group {onig[i:i + 4]!r} is not translated")
        out.append(c)
        i += 1
    if in_class:
        raise NotFast("unterminated character class in the pre-tokenizer regex")
    return "".join(out)


def _byte_map() -> dict[int, str]:
    """GPT-2's byte-to-character table (what the ByteLevel pre-tokenizer maps each byte to), for ASCII."""
    printable = set(range(ord("!"), ord("~") + 1))
    n, table = 0, {}
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return {b: table[b] for b in range(128)}


class WordCachedEncoder:
    """encode(text, add_special_tokens) -> ids exactly as the tokenizer gives them, or None (not handled)."""

    def __init__(self, model: Any, stages: list[re.Pattern[str]], added: dict[str, int],
                 affixes: SpecialAffixes | None, native_kind: int | None = None) -> None:
        """`native_kind`: the C scanner's number for the one stage's regex (NATIVE_KINDS), None for `re`."""
        self._model = model  # tokenizers.models.BPE: tokenize(pre-token) -> Tokens
        self._stages = stages
        self._native_kind = native_kind
        self._backend: Any = None  # the tokenizers.Tokenizer, for non-ASCII pieces between added tokens
        self._added = added
        alternatives = sorted(added, key=len, reverse=True)  # leftmost-longest, as in segments.Segmenter
        self._added_pattern = re.compile("|".join(re.escape(a) for a in alternatives)) if alternatives else None
        self._affixes = affixes
        self._to_bytelevel = str.maketrans(_byte_map())
        self._words: dict[str, list[int]] = {}
        self._sentences: dict[str, list[int]] = {}  # sentence s cut out of a text -> ids of " " + s + "."
        self._sentence_bytes = 0
        self._seen: set[int] = set()  # hashes of sentences seen once and not kept

    @classmethod
    def from_local(cls, hf: Any) -> WordCachedEncoder:
        """From a transformers fast tokenizer; raises NotFast (why) where the identity above may not hold,
        or where the encoder disagrees with the tokenizer on the load-time self-check."""
        if getattr(hf, "split_special_tokens", False):
            raise NotFast("split_special_tokens is set")
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise NotFast("not a fast (tokenizer.json) tokenizer")
        if getattr(backend, "encode_special_tokens", False):
            raise NotFast("encode_special_tokens is set")
        spec = json.loads(backend.to_str())
        if spec.get("truncation") or spec.get("padding"):
            raise NotFast("truncation or padding is enabled")
        _check_normalizer(spec.get("normalizer"))
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout"):
            raise NotFast(f"model {model.get('type')!r}{' with dropout' if model.get('dropout') else ''} is not "
                          f"a deterministic BPE")
        added: dict[str, int] = {}
        for tok in spec.get("added_tokens") or []:
            flags = [f for f in ("normalized", "lstrip", "rstrip", "single_word") if tok.get(f)]
            if flags:
                raise NotFast(f"added token {tok.get('content')!r} has {', '.join(flags)}")
            if tok.get("content"):
                added[tok["content"]] = int(tok["id"])
        patterns = _pre_tokenizer_stages(spec.get("pre_tokenizer"))
        stages = [re.compile(ascii_pattern(p), re.ASCII) for p in patterns]
        native_kind = NATIVE_KINDS.get(patterns[0]) if len(patterns) == 1 else None
        try:
            affixes = _affixes(spec.get("post_processor"), added)
        except (KeyError, TypeError, ValueError, NotSegmentable):
            affixes = None
        enc = cls(backend.model, stages, added, affixes, native_kind)
        enc._backend = backend
        enc._self_check(backend)
        return enc

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int] | None:
        """None where not handled: add_special_tokens with an unknown post-processor, or non-ASCII text without
        added tokens. Between added tokens, a non-ASCII piece is encoded by the tokenizer alone: the same tokens,
        since the tokenizer cuts added tokens out before anything else."""
        affixes = self._affixes
        if add_special_tokens and affixes is None:
            return None
        ascii_ = text.isascii()
        if not ascii_ and (self._backend is None or self._added_pattern is None
                           or self._added_pattern.search(text) is None):
            return None
        plain = self._plain if ascii_ else self._any
        if self._added_pattern is None or (ascii_ and self._added_pattern.search(text) is None):
            out = plain(text)  # a new list: returned as it is
        else:
            out = []
            pos = 0
            for m in self._added_pattern.finditer(text):
                if m.start() > pos:
                    out += plain(text[pos:m.start()])
                out.append(self._added[m.group()])
                pos = m.end()
            if pos < len(text):
                out += plain(text[pos:])
        if add_special_tokens and affixes is not None:  # (None returned None above)
            return [*affixes.prefix, *out, *affixes.suffix]
        return out

    def _split(self, text: str) -> list[str]:
        """The pre-tokens of `text` (ASCII, no added tokens in it), before the byte-level mapping."""
        if self._native_kind is not None:
            return _scanner.split_bytelevel(text, self._native_kind)
        words = [text]
        for stage in self._stages:
            words = stage.findall(words[0]) if len(words) == 1 else [w for p in words for w in stage.findall(p)]
            if sum(map(len, words)) != len(text):  # the matches leave gaps: spelled out, gaps kept
                return _split_isolated(self._stages, text)
        return words

    def _any(self, text: str) -> list[int]:
        if text.isascii():
            return self._plain(text)
        return self._backend.encode(text, add_special_tokens=False).ids

    def _plain(self, text: str) -> list[int]:
        """`text`'s ids, a new list (ASCII, no added tokens in it). With the C scanner's regexes, text with
        sentences is cut before the space of every ". " and each sentence between two cuts is looked up whole
        (see _SENTENCE_CUT for why the cuts change no token); everything else word by word."""
        if self._native_kind is None:
            return self._word_ids(text)
        # Sentences are looked up when one of them (the one after the first cut past the middle) is kept, and
        # kept from its second sight on (hashes of those seen once are remembered): splitting a text into
        # sentences and keeping them costs more than encoding it whole, when its sentences are new.
        cache = self._sentences
        sample = _sample_sentence(text)
        if sample is None:
            return self._word_ids(text)
        known = sample in cache
        if not known:
            key = hash(sample)
            if key not in self._seen:
                if len(self._seen) >= _MAX_SEEN:
                    self._seen.clear()
                self._seen.add(key)
                return self._word_ids(text)
        parts = text.split(_SENTENCE_CUT)
        middle = parts[1:-1]  # sentence i is " " + middle[i] + "."
        found = _scanner.concat_cached(middle, cache)
        if type(found) is tuple:
            if known and 2 * len(found) > len(middle):  # mostly new sentences around a kept one: whole, none kept
                return self._word_ids(text)
            for p in found:
                if p not in cache:  # a sentence may be missing more than once
                    ids = self._word_ids(" " + p + ".")
                    if len(p) <= _MAX_SENTENCE_CHARS:
                        if self._sentence_bytes > _MAX_SENTENCE_BYTES:
                            cache.clear()
                            self._sentence_bytes = 0
                        cache[p] = ids
                        self._sentence_bytes += len(p) + 8 * len(ids) + _SENTENCE_OVERHEAD
            found = _scanner.concat_cached(middle, cache)
            if type(found) is tuple:  # sentences too long to keep, or the cache started over: one at a time
                found = [i for p in middle for i in (cache.get(p) or self._word_ids(" " + p + "."))]
        found[0:0] = self._word_ids(parts[0] + ".")  # `found` is a new list: its ids moved, not copied
        found += self._word_ids(" " + parts[-1])
        return found

    def _word_ids(self, text: str) -> list[int]:
        """`text`'s ids word by word (ASCII, no added tokens in it): a new list."""
        words = self._split(text)
        found = _scanner.concat_cached(words, self._words)  # the ids, or a tuple of the words not cached yet
        if type(found) is tuple:
            cache = self._words
            for w in found:
                if w not in cache:  # a word may be missing more than once
                    if len(cache) >= _MAX_WORDS:
                        cache.clear()
                    cache[w] = [t.id for t in self._model.tokenize(w.translate(self._to_bytelevel))]
            found = _scanner.concat_cached(words, cache)
            if type(found) is tuple:  # more new words than the cache holds: one at a time
                found = [i for w in words for i in
                         (cache.get(w) or [t.id for t in self._model.tokenize(w.translate(self._to_bytelevel))])]
        return found

    def _self_check(self, backend: Any) -> None:
        """The tokenizer's own pre-tokens and ids on _check_corpus(), or NotFast (ids alone can hide a wrong
        split: a small vocabulary often gives the same ids for "a_b" as one word or three)."""
        texts = _check_corpus()
        for text in texts:
            pieces = [text] if self._added_pattern is None else [p for p in self._added_pattern.split(text) if p]
            for piece in pieces:
                mine = [w.translate(self._to_bytelevel) for w in self._split(piece)]
                theirs = [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(piece)]
                if mine != theirs:
                    raise NotFast(f"splits {piece[:60]!r} otherwise than the tokenizer")
        for special in (False, False, True):  # twice without: the second pass keeps and reuses sentences
            if special and self._affixes is None:
                continue
            for text in texts:
                ids = self.encode(text, special)
                theirs = backend.encode(text, add_special_tokens=special).ids
                if ids != theirs:
                    raise NotFast(f"differs from the tokenizer on {text[:60]!r} (add_special_tokens={special})")
        self._words.clear()  # the check's words and sentences are not the traffic's
        self._sentences.clear()
        self._sentence_bytes = 0
        self._seen.clear()


def _sample_sentence(text: str) -> str | None:
    """The text between the first two cuts (_SENTENCE_CUT) from the middle of `text` on, or the last two
    before; None with fewer than two cuts."""
    cut = _SENTENCE_CUT
    a = text.find(cut, len(text) // 2)
    if a >= 0:
        b = text.find(cut, a + 2)
        if b >= 0:
            return text[a + 2:b]
        b = a
    else:
        b = text.rfind(cut)
        if b < 0:
            return None
    a = text.rfind(cut, 0, b)
    return None if a < 0 else text[a + 2:b]


def _split_isolated(stages: list[re.Pattern[str]], text: str) -> list[str]:
    """Split pre-tokenizers with "isolated" behaviour, one after the other: every match, and every gap
    between matches, in order."""
    words = [text]
    for pattern in stages:
        out = []
        for piece in words:
            pos = 0
            for m in pattern.finditer(piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        words = out
    return words


def _check_normalizer(norm: Any) -> None:
    if norm is None:
        return
    kind = norm.get("type")
    if kind == "Sequence":
        for inner in norm.get("normalizers") or []:
            _check_normalizer(inner)
    elif kind not in _NORMALIZERS:
        raise NotFast(f"normalizer {kind!r} may change ASCII text")


def _pre_tokenizer_stages(pre: Any) -> list[str]:
    """The regexes (the tokenizer's syntax) of the pre-tokenizer's splits, in order; the last step must be
    ByteLevel."""
    steps = [pre] if pre is None or pre.get("type") != "Sequence" else list(pre.get("pretokenizers") or [])
    if not steps or steps[-1] is None or steps[-1].get("type") != "ByteLevel":
        raise NotFast("pre-tokenizer does not end with ByteLevel")
    stages = []
    for step in steps[:-1]:
        if step.get("type") != "Split" or step.get("invert") or step.get("behavior") != "Isolated" \
                or "Regex" not in (step.get("pattern") or {}):
            raise NotFast(f"pre-tokenizer step {json.dumps(step)[:120]} is not a regex Split, isolated")
        stages.append(step["pattern"]["Regex"])
    last = steps[-1]
    if last.get("add_prefix_space"):
        raise NotFast("ByteLevel add_prefix_space depends on the piece's position")
    if last.get("use_regex", True):
        stages.append(_GPT2_PATTERN)
    return stages


def _check_corpus() -> list[str]:
    """Every ASCII character alone and between letters, digits and spaces; contractions in any case; runs."""
    out = []
    for code in range(128):
        c = chr(code)
        out += [c, c * 3, f"a{c}b", f" {c} x", f"1{c}2", f"x {c}{c}\n", f"\n{c}\n"]
    out += ["I'm here, you're there; it's 'quoted' and THEY'LL go. We'VE, he'D, 'S 'T 'Re",
            "    def f(x):\n        return x + 12345678\n\n\n\t\tend  \n  ",
            '{"key": [1, 22, 333, 4444], "b": null}\r\n\r\nline2 \r\n  ',
            "a  b   c    d\n \n  \n\t \t", "numbers 1 12 123 1234 12345 123456 1.5e-10",
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
            "@@@ --- ... !!! ??? ;;; ::: ___ ~~~ ``` |||",
            ". Starts. Twice. Twice. . 'S. 's. 12. x.\n. y.  z. \t. a.b. c. ",
            "No one. Knows. How. It ends. "]
    return out
