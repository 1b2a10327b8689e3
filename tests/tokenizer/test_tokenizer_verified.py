"""VerifiedTokenizer: local tokens serve a shape of request only after agreeing with the engine's, a sample
keeps being checked in the background, and one difference sends the model back to the engine.

The engine is a fake here (the project's tokenizer behind the Tokenizer protocol, counting calls); the
end-to-end proof against `kvgate sim` is in test_tokenizer_exact.py."""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tokenizer import testdata
from tokenizer.local import LocalBackend, LocalTokenizer
from tokenizer.types import ChatInput, PromptInput, TokenizerError
from tokenizer.verified import VerifiedTokenizer, VerifyOptions, shape_of

MODEL = "m"


class Engine:
    """Stands in for an engine's /tokenize: the project's tokenizer, counting calls, failing on demand."""

    def __init__(self, local: LocalTokenizer) -> None:
        self.backend = LocalBackend(default=local)
        self.calls = 0
        self.fail = False

    async def tokenize(self, model, item, *, base_url=None):
        self.calls += 1
        if self.fail:
            raise TokenizerError("engine down")
        return await self.backend.tokenize(model, item)

    async def aclose(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine_tok() -> LocalTokenizer:
    return LocalTokenizer.from_path(testdata.path())


def _with_template(tmp: Path, template: str) -> LocalTokenizer:
    """The test tokenizer with another chat template: local files that are not quite the engine's."""
    d = tmp / "tok"
    shutil.copytree(testdata.path(), d, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return LocalTokenizer.from_path(d)


def chat(text: str, **kw) -> ChatInput:
    return ChatInput(messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": text}), **kw)


def disagreements(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("kvgate_tokenizer_local_disagreements_total", {"model": MODEL}) or 0.0


async def test_local_serves_only_after_n_agreements_then_the_engine_is_not_asked(engine_tok) -> None:
    engine = Engine(engine_tok)
    registry = CollectorRegistry()
    tok = VerifiedTokenizer(engine, local=engine_tok, options=VerifyOptions(verify_requests=3, sample_rate=0.0),
                            registry=registry)
    for i in range(3):
        assert await tok.tokenize(MODEL, chat(f"question {i}")) == engine_tok.encode(chat(f"question {i}"))
        assert tok.status()[MODEL]["state"] == "verifying"
    await tok.settle()
    assert engine.calls == 3
    assert tok.status()[MODEL]["state"] == "serving" and tok.status()[MODEL]["verified"] == ["chat", "prompt-raw"]
    for i in range(3, 20):
        assert await tok.tokenize(MODEL, chat(f"question {i}")) == engine_tok.encode(chat(f"question {i}"))
    assert engine.calls == 3, "a verified shape must not wait for the engine"
    assert tok.status()[MODEL]["served"] == {"local": 17, "remote": 3}
    assert registry.get_sample_value("kvgate_tokenizer_path_requests_total", {"model": MODEL, "path": "local"}) == 17
    assert disagreements(registry) == 0


async def test_each_shape_is_verified_on_its_own(engine_tok) -> None:
    engine = Engine(engine_tok)
    tok = VerifiedTokenizer(engine, local=engine_tok, options=VerifyOptions(verify_requests=1, sample_rate=0.0))
    await tok.tokenize(MODEL, chat("a"))
    await tok.settle()
    calls = engine.calls
    tools = ({"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},)
    for item in (chat("b", tools=tools), chat("c", add_generation_prompt=False), PromptInput(text="plain")):
        await tok.tokenize(MODEL, item)
        assert engine.calls == calls + 1, f"{shape_of(item)} was served before it was verified"
        calls = engine.calls
    await tok.settle()
    assert set(tok.status()[MODEL]["verified"]) == {"chat", "chat+tools", "chat+no-gen", "prompt", "prompt-raw"}


async def test_a_verified_chat_shape_verifies_text_without_special_tokens(engine_tok) -> None:
    engine = Engine(engine_tok)
    tok = VerifiedTokenizer(engine, local=engine_tok, options=VerifyOptions(verify_requests=1, sample_rate=0.0))
    await tok.tokenize(MODEL, chat("a"))
    await tok.settle()
    calls = engine.calls
    assert await tok.tokenize(MODEL, PromptInput(text="piece", add_special_tokens=False)) == \
        engine_tok.encode_prompt("piece", add_special_tokens=False)
    await tok.tokenize(MODEL, PromptInput(text="with specials"))  # not implied: the engine answers
    assert engine.calls == calls + 1


async def test_a_wrong_template_is_caught_before_it_serves(engine_tok, tmp_path, caplog) -> None:
    wrong = _with_template(tmp_path, engine_tok.hf.chat_template.replace("<|im_start|>assistant\\n",
                                                                         "<|im_start|>assistant \\n"))
    engine = Engine(engine_tok)
    registry = CollectorRegistry()
    dropped = []
    tok = VerifiedTokenizer(engine, local=wrong, options=VerifyOptions(verify_requests=3, sample_rate=0.0),
                            registry=registry, on_disagreement=dropped.append)
    with caplog.at_level(logging.ERROR, logger="tokenizer.verified"):
        assert await tok.tokenize(MODEL, chat("which template?")) == engine_tok.encode(chat("which template?"))
        await tok.settle()
    assert disagreements(registry) == 1 and dropped == [MODEL]
    status = tok.status()[MODEL]
    assert status["state"] == "disabled" and status["disagreement"]["shape"] == "chat"
    assert "which template?" in caplog.text and "differ from the engine's" in caplog.text
    for i in range(5):  # the engine tokenizes this model from now on, and its tokens are the answer
        assert await tok.tokenize(MODEL, chat(f"after {i}")) == engine_tok.encode(chat(f"after {i}"))
    await tok.settle()
    assert engine.calls == 6 and tok.status()[MODEL]["served"]["local"] == 0
    assert disagreements(registry) == 1


async def test_a_sampled_check_catches_a_difference_after_verification(engine_tok, tmp_path) -> None:
    # Wrong only for messages mentioning a zebra: invisible to the first requests.
    template = engine_tok.hf.chat_template.replace(
        "{{- message['content'] -}}", "{{- message['content'] | replace('zebra', 'zebra ') -}}")
    assert template != engine_tok.hf.chat_template
    wrong = _with_template(tmp_path, template)
    engine = Engine(engine_tok)
    registry = CollectorRegistry()
    tok = VerifiedTokenizer(engine, local=wrong, options=VerifyOptions(verify_requests=2, sample_rate=1.0),
                            registry=registry)
    for text in ("one", "two"):
        await tok.tokenize(MODEL, chat(text))
    await tok.settle()
    assert tok.status()[MODEL]["state"] == "serving"
    calls = engine.calls
    await tok.tokenize(MODEL, chat("a zebra"))  # served locally (and wrong), checked in the background
    assert tok.status()[MODEL]["served"]["local"] == 1
    await tok.settle()
    assert engine.calls == calls + 1 and disagreements(registry) == 1
    assert tok.status()[MODEL]["state"] == "disabled"
    assert await tok.tokenize(MODEL, chat("a zebra")) == engine_tok.encode(chat("a zebra"))
    assert tok.status()[MODEL]["served"]["local"] == 1


async def test_media_parts_go_to_the_engine_with_a_clear_refusal(engine_tok) -> None:
    engine = Engine(engine_tok)
    tok = VerifiedTokenizer(engine, local=engine_tok, options=VerifyOptions(verify_requests=1, sample_rate=0.0))
    await tok.tokenize(MODEL, chat("warm"))
    await tok.settle()
    image = ChatInput(messages=({"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]},))
    with pytest.raises(ValueError, match="image_url part needs the engine's multimodal processor"):
        engine_tok.encode(image)
    calls = engine.calls
    with pytest.raises(TokenizerError, match="image_url"):  # the stand-in engine has no images either
        await tok.tokenize(MODEL, image)
    assert engine.calls == calls + 1 and tok.status()[MODEL]["state"] == "serving"


async def test_engine_failures_during_checks_prove_nothing(engine_tok) -> None:
    engine = Engine(engine_tok)
    tok = VerifiedTokenizer(engine, local=engine_tok, options=VerifyOptions(verify_requests=1, sample_rate=1.0))
    await tok.tokenize(MODEL, chat("warm"))
    await tok.settle()
    engine.fail = True
    assert await tok.tokenize(MODEL, chat("while the engine is down")) == engine_tok.encode(chat("while the engine is down"))
    await tok.settle()
    status = tok.status()[MODEL]
    assert status["checks"]["remote_error"] == 1 and status["state"] == "serving"


async def test_checks_beyond_the_limit_are_skipped_and_counted(engine_tok) -> None:
    gate = asyncio.Event()

    class Slow(Engine):
        async def tokenize(self, model, item, *, base_url=None):
            if self.calls >= 1:
                await gate.wait()
            return await super().tokenize(model, item)

    engine = Slow(engine_tok)
    tok = VerifiedTokenizer(engine, local=engine_tok,
                            options=VerifyOptions(verify_requests=1, sample_rate=1.0, max_checks=2))
    await tok.tokenize(MODEL, chat("warm"))
    await tok.settle()
    for i in range(5):
        await tok.tokenize(MODEL, chat(f"q{i}"))
    assert tok.status()[MODEL]["checks"]["skipped"] == 3
    gate.set()
    await tok.settle()
    assert tok.status()[MODEL]["checks"]["agree"] == 3


async def test_files_loaded_in_the_background_then_verified(engine_tok) -> None:
    release = threading.Event()
    asked = []

    def load(model: str) -> LocalTokenizer:
        asked.append(model)
        if model == "unknown":
            raise ValueError("no such repository")
        release.wait(10)
        return engine_tok

    engine = Engine(engine_tok)
    tok = VerifiedTokenizer(engine, load=load, options=VerifyOptions(verify_requests=1, sample_rate=0.0))
    await tok.tokenize(MODEL, chat("while loading"))
    assert tok.status()[MODEL]["state"] == "loading" and engine.calls == 1
    release.set()
    await tok.settle()
    assert tok.status()[MODEL]["state"] == "verifying"
    await tok.tokenize(MODEL, chat("now"))
    await tok.settle()
    await tok.tokenize(MODEL, chat("local"))
    assert engine.calls == 2 and tok.status()[MODEL]["state"] == "serving"
    await tok.tokenize("unknown", chat("x"))
    await tok.settle()
    assert tok.status()["unknown"]["state"] == "unavailable" and "no such repository" in tok.status()["unknown"]["error"]
    assert asked == [MODEL, "unknown"]  # once per model
    await tok.aclose()


async def test_the_piece_cache_serves_only_verified_shapes_and_its_answers_are_sampled(engine_tok, tmp_path) -> None:
    from tokenizer.cache import CachedTokenizer, CacheOptions
    from tokenizer.segments import Segmenter

    template = engine_tok.hf.chat_template.replace(
        "{{- message['content'] -}}", "{{- message['content'] | replace('zebra', 'zebra ') -}}")
    wrong = _with_template(tmp_path, template)
    engine = Engine(engine_tok)
    registry = CollectorRegistry()
    verified = VerifiedTokenizer(engine, local=wrong, options=VerifyOptions(verify_requests=2, sample_rate=1.0),
                                 registry=registry)
    cache = CachedTokenizer(verified, default_segmenter=Segmenter.from_local(wrong), registry=registry,
                            options=CacheOptions(verify_requests=1), trust=verified.trusts, observe=verified.observe)
    verified.on_disagreement = lambda model: cache.clear()
    tools = ({"type": "function", "function": {"name": "f"}},)
    assert not verified.trusts(MODEL, chat("x"))
    for text in ("one", "two"):
        await cache.tokenize(MODEL, chat(text))
    await verified.settle()
    assert verified.trusts(MODEL, chat("x")) and not verified.trusts(MODEL, chat("x", tools=tools))
    calls = engine.calls
    await cache.tokenize(MODEL, chat("three", tools=tools))  # not verified: whole, by the engine
    assert engine.calls == calls + 1
    await cache.tokenize(MODEL, chat("a zebra"))  # pieces, checked once against the (wrong) local whole
    await cache.tokenize(MODEL, chat("another zebra"))  # pieces again; observed and sampled
    await verified.settle()
    assert disagreements(registry) == 1 and not verified.trusts(MODEL, chat("x"))
    assert await cache.tokenize(MODEL, chat("another zebra")) == engine_tok.encode(chat("another zebra"))


async def test_models_no_engine_serves_are_not_tracked(engine_tok) -> None:
    engine = Engine(engine_tok)
    tok = VerifiedTokenizer(engine, local=engine_tok, known=lambda m: m == MODEL,
                            options=VerifyOptions(verify_requests=1, sample_rate=0.0, max_models=2))
    await tok.tokenize("made-up", chat("x"))
    await tok.tokenize(MODEL, chat("x"))
    assert set(tok.status()) == {MODEL} and engine.calls == 2
    open_tok = VerifiedTokenizer(engine, local=engine_tok, options=VerifyOptions(max_models=2))
    for name in ("a", "b", "c", "d"):
        await open_tok.tokenize(name, chat("x"))
    await open_tok.settle()
    assert set(open_tok.status()) == {"a", "b"}


async def test_a_failed_load_is_tried_again_later(engine_tok) -> None:
    now = [0.0]
    attempts = []
    loaded = []

    def load(model: str) -> LocalTokenizer:
        attempts.append(now[0])
        if len(attempts) == 1:
            raise OSError("hub unreachable")
        return engine_tok

    tok = VerifiedTokenizer(Engine(engine_tok), load=load, retry_s=60.0, clock=lambda: now[0],
                            on_loaded=lambda model, local: loaded.append(model))
    await tok.tokenize(MODEL, chat("a"))
    await tok.settle()
    assert tok.status()[MODEL]["state"] == "unavailable"
    now[0] = 30.0
    await tok.tokenize(MODEL, chat("b"))
    await tok.settle()
    assert attempts == [0.0]  # not before retry_s
    now[0] = 61.0
    await tok.tokenize(MODEL, chat("c"))
    await tok.settle()
    assert attempts == [0.0, 61.0] and tok.status()[MODEL]["state"] == "verifying" and loaded == [MODEL]
    assert tok.status()[MODEL]["error"] is None
