"""The simulated engine on the network: vLLM's HTTP API in real time over one
`EngineModel` per data-parallel rank, each publishing its KV events through a
`kvcache.publisher.EventPublisher` (rank r on ports + r).

A generation request goes to the rank its `X-data-parallel-rank` header names, as in vLLM:
a value that is not an integer is ignored (the least loaded rank serves it, vLLM's own balancer
rule), an integer outside [0, dp_size) is refused with 400 (streamed requests get vLLM's
in-stream error event instead, since vLLM checks the rank after the response has started).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvcache.blockkeys import MediaItem
from kvcache.publisher import EventPublisher
from sim import apis, media, pd, shapes
from sim.engine import Completion, EngineConfig, EngineModel
from sim.media import PromptTokens
from sim.metrics import EngineCollector, engine_registry
from sim.protocol import (
    ApiError, GenerationRequest, ServedModels, chunk, full_body, parse_chat, parse_completion, parse_tokenize,
    render_body, usage,
)
from tokenizer import vllm_chat
from tokenizer.local import LocalTokenizer
from tokenizer.types import ChatInput

log = logging.getLogger(__name__)

_MIN_POLL_S = 0.002
_INLINE_BYTES = 4096  # request bodies up to this size are tokenized on the event loop, not in a worker thread
DP_RANK_HEADER = "X-data-parallel-rank"  # read case-insensitively


@dataclass(frozen=True, slots=True)
class SimOptions:
    model: str = "sim-model"
    name: str | None = None  # reported in `system_fingerprint` and `x-sim-name`; None: "sim-PORT"
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    engine: EngineConfig = field(default_factory=EngineConfig)
    dp_size: int = 1
    kv_events: bool = True
    kv_events_port: int = 5557  # rank r publishes on kv_events_port + r
    replay_port: int | None = 5558  # rank r replays on replay_port + r; None: no replay socket
    kv_events_generation: str = "0.33"
    max_tokens_default: int = 16
    tokenizer_path: str | None = None  # None: the project's test tokenizer
    model_shape: str | None = None  # sim.shapes.MODEL_SHAPES; None: the groups `engine` has
    retention: str | None = None  # "sparse" | "dense" (sim.shapes.RETENTIONS); None: as `engine` has it
    sliding_window: int = shapes.DEFAULT_SLIDING_WINDOW  # tokens, of the hybrid shape's sliding-window group
    image_tokens: int = 64  # placeholder tokens per image in a chat prompt (sim.media)
    # Prefill/decode disaggregation (sim.pd): the decode leg's pull time per block, and the NIXL side channel
    # port a prefill answer names (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT, 5600 by default).
    kv_transfer_s_per_block: float = 0.0002
    side_channel_port: int = 5600

    def __post_init__(self) -> None:
        shapes.check(self.model_shape, self.retention, self.sliding_window)
        if type(self.image_tokens) is not int or self.image_tokens < 1:
            raise ValueError(f"image_tokens must be an int >= 1, got {self.image_tokens!r}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if not self.kv_transfer_s_per_block >= 0:
            raise ValueError(f"kv_transfer_s_per_block must be >= 0, got {self.kv_transfer_s_per_block}")
        if self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1, got {self.max_tokens_default}")
        if not self.model:
            raise ValueError("model must not be empty")
        pub = set(range(self.kv_events_port, self.kv_events_port + self.dp_size))
        if self.kv_events and self.replay_port is not None and pub & {self.replay_port + r for r in range(self.dp_size)}:
            raise ValueError(f"KV event ports {sorted(pub)} overlap the replay ports from {self.replay_port}: "
                             f"with dp_size {self.dp_size} put them at least {self.dp_size} apart")


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _output_pool(tok: LocalTokenizer) -> dict[int, str]:
    """Whole-word tokens that decode alone to ' word', with their text: streamed text then equals the decoded
    output. Every id is decoded in one batch (a loop of single decodes took seconds on a 150k vocabulary);
    the batch skips transformers' clean-up of spaces, which leaves ' word' (letters only) unchanged."""
    n = len(tok.hf)
    texts = tok.hf.backend_tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    pool = {i: s for i, s in enumerate(texts) if len(s) >= 3 and s[0] == " " and s[1:].isalpha()}
    if pool:
        return pool
    special = set(tok.hf.all_special_ids)
    return {i: tok.decode([i]) for i in range(n) if i not in special}


class _Rank:
    """One data-parallel rank: its engine model, its publisher and the waiters for its requests."""

    def __init__(self, index: int, engine: EngineModel, publisher: EventPublisher | None, clock: Any) -> None:
        self.index = index
        self.engine = engine
        self.publisher = publisher
        self._clock = clock
        self.waiters: dict[str, asyncio.Future[Completion]] = {}
        self._wake = asyncio.Event()
        self.publish_errors = 0

    def load(self) -> int:
        m = self.engine.metrics()
        return m.running + m.waiting

    def sync(self) -> None:
        """Bring the engine to now: resolve finished requests, publish its KV events."""
        for done in self.engine.advance(self._clock()):
            fut = self.waiters.pop(done.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(done)
        self._publish()

    def submit(self, req_id: str, tokens: list[int], max_tokens: int, lora: str | None, cache_salt: str | None,
               mm_items: tuple[MediaItem, ...], remote_tokens: int = 0) -> asyncio.Future[Completion]:
        self.engine.add_request(req_id, tokens, max_tokens, self._clock(), lora,  # ValueError: bad request
                                cache_salt=cache_salt, mm_items=mm_items, remote_tokens=remote_tokens)
        fut: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self.waiters[req_id] = fut
        self.sync()
        self._wake.set()
        return fut

    def abort(self, req_id: str) -> None:
        self.waiters.pop(req_id, None)
        if self.engine.abort(req_id, self._clock()):
            self.sync()
            self._wake.set()

    def _publish(self) -> None:
        for batch in self.engine.drain_events():
            if self.publisher is None:
                continue
            try:
                self.publisher.publish(batch.events)
            except Exception:  # a broken publisher must not stop the engine
                self.publish_errors += 1
                log.exception("rank %d: cannot publish KV events", self.index)

    async def run(self) -> None:
        """Wake at the engine's next event (or a new request) and step it."""
        while True:
            t = self.engine.next_event_time()
            self._wake.clear()
            timeout = None if t is None else max(0.0, t - self._clock())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
            self.sync()

    def cancel_waiters(self) -> None:
        for fut in self.waiters.values():
            if not fut.done():
                fut.cancel()
        self.waiters.clear()


class SimServer:
    """A simulated vLLM engine serving HTTP on `options.host:options.port`."""

    def __init__(self, options: SimOptions, *, registry: CollectorRegistry | None = None) -> None:
        self.options = options
        path = options.tokenizer_path
        if path is None:
            from tokenizer import testdata
            path = str(testdata.path())
        self.tokenizer = LocalTokenizer.from_path(path, fast=False)  # the engine tokenizes as vLLM: no word cache
        self._token_text = _output_pool(self.tokenizer)
        # The image placeholder: one special token of this server's own tokenizer (sim.media).
        self.tokenizer.hf.add_tokens([media.PLACEHOLDER], special_tokens=True)
        self.image_token_id: int = self.tokenizer.hf.convert_tokens_to_ids(media.PLACEHOLDER)
        self._vocab_size = len(self.tokenizer.hf)
        pool = tuple(self._token_text)
        engine = shapes.shaped(options.engine, options.model_shape, options.retention, options.sliding_window)
        self.engine_config = dataclasses.replace(engine, output_token_ids=pool)
        self._served = ServedModels(options.model, self.engine_config.lora_names)
        self._t0 = time.monotonic()
        self.ranks: list[_Rank] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.port: int = options.port
        self.name = options.name or f"sim-{options.port}"
        # Disaggregated legs served, by kind (sim.pd.Leg: prefill, decode, invalid), and the next block id to name.
        self.kv_transfers: dict[str, int] = {"prefill": 0, "decode": 0, "invalid": 0}
        self._next_block_id = 0
        self.responses = apis.ResponseStore()  # vLLM's store (VLLM_ENABLE_RESPONSES_API_STORE=1)
        self.registry = engine_registry(
            EngineCollector(options.model, lambda: [r.engine.metrics() for r in self.ranks],
                            self.engine_config.block_size), registry)

    # ---- lifecycle ----------------------------------------------------------------------------

    def _clock(self) -> float:
        return time.monotonic() - self._t0

    async def start(self) -> None:
        o = self.options
        try:
            for r in range(o.dp_size):
                config = dataclasses.replace(self.engine_config, data_parallel_rank=r)
                publisher = None
                if o.kv_events:
                    publisher = EventPublisher(
                        _tcp(o.host, o.kv_events_port + r),
                        None if o.replay_port is None else _tcp(o.host, o.replay_port + r),
                        generation=o.kv_events_generation, data_parallel_rank=r)
                self.ranks.append(_Rank(r, EngineModel(config), publisher, self._clock))
            self._tasks = [asyncio.create_task(rank.run(), name=f"sim-rank-{rank.index}") for rank in self.ranks]
            app = web.Application(middlewares=[_errors], client_max_size=64 * 2**20)
            app.add_routes([
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions/render", self._completions_render),
                web.post("/v1/chat/completions/render", self._chat_render),
                web.post("/v1/responses", self._responses),
                web.post("/v1/responses/render", self._responses_render),
                web.get("/v1/responses/{response_id}", self._response_get),
                web.post("/v1/messages", self._messages),
                web.post("/v1/messages/render", self._messages_render),
                *(web.post(path, self._pooling) for path in apis.POOLING_PATHS),
                web.get("/v1/models", self._models),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.get("/health", self._health),
                web.get("/version", self._version),
                web.get("/metrics", self._metrics),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),
            ])
            # handler_cancellation: a client gone cancels its handler, which aborts its request (as vLLM does)
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
            await self._runner.setup()
            # backlog: uvicorn's default, vLLM's API server's; aiohttp's 128 overflowed when a test's Envoy
            # opened 1,000 connections at once on a busy machine (SYNs dropped, Envoy's connects timed out)
            site = web.TCPSite(self._runner, o.host, o.port, backlog=2048)
            await site.start()
            self.port = self._runner.addresses[0][1]  # the real port when o.port == 0
            self.name = o.name or f"sim-{self.port}"
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for rank in self.ranks:
            rank.cancel_waiters()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for rank in self.ranks:
            if rank.publisher is not None:
                rank.publisher.close()
        self.ranks = []

    @property
    def url(self) -> str:
        host = f"[{self.options.host}]" if ":" in self.options.host else self.options.host
        return f"http://{host}:{self.port}"

    def ready_info(self) -> dict[str, Any]:
        """What `kvgate sim` prints once serving."""
        o = self.options
        kv = None
        if o.kv_events:
            kv = {"generation": o.kv_events_generation,
                  "pub_ports": [o.kv_events_port + r for r in range(o.dp_size)],
                  "replay_ports": None if o.replay_port is None else [o.replay_port + r for r in range(o.dp_size)]}
        return {"name": self.name, "url": self.url, "model": o.model, "loras": list(self.engine_config.lora_names),
                "dp_size": o.dp_size, "block_size": self.engine_config.block_size,
                "num_blocks": self.engine_config.num_blocks, "kv_events": kv,
                "groups": [dataclasses.asdict(g) for g in self.engine_config.groups],
                "retention_interval": self.engine_config.retention_interval,
                "image": {"placeholder_token_id": self.image_token_id, "tokens_per_image": o.image_tokens}}

    # ---- handlers -----------------------------------------------------------------------------

    def _headers(self, rank: _Rank | None = None) -> dict[str, str]:
        h = {"x-sim-name": self.name}
        if rank is not None:
            h["x-sim-rank"] = str(rank.index)
        return h

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion(await _json(request), self._served))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat(await _json(request), self._served))

    async def _completions_render(self, request: web.Request) -> web.Response:
        """vLLM's /v1/completions/render: a list of one GenerateRequest per prompt (the sim takes one)."""
        return await self._render(request, parse_completion(await _json(request), self._served), listed=True)

    async def _chat_render(self, request: web.Request) -> web.Response:
        """vLLM's /v1/chat/completions/render: one GenerateRequest."""
        return await self._render(request, parse_chat(await _json(request), self._served), listed=False)

    async def _responses_render(self, request: web.Request) -> web.Response:
        """vLLM's /v1/responses/render: stateless (a previous_response_id is refused with 400)."""
        call = apis.parse_responses(await _json(request), self._served, None)
        return await self._render(request, call.gen, listed=False)

    async def _messages_render(self, request: web.Request) -> web.Response:
        return await self._render(request, apis.parse_messages(await _json(request, apis.AnthropicError),
                                                               self._served), listed=False)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /v1/responses: the conversation of a previous_response_id comes from this engine's store
        (404 when this engine did not store it); a response is stored unless `store` is false."""
        call = apis.parse_responses(await _json(request), self._served, self.responses)
        response_id = apis.new_response_id()
        out = await self._run(request, call.gen)
        if isinstance(out, web.StreamResponse):
            return out
        rank, engine_id, fut, prompt, max_tokens = out
        try:
            if call.gen.stream:
                return await self._stream_responses(request, call, rank, engine_id, fut, response_id, max_tokens)
            done = await fut
            text = "".join(self._text(t) for t in done.output_token_ids)
            if call.store:
                self.responses.put(response_id, call.messages, text)
            u = apis.response_usage(done.prompt_tokens, len(done.output_token_ids), done.cached_tokens)
            return web.json_response(apis.response_body(call, response_id, text, u, max_tokens),
                                     headers=self._headers(rank))
        finally:
            if not fut.done():
                rank.abort(engine_id)

    async def _response_get(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if self.responses.get(response_id) is None:
            raise apis.not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "status": "completed"},
                                 headers=self._headers())

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        req = apis.parse_messages(await _json(request, apis.AnthropicError), self._served)
        message_id = f"msg_{request.headers.get('X-Request-Id') or uuid.uuid4().hex}"
        try:
            out = await self._run(request, req)
        except ApiError as e:
            raise apis.AnthropicError(e.status, e.message, e.param) from None
        if isinstance(out, web.StreamResponse):
            return out
        rank, engine_id, fut, prompt, max_tokens = out
        try:
            if req.stream:
                return await self._stream_messages(request, req, rank, engine_id, fut, message_id)
            done = await fut
            text = "".join(self._text(t) for t in done.output_token_ids)
            return web.json_response(apis.message_body(req, message_id, text, done.prompt_tokens,
                                                       len(done.output_token_ids), done.cached_tokens),
                                     headers=self._headers(rank))
        finally:
            if not fut.done():
                rank.abort(engine_id)

    async def _pooling(self, request: web.Request) -> web.Response:
        """The pooling endpoints: each input's tokens prefilled (one output token, as a pooling run holds the
        engine), answered in vLLM's shapes with a deterministic vector or score per input."""
        lora, prompts = apis.pooling_inputs(request.path, await _json(request), self._served)
        rank = min(self.ranks, key=_Rank.load)
        results = []
        total = 0
        for p in prompts:
            tokens = (await self._encode(p, True, request.content_length)).token_ids
            if not tokens:
                raise ApiError(400, "the input encodes to no tokens", "input")
            if len(tokens) + 1 > self.engine_config.max_model_len:
                raise ApiError(400, f"This model's maximum context length is {self.engine_config.max_model_len} "
                                    f"tokens. However, you requested {len(tokens)} tokens in the input.")
            engine_id = f"pool-{uuid.uuid4().hex}"
            fut = rank.submit(engine_id, list(tokens), 1, lora, None, ())
            try:
                await fut
            finally:
                if not fut.done():
                    rank.abort(engine_id)
            total += len(tokens)
            results.append(apis.vector(list(tokens)))
        model = (await _json(request)).get("model") or self.options.model
        created = int(time.time())
        path = request.path
        u = {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0, "prompt_tokens_details": None}
        if path == "/v1/embeddings":
            body: dict[str, Any] = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": created,
                                    "model": model, "data": [{"index": i, "object": "embedding", "embedding": v}
                                                             for i, v in enumerate(results)], "usage": u}
        elif path == "/pooling":
            body = {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
                    "data": [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(results)], "usage": u}
        elif path == "/classify":
            body = {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
                    "data": [{"index": i, "label": "LABEL_0" if v[0] < 0 else "LABEL_1", "probs": [0.5, 0.5],
                              "num_classes": 2} for i, v in enumerate(results)], "usage": u}
        elif path == "/score":
            body = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
                    "data": [{"index": i, "object": "score", "score": v[0] + 0.5} for i, v in enumerate(results)],
                    "usage": u}
        else:
            docs = (await _json(request))["documents"]
            body = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": total},
                    "results": sorted(({"index": i, "document": {"text": docs[i]}, "relevance_score": v[0] + 0.5}
                                       for i, v in enumerate(results)), key=lambda r: -r["relevance_score"])}
        return web.json_response(body, headers=self._headers(rank))

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < self._vocab_size for t in tokens):
            raise ApiError(400, "`tokens` must be a list of token ids in the vocabulary", "tokens")
        self._served.resolve(body.get("model"))
        return web.json_response({"prompt": self.tokenizer.decode(tokens)}, headers=self._headers())

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.options.kv_events_generation + ".0-sim"}, headers=self._headers())

    async def _run(self, request: web.Request, req: GenerationRequest) -> Any:
        """A generation submitted to its rank: (rank, engine id, future, prompt, max_tokens), or the streamed
        error answer of a bad rank pin."""
        prompt, max_tokens = await self._prompt(request, req)
        rank = self._rank_for(request)
        if isinstance(rank, ApiError):
            if req.stream:
                return await self._stream_error(request, rank)
            raise rank
        engine_id = f"{req.kind}-{uuid.uuid4().hex}"
        try:
            fut = rank.submit(engine_id, prompt.token_ids, max_tokens, req.lora, req.cache_salt, prompt.media)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        return rank, engine_id, fut, prompt, max_tokens

    async def _deltas(self, rank: _Rank, engine_id: str, fut: asyncio.Future[Completion]) -> Any:
        """The output's texts as the engine produces them (an async generator); its last value is the
        Completion itself."""
        sent = 0
        while True:
            rank.sync()
            if fut.done():
                out = fut.result().output_token_ids
            else:
                out = rank.engine.output_so_far(engine_id, self._clock()) or ()
            for i in range(sent, len(out)):
                yield self._text(out[i])
            sent = len(out)
            if fut.done():
                yield fut.result()
                return
            await asyncio.wait((fut,), timeout=max(_MIN_POLL_S, rank.engine.step_time()))

    async def _event_stream(self, request: web.Request, rank: _Rank) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **self._headers(rank)})
        await resp.prepare(request)
        return resp

    async def _stream_responses(self, request: web.Request, call: apis.ResponsesCall, rank: _Rank, engine_id: str,
                                fut: asyncio.Future[Completion], response_id: str, max_tokens: int) -> web.StreamResponse:
        """The Responses API's event stream as vLLM's simple (non-harmony) path sends it."""
        resp = await self._event_stream(request, rank)
        seq = 0

        async def send(event: str, data: dict[str, Any]) -> None:
            nonlocal seq
            await resp.write(apis.sse(event, {"type": event, "sequence_number": seq, **data}))
            seq += 1

        pending = apis.response_body(call, response_id, "", {}, max_tokens, status="in_progress")
        item_id = f"msg_{uuid.uuid4().hex}"
        try:
            await send("response.created", {"response": pending})
            await send("response.in_progress", {"response": pending})
            await send("response.output_item.added", {"output_index": 0, "item": {
                "id": item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"}})
            await send("response.content_part.added", {"output_index": 0, "item_id": item_id, "content_index": 0,
                                                       "part": {"type": "output_text", "text": "", "annotations": [],
                                                                "logprobs": []}})
            texts = []
            async for delta in self._deltas(rank, engine_id, fut):
                if isinstance(delta, Completion):
                    done = delta
                    break
                texts.append(delta)
                await send("response.output_text.delta", {"item_id": item_id, "output_index": 0,
                                                          "content_index": 0, "delta": delta, "logprobs": []})
            text = "".join(texts)
            part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
            await send("response.output_text.done", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                                     "text": text, "logprobs": []})
            await send("response.content_part.done", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                                      "part": part})
            await send("response.output_item.done", {"output_index": 0, "item": {
                "id": item_id, "content": [part], "role": "assistant", "status": "completed", "type": "message"}})
            if call.store:
                self.responses.put(response_id, call.messages, text)
            u = apis.response_usage(done.prompt_tokens, len(done.output_token_ids), done.cached_tokens)
            final = apis.response_body(call, response_id, text, u, max_tokens)
            final["output"][0]["id"] = item_id
            await send("response.completed", {"response": final})
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            if not fut.done():
                rank.abort(engine_id)
            raise
        return resp

    async def _stream_messages(self, request: web.Request, req: GenerationRequest, rank: _Rank, engine_id: str,
                               fut: asyncio.Future[Completion], message_id: str) -> web.StreamResponse:
        """Anthropic's event stream as vLLM sends it: message_start, content_block_start, ping,
        content_block_delta (text_delta) per token, content_block_stop, message_delta (stop reason and
        usage), message_stop."""
        resp = await self._event_stream(request, rank)

        async def send(event: str, data: dict[str, Any]) -> None:
            await resp.write(apis.sse(event, {"type": event, **data}))

        try:
            await send("message_start", {"message": {
                "id": message_id, "type": "message", "role": "assistant", "content": [], "model": req.model,
                "stop_reason": None, "stop_sequence": None, "usage": apis.message_usage(0, 0, 0)}})
            await send("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            await send("ping", {})
            async for delta in self._deltas(rank, engine_id, fut):
                if isinstance(delta, Completion):
                    done = delta
                    break
                await send("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta}})
            await send("content_block_stop", {"index": 0})
            await send("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                         "usage": apis.message_usage(done.prompt_tokens, len(done.output_token_ids),
                                                                     done.cached_tokens)})
            await send("message_stop", {})
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            if not fut.done():
                rank.abort(engine_id)
            raise
        return resp

    async def _render(self, request: web.Request, req: GenerationRequest, listed: bool) -> web.Response:
        prompt, max_tokens = await self._prompt(request, req)
        body = render_body(self._response_id(request, req), req.model, prompt.token_ids, prompt.media, max_tokens,
                           req.cache_salt, req.stream, req.include_usage)
        return web.json_response([body] if listed else body, headers=self._headers())

    async def _encode(self, item: Any, add_special_tokens: bool | None = None, size: int | None = None) -> PromptTokens:
        """Tokens of `item` (with its images' placeholders, sim.media); `size` is its request body's length.
        Small inputs are tokenized on the event loop (well under a millisecond: a worker thread would cost
        more than the work); big ones in a worker thread."""
        try:
            if size is not None and size <= _INLINE_BYTES:
                return self._encode_now(item, add_special_tokens)
            return await asyncio.to_thread(self._encode_now, item, add_special_tokens)
        except ValueError as e:  # media.MediaError too
            raise ApiError(400, str(e)) from e

    def _encode_now(self, item: Any, add_special_tokens: bool | None) -> PromptTokens:
        identifiers: list[str] = []
        if isinstance(item, ChatInput) and media.has_media(item):
            template = self.tokenizer.template(item.chat_template, vllm_chat.tool_dicts(item.tools))
            item, identifiers = media.with_placeholders(item, vllm_chat.content_format(template), self.options.model)
        if isinstance(item, ChatInput) and add_special_tokens:
            ids = self.tokenizer.encode_prompt(self.tokenizer.render_chat(item), True)
        else:
            ids = self.tokenizer.encode(item)
        if not identifiers:  # a placeholder token without an image stays one token, as in vLLM
            return PromptTokens(ids)
        return media.expand(ids, self.image_token_id, identifiers, self.options.image_tokens)

    async def _prompt(self, request: web.Request, req: GenerationRequest) -> tuple[PromptTokens, int]:
        """The request's prompt as the engine gets it, and its max_tokens; ApiError as vLLM refuses them."""
        prompt = await self._encode(req.item, size=request.content_length)
        tokens = prompt.token_ids
        if not tokens:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        bad = next((t for t in tokens if not 0 <= t < self._vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} is out of vocabulary", "prompt")
        limit = self.engine_config.max_model_len
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.options.max_tokens_default, limit - len(tokens)))
        if len(tokens) + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the messages, {max_tokens} "
                                f"in the completion). Please reduce the length of the messages or completion.")
        return prompt, max_tokens

    @staticmethod
    def _response_id(request: web.Request, req: GenerationRequest) -> str:
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        return f"{prefix}-{request.headers.get('X-Request-Id') or uuid.uuid4().hex}"

    async def _generate(self, request: web.Request, req: GenerationRequest) -> web.StreamResponse:
        prompt, max_tokens = await self._prompt(request, req)
        rank = self._rank_for(request)
        if isinstance(rank, ApiError):
            if req.stream:  # vLLM meets the bad rank inside the stream it has already answered 200 to
                return await self._stream_error(request, rank)
            raise rank
        response_id = self._response_id(request, req)
        engine_id = f"{response_id}-{uuid.uuid4().hex[:8]}"
        n_prompt = len(prompt.token_ids)
        leg = pd.leg(req.kv_transfer, n_prompt, self.engine_config.block_size)
        headers = self._headers(rank)
        if leg.kind:
            self.kv_transfers[leg.kind] += 1
            headers["x-sim-kv-transfer"] = leg.kind
        if leg.blocks and self.options.kv_transfer_s_per_block:
            await asyncio.sleep(leg.blocks * self.options.kv_transfer_s_per_block)  # the pull from the prefill engine
        try:
            fut = rank.submit(engine_id, prompt.token_ids, max_tokens, req.lora, req.cache_salt, prompt.media,
                              leg.remote_tokens)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        answer = None
        if leg.kind == "prefill":
            answer = pd.prefill_answer(engine_id=f"{self.name}-rank{rank.index}", request_id=engine_id,
                                       host=self.options.host, port=self.options.side_channel_port + rank.index,
                                       n_prompt=n_prompt, block_size=self.engine_config.block_size,
                                       first_block=self._next_block_id)
            self._next_block_id += len(answer["remote_block_ids"][0])
        try:
            if req.stream:
                return await self._stream(request, req, rank, engine_id, fut, response_id, headers, answer)
            done = await fut
            text = "".join(self._text(t) for t in done.output_token_ids)
            body = full_body(req, response_id, self.name, text,
                             usage(done.prompt_tokens, len(done.output_token_ids), done.cached_tokens))
            if answer is not None:
                body["kv_transfer_params"] = answer
            return web.json_response(body, headers=headers)
        finally:
            if not fut.done():
                rank.abort(engine_id)

    def _rank_for(self, request: web.Request) -> _Rank | ApiError:
        """The rank the request's header pins it to, else the least loaded one; an ApiError for a
        rank this engine does not have."""
        pinned = _pinned_rank(request.headers.get(DP_RANK_HEADER))
        if pinned is None:
            return min(self.ranks, key=_Rank.load)
        if 0 <= pinned < len(self.ranks):
            return self.ranks[pinned]
        return ApiError(400, f"data_parallel_rank {pinned} is out of range [0, {len(self.ranks)}).")

    async def _stream_error(self, request: web.Request, err: ApiError) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **self._headers()})
        await resp.prepare(request)
        await _send(resp, err.body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        return text if text is not None else self.tokenizer.decode([token_id])

    async def _stream(self, request: web.Request, req: GenerationRequest, rank: _Rank, engine_id: str,
                      fut: asyncio.Future[Completion], response_id: str, headers: dict[str, str],
                      kv_answer: dict[str, Any] | None) -> web.StreamResponse:
        """SSE chunks as the tokens come; a prefill leg's kv_transfer_params ride on the last token's chunk."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **headers})
        await resp.prepare(request)
        created = int(time.time())
        fp = self.name
        sent = 0
        try:
            while True:
                rank.sync()
                if fut.done():
                    done = fut.result()
                    out = done.output_token_ids
                else:
                    out = rank.engine.output_so_far(engine_id, self._clock()) or ()
                for i in range(sent, len(out)):
                    if i == 0 and req.kind == "chat":
                        await _send(resp, chunk(req, response_id, created, fp, first=True))
                    last = fut.done() and i == len(out) - 1
                    body = chunk(req, response_id, created, fp, text=self._text(out[i]), finish=last)
                    if last and kv_answer is not None:
                        body["kv_transfer_params"] = kv_answer
                    await _send(resp, body)
                sent = len(out)
                if fut.done():
                    break
                await asyncio.wait((fut,), timeout=max(_MIN_POLL_S, rank.engine.step_time()))
            if req.include_usage:
                u = usage(done.prompt_tokens, len(done.output_token_ids), done.cached_tokens)
                await _send(resp, chunk(req, response_id, created, fp, usage_=u))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            log.debug("stream %s: client went away", response_id)
            if not fut.done():
                rank.abort(engine_id)
            raise
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        limit = self.engine_config.max_model_len
        data = [{"id": self.options.model, "object": "model", "created": created, "owned_by": "vllm",
                 "root": self.options.model, "parent": None, "max_model_len": limit}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": name,
                  "parent": self.options.model, "max_model_len": None} for name in self.engine_config.lora_names]
        return web.json_response({"object": "list", "data": data}, headers=self._headers())

    async def _tokenize(self, request: web.Request) -> web.Response:
        req = parse_tokenize(await _json(request), self._served)
        size = request.content_length
        tokens = (await self._encode(req.item, req.add_special_tokens, size)).token_ids
        strs = None
        if req.return_token_strs:
            if size is not None and size <= _INLINE_BYTES:
                strs = self.tokenizer.token_strs(tokens)
            else:
                strs = await asyncio.to_thread(self.tokenizer.token_strs, tokens)
        body = {"count": len(tokens), "max_model_len": self.engine_config.max_model_len, "tokens": tokens,
                "token_strs": strs}
        return web.json_response(body, headers=self._headers())

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200, headers=self._headers())

    async def _metrics(self, request: web.Request) -> web.Response:
        for rank in self.ranks:
            rank.sync()
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        refused = []
        for rank in self.ranks:
            rank.sync()
            if not rank.engine.reset_prefix_cache(self._clock()):
                refused.append(rank.index)
            rank.sync()
        if refused:
            raise ApiError(409, f"requests are running on rank(s) {refused}: their prefix cache was not reset")
        return web.Response(status=200, headers=self._headers())


def _pinned_rank(value: str | None) -> int | None:
    """The header's rank as vLLM reads it: Python's int() of the value; absent or not an integer
    means not pinned."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def _json(request: web.Request, error: type[ApiError] = ApiError) -> Any:
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(400, f"the request body is not valid JSON: {e}") from e


async def _send(resp: web.StreamResponse, body: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status in (404, 405):
            return web.json_response({"detail": e.reason}, status=e.status)
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response(ApiError(500, "internal error in the simulated engine").body(), status=500)
