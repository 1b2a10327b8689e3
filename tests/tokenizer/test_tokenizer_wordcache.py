"""The word-cached encoder (tokenizer.wordcache) gives the tokenizer's own tokens, or declines.

Compared with the `tokenizers` library's encode on random ASCII text built to reach every branch of the
pre-tokenizer regexes (contractions in any case, letter/digit/punctuation runs, whitespace runs before
letters, newlines, control characters, added tokens), on the project's test tokenizer and on Qwen3's and
Llama 3.1's (realtok.py; skipped, saying why, without them). The C scanner on its own:
test_tokenizer_scanner.py."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import realtok
from test_tokenizer_scanner import random_ascii as _random_ascii
from tokenizer import testdata, wordcache
from tokenizer.local import LocalTokenizer
from tokenizer.types import ChatInput, PromptInput
from tokenizer.wordcache import NATIVE_KINDS, NotFast, WordCachedEncoder, ascii_pattern

_LOCAL: dict[str, LocalTokenizer] = {}


def _local(name: str) -> LocalTokenizer:
    if name not in _LOCAL:
        if name == "test":
            directory = testdata.path()
        else:
            try:
                directory = realtok.ensure(name)
            except realtok.Unreachable as e:
                pytest.skip(f"real tokenizer {name} not available: {e}")
        _LOCAL[name] = LocalTokenizer.from_path(directory)
    return _LOCAL[name]


@pytest.mark.parametrize("name", ["test", "qwen3", "llama3_1"])
def test_word_cache_gives_the_tokenizers_tokens_on_random_ascii_text(name) -> None:
    local = _local(name)
    assert local.word_cached, f"{name}: the word cache declined a tokenizer it should take"
    backend = local.hf.backend_tokenizer
    rng = random.Random(14)
    differ = []
    for i in range(2000):
        text = _random_ascii(rng)
        special = i % 3 == 0
        theirs = backend.encode(text, add_special_tokens=special).ids
        if local.encode_prompt(text, add_special_tokens=special) != theirs:
            differ.append(repr(text))
    assert not differ, f"{len(differ)} texts differ, e.g. {differ[:5]}"


@pytest.mark.parametrize("name", ["test", "qwen3", "llama3_1"])
def test_a_long_prompt_with_a_new_start_matches_word_for_word(name) -> None:
    local = _local(name)
    system = " ".join(["You are a careful assistant that answers questions about caches and routing."] * 40)
    for nonce in ("abc123-1", "zz-99 ", "'S\n\n  "):
        chat = ChatInput(messages=({"role": "system", "content": nonce + system},
                                   {"role": "user", "content": "How does prefix caching help?"}))
        text = local.render_chat(chat)
        assert local.encode(chat) == local.hf.backend_tokenizer.encode(text, add_special_tokens=False).ids


def test_non_ascii_text_is_left_to_the_tokenizer() -> None:
    local = _local("test")
    enc = local._fast
    for text in ("café au lait", "naïve\u00a0space", "emoji 🙂 here", "ſ's"):
        assert enc.encode(text) is None
        assert local.encode_prompt(text, False) == local.hf.backend_tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["test", "qwen3", "llama3_1"])
def test_non_ascii_pieces_between_added_tokens_are_encoded_exactly(name) -> None:
    local = _local(name)
    backend = local.hf.backend_tokenizer
    rng = random.Random(9)
    others = ["café", " naïve", "\u00a0", "🙂", "ſ's", " Ünïcödé words", "\u2028", "日本語"]
    for i in range(500):
        parts = [_random_ascii(rng) if rng.random() < 0.6 else rng.choice(others) for _ in range(rng.randint(1, 6))]
        text = rng.choice(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|begin_of_text|>"]).join(parts)
        special = i % 2 == 0
        assert local.encode_prompt(text, special) == backend.encode(text, add_special_tokens=special).ids, repr(text)


def test_the_regex_is_translated_to_ascii_classes_or_refused() -> None:
    assert ascii_pattern(r"[^\s\p{L}\p{N}]+") == "[^\\t\\n\\x0b\\x0c\\r A-Za-z0-9]+"
    assert ascii_pattern(r"\s+(?!\S)") == "[\\t\\n\\x0b\\x0c\\r ]+(?![^\\t\\n\\x0b\\x0c\\r ])"
    assert ascii_pattern(r"(?i:'s|'t)|\p{N}{1,3}") == "(?i:'s|'t)|[0-9]{1,3}"
    for onig in (r"\w+", r"\p{Lu}", r"(?<=a)b", r"[a[b]]", r"\d"):
        with pytest.raises(NotFast):
            ascii_pattern(onig)


def _hf(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _bpe() -> Tokenizer:
    vocab = {chr(c): i for i, c in enumerate(range(33, 127))}
    vocab.update({"Ġ": len(vocab), "Ċ": len(vocab) + 1, "ĉ": len(vocab) + 2})
    return Tokenizer(models.BPE(vocab=vocab, merges=[]))


@pytest.mark.parametrize("change, reason", [
    (lambda t: setattr(t, "normalizer", normalizers.Lowercase()), "normalizer"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True)), "add_prefix_space"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace()), "ByteLevel"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel(use_regex=False)])), "Split"),
])
def test_configurations_it_cannot_reproduce_are_refused(change, reason) -> None:
    tok = _bpe()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    WordCachedEncoder.from_local(_hf(tok))  # the plain byte-level BPE is taken
    change(tok)
    with pytest.raises(NotFast, match=reason):
        WordCachedEncoder.from_local(_hf(tok))


def test_a_wrong_translation_is_caught_at_load(monkeypatch) -> None:
    # \p{L} read as Python's \w would (digits and "_" as letters): the load-time check must see it.
    monkeypatch.setattr(wordcache, "NATIVE_KINDS", {})  # the `re` path
    monkeypatch.setitem(wordcache._ALONE, "\\p{L}", "[A-Za-z0-9_]")
    monkeypatch.setitem(wordcache._IN_CLASS, "\\p{L}", "A-Za-z0-9_")
    with pytest.raises(NotFast, match="otherwise than the tokenizer"):
        WordCachedEncoder.from_local(_local("test").hf)
    assert not LocalTokenizer(_local("test").hf).word_cached


def test_the_word_cache_is_bounded_and_stays_exact(monkeypatch) -> None:
    monkeypatch.setattr(wordcache, "_MAX_WORDS", 50)
    hf = _local("test").hf
    enc = WordCachedEncoder.from_local(hf)
    rng = random.Random(3)
    for _ in range(300):
        text = _random_ascii(rng)
        assert enc.encode(text) == hf.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert len(enc._words) <= 50


def test_without_fast_every_text_goes_through_the_tokenizer(monkeypatch) -> None:
    local = LocalTokenizer(_local("test").hf, fast=False)
    assert not local.word_cached
    monkeypatch.setattr(WordCachedEncoder, "encode", lambda *a: pytest.fail("word cache used"))
    assert local.encode_prompt("hello world", False)


def test_ascii_inputs_the_word_cache_takes_stay_on_the_calling_thread() -> None:
    fast, slow = _local("test"), LocalTokenizer(_local("test").hf, fast=False)
    big_ascii = PromptInput(text="word " * 1000)  # 5,000 characters
    big_other = PromptInput(text="wörd " * 1000)
    assert fast.inline(big_ascii, 2048) and not slow.inline(big_ascii, 2048)
    assert not fast.inline(big_other, 2048)
    assert fast.inline(PromptInput(text="small"), 2048) and slow.inline(PromptInput(text="small"), 2048)
    assert not fast.inline(PromptInput(text="word " * 5000), 2048)
    chat = ChatInput(messages=({"role": "user", "content": "word " * 1000},))
    assert fast.inline(chat, 2048) and not slow.inline(chat, 2048)


@pytest.mark.parametrize("name", ["test", "qwen3", "llama3_1"])
def test_the_c_scanner_serves_the_known_regexes(name) -> None:
    assert _local(name)._fast._native_kind is not None, f"{name}: its pre-tokenizer regex is not split in C"


def test_the_re_path_and_the_c_scanner_give_the_same_tokens(monkeypatch) -> None:
    local = _local("test")
    enc = WordCachedEncoder.from_local(local.hf)
    monkeypatch.setattr(wordcache, "NATIVE_KINDS", {})
    by_re = WordCachedEncoder.from_local(local.hf)
    assert enc._native_kind is not None and by_re._native_kind is None
    rng = random.Random(5)
    for _ in range(1000):
        text = _random_ascii(rng)
        assert enc.encode(text) == by_re.encode(text)


def test_a_scanner_of_another_regex_is_caught_at_load(monkeypatch) -> None:
    gpt2 = next(p for p, k in NATIVE_KINDS.items() if k == 0)
    monkeypatch.setattr(wordcache, "NATIVE_KINDS", {gpt2: 1})  # the test tokenizer's regex split as Llama 3's
    with pytest.raises(NotFast, match="otherwise than the tokenizer"):
        WordCachedEncoder.from_local(_local("test").hf)


def _sentence_texts(rng: random.Random, n: int) -> list[str]:
    """Texts cut at ". " (tokenizer.wordcache._SENTENCE_CUT) into sentences drawn from a small pool, so most
    come back in other texts and orders; sentences, starts and ends built to reach the pre-tokenizers'
    branches next to the cut (empty sentences, ". . ", digits, contractions, whitespace, newlines)."""
    pool = [_random_ascii(rng) for _ in range(40)] + ["", ".", " ", "'S", "'s", "12345", "x\n", "\n", "  y  ", "a'",
                                                      "You are a careful assistant", "...", "\t"]
    out = []
    for _ in range(n):
        sentences = [rng.choice(pool) for _ in range(rng.randint(2, 12))]
        out.append(rng.choice(["", "a", " ", "\n", "nonce 3f2a"]) + ". ".join(sentences) + rng.choice(["", ".", ". ", " "]))
    return out


@pytest.mark.parametrize("name", ["test", "qwen3", "llama3_1"])
def test_texts_cut_into_kept_sentences_give_the_tokenizers_tokens(name) -> None:
    hf = _local(name).hf
    enc = WordCachedEncoder.from_local(hf)
    backend = hf.backend_tokenizer
    rng = random.Random(21)
    texts = _sentence_texts(rng, 600)
    differ = []
    for text in texts + texts[::-1]:  # each text twice: its sentences seen once, then kept and looked up
        if enc.encode(text) != backend.encode(text, add_special_tokens=False).ids:
            differ.append(repr(text))
    assert not differ, f"{len(differ)} texts differ, e.g. {differ[:5]}"
    assert len(enc._sentences) > 20, "the sentence path was not reached"


def test_the_sentence_cache_is_bounded_and_stays_exact(monkeypatch) -> None:
    monkeypatch.setattr(wordcache, "_MAX_SENTENCE_BYTES", 3000)
    monkeypatch.setattr(wordcache, "_MAX_SENTENCE_CHARS", 30)
    monkeypatch.setattr(wordcache, "_MAX_SEEN", 20)
    hf = _local("test").hf
    enc = WordCachedEncoder.from_local(hf)
    rng = random.Random(4)
    texts = _sentence_texts(rng, 300)
    kept = 0
    for text in texts + texts:
        assert enc.encode(text) == hf.backend_tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
        assert enc._sentence_bytes <= 3000 + 30 + 8 * 60 + wordcache._SENTENCE_OVERHEAD
        assert all(len(s) <= 30 for s in enc._sentences) and len(enc._seen) <= 20
        kept = max(kept, len(enc._sentences))
    assert kept > 5, "the sentence path was not reached"


def test_new_sentences_around_a_kept_one_are_not_kept() -> None:
    hf = _local("test").hf
    enc = WordCachedEncoder.from_local(hf)
    rng = random.Random(8)
    shared = "The same sentence every time"
    for text in [f"Start. {shared}. {shared}. {shared}. End"] * 2:  # kept from its second sight on
        enc.encode(text)
    assert shared in enc._sentences
    kept = len(enc._sentences)
    for _ in range(100):
        sentences = [" ".join(rng.choice(("route", "Cache", "x1", "42", "'s", "a-b", "\n")) for _ in range(8))
                     for _ in range(9)]
        sentences[5] = shared  # the sentence sampled from the middle
        text = ". ".join(sentences)
        assert enc.encode(text) == hf.backend_tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
    assert len(enc._sentences) == kept, "new sentences around a kept one were kept"
