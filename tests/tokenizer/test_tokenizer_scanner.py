"""The word-cached encoder's C scanner (tokenizer/_scanner.c, the module tokenizer._scanner):
split_bytelevel cuts ASCII text as the pre-tokenizer regexes it knows would, compared with Python's `re`
on the translated patterns over random text built to reach every branch of them; concat_cached joins
the cached id lists of words, or names the words not cached yet."""
from __future__ import annotations

import random
import re

import pytest

from tokenizer import _scanner
from tokenizer.wordcache import NATIVE_KINDS, ascii_pattern

ATOMS = (["a", "Z", "word", " word", "  Word", "x1", "42", "1234567", " 9", "'s", "'S", "'ll", "'LL", "'Re", "'ve",
          "'d", "'m", "'t", "'", "''", " ", "  ", "   ", "\n", "\n\n", " \n", "\r\n", "\t", " \t ", "\x0b", "\x0c",
          "\x1c", "\x00", "\x7f", ".", "...", " -", "!?", "{\"k\": [1, 2]}", "<|im_start|>", "<|im_end|>",
          "<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>", "<think>", "_", "__init__", "a_b", "$", "#!", "\\n"])


def random_ascii(rng: random.Random) -> str:
    """Contractions in any case, letter/digit/punctuation runs, whitespace runs before letters, newlines,
    control characters and added tokens' text, joined at random (the wordcache tests use it too)."""
    parts = []
    for _ in range(rng.randint(1, 40)):
        parts.append(rng.choice(ATOMS) if rng.random() < 0.8 else chr(rng.randrange(128)))
    return "".join(parts)


@pytest.mark.parametrize("pattern, kind", sorted(NATIVE_KINDS.items(), key=lambda kv: kv[1]))
def test_the_c_scanner_splits_as_the_translated_regex(pattern, kind) -> None:
    reference = re.compile(ascii_pattern(pattern), re.ASCII)
    rng = random.Random(kind)
    differ = []
    for _ in range(10000):
        text = random_ascii(rng)
        if _scanner.split_bytelevel(text, kind) != reference.findall(text):
            differ.append(text)
    assert not differ, f"{len(differ)} texts split otherwise, e.g. {differ[:5]}"
    with pytest.raises(ValueError):
        _scanner.split_bytelevel("café", kind)


def test_the_scanner_knows_three_kinds_and_takes_only_str() -> None:
    assert sorted(NATIVE_KINDS.values()) == [0, 1, 2]
    assert _scanner.split_bytelevel("", 0) == []
    assert _scanner.split_bytelevel("I'll pay 12345 now", 1) == ["I", "'ll", " pay", " ", "123", "45", " now"]
    assert _scanner.split_bytelevel("I'll pay 12345 now", 2) == ["I", "'ll", " pay", " ", "1", "2", "3", "4", "5",
                                                                  " now"]
    for kind in (-1, 3):
        with pytest.raises(ValueError, match="unknown pre-tokenizer kind"):
            _scanner.split_bytelevel("text", kind)
    with pytest.raises(TypeError):
        _scanner.split_bytelevel(b"text", 0)


def test_concat_cached_joins_the_cached_ids_or_names_the_words_missing() -> None:
    cache = {"a": [1, 2], " b": [3], "c": []}
    assert _scanner.concat_cached(["a", " b", "c", "a"], cache) == [1, 2, 3, 1, 2]
    assert _scanner.concat_cached([], cache) == []
    # the words not cached, in order with repeats, as a tuple (the caller encodes them, then asks again)
    missing = _scanner.concat_cached(["x", "a", "y", "x"], cache)
    assert missing == ("x", "y", "x") and isinstance(missing, tuple)
    joined = _scanner.concat_cached(["a"], cache)
    joined.append(9)
    assert cache["a"] == [1, 2]  # a new list: the cached ones are left as they are
    with pytest.raises(TypeError, match="cached ids must be lists"):
        _scanner.concat_cached(["a"], {"a": (1, 2)})
    with pytest.raises(TypeError):
        _scanner.concat_cached(("a",), cache)  # words: a list
    with pytest.raises(TypeError):
        _scanner.concat_cached(["a"], list(cache.items()))  # cache: a dict
