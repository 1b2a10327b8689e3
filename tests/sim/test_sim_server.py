"""The simulated engine on loopback: real HTTP, real ZMQ SUB and DEALER sockets, the real CLI process."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.wire import decode_batch
from sim.engine import EngineConfig
from sim.server import SimOptions, SimServer
from tokenizer.local import LocalTokenizer
from tokenizer import testdata
from tokenizer.types import ChatInput
from helpers import free_port_run, free_ports, wait_until_async

REPO = Path(__file__).resolve().parents[2]
END = b"\xff" * 8
ENGINE = EngineConfig(block_size=16, num_blocks=256, ttft_overhead_s=0.002, prefill_s_per_token=0.00002,
                      tpot_base_s=0.004, tpot_per_seq_s=0.0005, lora_names=("ad1",))
LONG_PROMPT = " ".join(f"word{i} and more text" for i in range(40))


@pytest.fixture(scope="module")
def tok() -> LocalTokenizer:
    return LocalTokenizer.from_path(testdata.path())


async def start_sim(**kw) -> SimServer:
    dp = kw.get("dp_size", 1)
    if dp == 1:
        kv, replay = free_ports(2)
    else:
        kv = free_port_run(2 * dp)
        replay = kv + dp
    opts = dict(model="sim-model", name="sim-a", port=0, engine=ENGINE, kv_events_port=kv,
                replay_port=replay, max_tokens_default=8)
    opts.update(kw)
    server = SimServer(SimOptions(**opts))
    await server.start()
    return server


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await start_sim()
    yield server
    await server.stop()


class Events:
    """A SUB socket on one rank plus its DEALER for replay."""

    def __init__(self, ctx: zmq.asyncio.Context, pub_port: int, replay_port: int) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{pub_port}")
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://127.0.0.1:{replay_port}")

    async def live(self, timeout: float = 5.0) -> tuple[int, list]:
        frames = await asyncio.wait_for(self.sub.recv_multipart(), timeout)
        assert len(frames) == 3
        return int.from_bytes(frames[1], "big"), decode_batch(frames[2]).batch

    async def replay(self, start: int, with_topic: bool, timeout: float = 5.0) -> list[tuple[int, object]]:
        await self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(self.dealer.recv_multipart(), timeout)
            assert frames[0] == b""
            if with_topic:
                assert len(frames) == 4
                frames = frames[2:]
            else:
                assert len(frames) == 3
                frames = frames[1:]
            if frames[0] == END:
                return out
            out.append((int.from_bytes(frames[0], "big"), decode_batch(frames[1]).batch))


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_completion_usage_and_engine_name(client: httpx.AsyncClient, tok: LocalTokenizer) -> None:
    r = await client.post("/v1/completions", json={"model": "sim-model", "prompt": LONG_PROMPT, "max_tokens": 7})
    assert r.status_code == 200, r.text
    assert r.headers["x-sim-name"] == "sim-a"
    body = r.json()
    assert body["object"] == "text_completion" and body["system_fingerprint"] == "sim-a"
    n_prompt = len(tok.encode_prompt(LONG_PROMPT))
    assert body["usage"]["prompt_tokens"] == n_prompt
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["total_tokens"] == n_prompt + 7
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(tok.encode_prompt(choice["text"], False)) == 7
    again = (await client.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 7})).json()
    assert again["choices"][0]["text"] == choice["text"]  # deterministic, like greedy decoding
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n_prompt - 1) // 16 * 16
    # Token ids as the prompt, and the default max_tokens.
    ids = (await client.post("/v1/completions", json={"prompt": [5, 6, 7]})).json()
    assert ids["usage"]["prompt_tokens"] == 3 and ids["usage"]["completion_tokens"] == 8


async def test_chat_counts_the_templated_prompt(client: httpx.AsyncClient, tok: LocalTokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = await client.post("/v1/chat/completions", json={"model": "sim-model", "messages": messages,
                                                         "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == len(tok.encode_chat(ChatInput(messages=tuple(messages))))
    assert body["usage"]["completion_tokens"] == 3


async def test_streaming_arrives_incrementally(sim: SimServer, client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "stream please"}]
    payload = {"messages": messages, "max_tokens": 60, "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    running_at_first_content = None
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: "):]
            chunks.append(data)
            if data != "[DONE]" and running_at_first_content is None and json.loads(data)["choices"] \
                    and json.loads(data)["choices"][0]["delta"].get("content"):
                running_at_first_content = sim.ranks[0].engine.metrics().running
    # The first token reached us while the engine was still generating the other 59.
    assert running_at_first_content == 1
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [p for p in parsed if p["choices"]]
    assert len(content) == 61  # role chunk + one per token
    assert [p["choices"][0]["finish_reason"] for p in content[-2:]] == [None, "length"]
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] == 60
    streamed = "".join(p["choices"][0]["delta"]["content"] for p in content)
    full = (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 60})).json()
    assert streamed == full["choices"][0]["message"]["content"]


async def test_completion_stream_without_usage(client: httpx.AsyncClient) -> None:
    async with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    parsed = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(parsed) == 4 and all("usage" not in p for p in parsed)
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"


async def test_client_disconnect_aborts_the_request(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as c:
        async with c.stream("POST", "/v1/completions",
                            json={"prompt": "long one", "max_tokens": 5000, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line:
                    break
    engine = sim.ranks[0].engine
    assert await wait_until_async(lambda: engine.metrics().running == 0, timeout=4)
    assert engine.metrics().kv_usage == 0.0


async def test_tokenize_matches_local_tokenizer(client: httpx.AsyncClient, tok: LocalTokenizer) -> None:
    r = await client.post("/tokenize", json={"model": "sim-model", "prompt": LONG_PROMPT})
    body = r.json()
    assert body["tokens"] == tok.encode_prompt(LONG_PROMPT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256 * 16
    assert body["token_strs"] is None
    r = await client.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False,
                                             "return_token_strs": True})
    assert r.json()["tokens"] == tok.encode_prompt("hello", False)
    assert r.json()["token_strs"] == tok.token_strs(tok.encode_prompt("hello", False))
    messages = [{"role": "user", "content": "hi there"}]
    r = await client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    expected = tok.encode_chat(ChatInput(messages=tuple(messages), chat_template_kwargs={"enable_thinking": False}))
    assert r.json()["tokens"] == expected
    r = await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.json()["tokens"] == tok.encode_chat(ChatInput(messages=tuple(messages), add_generation_prompt=False))


async def test_tokenize_answers_alike_for_small_and_big_bodies(client: httpx.AsyncClient, tok: LocalTokenizer) -> None:
    """Bodies up to 4 KiB are tokenized on the event loop, bigger ones in a worker thread: same answers."""
    small = LONG_PROMPT[:1000]
    big = " ".join([LONG_PROMPT] * 8)
    for text in (small, big):
        r = await client.post("/tokenize", json={"prompt": text, "return_token_strs": True})
        assert r.status_code == 200
        tokens = tok.encode_prompt(text)
        assert r.json() == {"count": len(tokens), "max_model_len": 256 * 16, "tokens": tokens,
                            "token_strs": tok.token_strs(tokens)}
        messages = [{"role": "user", "content": text}]
        r = await client.post("/tokenize", json={"messages": messages, "add_special_tokens": True})
        rendered = tok.render_chat(ChatInput(messages=tuple(messages)))
        assert r.json()["tokens"] == tok.encode_prompt(rendered, True)
    assert len(big) > 4096 > len(small) + 200


async def test_metrics_use_vllm_names(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2})
    await client.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2})
    r = await client.get("/metrics")
    samples = {s.name: s for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert samples[name].labels == {"model_name": "sim-model", "engine": "0"}, name
    assert samples["vllm:prefix_cache_hits_total"].value > 0
    assert samples["vllm:prefix_cache_queries_total"].value > samples["vllm:prefix_cache_hits_total"].value
    assert samples["vllm:num_requests_running"].value == 0
    assert "vllm:num_requests_running{" in r.text and "vllm:prefix_cache_queries_total{" in r.text
    # the token counters and latency histograms kvgate's throughput and least-latency strategies read
    from routing.state.engine_metrics import parse_engine_metrics
    load = parse_engine_metrics(r.text)
    assert load.tokens is not None and load.tokens[1] == 4.0 and load.tokens[0] > 0
    assert load.ttft is not None and load.ttft[1] == 2 and load.ttft[0] > 0
    assert load.tpot is not None and load.tpot[1] == 2 and load.tpot[0] > 0  # one gap per request of 2 tokens


async def test_errors_in_openai_shape(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `other` does not exist.", "type": "NotFoundError",
                                 "param": "model", "code": 404}
    for body in ({"prompt": "x", "max_tokens": 0}, {"prompt": ""}, {"prompt": "x", "stream_options": {}},
                 {"prompt": "x", "max_tokens": 5000}, {"prompt": [1, 99999]}, {"prompt": "x", "n": 2}):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "BadRequestError"
    r = await client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    assert (await client.get("/nope")).status_code == 404
    assert (await client.get("/health")).status_code == 200  # still serving


async def test_models_and_lora(sim: SimServer, client: httpx.AsyncClient, zctx: zmq.asyncio.Context) -> None:
    ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
    assert ids == ["sim-model", "ad1"]
    ev = Events(zctx, sim.options.kv_events_port, sim.options.replay_port)
    await client.post("/v1/completions", json={"model": "ad1", "prompt": LONG_PROMPT, "max_tokens": 1})
    batches = await ev.replay(0, with_topic=True)
    stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored and all(e.lora_name == "ad1" for e in stored)


async def test_kv_events_live_and_replay_equal_cache(sim: SimServer, client: httpx.AsyncClient,
                                                     zctx: zmq.asyncio.Context, tok: LocalTokenizer) -> None:
    ev = Events(zctx, sim.options.kv_events_port, sim.options.replay_port)
    r = await client.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 20})
    assert r.status_code == 200
    # The SUB may have joined after the first batches (slow joiner): replay fills the gap.
    replayed = await ev.replay(0, with_topic=True)
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    await client.post("/v1/completions", json={"prompt": "another prompt " * 20, "max_tokens": 3})
    seq, batch = await ev.live()
    while seq < len(replayed):  # skip live copies of batches already replayed
        seq, batch = await ev.live()
    assert seq == len(replayed) and batch.data_parallel_rank == 0
    mirror: set = set()
    for b in [b for _, b in replayed] + [batch]:
        for e in b.events:
            assert isinstance(e, BlockStored)
            mirror.update(e.block_hashes)
    prompt_ids = tok.encode_prompt(LONG_PROMPT)
    first = replayed[0][1].events[0]
    assert first.parent_block_hash is None and first.medium == "GPU" and first.block_size == 16
    assert list(first.token_ids) == prompt_ids[:len(first.token_ids)]
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in mirror)
    assert mirror == sim.ranks[0].engine.cached_block_hashes()
    # Reset: AllBlocksCleared goes out live, and the same prompt is a miss again.
    assert (await client.post("/reset_prefix_cache")).status_code == 200
    seq, batch = await ev.live()
    assert batch.events == (AllBlocksCleared(),)
    r = await client.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("generation", ["0.23", "0.25"])
async def test_older_generations_and_data_parallel_ranks(generation: str, zctx: zmq.asyncio.Context) -> None:
    server = await start_sim(dp_size=2, kv_events_generation=generation)
    try:
        o = server.options
        evs = [Events(zctx, o.kv_events_port + r, o.replay_port + r) for r in range(2)]
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            prompts = [LONG_PROMPT, "a different prompt " * 30]
            rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": p, "max_tokens": 30})
                                        for p in prompts))
        assert sorted(r.headers["x-sim-rank"] for r in rs) == ["0", "1"]  # spread over the ranks
        for rank, ev in enumerate(evs):
            batches = await ev.replay(0, with_topic=False)  # 0.25 and earlier: no topic frame
            assert batches and all(b.data_parallel_rank == rank for _, b in batches)
            hashes = {h for _, b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes}
            assert hashes == server.ranks[rank].engine.cached_block_hashes()
    finally:
        await server.stop()


def _sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


async def test_rank_header_pins_the_request_to_that_rank(tok: LocalTokenizer) -> None:
    server = await start_sim(dp_size=2)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            # Concurrent requests the least-loaded balancer would spread: every one goes to rank 1,
            # whatever the spelling of the header's name.
            names = ["X-data-parallel-rank", "x-data-parallel-rank", "X-Data-Parallel-Rank"]
            rs = await asyncio.gather(*(c.post("/v1/completions", headers={names[i % 3]: "1"},
                                               json={"prompt": f"{LONG_PROMPT} {i}", "max_tokens": 20})
                                        for i in range(4)))
            chat = await c.post("/v1/chat/completions", headers={"X-data-parallel-rank": "1"},
                                json={"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 2})
            stream = await c.post("/v1/completions", headers={"X-data-parallel-rank": "1"},
                                  json={"prompt": LONG_PROMPT, "max_tokens": 3, "stream": True})
        assert [r.status_code for r in rs] == [200] * 4 and chat.status_code == 200 and stream.status_code == 200
        assert [r.headers["x-sim-rank"] for r in [*rs, chat, stream]] == ["1"] * 6
        assert _sse_events(stream.text)[-1] == "[DONE]"
        assert server.ranks[1].engine.cached_block_hashes() and not server.ranks[0].engine.cached_block_hashes()
    finally:
        await server.stop()


async def test_rank_header_that_is_no_integer_is_ignored() -> None:
    server = await start_sim(dp_size=2)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            # Rank 0 busy with a long stream: an unpinned request goes to the least loaded rank, 1.
            async with c.stream("POST", "/v1/completions", headers={"X-data-parallel-rank": "0"},
                                json={"prompt": "x", "max_tokens": 500, "stream": True}) as busy:
                assert busy.headers["x-sim-rank"] == "0"
                for value in ("one", "", "1.0", "0x1"):
                    r = await c.post("/v1/completions", headers={"X-data-parallel-rank": value},
                                     json={"prompt": "hello there", "max_tokens": 1})
                    assert r.status_code == 200 and r.headers["x-sim-rank"] == "1", value
    finally:
        await server.stop()


async def test_rank_header_out_of_range_is_refused_like_vllm() -> None:
    server = await start_sim(dp_size=2)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            for value in ("2", "-1", "17"):
                for path, body in (("/v1/completions", {"prompt": LONG_PROMPT}),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                    r = await c.post(path, headers={"X-data-parallel-rank": value}, json=body)
                    assert r.status_code == 400, (value, path)
                    assert r.json()["error"] == {"message": f"data_parallel_rank {int(value)} is out of range [0, 2).",
                                                 "type": "BadRequestError", "param": None, "code": 400}
                    # Streamed: vLLM has answered 200 before it checks the rank; the error is the stream's event.
                    r = await c.post(path, headers={"X-data-parallel-rank": value}, json={**body, "stream": True})
                    assert r.status_code == 200 and "x-sim-rank" not in r.headers
                    events = _sse_events(r.text)
                    assert events[-1] == "[DONE]" and len(events) == 2
                    assert json.loads(events[0])["error"]["message"].startswith(f"data_parallel_rank {int(value)} ")
        assert not any(rank.engine.cached_block_hashes() for rank in server.ranks)  # nothing ran
    finally:
        await server.stop()


async def test_rank_header_on_a_single_rank_engine(client: httpx.AsyncClient) -> None:
    ok = await client.post("/v1/completions", headers={"X-data-parallel-rank": "0"}, json={"prompt": "x"})
    assert ok.status_code == 200 and ok.headers["x-sim-rank"] == "0"
    bad = await client.post("/v1/completions", headers={"X-data-parallel-rank": "1"}, json={"prompt": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "data_parallel_rank 1 is out of range [0, 1)."


async def test_eviction_is_published(zctx: zmq.asyncio.Context) -> None:
    server = await start_sim(engine=EngineConfig(block_size=16, num_blocks=12, ttft_overhead_s=0.001,
                                                 prefill_s_per_token=0.00001, tpot_base_s=0.001))
    try:
        ev = Events(zctx, server.options.kv_events_port, server.options.replay_port)
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            for i in range(6):
                r = await c.post("/v1/completions", json={"prompt": f"prompt number {i} " * 12, "max_tokens": 2})
                assert r.status_code == 200
        mirror: set = set()
        removed = 0
        for _, b in await ev.replay(0, with_topic=True):
            for e in b.events:
                if isinstance(e, BlockStored):
                    mirror.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    mirror.difference_update(e.block_hashes)
                    removed += 1
        assert removed > 0
        assert mirror == server.ranks[0].engine.cached_block_hashes()
    finally:
        await server.stop()


async def test_reset_refused_while_running(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as c:
        async with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line:
                    break
            refused = await c.post("/reset_prefix_cache")
    assert refused.status_code == 409 and "running" in refused.json()["error"]["message"]


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="overlap"):
        SimOptions(dp_size=2, kv_events_port=5557, replay_port=5558)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_prints_ready_line_and_exits_on_signal(sig: signal.Signals) -> None:
    pub, replay = free_ports(2)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "plugin.cli", "sim", "--port", "0", "--name", "cli-sim", "--kv-events-port",
         str(pub), "--replay-port", str(replay), "--lora", "ad1", "--tpot-ms", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["name"] == "cli-sim" and info["loras"] == ["ad1"]
        assert info["kv_events"] == {"generation": "0.33", "pub_ports": [pub], "replay_ports": [replay]}
        r = httpx.post(info["url"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.headers["x-sim-name"] == "cli-sim" and r.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
