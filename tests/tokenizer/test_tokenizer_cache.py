"""The cache returns exactly the uncached tokenizer's tokens, on random and adversarial inputs."""
from __future__ import annotations

import asyncio
import copy as copy_module
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, models, pre_tokenizers

from tokenizer import testdata
from tokenizer.cache import ByteLRU, CachedTokenizer, CacheOptions, _request_key
from tokenizer.local import LocalBackend, LocalTokenizer
from tokenizer.segments import NotSegmentable, Segmenter, SpecialAffixes
from tokenizer.types import ChatInput, PromptInput, TokenizerError, TokenizerTimeout

MODEL = "m"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
# Fragments that sit next to special tokens in awkward ways: partial markers, spaces, newlines, bytes of multi-byte chars.
NO_VERIFY = CacheOptions(verify_requests=0)
FRAGMENTS = SPECIALS + ["<|im_", "start|>", "<|", "|>", "<", ">", "|", " ", "  ", "\n", "\n\n", "'s", "é", "😀", "a", "ab", "hello", "world", "0", "42", ".", "{\"", "tool"]

text_st = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=25).map("".join)
message_st = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": text_st})


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer.from_path(testdata.path())


class CountingBackend(LocalBackend):
    def __init__(self, tokenizers):
        super().__init__(tokenizers)
        self.calls: list = []

    async def tokenize(self, model, item, *, base_url=None):
        self.calls.append(item)
        return await super().tokenize(model, item, base_url=base_url)


def make_cached(local: LocalTokenizer, max_bytes: int = 1 << 26) -> tuple[CachedTokenizer, CountingBackend]:
    """No verification calls: every answer is assembled from pieces, which is what these tests check."""
    inner = CountingBackend({MODEL: local})
    options = CacheOptions(max_bytes=max_bytes, verify_requests=0)
    return CachedTokenizer(inner, segmenters={MODEL: Segmenter.from_local(local)}, options=options), inner


def run(coro):
    return asyncio.run(coro)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(text_st, min_size=1, max_size=6), add_special=st.booleans())
def test_prompts_match_uncached(local: LocalTokenizer, texts: list[str], add_special: bool) -> None:
    cached, _ = make_cached(local, max_bytes=4096)  # small: eviction happens too

    async def go():
        for t in texts + texts[::-1]:
            got = await cached.tokenize(MODEL, PromptInput(text=t, add_special_tokens=add_special))
            assert got == local.encode_prompt(t, add_special), repr(t)

    run(go())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    conversation=st.lists(message_st, min_size=1, max_size=6),
    gen=st.booleans(),
    kwargs=st.sampled_from([None, {"enable_thinking": False}, {"enable_thinking": True}]),
    tools=st.sampled_from([None, ({"type": "function", "function": {"name": "f<|im_end|>", "parameters": {}}},)]),
)
def test_multi_turn_chats_match_uncached(local, conversation, gen, kwargs, tools) -> None:
    cached, _ = make_cached(local, max_bytes=64 * 1024)

    async def go():
        for turn in range(1, len(conversation) + 1):
            item = ChatInput(messages=tuple(conversation[:turn]), tools=tools, chat_template_kwargs=kwargs,
                             add_generation_prompt=gen, continue_final_message=not gen)
            assert await cached.tokenize(MODEL, item) == local.encode_chat(item)

    run(go())


def test_segmenter_cuts_at_every_added_token(local) -> None:
    seg = Segmenter.from_local(local)
    ids = {s: local.hf.convert_tokens_to_ids(s) for s in SPECIALS}
    assert seg.split("a<|im_start|><|im_end|>b<|im_") == ["a", ids["<|im_start|>"], ids["<|im_end|>"], "b<|im_"]
    assert seg.split("") == []
    assert seg.pieces(PromptInput(text="x", add_special_tokens=True)) == (["x"], SpecialAffixes())


def _reference_split(text: str, added: dict[str, int]) -> list:
    """Leftmost-longest cutting, spelled out: at each position the longest added token starting there."""
    out, plain, i = [], "", 0
    while i < len(text):
        hit = max((t for t in added if text.startswith(t, i)), key=len, default=None)
        if hit is None:
            plain += text[i]
            i += 1
            continue
        if plain:
            out.append(plain)
            plain = ""
        out.append(added[hit])
        i += len(hit)
    return out + ([plain] if plain else [])


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.text(alphabet="<|ab>\\.*", min_size=1, max_size=6), min_size=1, max_size=12, unique=True),
       text=st.text(alphabet="<|ab>\\.*x", max_size=60))
def test_split_is_leftmost_longest_for_any_added_tokens(tokens, text) -> None:
    """Overlapping tokens (one a prefix of another, one inside another), regex metacharacters, one or
    several first characters: the cut is the reference's."""
    added = {t: 1000 + i for i, t in enumerate(tokens)}
    assert Segmenter(None, added, SpecialAffixes()).split(text) == _reference_split(text, added)


def test_shared_system_prompt_is_tokenized_once(local) -> None:
    cached, inner = make_cached(local)
    system = {"role": "system", "content": "You are a careful assistant. " * 50}

    async def go():
        for user in range(10):
            item = ChatInput(messages=(system, {"role": "user", "content": f"question number {user}"}))
            assert await cached.tokenize(MODEL, item) == local.encode_chat(item)

    run(go())
    sent = [c.text for c in inner.calls]
    assert sum("careful assistant" in t for t in sent) == 1
    assert all(not c.add_special_tokens for c in inner.calls)
    assert cached.hit_ratio > 0.8


def test_repeated_request_costs_no_backend_call_and_metrics_count(local) -> None:
    registry = CollectorRegistry()
    inner = CountingBackend({MODEL: local})
    cached = CachedTokenizer(inner, registry=registry)  # no segmenter: whole-request level only
    item = ChatInput(messages=({"role": "user", "content": "hi"},))

    async def go():
        a = await cached.tokenize(MODEL, item)
        b = await cached.tokenize(MODEL, item)
        return a, b

    a, b = run(go())
    assert a == b == local.encode_chat(item)
    assert len(inner.calls) == 1
    assert registry.get_sample_value("kvgate_tokenizer_cache_lookups_total", {"level": "request", "result": "hit"}) == 1
    assert registry.get_sample_value("kvgate_tokenizer_cache_hit_ratio") == pytest.approx(0.5)
    assert registry.get_sample_value("kvgate_tokenizer_cache_bytes") > 0


def test_cached_probe_is_a_read_only_view_counted_like_a_hit(local) -> None:
    registry = CollectorRegistry()
    inner = CountingBackend({MODEL: local})
    cached = CachedTokenizer(inner, registry=registry)
    item = ChatInput(messages=({"role": "user", "content": "hello there"},))
    assert cached.cached(MODEL, item) is None  # not cached yet: nothing counted, no backend call
    assert cached.cached(MODEL, PromptInput(token_ids=(1, 2))) is None
    assert not inner.calls
    hits = ("kvgate_tokenizer_cache_lookups_total", {"level": "request", "result": "hit"})
    assert not registry.get_sample_value(*hits)

    expected = run(cached.tokenize(MODEL, item))
    view = cached.cached(MODEL, item)
    assert list(view) == expected and len(view) == len(expected)
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 0  # the cache's own array: callers cannot change what later requests get
    assert cached.cached("other-model", item) is None
    assert registry.get_sample_value(*hits) == 1
    assert cached.tokens_cached == len(expected) and cached.tokens_total == 2 * len(expected)
    assert run(cached.tokenize(MODEL, item)) == expected and len(inner.calls) == 1



def test_tokenize_ids_gives_tokenizes_ids_without_a_list_of_ints(local) -> None:
    """The request path's form: an assembled request's ids as a 32-bit array of its own, a cached one's
    as a read-only view of the cache's array; the same ids as `tokenize` either way."""
    from array import array

    cached, inner = make_cached(local)
    item = ChatInput(messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}))
    expected = local.encode_chat(item)
    first = run(cached.tokenize_ids(MODEL, item))
    assert type(first) is array and first.typecode == "I" and first.tolist() == expected
    first[0] = 0  # its own copy: what later requests get does not change
    second = run(cached.tokenize_ids(MODEL, item))  # asked for again: assembled again, and now kept whole
    assert type(second) is array and second.tolist() == expected
    again = run(cached.tokenize_ids(MODEL, item))
    assert type(again) is memoryview and again.readonly and again.tolist() == expected
    assert run(cached.tokenize(MODEL, item)) == expected and type(run(cached.tokenize(MODEL, item))) is list
    assert len(inner.calls) == 1
    assert run(cached.tokenize_ids(MODEL, PromptInput(token_ids=(5, 6)))) == [5, 6]


def test_pieces_with_ids_past_32_bits_are_joined_as_a_list_and_not_cached(local) -> None:
    """A backend answering ids that do not fit 32 bits (no real vocabulary has them) gets them passed on as
    they are, uncached, instead of a failed request."""
    class Odd(CountingBackend):
        async def tokenize(self, model, item, *, base_url=None):
            ids = await super().tokenize(model, item, base_url=base_url)
            return [i + (1 << 40) for i in ids]

    inner = Odd({MODEL: local})
    cached = CachedTokenizer(inner, segmenters={MODEL: Segmenter.from_local(local)},
                             options=CacheOptions(verify_requests=0))
    item = ChatInput(messages=({"role": "user", "content": "hello"},))
    got = run(cached.tokenize_ids(MODEL, item))
    assert type(got) is list and any(i >= 1 << 40 for i in got)
    assert run(cached.tokenize(MODEL, item)) == got and cached.cached(MODEL, item) is None


def test_a_miss_key_serves_only_the_same_item_and_model(local) -> None:
    """tokenize() takes the key cached() built for the item it just missed, and only for that very
    object and model: another item or model right after a miss is keyed (and answered) as its own."""
    cached = CachedTokenizer(CountingBackend({MODEL: local, "other-model": local}))
    a = ChatInput(messages=({"role": "user", "content": "hello there"},))
    b = ChatInput(messages=({"role": "user", "content": "something else entirely"},))
    assert cached.cached(MODEL, a) is None
    assert run(cached.tokenize(MODEL, b)) == local.encode_chat(b)  # not a's key
    assert cached.cached(MODEL, a) is None and list(cached.cached(MODEL, b)) == local.encode_chat(b)
    assert cached.cached(MODEL, a) is None
    assert run(cached.tokenize("other-model", a)) == local.encode_chat(a)  # not MODEL's key
    assert cached.cached(MODEL, a) is None and list(cached.cached("other-model", a)) == local.encode_chat(a)
    assert cached.cached(MODEL, a) is None
    assert run(cached.tokenize(MODEL, a)) == local.encode_chat(a)
    assert list(cached.cached(MODEL, a)) == local.encode_chat(a)

JSON_VALUES = [1, 1.0, True, "1", None, "None", 0.0, -0.0, 0, False, "", [], {}, [1], {"a": 1}, [["a", 1]],
               {"a": [1]}, {"a": {"b": 1}}, [1, 2], [2, 1], {"a": 1, "b": 2}, {"b": 2, "a": 1}, 1e300, 10**30,
               float("inf"), float("-inf"), 1e16, 10**16, "é", "\\u00e9", '"', "\\", "\n", "\\n", "\ud800", {"é": 1}]


@pytest.mark.parametrize("item_of", [
    lambda v: ChatInput(messages=({"role": "user", "content": v},)),
    lambda v: ChatInput(messages=({"role": "user", "content": "x"},), tools=({"type": "function", "x": v},)),
    lambda v: ChatInput(messages=({"role": "user", "content": "x"},), chat_template_kwargs={"flag": v}),
])
def test_request_keys_tell_apart_whatever_a_template_could_render_differently(item_of) -> None:
    """Equal keys only for inputs equal in value, type, order and sign: `1`, `1.0` and `true`, `0.0` and `-0.0`,
    key orders, and lists and objects of the same contents all render differently in a template."""
    keys = [_request_key(item_of(v)) for v in JSON_VALUES]
    for i, a in enumerate(keys):
        for j, b in enumerate(keys):
            assert (a == b) == (i == j), (JSON_VALUES[i], JSON_VALUES[j])
        hash(a)
    copies = [_request_key(item_of(json.loads(json.dumps(v)))) for v in JSON_VALUES]
    assert copies == keys  # the same JSON parsed again gives the same key


def _same_to_a_template(a, b) -> bool:
    """Equal in value, type (lists and tuples alike: both are JSON arrays), key order and float digits."""
    kind = lambda v: list if type(v) is tuple else type(v)  # noqa: E731
    if kind(a) is not kind(b):
        return False
    if type(a) is dict:
        return len(a) == len(b) and all(ka == kb and type(ka) is type(kb) and _same_to_a_template(va, vb)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    if kind(a) is list:
        return len(a) == len(b) and all(_same_to_a_template(x, y) for x, y in zip(a, b))
    return repr(a) == repr(b) if type(a) is float else a == b


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.sampled_from([0.0, -0.0, 1.0, 1e300]),
                     st.sampled_from(["", "1", "a", "role", "content"]))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner) | st.dictionaries(
    st.sampled_from(["role", "content", "a", "1"]), inner, max_size=3), max_leaves=8)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.sampled_from(["", "x", "1"])}),
    st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]), _json, max_size=3), _json)
_chat = st.builds(lambda messages, tools, kwargs: ChatInput(messages=tuple(messages), tools=tools,
                                                            chat_template_kwargs=kwargs),
                  st.lists(_message, min_size=1, max_size=3), st.none() | st.tuples(_json).map(tuple),
                  st.none() | st.dictionaries(st.sampled_from(["a", "b"]), _json, max_size=2))


@settings(max_examples=400, deadline=None)
@given(a=_chat, b=_chat)
def test_request_keys_are_equal_exactly_for_inputs_a_template_cannot_tell_apart(a, b) -> None:
    """Whatever the inputs' shapes (messages of strings, which are keyed without a call per message, or
    anything else), keys meet only for inputs equal in every way a template could see."""
    same = all(_same_to_a_template(getattr(a, f), getattr(b, f)) for f in ("messages", "tools", "chat_template_kwargs"))
    assert (_request_key(a) == _request_key(b)) == same
    copy = ChatInput(messages=copy_module.deepcopy(a.messages), tools=copy_module.deepcopy(a.tools),
                     chat_template_kwargs=copy_module.deepcopy(a.chat_template_kwargs))
    assert _request_key(copy) == _request_key(a)  # the same input built again (other objects): the same key
    hash(_request_key(a))


def test_request_keys_of_prompts_and_chats_never_meet() -> None:
    assert _request_key(PromptInput(text="x")) != _request_key(PromptInput(text="x", add_special_tokens=False))
    chat = ChatInput(messages=({"role": "user", "content": "x"},))
    assert _request_key(chat) != _request_key(ChatInput(messages=chat.messages, add_generation_prompt=False))
    assert _request_key(chat) != _request_key(PromptInput(text="x"))


def test_values_json_has_no_form_for_are_keyed_by_type() -> None:
    """Bytes (no JSON form) are keyed by their _frozen form: apart from the text they spell, equal to themselves."""
    of = lambda v: _request_key(ChatInput(messages=({"role": "user", "content": "x", "extra": v},),  # noqa: E731
                                          tools=({"type": "function", "x": v},), chat_template_kwargs={"k": v}))
    assert of(b"x") == of(b"x") and of(b"x") != of("x") and of(b"x") != of(b"y")
    hash(of(b"x"))


def test_key_order_and_types_are_not_confused(local) -> None:
    cached, _ = make_cached(local)
    t1 = ({"type": "function", "function": {"name": "a", "b": 1}},)
    t2 = ({"type": "function", "function": {"b": 1, "name": "a"}},)
    t3 = ({"type": "function", "function": {"name": "a", "b": 1.0}},)
    msgs = ({"role": "user", "content": "x"},)

    async def go():
        for tools in (t1, t2, t3, t1):
            item = ChatInput(messages=msgs, tools=tools)
            assert await cached.tokenize(MODEL, item) == local.encode_chat(item)

    run(go())


def test_separator_inside_piece_falls_back_to_one_call_per_piece(local) -> None:
    """A backend whose pieces yield the separator id must not corrupt the split."""
    sep_id = Segmenter.from_local(local).separator[1]

    class Weird(CountingBackend):
        async def tokenize(self, model, item, *, base_url=None):
            ids = await super().tokenize(model, item, base_url=base_url)
            return [sep_id if i == 67 else i for i in ids]  # "a" encodes to the separator's id

    inner = Weird({MODEL: local})
    cached = CachedTokenizer(inner, segmenters={MODEL: Segmenter.from_local(local)}, options=NO_VERIFY)
    item = PromptInput(text="a b<|im_end|>c a", add_special_tokens=False)
    expected = [sep_id if i == 67 else i for i in local.encode_prompt(item.text, False)]
    assert run(cached.tokenize(MODEL, item)) == expected
    assert len(inner.calls) == 3  # the joined call, then one per piece


def test_lru_is_bounded_by_bytes() -> None:
    lru = ByteLRU(max_bytes=2000, max_entry_bytes=1000)
    for i in range(100):
        lru.put(i, list(range(50)), 10)
        assert lru.bytes <= 2000
    assert lru.get(99) is not None and lru.get(0) is None
    lru.put("huge", list(range(1000)), 10)
    assert lru.get("huge") is None


def test_template_failure_is_a_tokenizer_error(local) -> None:
    cached, _ = make_cached(local)
    item = ChatInput(messages=({"role": "user", "content": "x"},), add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(TokenizerError):
        run(cached.tokenize(MODEL, item))
    with pytest.raises(TokenizerError):
        run(cached.tokenize(MODEL, ChatInput(messages=({"role": "user", "content": [{"type": "image_url"}]},))))


def test_token_ids_given_directly_pass_through(local) -> None:
    cached, inner = make_cached(local)
    assert run(cached.tokenize(MODEL, PromptInput(token_ids=(5, 6, 7)))) == [5, 6, 7]
    assert inner.calls == []


def _tokenizer_with(tmp_path, pre_tokenizer, added_kw=None, post=None):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "▁": 2}, merges=[]))
    tok.pre_tokenizer = pre_tokenizer
    tok.add_special_tokens([AddedToken("<x>", **(added_kw or {}))])
    if post is not None:
        tok.post_processor = post
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    hf.save_pretrained(tmp_path)
    return LocalTokenizer.from_path(tmp_path)


def test_unsafe_configurations_are_refused(tmp_path) -> None:
    first = _tokenizer_with(tmp_path / "first", pre_tokenizers.Metaspace(prepend_scheme="first"))
    with pytest.raises(NotSegmentable, match="first"):
        Segmenter.from_local(first)
    stripping = _tokenizer_with(tmp_path / "lstrip", pre_tokenizers.Whitespace(), {"lstrip": True})
    with pytest.raises(NotSegmentable, match="lstrip"):
        Segmenter.from_local(stripping)


def test_metaspace_always_with_template_processing_is_exact(tmp_path) -> None:
    from tokenizers.processors import TemplateProcessing

    post = TemplateProcessing(single="<x> $A <x>", special_tokens=[("<x>", 3)])
    local = _tokenizer_with(tmp_path / "always", pre_tokenizers.Metaspace(prepend_scheme="always"), post=post)
    seg = Segmenter.from_local(local)
    cached = CachedTokenizer(LocalBackend({MODEL: local}), segmenters={MODEL: seg}, options=NO_VERIFY)
    for text in ["ab<x>ba", "<x><x>a", "a b <x> b a", ""]:
        for special in (True, False):
            assert run(cached.tokenize(MODEL, PromptInput(text=text, add_special_tokens=special))) == \
                local.encode_prompt(text, special), (text, special)


async def test_concurrent_misses_of_one_piece_are_fetched_once(local) -> None:
    class Slow(CountingBackend):
        async def tokenize(self, model, item, *, base_url=None):
            await asyncio.sleep(0.05)
            return await super().tokenize(model, item, base_url=base_url)

    inner = Slow({MODEL: local})
    cached = CachedTokenizer(inner, segmenters={MODEL: Segmenter.from_local(local)}, options=NO_VERIFY)
    system = {"role": "system", "content": "Shared instructions. " * 40}
    items = [ChatInput(messages=(system, {"role": "user", "content": f"q{i}"})) for i in range(8)]
    results = await asyncio.gather(*(cached.tokenize(MODEL, it) for it in items))
    assert results == [local.encode_chat(it) for it in items]
    assert sum("Shared instructions" in c.text for c in inner.calls) == 1


@pytest.mark.parametrize("failure", [TokenizerError("down"), TokenizerTimeout("timed out after 20 ms")])
async def test_failed_fetch_reaches_every_waiter_as_it_failed(local, failure) -> None:
    class Down(LocalBackend):
        async def tokenize(self, model, item, *, base_url=None):
            await asyncio.sleep(0.02)
            raise failure

    cached = CachedTokenizer(Down({MODEL: local}), segmenters={MODEL: Segmenter.from_local(local)})
    item = PromptInput(text="same text", add_special_tokens=False)
    results = await asyncio.gather(*(cached.tokenize(MODEL, item) for _ in range(3)), return_exceptions=True)
    assert [type(r) for r in results] == [type(failure)] * 3, results  # a timeout reaches the waiters as one
    assert cached._inflight == {}


async def test_a_waiter_fetches_the_piece_itself_when_its_fetcher_is_cancelled(local) -> None:
    # The request fetching a piece was cancelled (its deadline, or its client gone) while another waited on the
    # fetch: the waiter has its own time left and gets its tokens, not the other's cancellation as an error.
    class Slow(CountingBackend):
        started: list = []

        async def tokenize(self, model, item, *, base_url=None):
            self.started.append(item)
            await asyncio.sleep(0.05)
            return await super().tokenize(model, item, base_url=base_url)

    inner = Slow({MODEL: local})
    cached = CachedTokenizer(inner, segmenters={MODEL: Segmenter.from_local(local)}, options=NO_VERIFY)
    system = {"role": "system", "content": "Shared instructions. " * 40}
    first, second = (ChatInput(messages=(system, {"role": "user", "content": q})) for q in ("q1", "q2"))
    owner = asyncio.create_task(cached.tokenize(MODEL, first))
    await asyncio.sleep(0.01)  # the owner's fetch of the system prompt is under way
    waiter = asyncio.create_task(cached.tokenize(MODEL, second))
    await asyncio.sleep(0.01)  # the waiter waits on it
    owner.cancel()
    assert await waiter == local.encode_chat(second)
    assert owner.cancelled()
    assert sum("Shared instructions" in c.text for c in inner.started) == 2  # asked again by the waiter
    assert sum("Shared instructions" in c.text for c in inner.calls) == 1  # the owner's call never got its answer
    assert cached._inflight == {}


async def test_default_segmenter_applies_to_unlisted_models(local) -> None:
    inner = CountingBackend({})
    inner._default = local
    cached = CachedTokenizer(inner, default_segmenter=Segmenter.from_local(local), options=NO_VERIFY)
    system = {"role": "system", "content": "Common preamble. " * 20}
    for model in ("a", "b"):
        for q in ("x", "y"):
            item = ChatInput(messages=(system, {"role": "user", "content": q}))
            assert await cached.tokenize(model, item) == local.encode_chat(item)
    assert sum("Common preamble" in c.text for c in inner.calls) == 2  # once per model: pieces are keyed by model


def test_lru_skips_ids_that_do_not_fit_32_bits() -> None:
    lru = ByteLRU(max_bytes=10_000, max_entry_bytes=10_000)
    lru.put("big", [1 << 40], 3)
    lru.put("neg", [-1], 3)
    assert lru.get("big") is None and lru.get("neg") is None and lru.bytes == 0


async def test_local_files_that_are_not_the_engines_turn_pieces_off(local, tmp_path, caplog) -> None:
    import shutil

    other = tmp_path / "other"
    shutil.copytree(testdata.path(), other, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<|im_start|>' + message['role']", "<|im_start|>' + 'x'")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    wrong = Segmenter.from_local(LocalTokenizer.from_path(other))
    registry = CollectorRegistry()
    inner = CountingBackend({MODEL: local})
    cached = CachedTokenizer(inner, segmenters={MODEL: wrong}, registry=registry)
    for q in ("a", "b", "c"):
        item = ChatInput(messages=({"role": "user", "content": q},))
        assert await cached.tokenize(MODEL, item) == local.encode_chat(item)
    assert registry.get_sample_value("kvgate_tokenizer_cache_piece_mismatches_total") == 1
    assert "not add up" in caplog.text
    assert all(isinstance(c, ChatInput) for c in inner.calls[-2:])  # whole requests after the mismatch


async def test_matching_files_are_verified_then_trusted(local) -> None:
    inner = CountingBackend({MODEL: local})
    cached = CachedTokenizer(inner, segmenters={MODEL: Segmenter.from_local(local)}, options=CacheOptions(verify_requests=2))
    for q in ("a", "b", "c", "d"):
        item = ChatInput(messages=({"role": "user", "content": q},))
        assert await cached.tokenize(MODEL, item) == local.encode_chat(item)
    assert sum(isinstance(c, ChatInput) for c in inner.calls) == 2


def test_split_at_keeps_empty_parts_and_takes_any_sequence() -> None:
    from array import array

    from tokenizer.cache import _split_at

    assert _split_at([], 5) == [[]]
    assert _split_at([1, 2], 5) == [[1, 2]]
    assert _split_at([5, 1, 5, 5, 2], 5) == [[], [1], [], [2]]
    assert _split_at(array("I", [1, 5, 2, 5]), 5) == [[1], [2], []]


def test_piece_lookups_are_counted_once_per_distinct_piece(local) -> None:
    registry = CollectorRegistry()
    inner = CountingBackend({MODEL: local})
    cached = CachedTokenizer(inner, segmenters={MODEL: Segmenter.from_local(local)}, options=NO_VERIFY, registry=registry)
    system = {"role": "system", "content": "Shared rules."}
    first = ChatInput(messages=(system, {"role": "user", "content": "one"}))
    second = ChatInput(messages=(system, {"role": "user", "content": "two"}))

    async def go():
        assert await cached.tokenize(MODEL, first) == local.encode_chat(first)
        assert await cached.tokenize(MODEL, second) == local.encode_chat(second)

    run(go())
    pieces = [p for p in Segmenter.from_local(local).split(local.render_chat(second)) if isinstance(p, str)]
    sample = lambda result: registry.get_sample_value(  # noqa: E731
        "kvgate_tokenizer_cache_lookups_total", {"level": "piece", "result": result})
    # The second request misses only its own user turn; every other distinct piece was seen in the first.
    assert sample("miss") == len(set(pieces)) + 1
    assert sample("hit") == len(set(pieces)) - 1
    assert registry.get_sample_value("kvgate_tokenizer_cache_tokens_total", {"source": "backend"}) + \
        registry.get_sample_value("kvgate_tokenizer_cache_tokens_total", {"source": "cache"}) == \
        len(local.encode_chat(first)) + len(local.encode_chat(second))


@pytest.mark.parametrize("openmetrics", [False, True])
def test_metrics_expose_what_prometheus_client_would(local, openmetrics) -> None:
    import re

    from prometheus_client import Counter, Gauge, generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_om

    generate = generate_om if openmetrics else generate_latest
    ours = CollectorRegistry()
    cached = CachedTokenizer(CountingBackend({MODEL: local}), segmenters={MODEL: Segmenter.from_local(local)},
                             options=NO_VERIFY, registry=ours)
    system = {"role": "system", "content": "Shared rules."}

    def chat(q: str) -> ChatInput:
        return ChatInput(messages=(system, {"role": "user", "content": q}))

    async def go():
        for q in ("one", "one", "two", "one"):  # "one" kept whole once asked for twice, "two" not
            await cached.tokenize(MODEL, chat(q))
        assert cached.cached(MODEL, chat("one")) is not None and cached.cached(MODEL, chat("two")) is None

    run(go())
    m = cached._metrics
    assert m.request_hit == 2 and m.request_miss == 3 and m.piece_hit > 0 and m.tokens_cache > 0
    # The same numbers through prometheus_client's own metrics, registered in the order the cache's come in.
    theirs = CollectorRegistry()
    lookups = Counter("kvgate_tokenizer_cache_lookups", "Tokenizer cache lookups", ["level", "result"], registry=theirs)
    tokens = Counter("kvgate_tokenizer_cache_tokens", "Tokens returned, by where they came from", ["source"],
                     registry=theirs)
    ratio = Gauge("kvgate_tokenizer_cache_hit_ratio", "Fraction of returned tokens served from the cache",
                  registry=theirs)
    size = Gauge("kvgate_tokenizer_cache_bytes", "Approximate bytes held by the cache", registry=theirs)
    Counter("kvgate_tokenizer_cache_piece_mismatches", "Models whose pieces did not add up to the engine's tokens",
            registry=theirs)
    entries = Gauge("kvgate_tokenizer_cache_entries", "Entries held by the cache", registry=theirs)
    for labels, n in ((("request", "hit"), m.request_hit), (("request", "miss"), m.request_miss),
                      (("piece", "hit"), m.piece_hit), (("piece", "miss"), m.piece_miss)):
        lookups.labels(*labels).inc(n)
    tokens.labels("cache").inc(cached.tokens_cached)
    tokens.labels("backend").inc(cached.tokens_total - cached.tokens_cached)
    ratio.set(cached.hit_ratio)
    size.set(cached._lru.bytes)
    entries.set(len(cached._lru))

    def lines(registry):
        return [re.sub(r"^(\S*_created\S*) \S+$", r"\1 T", line) for line in generate(registry).decode().splitlines()]

    assert lines(ours) == lines(theirs)
    assert ours.get_sample_value("kvgate_tokenizer_cache_hit_ratio") == cached.hit_ratio > 0
    assert ours.get_sample_value("kvgate_tokenizer_cache_tokens_created", {"source": "cache"}) > 0
    with pytest.raises(ValueError):  # a second cache on the same registry collides, as prometheus_client's would
        CachedTokenizer(CountingBackend({MODEL: local}), registry=ours)


def _nested_tools(depth: int, leaf: object = 1) -> tuple:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return ({"type": "function", "function": {"name": "f", "parameters": value}},)


@pytest.mark.parametrize("depth", [10, 30, 31, 32, 33, 300, 450, 600, 950])
def test_deeply_nested_input_is_keyed_and_never_an_internal_error(local, depth) -> None:
    """JSON nests as deep as the parser allows (about 1000 levels); keys still tell inputs apart. Run on a
    thread of its own: the request path's stack is shallow, a test runner's (pytest-xdist's worker) is not."""
    done: list[BaseException | None] = []

    def body() -> None:
        try:
            _nested_input_is_keyed(local, depth)
        except BaseException as e:  # re-raised on the test's thread
            done.append(e)
        else:
            done.append(None)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    if done[0] is not None:
        raise done[0]


def _nested_input_is_keyed(local, depth: int) -> None:
    msgs = ({"role": "user", "content": "x"},)
    a, b = ChatInput(messages=msgs, tools=_nested_tools(depth)), ChatInput(messages=msgs, tools=_nested_tools(depth, 2))
    ka, kb = _request_key(a), _request_key(b)
    assert ka != kb and ka == _request_key(ChatInput(messages=msgs, tools=_nested_tools(depth)))
    hash(ka)
    cached, _ = make_cached(local)
    assert cached.cached(MODEL, a) is None
    try:  # the template may refuse such tools: a TokenizerError (routing on load), nothing else
        ids = run(cached.tokenize(MODEL, a))
    except TokenizerError:
        return
    assert run(cached.tokenize(MODEL, a)) == ids  # asked for twice: kept whole
    assert list(cached.cached(MODEL, a)) == ids


def test_input_too_deep_even_for_repr_is_a_tokenizer_error(local) -> None:
    msgs = ({"role": "user", "content": "x"},)
    too_deep = ChatInput(messages=msgs, tools=_nested_tools(100_000))
    with pytest.raises(TokenizerError):
        _request_key(too_deep)
    cached, _ = make_cached(local)
    assert cached.cached(MODEL, too_deep) is None
    with pytest.raises(TokenizerError):
        run(cached.tokenize(MODEL, too_deep))


def test_a_request_assembled_from_pieces_is_kept_whole_once_asked_for_twice(local) -> None:
    """Most requests are asked for once (each turn of a chat is a new one): assembled from cached pieces, they are
    not copied into the cache whole; the second time one is asked for, it is. Remembered among the last ONCE_KEPT
    first sightings. A request the inner tokenizer answers whole (no piece level) is kept at once, as before."""
    from tokenizer import cache as cache_mod

    cached, inner = make_cached(local)
    system = {"role": "system", "content": "Shared rules."}
    turns = [ChatInput(messages=(system, {"role": "user", "content": f"question {i}"})) for i in range(3)]
    for t in turns:
        assert list(cached.tokenize_now(MODEL, t)) == local.encode_chat(t)
    entries = len(cached._lru)  # the pieces only
    assert all(cached.cached(MODEL, t) is None for t in turns)
    assert list(cached.tokenize_now(MODEL, turns[0])) == local.encode_chat(turns[0])  # the second time: kept
    assert len(cached._lru) == entries + 1 and list(cached.cached(MODEL, turns[0])) == local.encode_chat(turns[0])
    for i in range(cache_mod.ONCE_KEPT):  # as many other first sightings: turns[1]'s is forgotten
        cached.tokenize_now(MODEL, ChatInput(messages=(system, {"role": "user", "content": f"other {i}"})))
    cached.tokenize_now(MODEL, turns[1])
    assert cached.cached(MODEL, turns[1]) is None  # a first sighting again
    cached.tokenize_now(MODEL, turns[1])
    assert cached.cached(MODEL, turns[1]) is not None
    whole = CachedTokenizer(CountingBackend({MODEL: local}), options=CacheOptions(verify_requests=0))
    run(whole.tokenize(MODEL, turns[2]))
    assert whole.cached(MODEL, turns[2]) is not None
