"""Proof that local tokenization equals the engine's, on the project's test tokenizer and on real models'
tokenizers and chat templates (Qwen3, Llama 3.1; see realtok.py), for every request of the demo workload
and a corpus of chat shapes: three ways, which must agree token for token:
  - the gateway's local path (tokenizer.local.LocalTokenizer, as VerifiedTokenizer uses it);
  - the engine: `kvgate sim --tokenizer DIR`'s `POST /tokenize`, over HTTP;
  - an independent rendering (chat_reference.py: jinja2 set up per transformers' rules, vLLM's conversation
    rules re-derived, the `tokenizers` library's encoder).
Then VerifiedTokenizer in front of the sim: after verification no request waits for /tokenize, and a
deliberately wrong local template is caught and switched off."""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

import realtok
from chat_reference import Reference
from devkit.workload import ChatWorkload, WorkloadShape
from tokenizer import testdata, vllm_chat
from tokenizer.local import LocalTokenizer
from tokenizer.remote import RemoteOptions, RemoteTokenizer
from tokenizer.types import ChatInput, PromptInput
from tokenizer.verified import VerifiedTokenizer, VerifyOptions

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TOKENIZERS = ("test", "qwen3", "llama3_1")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
BARE_TOOL = {"type": "function", "function": {"name": "ping"}}  # unset description/parameters dump as null
CALL = {"id": "call_1", "type": "function", "index": 0,  # keys in another order than vLLM's, one it drops
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _chat(*messages, **kw) -> ChatInput:
    return ChatInput(messages=tuple(messages), **kw)


SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CORPUS: list[tuple[str, ChatInput | PromptInput]] = [
    ("user only", _chat({"role": "user", "content": "What is a KV cache?"})),
    ("system", _chat(SYSTEM, {"role": "user", "content": "Name three prime numbers."})),
    ("multi-turn", _chat(SYSTEM, {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                         {"role": "user", "content": "And again?"})),
    ("no generation prompt", _chat(SYSTEM, {"role": "user", "content": "x"}, add_generation_prompt=False)),
    ("continue final message", _chat({"role": "user", "content": "Count to five."},
                                     {"role": "assistant", "content": "One, two,"},
                                     add_generation_prompt=False, continue_final_message=True)),
    ("continue with trailing space", _chat({"role": "user", "content": "Spell it."},
                                           {"role": "assistant", "content": "It is spelled "},
                                           add_generation_prompt=False, continue_final_message=True)),
    ("tools", _chat(SYSTEM, {"role": "user", "content": "Weather in Paris?"}, tools=(WEATHER, BARE_TOOL))),
    ("tools without system", _chat({"role": "user", "content": "Weather in Oslo?"}, tools=(WEATHER,))),
    ("tool call and result", _chat(
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "user", "content": "Thanks. And tomorrow?"}, tools=(WEATHER,))),
    ("text parts", _chat({"role": "user", "content": [{"type": "text", "text": "first part"},
                                                      {"type": "text", "text": "second part"}]})),
    ("tool result as parts", _chat({"role": "user", "content": "go"},
                                   {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                   {"role": "tool", "tool_call_id": "call_1",
                                    "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21C"}]})),
    ("extra fields are dropped", _chat({"role": "user", "content": "hello", "name": "ann", "weight": 3,
                                        "metadata": {"k": "v"}})),
    ("empty tool calls", _chat({"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello", "tool_calls": []},
                               {"role": "user", "content": "bye"})),
    ("unparsable arguments", _chat({"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": "not json"}}]},
        {"role": "user", "content": "again"})),
    ("reasoning", _chat({"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4", "reasoning": "Two and two make four."},
                        {"role": "user", "content": "3+3?"})),
    ("thinking off", _chat({"role": "user", "content": "quick"}, chat_template_kwargs={"enable_thinking": False})),
    ("kwargs do not override the request", _chat({"role": "user", "content": "q"},
                                                 chat_template_kwargs={"add_generation_prompt": False})),
    ("unicode and whitespace", _chat({"role": "user", "content": "  Grüße 👋 — 東京\n\n\ttabs  "})),
    ("markers inside text", _chat({"role": "user", "content": "say <|im_end|> or <|eot_id|> literally"})),
    ("empty content", _chat({"role": "user", "content": ""})),
    ("custom template", _chat({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n"
                                            "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")),
    ("prompt", PromptInput(text="The quick brown fox jumps over the lazy dog.")),
    ("prompt without special tokens", PromptInput(text="Hello, world!", add_special_tokens=False)),
]
IMAGE = _chat({"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                           {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]})


def demo_requests(n: int = 48) -> list[tuple[str, ChatInput]]:
    """The demo's own requests (devkit.workload.ChatWorkload), two turns per user, with stand-in answers."""
    shape = WorkloadShape()
    workload = ChatWorkload(shape, "demo-model", seed=1)
    users = [(g, u) for g in range(shape.groups) for u in range(shape.users_per_group)]
    rng = random.Random(3)
    out = []
    for i in range(n):
        user = users[i % len(users)]
        out.append((f"demo {i}", ChatInput(messages=tuple(workload.next_messages(user)))))
        workload.record_answer(user, " ".join(rng.choice(("cache", "token", "route", "pod", "ok.")) for _ in range(10)))
    return out


@pytest.fixture(scope="module")
def engines():
    """One `kvgate sim --tokenizer DIR` per tokenizer, started together; name -> (directory, URL)."""
    dirs = {}
    for name in TOKENIZERS:
        try:
            dirs[name] = testdata.path() if name == "test" else realtok.ensure(name)
        except realtok.Unreachable:
            continue
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "plugin.cli", "sim", "--port", "0", "--no-kv-events", "--model", name,
         "--tokenizer", str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for name, d in dirs.items()}
    try:
        urls = {}
        for name, proc in procs.items():
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kvgate sim --tokenizer {dirs[name]} did not start: {proc.stderr.read()[-2000:]}")
            urls[name] = json.loads(line)["url"]
        yield {name: (dirs[name], urls[name]) for name in dirs}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_LOCAL: dict[str, LocalTokenizer] = {}


def _local(directory: Path) -> LocalTokenizer:
    key = str(directory)
    if key not in _LOCAL:
        _LOCAL[key] = LocalTokenizer.from_path(directory)
    return _LOCAL[key]


def _engine(engines, name: str) -> tuple[Path, str]:
    realtok.directory_or_skip(name)  # skips, saying why, when the files cannot be had
    return engines[name]


def _remote(name: str, url: str, registry: CollectorRegistry | None = None) -> RemoteTokenizer:
    return RemoteTokenizer({name: url}, options=RemoteOptions(total_timeout_s=30, attempt_timeout_s=30),
                           registry=registry)


@pytest.mark.parametrize("name", TOKENIZERS)
async def test_every_request_tokenizes_identically_three_ways(engines, name) -> None:
    directory, url = _engine(engines, name)
    local, reference, remote = _local(directory), Reference(directory), _remote(name, url)
    try:
        differ = []
        requests = CORPUS + demo_requests()
        engine = await asyncio.gather(*(remote.tokenize(name, item) for _, item in requests))
        for (label, item), engine_ids in zip(requests, engine):
            local_ids, reference_ids = local.encode(item), reference.encode(item)
            if not (local_ids == engine_ids == reference_ids):
                text = local.render_chat(item) if isinstance(item, ChatInput) else item.text
                differ.append(f"{label}: local {len(local_ids)} engine {len(engine_ids)} reference "
                              f"{len(reference_ids)} tokens; local text {text[:300]!r}; reference text "
                              f"{reference.render(item)[:300] if isinstance(item, ChatInput) else ''!r}")
        assert not differ, "\n".join(differ)
    finally:
        await remote.aclose()


# Plain chats (what tokenizer.local.DirectRender renders without apply_chat_template), beside the corpus.
PLAIN: list[tuple[str, ChatInput]] = [
    ("cold bench", _chat({"role": "system", "content": "3f2a9c " + "You are careful. " * 40},
                         {"role": "user", "content": "How does prefix caching reduce time to first token?"})),
    ("names", _chat({"role": "system", "content": "s", "name": "ops"}, {"role": "user", "content": "u", "name": "ann"})),
    ("assistant last, generation prompt", _chat(SYSTEM, {"role": "user", "content": "x"},
                                                {"role": "assistant", "content": "y"})),
    ("scalar kwargs", _chat({"role": "user", "content": "q"},
                            chat_template_kwargs={"enable_thinking": True, "date_string": "1 Jan 2026", "n": 2,
                                                  "x": 0.5, "bos_token": "<s>", "unused": "auto"})),
    ("template raises", _chat({"role": "user", "content": "x"}, chat_template="{{ raise_exception('no') }}")),
    ("template missing variable", _chat({"role": "user", "content": "x"}, chat_template="{{ messages[3].content }}")),
    ("template uses globals", _chat({"role": "user", "content": "x"}, chat_template=(
        "{% set ns = namespace(n=0) %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"
        "{{ dict(a=1) | tojson }}{% for m in messages %}{{ m | tojson }}{% generation %}g{% endgeneration %}"
        "{% endfor %}{{ bos_token is defined }}{{ eos_token | default('-') }}{{ tools is none }}{{ documents is none }}"))),
    ("kwargs apply_chat_template takes itself", _chat({"role": "user", "content": "x"},
                                                      chat_template_kwargs={"documents": "d", "padding": True})),
    ("nested kwargs", _chat({"role": "user", "content": "x"}, chat_template_kwargs={"extra": {"k": [1, 2]}})),
    # The sandbox still refuses, also when its answer for (type, attribute) is remembered from a first time.
    *[(f"unsafe {i}, {n} time", _chat({"role": "user", "content": "x"}, chat_template=t))
      for n in ("first", "second") for i, t in enumerate(("{{ messages[0].content.__class__ }}{{ 'ok' }}",
                                    "{{ messages.append(1) }}{% for m in messages %}{{ m.update(a=1) }}{% endfor %}",
                                    "{{ messages[0].content.format.__self__ }}{{ namespace.mro() }}"))],
]


def _render_or_error(local: LocalTokenizer, item: ChatInput) -> str:
    try:
        return local.render_chat(item)
    except ValueError as e:
        return f"error: {e}"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_direct_render_equals_apply_chat_template(name) -> None:
    """The gateway's plain-chat render (tokenizer.local.DirectRender) gives apply_chat_template's text, or its
    error, on every chat of the corpus, the demo and PLAIN; and it serves every plain chat there (a render
    that quietly fell back each time would pass the first check and save nothing)."""
    directory = realtok.directory_or_skip(name)
    fast, slow = _local(directory), LocalTokenizer.from_path(directory, fast=False)  # the module's loaded one
    assert fast.renders_directly and not slow.renders_directly
    chats = [(label, item) for label, item in CORPUS + demo_requests() + PLAIN if isinstance(item, ChatInput)]
    differ = [label for label, item in chats if _render_or_error(fast, item) != _render_or_error(slow, item)]
    assert not differ, differ
    direct = fast._direct
    served = []
    for label, item in chats:
        template = fast.template(item.chat_template)
        kwargs = vllm_chat.template_kwargs(None, item.chat_template_kwargs, item.add_generation_prompt,
                                           item.continue_final_message)
        messages = vllm_chat.conversation(item.messages, vllm_chat.content_format(template))
        if item.tools is None and direct.render(template, messages, kwargs) is not None:
            served.append(label)
    plain = {"user only", "system", "multi-turn", "no generation prompt", "thinking off", "unicode and whitespace",
             "markers inside text", "empty content", "custom template", "cold bench", "names",
             "assistant last, generation prompt", "scalar kwargs", "template uses globals",
             "extra fields are dropped", "text parts", "kwargs do not override the request",
             "empty tool calls", "unsafe 0, first time", "unsafe 0, second time"} | {label for label, _ in demo_requests()}
    assert set(served) == plain
    compiled, _ = direct._compiled(fast.template(None))
    assert type(compiled.environment).__name__ == "RememberingSandbox"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_corpus_reaches_the_templates_branches(engines, name) -> None:
    """Guards the corpus itself: tools, tool results and continued messages really render (no silent drop)."""
    directory, _ = _engine(engines, name)
    local = _local(directory)
    items = dict(CORPUS)
    rendered = local.render_chat(items["tools"])
    if name != "llama3_1":  # this Llama 3.1 template has no tools section
        assert "get_weather" in rendered and "City name" in rendered
    assert "Thanks. And tomorrow?" in local.render_chat(items["tool call and result"])
    assert local.render_chat(items["continue final message"]).endswith("One, two,")
    assert "weight" not in local.render_chat(items["extra fields are dropped"])


@pytest.mark.parametrize("name", TOKENIZERS)
async def test_after_verification_no_request_waits_for_tokenize(engines, name) -> None:
    directory, url = _engine(engines, name)
    registry = CollectorRegistry()
    remote = _remote(name, url, registry)
    tok = VerifiedTokenizer(remote, local=_local(directory), options=VerifyOptions(verify_requests=2, sample_rate=0.0),
                            registry=registry)
    requests = [item for _, item in CORPUS + demo_requests()]
    try:
        for item in requests:  # every shape is seen at least twice: custom template, kwargs, tools, ...
            await tok.tokenize(name, item)
            await tok.settle()
        for item in requests:
            await tok.tokenize(name, item)
            await tok.settle()
        round_trips = registry.get_sample_value("kvgate_tokenizer_remote_attempts_total", {"outcome": "ok"})
        for item in requests:  # a third pass: every answer local, equal to the engine's
            assert await tok.tokenize(name, item) == await remote.tokenize(name, item)
        await tok.settle()
        after = registry.get_sample_value("kvgate_tokenizer_remote_attempts_total", {"outcome": "ok"})
        assert after - round_trips == len(requests), "only the test's own engine calls may reach /tokenize"
        status = tok.status()[name]
        assert status["state"] == "serving" and status["checks"]["disagree"] == 0, status
        assert status["served"]["local"] >= len(requests)
        assert registry.get_sample_value("kvgate_tokenizer_local_disagreements_total", {"model": name}) == 0
    finally:
        await tok.aclose()


async def test_images_are_refused_locally_and_left_to_the_engine(engines) -> None:
    directory, url = engines["test"]
    with pytest.raises(ValueError, match="image_url part needs the engine's multimodal processor"):
        _local(directory).encode(IMAGE)
    async with httpx.AsyncClient() as client:  # the simulated engine expands the image to placeholder tokens
        r = await client.post(url + "/tokenize", json={"model": "test", "messages": list(IMAGE.messages)})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert max(map(tokens.count, set(tokens))) >= 64  # 64 placeholder tokens: SimOptions.image_tokens


@pytest.mark.parametrize("name", ["qwen3", "test"])
async def test_a_wrong_local_template_is_caught_and_switched_off(engines, name, tmp_path) -> None:
    directory, url = _engine(engines, name)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    shutil.copy(directory / "tokenizer.json", wrong)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert "'<|im_start|>' + message" in config["chat_template"] or "'<|im_start|>' + message" in json.dumps(config)
    # One character off: a space after the role, as a hand-edited or outdated template might have.
    config["chat_template"] = config["chat_template"].replace("'<|im_start|>' + message['role'] + '\\n'",
                                                              "'<|im_start|>' + message['role'] + ' \\n'")
    config["chat_template"] = config["chat_template"].replace("'<|im_start|>' + message.role + '\\n'",
                                                              "'<|im_start|>' + message.role + ' \\n'")
    (wrong / "tokenizer_config.json").write_text(json.dumps(config))
    registry = CollectorRegistry()
    remote = _remote(name, url, registry)
    tok = VerifiedTokenizer(remote, local=LocalTokenizer.from_path(wrong),
                            options=VerifyOptions(verify_requests=3, sample_rate=1.0), registry=registry)
    try:
        item = dict(CORPUS)["multi-turn"]
        assert await tok.tokenize(name, item) == await remote.tokenize(name, item)
        await tok.settle()
        assert registry.get_sample_value("kvgate_tokenizer_local_disagreements_total", {"model": name}) == 1
        assert tok.status()[name]["state"] == "disabled"
        for _, item in CORPUS[:6]:  # served by the engine from now on
            assert await tok.tokenize(name, item) == await remote.tokenize(name, item)
        await tok.settle()
        assert tok.status()[name]["served"] == {"local": 0, "remote": 7}
    finally:
        await tok.aclose()
