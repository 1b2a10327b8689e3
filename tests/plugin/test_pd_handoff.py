"""The pd strategy's plan and handoff in process: the prefill leg's body field by field, the decider, the decode
picks spread over a burst, and every prefill failure (refused, timed out, unreachable, a bad answer, the client
gone) ending in a served plan with every running count back to zero."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import AsyncIterator

import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry

from kvcache.index import PrefixIndex
from plugin.extproc import ExternalProcessor
from plugin.metrics import GatewayMetrics
from plugin.pd import PREFILL_PARAMS, PDHandoff, prefill_body, usable_params
from plugin.pipeline import Gateway
from routing.pd import AGGREGATED, DISAGGREGATED, FALLBACK, NO_PREFILL_POD, PDConfig, PDPlanner
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.scoring import RouteRequest
from routing.scheduling.strategies import StrategyConfig

MODEL = "sim-model"
# An empty index and no engine metrics in process: load decides.
WEIGHTS = {"pd": {"ttft": 0.0, "affinity": 0.0}}
PROMPT = " ".join(f"word{i} and more text" for i in range(60))


def test_prefill_body_field_by_field():
    client = {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": True},
              "max_tokens": 200, "min_tokens": 5, "min_completion_tokens": 3, "temperature": 0.5,
              "cache_salt": "s"}
    out = prefill_body(client, chat=False)
    assert out == {"model": MODEL, "prompt": "hi", "stream": False, "max_tokens": 1, "temperature": 0.5,
                   "cache_salt": "s", "kv_transfer_params": {
                       "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    assert client["stream"] is True and client["max_tokens"] == 200  # the client's body is left as it is
    chat = prefill_body({"model": MODEL, "messages": [], "max_completion_tokens": 50}, chat=True)
    assert (chat["max_tokens"], chat["max_completion_tokens"], chat["stream"]) == (1, 1, False)
    assert prefill_body({"model": MODEL, "messages": []}, chat=True)["max_completion_tokens"] == 1
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"}, chat=False)
    assert out["kv_transfer_params"] is not PREFILL_PARAMS  # a copy per request


def test_usable_params():
    good = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e", "remote_host": "h",
            "remote_port": 1, "remote_request_id": "r"}
    assert usable_params({"kv_transfer_params": good}) == good
    for bad in (None, "x", {}, {**good, "do_remote_prefill": False}, {**good, "remote_block_ids": []},
                {**good, "remote_host": None}):
        assert usable_params({"kv_transfer_params": bad}) is None
    assert usable_params([1]) is None


class Stub:
    """A prefill engine that misbehaves: `mode` is ok (a sim-like answer), refuse (500), slow (never answers in
    time), invalid (200 without kv_transfer_params). Records what it received."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.bodies: list[dict] = []
        self.request_ids: list[str | None] = []
        self.auths: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.cancelled = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.request_ids.append(request.headers.get("X-Request-Id"))
        self.auths.append(request.headers.get("Authorization"))
        if self.mode == "refuse":
            return web.json_response({"error": {"message": "no"}}, status=500)
        if self.mode == "slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if self.mode == "invalid":
            return web.json_response({"choices": [{"text": "x"}]})
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[0, 1, 2]],
            "remote_engine_id": f"stub-{self.port}", "remote_request_id": "r", "remote_host": "127.0.0.1",
            "remote_port": 5600}})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[list[Stub], Router, PDHandoff, GatewayMetrics]]:
    stubs = [Stub(), Stub()]
    for s in stubs:
        await s.start()
    pods = [Pod("p0", "127.0.0.1", stubs[0].port, MODEL, role="prefill"),
            Pod("p1", "127.0.0.1", stubs[1].port, MODEL, role="prefill"),
            Pod("d0", "127.0.0.1", 1, MODEL, role="decode"), Pod("d1", "127.0.0.1", 2, MODEL, role="decode")]
    router = Router(PodRegistry(pods), default_strategy="pd", config=StrategyConfig(weights=WEIGHTS), index=PrefixIndex(), seed=1)
    metrics = GatewayMetrics(CollectorRegistry())
    # The prefill leg's bound: long enough for a loaded machine to connect and answer (0.3 s was not, once, with
    # the suite beside other work on 2 cores: p1's ConnectTimeout), short beside the slow stub's 30 s.
    handoff = PDHandoff(PDPlanner(router, router._registry, PDConfig(threshold_tokens=16, prefill_timeout_s=1.5)),
                        metrics)
    yield stubs, router, handoff, metrics
    await handoff.aclose()
    for s in stubs:
        await s.stop()


def _request(n_tokens: int | None = 400, rid: str = "req-1") -> RouteRequest:
    return RouteRequest(MODEL, token_ids=None if n_tokens is None else list(range(n_tokens)), strategy="pd",
                        request_id=rid)


async def _serve(router: Router, handoff: PDHandoff, body: dict, rid: str = "req-1") -> tuple[str, bytes | None]:
    """A request's life as the pipeline runs it: plan, prefill leg, then the decode stream ends."""
    plan = await handoff.plan(_request(rid=rid), None, False)
    assert plan.mode == DISAGGREGATED and plan.prefill is not None and plan.decode.pod.role == "decode"
    try:
        return await handoff.prefill(plan, "/v1/completions", json.dumps(body).encode(), rid, chat=False)
    finally:
        await router.release(plan.decode)


def _outcomes(metrics: GatewayMetrics) -> dict[str, float]:
    return {k[0]: v.value for k, v in metrics.pd_prefill._children.items()}  # type: ignore[attr-defined]


async def test_handoff_rewrites_the_body_with_the_prefill_answer(fleet):
    stubs, router, handoff, metrics = fleet
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "stream": True}
    mode, out = await _serve(router, handoff, body)
    assert mode == DISAGGREGATED and out is not None
    decoded = json.loads(out)
    assert {k: v for k, v in decoded.items() if k != "kv_transfer_params"} == body
    assert decoded["kv_transfer_params"]["do_remote_prefill"] is True
    sent = [b for s in stubs for b in s.bodies]
    assert len(sent) == 1 and sent[0]["kv_transfer_params"] == PREFILL_PARAMS and sent[0]["max_tokens"] == 1
    assert [r for s in stubs for r in s.request_ids] == ["req-1"]
    assert sum(router.running().values()) == 0
    assert _outcomes(metrics) == {"ok": 1}


@pytest.mark.parametrize("failure, outcome", [("refuse", "refused"), ("slow", "timeout"), ("invalid", "invalid"),
                                              ("dead", "unreachable")])
async def test_a_failed_prefill_is_retried_once_on_the_next_engine(fleet, failure, outcome):
    stubs, router, handoff, metrics = fleet
    for s in stubs:  # whichever is picked first fails; the other answers
        s.mode = failure if failure != "dead" else "ok"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    plan = await handoff.plan(_request(), None, False)
    first = next(s for s in stubs if s.port == plan.prefill.pod.port)
    other = next(s for s in stubs if s is not first)
    other.mode = "ok"
    if failure == "dead":
        await first.stop()
    mode, out = await handoff.prefill(plan, "/v1/completions", json.dumps(body).encode(), "req-2", chat=False)
    await router.release(plan.decode)
    assert mode == DISAGGREGATED and json.loads(out)["kv_transfer_params"]["remote_engine_id"] == f"stub-{other.port}"
    assert _outcomes(metrics) == {outcome: 1, "ok": 1}
    assert sum(router.running().values()) == 0


async def test_every_prefill_engine_failing_serves_it_whole(fleet):
    stubs, router, handoff, metrics = fleet
    stubs[0].mode, stubs[1].mode = "refuse", "slow"
    mode, out = await _serve(router, handoff, {"model": MODEL, "prompt": PROMPT})
    assert (mode, out) == (FALLBACK, None)  # the decode engine gets the client's body and prefills itself
    assert sorted(_outcomes(metrics)) == ["refused", "timeout"]
    assert metrics.pd_requests.labels(FALLBACK).value == 1
    assert sum(router.running().values()) == 0


async def test_client_gone_mid_prefill_cancels_the_leg_and_leaves_nothing_counted(fleet):
    stubs, router, handoff, metrics = fleet
    for s in stubs:
        s.mode = "slow"
    handoff.timeout_s = 30.0
    await handoff.aclose()  # the client is made again with the new bound
    plan = await handoff.plan(_request(), None, False)
    task = asyncio.create_task(handoff.prefill(plan, "/v1/completions",
                                               json.dumps({"model": MODEL, "prompt": PROMPT}).encode(), "r", False))
    await asyncio.wait_for(_until(lambda: sum(len(s.bodies) for s in stubs) == 1), 5)
    task.cancel()  # what the ext_proc stream's reset does to the pipeline
    with pytest.raises(asyncio.CancelledError):
        await task
    router.release_now(plan.decode)  # the stream's end
    assert _outcomes(metrics) == {"cancelled": 1}
    assert sum(router.running().values()) == 0 and metrics.pd_in_flight.value == 0
    await asyncio.wait_for(_until(lambda: sum(s.cancelled for s in stubs) == 1), 5)  # the engine saw it go


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_decider_and_roles(fleet):
    _, router, handoff, metrics = fleet
    short = await handoff.plan(_request(10), None, False)  # fewer uncached tokens than the threshold (16)
    assert (short.mode, short.prefill, short.decode.pod.role) == (AGGREGATED, None, "decode")
    untokenized = await handoff.plan(_request(None), None, False)  # unknown length: split
    assert untokenized.mode == DISAGGREGATED and untokenized.prefill.pod.role == "prefill"
    for d in (short.decode, untokenized.decode, untokenized.prefill):
        await router.release(d)
    # only the prefill engines allowed by the data plane's subset: none of them decodes -> 503
    from routing.errors import NoEligibleEndpointError
    p0 = next(p for p in router._registry.pods() if p.name == "p0")
    with pytest.raises(NoEligibleEndpointError):
        await handoff.plan(_request(), frozenset({p0.endpoint}), False)
    # a subset without prefill engines: served whole on the decode engine
    d0 = next(p for p in router._registry.pods() if p.name == "d0")
    whole = await handoff.plan(_request(), frozenset({d0.endpoint}), False)
    assert (whole.mode, whole.decode.pod.name) == (NO_PREFILL_POD, "d0")
    await router.release(whole.decode)
    assert metrics.pd_requests.labels(AGGREGATED).value == 1
    # another strategy never picks a prefill-only engine
    for _ in range(6):
        d = await router.pick(RouteRequest(MODEL, strategy="least-request"))
        assert d.pod.role == "decode"
        await router.release(d)
    assert sum(router.running().values()) == 0


async def test_a_burst_spreads_over_decode_engines_including_a_new_empty_one():
    pods = [Pod(f"d{i}", "127.0.0.1", 9000 + i, MODEL, role="decode") for i in range(3)]
    router = Router(PodRegistry(pods), default_strategy="pd", config=StrategyConfig(weights=WEIGHTS), index=PrefixIndex(), seed=3)
    planner = PDPlanner(router, router._registry, PDConfig(threshold_tokens=10**6))
    plans = [await planner.plan(_request(rid=str(i))) for i in range(12)]
    per_pod: dict[str, int] = {}
    for p in plans:
        per_pod[p.decode.pod.name] = per_pod.get(p.decode.pod.name, 0) + 1
    assert per_pod == {"d0": 4, "d1": 4, "d2": 4}


async def test_admission_and_profiles_cover_the_prefill_leg(fleet):
    from routing.learning.profiles import EngineProfiles
    from routing.state.admission import Admission, LocalLimiter
    stubs, router, handoff, metrics = fleet
    handoff.admission = admission = Admission(LocalLimiter(), max_running=1)
    handoff.profiles = profiles = EngineProfiles(prefill_tokens_per_s=1.0)
    plan = await handoff.plan(_request(400), None, False)
    full = plan.prefill.pod.name
    assert await admission.limiter.try_acquire(full, 1)  # the picked prefill engine is full: the other one runs it
    mode, out = await handoff.prefill(plan, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode(),
                                      "adm", chat=False, n_tokens=400)
    await router.release(plan.decode)
    assert mode == DISAGGREGATED and _outcomes(metrics) == {"full": 1, "ok": 1}
    other = next(p for p in ("p0", "p1") if p != full)
    assert admission.limiter.running() == {full: 1}  # the leg's place was given back
    assert profiles.prefill_rate(other) > 1.0  # 400 tokens in well under 400 s: learned from the leg
    assert sum(router.running().values()) == 0


# ---- the ext_proc answer of a pd request, over real gRPC -----------------------------------------------------------

def _headers_msg(streamed: bool) -> pb.ProcessingRequest:
    hs = [(":method", "POST"), (":path", "/v1/completions"), ("x-request-id", "rid-pd")]
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])))
    if streamed:
        msg.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    return msg


async def _exchange(gw: Gateway, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    proc = ExternalProcessor(gw)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(proc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            for m in messages:
                await call.write(m)
            await call.done_writing()
            out = [r async for r in call]
        await asyncio.wait_for(_until(lambda: gw.metrics.active_streams.value == 0), 5)
        await proc.drain()
        return out
    finally:
        await server.stop(0)


@pytest.mark.parametrize("streamed", [False, True])
async def test_the_answer_mutates_the_body_for_the_decode_engine(fleet, streamed):
    stubs, router, handoff, metrics = fleet
    registry = router._registry
    gw = Gateway(router=router, registry=registry, tokenizer=None, metrics=metrics, default_strategy="pd",
                 max_body_bytes=1 << 20, tokenizer_timeout_s=1.0, pd=handoff)
    client = {"model": MODEL, "prompt": list(range(400)), "max_tokens": 9, "stream": True}  # token ids: no tokenizer
    raw = json.dumps(client).encode()
    out = await _exchange(gw, _headers_msg(streamed), pb.ProcessingRequest(
        request_body=pb.HttpBody(body=raw, end_of_stream=True)))
    if streamed:  # the held headers' answer names the decode engine, then the body goes back rewritten
        head, body_answer = out[0], out[1]
        common = head.request_headers.response
        sent = body_answer.request_body.response.body_mutation.streamed_response.body
    else:  # headers, the longer message timeout, then the body's answer with the body mutation
        assert out[1].override_message_timeout.seconds == int(2 * handoff.timeout_s) + 5
        head = out[2]
        common = head.request_body.response
        sent = common.body_mutation.body
        hs = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
        assert hs["content-length"] == str(len(sent))
    decoded = json.loads(sent)
    assert {k: v for k, v in decoded.items() if k != "kv_transfer_params"} == client
    assert decoded["kv_transfer_params"]["do_remote_prefill"] is True
    ours = head.dynamic_metadata.fields["kvgate"].struct_value.fields
    assert ours["pd"].string_value == DISAGGREGATED and ours["strategy"].string_value == "pd"
    assert ours["pod"].string_value in ("d0", "d1")
    assert [b["max_tokens"] for s in stubs for b in s.bodies] == [1]
    assert sum(router.running().values()) == 0  # both legs released: the prefill's after it, the decode's at the end


async def test_an_aggregated_answer_leaves_the_body_alone(fleet):
    _, router, handoff, metrics = fleet
    gw = Gateway(router=router, registry=router._registry, tokenizer=None, metrics=metrics, default_strategy="pd",
                 max_body_bytes=1 << 20, tokenizer_timeout_s=1.0, pd=handoff)
    out = await _exchange(gw, _headers_msg(False), pb.ProcessingRequest(request_body=pb.HttpBody(
        body=json.dumps({"model": MODEL, "prompt": [1, 2, 3]}).encode(), end_of_stream=True)))
    answer = out[2]
    assert not answer.request_body.response.HasField("body_mutation")
    assert answer.dynamic_metadata.fields["kvgate"].struct_value.fields["pd"].string_value == AGGREGATED
    assert sum(router.running().values()) == 0


async def test_pd_aware_kv_sync_splits_only_where_there_are_prefill_engines(fleet):
    _, router, handoff, _ = fleet
    assert not handoff.splits("kv-sync", MODEL)  # not configured: kv-sync serves whole requests
    handoff.strategies = frozenset({"pd", "kv-sync"})
    assert handoff.splits("kv-sync", MODEL) and handoff.splits("pd", MODEL) and not handoff.splits("slo", MODEL)
    plan = await handoff.plan(dataclasses.replace(_request(), strategy="kv-sync"), None, False)
    assert plan.mode == DISAGGREGATED and plan.prefill.strategy == "kv-sync" and plan.decode.strategy == "kv-sync"
    assert plan.prefill.pod.role == "prefill"
    await router.release(plan.prefill)
    await router.release(plan.decode)
    # a fleet without prefill engines: kv-sync routes as ever
    plain = PDHandoff(PDPlanner(router, PodRegistry([Pod("a", "10.0.0.1", 8000, MODEL)])),
                      GatewayMetrics(CollectorRegistry()), strategies=frozenset({"kv-sync"}))
    assert not plain.splits("kv-sync", MODEL) and plain.splits("pd", MODEL)


def test_pd_strategies_setting():
    from plugin.config import ConfigError, Settings
    base = {"KVGATE_PODS": "p=127.0.0.1:1/m"}
    assert Settings.from_env({**base, "KVGATE_PD_STRATEGIES": " kv-sync , slo"}).pd_strategies == "kv-sync,slo"
    for bad in ("pd-decode", "fastest"):
        with pytest.raises(ConfigError, match="KVGATE_PD_STRATEGIES"):
            Settings.from_env({**base, "KVGATE_PD_STRATEGIES": bad})
    with pytest.raises(ConfigError, match="KVGATE_PD_THRESHOLD_TOKENS"):
        Settings.from_env({**base, "KVGATE_PD_THRESHOLD_TOKENS": "-1"})


async def test_a_clients_own_kv_transfer_params_never_reach_a_decode_engine(fleet):
    from plugin.pd import without_client_params
    stubs, router, handoff, metrics = fleet
    evil = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "x", "remote_request_id": "r",
            "remote_host": "169.254.169.254", "remote_port": 80}
    body = {"model": MODEL, "prompt": "hi", "kv_transfer_params": evil}
    assert json.loads(without_client_params(json.dumps(body).encode())) == {"model": MODEL, "prompt": "hi"}
    assert without_client_params(b'{"model": "m", "prompt": "hi"}') is None
    # split: the prefill engine's parameters replace them; every prefill engine failing: removed
    mode, out = await _serve(router, handoff, body)
    assert mode == DISAGGREGATED and json.loads(out)["kv_transfer_params"]["remote_host"] == "127.0.0.1"
    assert all(b["kv_transfer_params"] == PREFILL_PARAMS for s in stubs for b in s.bodies)
    stubs[0].mode = stubs[1].mode = "refuse"
    mode, out = await _serve(router, handoff, body, rid="req-2")
    assert mode == FALLBACK and "kv_transfer_params" not in json.loads(out)
    assert sum(router.running().values()) == 0


async def test_a_defect_in_the_leg_serves_the_request_whole(fleet, monkeypatch):
    _, router, handoff, metrics = fleet

    async def broken(*args, **kwargs):
        raise KeyError("oops")
    monkeypatch.setattr(handoff, "_call", broken)
    mode, out = await _serve(router, handoff, {"model": MODEL, "prompt": PROMPT})
    assert (mode, out) == (FALLBACK, None) and _outcomes(metrics) == {"error": 1}
    assert sum(router.running().values()) == 0


async def test_the_prefill_leg_carries_the_clients_authorization(fleet):
    stubs, router, handoff, _ = fleet
    plan = await handoff.plan(_request(), None, False)
    mode, _ = await handoff.prefill(plan, "/v1/completions", b'{"model": "sim-model", "prompt": "x"}', "a", False,
                                    authorization="Bearer k")
    await router.release(plan.decode)
    assert mode == DISAGGREGATED and [a for s in stubs for a in s.auths] == ["Bearer k"]
