"""The tokenizers' answers without a wait (`tokenize_now`): the same ids and the same counts as the awaited
call, or None with nothing done when that call would wait (then the awaited call does all of it)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tokenizer import testdata
from tokenizer.cache import CachedTokenizer, CacheOptions
from tokenizer.local import LocalBackend, LocalTokenizer
from tokenizer.segments import Segmenter
from tokenizer.remote import RemoteTokenizer
from tokenizer.types import ChatInput, PromptInput, TokenizerError, TokenizesNow
from tokenizer.verified import VerifiedTokenizer, VerifyOptions

MODEL = "m"


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer.from_path(testdata.path())


def samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples
            if not s.name.endswith("_created")}


def chats() -> list:
    system = {"role": "system", "content": "You are a careful assistant. " * 8}
    turns = [ChatInput(messages=(system, {"role": "user", "content": f"question {i}"})) for i in range(4)]
    return [*turns, turns[0], PromptInput(text="a plain prompt"), PromptInput(text="a plain prompt"),
            ChatInput(messages=(system, {"role": "user", "content": "question 1"}, {"role": "assistant", "content": "ok"},
                                {"role": "user", "content": "and then?"}))]


@pytest.mark.parametrize("verify", [0, 3])
@pytest.mark.parametrize("segmented", [True, False])
def test_now_then_awaited_gives_the_awaited_calls_ids_and_counts(local, verify, segmented) -> None:
    def make():
        registry = CollectorRegistry()
        segmenters = {MODEL: Segmenter.from_local(local)} if segmented else None
        return CachedTokenizer(LocalBackend({MODEL: local}), segmenters=segmenters,
                               options=CacheOptions(verify_requests=verify), registry=registry), registry

    now_cache, now_registry = make()
    awaited_cache, awaited_registry = make()
    answered_now = 0

    async def go():
        nonlocal answered_now
        for item in chats():
            ids = now_cache.tokenize_now(MODEL, item)
            answered_now += ids is not None
            if ids is None:
                ids = await now_cache.tokenize_ids(MODEL, item)
            expected = await awaited_cache.tokenize_ids(MODEL, item)
            assert list(ids) == list(expected) == local.encode(item)

    asyncio.run(go())
    assert samples(now_registry) == samples(awaited_registry)
    # short inputs are encoded on the calling thread: every one is answered now, but for the pieces of a
    # model's first requests, which are checked against a whole-request call first
    assert answered_now == (len(chats()) - verify if segmented else len(chats()))


def test_now_is_none_and_counts_nothing_when_the_inner_call_would_wait(local) -> None:
    registry = CollectorRegistry()
    # every input runs in a worker thread (offload_chars=1): the backend has no answer without a wait
    cache = CachedTokenizer(LocalBackend({MODEL: local}, offload_chars=1), registry=registry)
    item = ChatInput(messages=({"role": "user", "content": "hello there"},))
    before = samples(registry)
    assert cache.tokenize_now(MODEL, item) is None
    assert samples(registry) == before
    assert list(asyncio.run(cache.tokenize_ids(MODEL, item))) == local.encode(item)
    assert registry.get_sample_value("kvgate_tokenizer_cache_lookups_total", {"level": "request", "result": "miss"}) == 1
    assert list(cache.tokenize_now(MODEL, item)) == local.encode(item)  # now a hit


def test_now_without_an_inner_answer_serves_hits_only(local) -> None:
    class Remote:  # the Tokenizer protocol alone: every call may wait
        async def tokenize(self, model, item, *, base_url=None):
            return local.encode(item)

        async def aclose(self):
            pass

    cache = CachedTokenizer(Remote())
    item = PromptInput(text="hello")
    assert cache.tokenize_now(MODEL, item) is None
    assert asyncio.run(cache.tokenize_ids(MODEL, item)) == local.encode(item)
    assert list(cache.tokenize_now(MODEL, item)) == local.encode(item)
    assert cache.tokenize_now(MODEL, PromptInput(token_ids=(3, 4))) == [3, 4]


def test_now_raises_what_the_awaited_call_raises_and_counts_the_miss(local) -> None:
    registry = CollectorRegistry()
    cache = CachedTokenizer(LocalBackend({MODEL: local}), segmenters={MODEL: Segmenter.from_local(local)},
                            registry=registry)
    bad = ChatInput(messages=({"role": "user", "content": "x"},), chat_template="{{ raise_exception('no') }}")
    with pytest.raises(TokenizerError):
        cache.tokenize_now(MODEL, bad)
    assert registry.get_sample_value("kvgate_tokenizer_cache_lookups_total", {"level": "request", "result": "miss"}) == 1


class Engine:
    def __init__(self, local: LocalTokenizer) -> None:
        self.backend = LocalBackend(default=local)
        self.calls = 0

    async def tokenize(self, model, item, *, base_url=None):
        self.calls += 1
        return await self.backend.tokenize(model, item)

    async def aclose(self) -> None:
        pass


async def test_verified_answers_now_only_for_a_verified_shape(local) -> None:
    engine = Engine(local)
    verified = VerifiedTokenizer(engine, local=local, options=VerifyOptions(verify_requests=1, sample_rate=0.0))
    item = ChatInput(messages=({"role": "user", "content": "hi"},))
    assert verified.tokenize_now(MODEL, item) is None  # the model is not known yet: the engine's answer first
    assert await verified.tokenize(MODEL, item) == local.encode(item)
    await verified.settle()  # the shape's check against the engine
    calls = engine.calls
    assert verified.tokenize_now(MODEL, item) == local.encode(item)
    assert engine.calls == calls
    assert verified.status()[MODEL]["served"]["local"] == 1


def test_the_tokenizers_that_answer_now_say_so_by_their_protocol(local) -> None:
    """The request path and the cache find `tokenize_now` through the TokenizesNow protocol: the
    tokenizers that have it are recognised, the remote one (it always waits) is not."""
    backend = LocalBackend({MODEL: local})
    assert isinstance(backend, TokenizesNow)
    assert isinstance(CachedTokenizer(backend, registry=CollectorRegistry()), TokenizesNow)
    assert isinstance(VerifiedTokenizer(RemoteTokenizer(), local=local,
                                        options=VerifyOptions(verify_requests=1, sample_rate=0.0)), TokenizesNow)
    assert not isinstance(RemoteTokenizer(), TokenizesNow)
