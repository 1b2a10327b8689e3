"""The Endpoint Picker protocol (v1.0.0), one ext_proc conversation per clause, over real gRPC with
the real Router, registry and counts (engine loads put in by hand where saturation matters)."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from plugin import grpcserver
from plugin.app import App
from plugin.config import Settings
from plugin.extproc import ExternalProcessor
from plugin.pipeline import Gateway
from plugin.metrics import GatewayMetrics
from routing.discovery.static import StaticSource
from routing.state.engine_metrics import EngineLoad, EngineMetrics
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router

PODS = [Pod(f"p{i}", f"10.0.0.{i + 1}", 8000, "m") for i in range(4)]
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def headers_msg(extra=(), metadata: dict | None = None, streamed=False, path="/v1/completions", method="POST"):
    hs = [(":method", method), (":path", path), ("x-request-id", "rid")] + list(extra)
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])))
    if metadata:
        for ns, fields in metadata.items():
            msg.metadata_context.filter_metadata[ns].update(fields)
    if streamed:
        msg.protocol_config.request_body_mode = FULL_DUPLEX
        msg.protocol_config.response_body_mode = FULL_DUPLEX
    return msg


def body_msg(raw: bytes, eos=True):
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=eos))


PROMPT = json.dumps({"model": "m", "prompt": "hello"}).encode()


class Conversation:
    """One ext_proc server over loopback gRPC; `stream()` opens a Process call to write and read. The server is
    kvgate's own or grpcio's (`server`, each test run on both: the `_both_servers` fixture)."""

    server_kind = "kvgate"

    def __init__(self, gw: Gateway) -> None:
        self.proc = ExternalProcessor(gw)
        if self.server_kind == "grpcio":
            self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            pb_grpc.add_ExternalProcessorServicer_to_server(self.proc, self.server)
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            self.server = grpcserver.Server()
            self.server.add(grpcserver.EXT_PROC_SERVICE, grpcserver.ext_proc_methods(self.proc))

    async def __aenter__(self):
        if self.server_kind == "grpcio":
            await self.server.start()
        else:
            self.port = await self.server.listen("127.0.0.1", 0)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.server.stop(0)

    def stream(self):
        return pb_grpc.ExternalProcessorStub(self.channel).Process()

    async def exchange(self, *messages):
        """Write every message, close, and return every answer."""
        call = self.stream()
        for m in messages:
            await call.write(m)
        await call.done_writing()
        return [r async for r in call]


@pytest.fixture(autouse=True, params=["kvgate", "grpcio"])
def _both_servers(request, monkeypatch):
    monkeypatch.setattr(Conversation, "server_kind", request.param)
    return request.param


def setup(pods=PODS, strategy="least-request", **gw_kw):
    registry = PodRegistry(pods)
    engines = EngineMetrics(registry, interval_s=60)
    router = Router(registry, default_strategy=strategy, engines=engines, seed=1)
    gw = Gateway(router=router, registry=registry, tokenizer=None, metrics=GatewayMetrics(CollectorRegistry()),
                 default_strategy=strategy, max_body_bytes=1 << 20, tokenizer_timeout_s=1.0, **gw_kw)
    return gw, router, engines


def destination(resp: pb.ProcessingResponse, phase: str = "request_body"):
    common = getattr(resp, phase).response
    header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    return header["x-gateway-destination-endpoint"], meta.string_value


def retries(resp: pb.ProcessingResponse) -> str:
    return {h.header.key: h.header.raw_value.decode()
            for h in resp.request_body.response.header_mutation.set_headers}["x-envoy-max-retries"]


def busy(router: Router, loads: dict[str, int]) -> None:
    """Running counts as if requests were in flight on those pods."""
    for name, n in loads.items():
        router._counts.add(name, n)


async def test_subset_hint_limits_the_pick_and_the_fallbacks():
    gw, router, _ = setup()
    allowed = [PODS[1].endpoint, PODS[3].endpoint]
    async with Conversation(gw) as c:
        for form in (allowed, ",".join(allowed)):  # a list, or one comma-separated string
            for _ in range(4):
                out = await c.exchange(
                    headers_msg(metadata={"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": form}}),
                    body_msg(PROMPT))
                header, meta = destination(out[1])
                assert set(header.split(",")) == set(allowed) and header == meta
        # without a hint every pod of the pool is eligible
        out = await c.exchange(headers_msg(), body_msg(PROMPT))
        assert set(destination(out[1])[0].split(",")) == {p.endpoint for p in PODS}


async def test_subset_hint_with_no_eligible_pod_is_503():
    gw, router, _ = setup()
    async with Conversation(gw) as c:
        for subset in (["10.9.9.9:8000"], []):  # a foreign endpoint; an empty list
            out = await c.exchange(
                headers_msg(metadata={"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": subset}}),
                body_msg(PROMPT))
            imm = out[-1].immediate_response
            assert imm.status.code == 503
            assert json.loads(imm.body)["error"]["code"] == "no_eligible_endpoint"
        out = await c.exchange(
            headers_msg(path="/v1/models", method="GET",
                        metadata={"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["10.9.9.9:1"]}}))
        assert out[0].immediate_response.status.code == 503
    assert not any(router.running().values())  # nothing was counted for a refused request


async def test_ranked_list_is_the_pick_then_the_next_best_identical_in_header_and_metadata():
    gw, router, _ = setup()
    busy(router, {"p0": 3, "p1": 1, "p2": 0, "p3": 2})  # least-request ranks p2, p1, p3, p0
    async with Conversation(gw) as c:
        call = c.stream()
        await call.write(headers_msg())
        await call.read()
        await call.write(body_msg(PROMPT))
        resp = await call.read()
        header, meta = destination(resp)
        assert header == meta == ",".join(PODS[i].endpoint for i in (2, 1, 3, 0))
        assert retries(resp) == "3"  # Envoy's retries walk exactly the list
        assert router.running()["p2"] == 1  # the primary carries the count
        await call.done_writing()


async def test_served_endpoint_takes_the_requests_count():
    gw, router, _ = setup()
    busy(router, {"p1": 1, "p2": 1, "p3": 1})  # p0 is picked
    async with Conversation(gw) as c:
        call = c.stream()
        await call.write(headers_msg())
        await call.read()
        await call.write(body_msg(PROMPT))
        header, _ = destination(await call.read())
        assert header.startswith(PODS[0].endpoint)
        assert router.running()["p0"] == 1
        served = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
        served.metadata_context.filter_metadata["envoy.lb"].update(
            {"x-gateway-destination-endpoint-served": PODS[2].endpoint})
        await call.write(served)
        answer = await call.read()
        names = {h.header.key: h.header.raw_value.decode()
                 for h in answer.response_headers.response.header_mutation.set_headers}
        assert names == {"x-kvgate-pod": "p2"}  # the pod that served it, not the one picked
        assert router.running().get("p0", 0) == 0 and router.running()["p2"] == 2
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    for _ in range(100):  # the stream's end releases the count where it moved
        if router.running()["p2"] == 1:
            break
        await asyncio.sleep(0.01)
    assert {k: v for k, v in router.running().items() if v} == {"p1": 1, "p2": 1, "p3": 1}
    assert gw.metrics.served.labels("fallback").value == 1


async def test_sheddable_request_gets_429_only_when_every_eligible_pod_is_saturated():
    gw, router, engines = setup(sheddable_objectives=frozenset({"batch"}))
    import time
    for i, p in enumerate(PODS):  # queueing (waiting >= 5) or KV cache nearly full (>= 0.8)
        engines.put(p.name, EngineLoad(waiting=9 if i % 2 else 0, running=4, kv_usage=0.5 if i % 2 else 0.95,
                                       at=time.monotonic()))
    shed = ("x-gateway-inference-objective", "batch")
    async with Conversation(gw) as c:
        out = await c.exchange(headers_msg([shed]), body_msg(PROMPT))
        assert out[-1].immediate_response.status.code == 429
        assert json.loads(out[-1].immediate_response.body)["error"]["code"] == "saturated"
        # an objective that is not sheddable is routed all the same
        out = await c.exchange(headers_msg([("x-gateway-inference-objective", "chat")]), body_msg(PROMPT))
        assert out[1].HasField("request_body") and destination(out[1])[0]
        # one eligible pod with room: the sheddable request is routed
        engines.put("p3", EngineLoad(waiting=0, running=1, kv_usage=0.2, at=time.monotonic()))
        out = await c.exchange(headers_msg([shed]), body_msg(PROMPT))
        assert out[1].HasField("request_body")
        # ... unless the subset hint leaves only saturated pods
        out = await c.exchange(headers_msg([shed], metadata={"envoy.lb.subset_hint": {
            "x-gateway-destination-endpoint-subset": [PODS[0].endpoint, PODS[1].endpoint]}}), body_msg(PROMPT))
        assert out[-1].immediate_response.status.code == 429


async def test_full_duplex_streamed_bodies_are_gathered_answered_on_headers_and_echoed():
    gw, router, _ = setup()
    chunks = [PROMPT[:7], PROMPT[7:15], PROMPT[15:]]
    async with Conversation(gw) as c:
        call = c.stream()
        await call.write(headers_msg(streamed=True))
        for i, chunk in enumerate(chunks):
            await call.write(body_msg(chunk, eos=i == len(chunks) - 1))
        head = await call.read()  # nothing was answered before the last chunk: the first answer is the headers'
        assert head.HasField("request_headers")
        header, meta = destination(head, "request_headers")
        assert header == meta and header.split(",")[0] in {p.endpoint for p in PODS}
        body = await call.read()
        streamed = body.request_body.response.body_mutation.streamed_response
        assert streamed.body == PROMPT and streamed.end_of_stream
        # the response body's chunks go back as they come
        for i, piece in enumerate((b"data: a\n\n", b"data: [DONE]\n\n")):
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece, end_of_stream=i == 1)))
            echo = (await call.read()).response_body.response.body_mutation.streamed_response
            assert echo.body == piece and echo.end_of_stream == (i == 1)
        await call.done_writing()
        # a streamed body on a path kvgate does not route is sent straight back, chunk by chunk
        out = await c.exchange(headers_msg(path="/other", streamed=True), body_msg(b"abc", eos=False),
                               body_msg(b"def"))
        assert out[0].HasField("request_headers")
        assert [r.request_body.response.body_mutation.streamed_response.body for r in out[1:]] == [b"abc", b"def"]


async def test_full_duplex_streamed_body_over_the_limit_is_413():
    gw, router, _ = setup()
    gw.max_body_bytes = 64
    async with Conversation(gw) as c:
        out = await c.exchange(headers_msg(streamed=True), body_msg(b"x" * 40, eos=False), body_msg(b"y" * 40))
        assert out[-1].immediate_response.status.code == 413
        assert not any(r.HasField("request_headers") for r in out)


class GatedSource(StaticSource):
    """The static source, whose first sync waits for the test to open the gate (a slow API server)."""

    def __init__(self, *a, gate: asyncio.Event, **kw):
        super().__init__(*a, **kw)
        self.gate = gate

    async def start(self, registry):
        await self.gate.wait()
        await super().start(registry)


async def test_health_services_liveness_readiness_and_ext_proc(_both_servers):
    settings = Settings(pods="p0=127.0.0.1:1/m", grpc_port=0, http_port=0, engine_metrics_interval_s=60,
                        grpc_server=_both_servers)
    app = App(settings)
    gate = asyncio.Event()
    app.source = GatedSource("", settings.pods, gate=gate)
    starting = asyncio.create_task(app.start())
    try:
        for _ in range(500):  # the gRPC port is bound before discovery syncs
            if app.grpc_port is not None:
                break
            await asyncio.sleep(0.01)
        port = app.grpc_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def status(service):
                return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

            S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            ext = "envoy.service.ext_proc.v3.ExternalProcessor"
            # discovery not synced: alive, not ready
            assert (await status("liveness"), await status("readiness"), await status(ext)) == (S, N, N)
            gate.set()
            await starting
            assert (await status("liveness"), await status("readiness"), await status(ext)) == (S, S, S)
            # draining: not ready any more, still alive (no restart while in-flight requests finish)
            drain = asyncio.create_task(app.drain(delay_s=30, timeout_s=0))
            for _ in range(500):
                if await status("readiness") == N:
                    break
                await asyncio.sleep(0.01)
            assert (await status("liveness"), await status("readiness"), await status(ext)) == (S, N, N)
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)
    finally:
        gate.set()
        await asyncio.gather(starting, return_exceptions=True)
        await app.stop(0)


async def test_slo_headers_reach_the_router_and_a_bad_one_is_400():
    gw, router, _ = setup(strategy="slo")
    seen = []
    real = router.pick

    async def spy(request, **kw):
        seen.append((request.slo_ttft_s, request.slo_tpot_s))
        return await real(request, **kw)

    router.pick = spy
    async with Conversation(gw) as c:
        await c.exchange(headers_msg([("x-slo-ttft-ms", "250"), ("x-slo-tpot-ms", "40")]), body_msg(PROMPT))
        bad = await c.exchange(headers_msg([("x-slo-ttft-ms", "soon")]), body_msg(PROMPT))
    assert seen == [(0.25, 0.04)]
    assert bad[0].immediate_response.status.code == 400
    assert json.loads(bad[0].immediate_response.body)["error"]["code"] == "invalid_slo"


async def test_admission_moves_to_a_fallback_with_room_then_answers_429_with_retry_after():
    from routing.state.admission import Admission, LocalLimiter
    adm = Admission(LocalLimiter(), max_running=1, max_wait_s=0.3, retry_after_s=2)
    gw, router, _ = setup(pods=PODS[:2], admission=adm)
    async with Conversation(gw) as c:
        first, second = c.stream(), c.stream()
        await first.write(headers_msg())
        await first.write(body_msg(PROMPT))
        a = [await first.read(), await first.read()]
        await second.write(headers_msg())
        await second.write(body_msg(PROMPT))
        b = [await second.read(), await second.read()]
        pods = {destination(a[1])[0].split(",")[0], destination(b[1])[0].split(",")[0]}
        assert pods == {p.endpoint for p in PODS[:2]}  # the second went to the pod with room
        assert adm.limiter.running() == {"p0": 1, "p1": 1}
        third = await c.exchange(headers_msg(), body_msg(PROMPT))  # both full: waits 0.3 s, then 429
        resp = third[-1].immediate_response
        assert resp.status.code == 429
        assert json.loads(resp.body)["error"]["code"] == "admission_timeout"
        assert ("retry-after", "2") in {(h.header.key, h.header.raw_value.decode()) for h in resp.headers.set_headers}
        for call in (first, second):  # both streams end: their admitted counts are released
            await call.done_writing()
            while await call.read() != grpc.aio.EOF:
                pass
        deadline = asyncio.get_running_loop().time() + 5
        while (adm.limiter.running() or router.running()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
    assert adm.limiter.running() == {} and router.running() == {}
