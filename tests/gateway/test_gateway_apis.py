"""Every API a vLLM user points a client at, through a real Envoy and `kvgate serve` to simulated engines,
with the official `openai` and `anthropic` SDKs: chat (tools, reasoning options), completions, the Responses
API (previous_response_id lands on the engine that stored the conversation), Anthropic messages, embeddings;
streamed and not.

The tokens kvgate routes on are checked against the engine's: a prompt is warmed on one engine directly,
then sent through Envoy; kvgate must pick that engine, believe it holds exactly the blocks the engine then
served from its cache (block hashes chain every token of every full block, so equal blocks are equal
tokens), and count as many prompt blocks as the engine's prompt has. Bad bodies on each new endpoint get
the engine API's 4xx shape from kvgate, and the running counts end at zero."""
from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from devkit.stack import Stack
from helpers import GatewayEnv, stack_fixture, wait_until

pytestmark = pytest.mark.integration

MODEL = "m"
BS = 16


class Env(GatewayEnv):
    def __init__(self, stack: Stack):
        super().__init__(stack)
        fast = ["--tpot-ms", "1", "--ttft-overhead-ms", "1", "--block-size", str(BS)]
        pods = stack.engines(2, model=MODEL, extra=fast)
        self.ports = {p["name"]: p["port"] for p in pods}
        self.start_gateway(pods, {"KVGATE_ROUTING_STRATEGY": "kv-sync"})
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=30)
        self.anthropic = anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0, timeout=30)
        self.on_close(self.openai.close)
        self.on_close(self.anthropic.close)

    def metric(self, name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        want = f"{{{want}}}" if want else ""
        m = re.search(rf"^{re.escape(name)}{re.escape(want)} ([0-9.e+]+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else 0.0

    def blocks(self, pod: str) -> int:
        return next(p for p in self.debug()["pods"] if p["name"] == pod).get("blocks", 0)

    def warm(self, pod: str, path: str, body: dict) -> int:
        """`body` sent to `pod` directly; returns its prompt tokens once kvgate's index holds more of that
        pod's blocks than before."""
        before = self.blocks(pod)
        r = httpx.post(f"http://127.0.0.1:{self.ports[pod]}{path}", json=body, timeout=10)
        assert r.status_code == 200, r.text
        wait_until(lambda: self.blocks(pod) > before, what=f"{pod}'s blocks in the index", detail=self.debug)
        usage = r.json()["usage"]
        return usage.get("prompt_tokens") or usage["input_tokens"]

    def believed(self) -> tuple[float, float]:
        return (self.metric("kvgate_prefix_blocks_total", kind="cached"),
                self.metric("kvgate_prefix_blocks_total", kind="total"))


env = stack_fixture(Env)


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i % 7}" for i in range(n))


def _tools(tag: str) -> list[dict]:
    return [{"type": "function", "function": {"name": f"{tag}_tool{i}", "description": _words(tag + "d", 12),
                                              "parameters": {"type": "object", "properties": {
                                                  "q": {"type": "string"}}}}} for i in range(4)]


def _check(env: Env, before: tuple[float, float], pod: str, want_pod: str, prompt: int, served: int) -> None:
    """kvgate picked `want_pod`, believed it held what the engine served from its cache, and tokenized the
    prompt into as many full blocks as the engine's."""
    cached, total = env.believed()
    assert pod == want_pod
    assert (cached - before[0]) * BS == served > 0
    assert total - before[1] == prompt // BS


def _chat_crossing_a_block(env: Env) -> dict:
    """A chat with tools whose `reasoning_effort: none` (the template's empty think block, which /tokenize
    cannot ask for) makes its prompt end in another block than the same chat tokenized by /tokenize."""
    url = f"http://127.0.0.1:{env.ports['sim0']}"
    for n in range(90, 130):
        body = {"model": MODEL, "tools": _tools("c"), "tool_choice": "required", "reasoning_effort": "none",
                "messages": [{"role": "system", "content": _words("csys", n)}, {"role": "user", "content": "go"}]}
        rendered = len(httpx.post(url + "/v1/chat/completions/render", json=body, timeout=10).json()["token_ids"])
        tokenized = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": body["messages"],
                                                        "tools": body["tools"]}, timeout=10).json()["count"]
        if rendered // BS != tokenized // BS:
            return body
    raise AssertionError("no chat length puts the think block across a block boundary")


def test_chat_with_tools_and_reasoning_effort_uses_the_engines_tokens(env):
    body = _chat_crossing_a_block(env)
    prompt = env.warm("sim1", "/v1/chat/completions", {**body, "max_tokens": 1})
    before = env.believed()
    raw = env.openai.chat.completions.with_raw_response.create(**body, max_tokens=2)
    out = raw.parse()
    _check(env, before, raw.headers["x-kvgate-pod"], "sim1", prompt, out.usage.prompt_tokens_details.cached_tokens)
    # streamed, through the same render
    before = env.believed()
    with env.openai.chat.completions.with_streaming_response.create(
            **body, max_tokens=2, stream=True, stream_options={"include_usage": True}) as s:
        pod = s.headers["x-kvgate-pod"]
        chunks = list(s.parse())
    _check(env, before, pod, "sim1", prompt, chunks[-1].usage.prompt_tokens_details.cached_tokens)


def test_completions_streamed_and_not(env):
    prompt_text = _words("cmp", 150)
    prompt = env.warm("sim0", "/v1/completions", {"model": MODEL, "prompt": prompt_text, "max_tokens": 1})
    before = env.believed()
    raw = env.openai.completions.with_raw_response.create(model=MODEL, prompt=prompt_text, max_tokens=2)
    _check(env, before, raw.headers["x-kvgate-pod"], "sim0", prompt,
           raw.parse().usage.prompt_tokens_details.cached_tokens)
    text = "".join(c.choices[0].text for c in env.openai.completions.create(
        model=MODEL, prompt=prompt_text, max_tokens=3, stream=True) if c.choices)
    assert text


def test_responses_by_prefix_and_previous_response_id_on_the_engine_that_stored_it(env):
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in _tools("r")]
    body = {"model": MODEL, "instructions": _words("rsys", 90), "input": "start", "tools": tools}
    prompt = env.warm("sim1", "/v1/responses", {**body, "max_output_tokens": 1})
    before = env.believed()
    raw = env.openai.responses.with_raw_response.create(**body, max_output_tokens=2)
    first = raw.parse()
    _check(env, before, raw.headers["x-kvgate-pod"], "sim1", prompt, first.usage.input_tokens_details.cached_tokens)
    # Conversations continued by id, streamed and not, land on the engine that stored them (any other would 404).
    routed = env.metric("kvgate_response_affinity_total", outcome="routed")
    for i in range(4):
        r = env.openai.responses.with_raw_response.create(model=MODEL, input=_words(f"conv{i}", 20),
                                                          max_output_tokens=2)
        stored_on, previous = r.headers["x-kvgate-pod"], r.parse().id
        for turn in range(2):
            with env.openai.responses.with_streaming_response.create(
                    model=MODEL, input=f"turn {turn}", previous_response_id=previous, max_output_tokens=2,
                    stream=True) as s:
                assert s.headers["x-kvgate-pod"] == stored_on and s.headers["x-kvgate-strategy"] == "previous-response"
                events = list(s.parse())
            assert events[0].type == "response.created" and events[-1].type == "response.completed"
            previous = events[-1].response.id
        got = env.openai.responses.with_raw_response.retrieve(previous)
        assert got.headers["x-kvgate-pod"] == stored_on
    assert env.metric("kvgate_response_affinity_total", outcome="routed") - routed == 4 * 3
    # an id no engine stored: routed as any other, the engine's 404
    with pytest.raises(openai.NotFoundError):
        env.openai.responses.create(model=MODEL, input="x", previous_response_id="resp_nobody")


def test_messages_streamed_and_not(env):
    body = {"model": MODEL, "system": _words("msys", 90), "max_tokens": 2,
            "tools": [{"name": f"m_tool{i}", "description": "d", "input_schema": {"type": "object"}} for i in range(3)],
            "messages": [{"role": "user", "content": "hello"}]}
    prompt = env.warm("sim0", "/v1/messages", {**body, "max_tokens": 1})
    before = env.believed()
    raw = env.anthropic.messages.with_raw_response.create(**body)
    out = raw.parse()
    assert out.content[0].type == "text"
    _check(env, before, raw.headers["x-kvgate-pod"], "sim0", prompt, out.usage.cache_read_input_tokens)
    before = env.believed()
    with env.anthropic.messages.stream(**body) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.usage.output_tokens == 2
    cached, total = env.believed()
    assert (cached - before[0]) * BS == final.usage.cache_read_input_tokens > 0


def test_embeddings_by_load_and_read_only_paths_counted(env):
    out = env.openai.embeddings.create(model=MODEL, input=["one", "two"])
    assert [d.index for d in out.data] == [0, 1]
    assert env.openai.models.list().data[0].id == MODEL
    assert env.client.get("/version").status_code == 200
    assert env.metric("kvgate_read_only_requests_total", path="/version") >= 1
    assert env.metric("kvgate_requests_total", kind="pooling", outcome="routed") >= 1


def test_bad_bodies_get_the_apis_4xx_and_nothing_stays_counted(env):
    with pytest.raises(openai.BadRequestError) as e:
        env.openai.responses.create(model=MODEL, input=3)  # type: ignore[arg-type]
    assert e.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        env.openai.embeddings.create(model="", input="x")
    with pytest.raises(anthropic.BadRequestError) as a:
        env.anthropic.messages.create(model=MODEL, max_tokens=2, messages="hi")  # type: ignore[arg-type]
    assert a.value.body["type"] == "error" and a.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    r = env.client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    wait_until(env.counts_are_zero, what="running counts back to zero", detail=env.debug)


def test_messages_reach_kvgate_in_one_message_routed_by_prefix(env):
    """/v1/messages takes envoy/envoy.yaml's one-message routes as completions and chats do (90% of requests):
    routed as before, the prefix's engine serving it."""
    body = {"model": MODEL, "system": _words("onemsg", 90), "max_tokens": 1,
            "messages": [{"role": "user", "content": "hello"}]}
    env.warm("sim1", "/v1/messages", body)
    before = env.metric("kvgate_one_message_requests_total")
    for _ in range(12):
        raw = env.anthropic.messages.with_raw_response.create(**body)
        assert raw.headers["x-kvgate-pod"] == "sim1" and raw.parse().usage.cache_read_input_tokens > 0
    assert env.metric("kvgate_one_message_requests_total") - before >= 6  # of 12 at 90%: all but certainly
