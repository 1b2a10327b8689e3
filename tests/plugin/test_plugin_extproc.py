"""The ext_proc servicer over real gRPC, with a fake router: the protocol answers."""
import asyncio
from array import array
import json
from dataclasses import dataclass

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from prometheus_client import CollectorRegistry

from plugin.extproc import ExternalProcessor
from plugin.pipeline import Gateway
from plugin.metrics import GatewayMetrics
from routing.errors import NoReadyPodError, UnknownModelError, UnknownStrategyError
from routing.pods import Pod
from helpers import wait_until_async
from tokenizer.types import TokenizerError

POD = Pod("p0", "10.0.0.7", 8000, "m")


@dataclass
class FakeDecision:
    pod: Pod
    strategy: str
    matched_blocks: int = 0
    total_blocks: int = 0
    rank: int | None = None
    fallbacks: tuple = ()
    running: int = 0


class FakeRouter:
    def __init__(self, fail: Exception | None = None, needs_tokens: bool = True, rank: int | None = None):
        self.fail = fail
        self.tokens = needs_tokens
        self.rank = rank
        self.picks = []
        self.running = 0

    def needs_tokens(self, strategy):
        if strategy == "bogus":
            raise UnknownStrategyError(strategy, ("random",))
        return self.tokens

    async def pick(self, req, subset=None, sheddable=False):
        if self.fail:
            raise self.fail
        self.picks.append(req)
        self.running += 1
        return FakeDecision(POD, req.strategy, rank=self.rank, running=self.running)

    async def release(self, d):
        self.running -= 1


class FakeRegistry:
    def __init__(self, pods):
        self._pods = pods

    def pods(self):
        return self._pods

    def get(self, name):
        return next((p for p in self._pods if p.name == name), None)

    def ready_pods(self, model):
        return [p for p in self._pods if p.ready and p.serves(model)]


class FakeTokenizer:
    def __init__(self, fail=False, delay=0.0):
        self.fail, self.delay = fail, delay

    async def tokenize(self, model, item, *, base_url=None):
        await asyncio.sleep(self.delay)
        if self.fail:
            raise TokenizerError("down")
        return [1, 2, 3]

    async def aclose(self):
        pass


def headers(method, path, extra=(), eos=False):
    hs = [(":method", method), (":path", path), ("x-request-id", "rid-1")] + list(extra)
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
        end_of_stream=eos))


def body(obj):
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


async def run_stream(gw, messages, processor=None):
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    proc = processor or ExternalProcessor(gw)
    pb_grpc.add_ExternalProcessorServicer_to_server(proc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            call = stub.Process(iter(messages))
            out = [r async for r in call]
        # The client may have its last answer before the server's handler has run its `finally` (the
        # release): wait until no stream is open, then for the releases still pending.
        assert await wait_until_async(lambda: gw.metrics.active_streams.value == 0, timeout=5)
        await proc.drain()
        return out
    finally:
        await server.stop(0)


def gateway(router=None, tokenizer=None, pods=(POD,), **kw):
    return Gateway(router=router or FakeRouter(), registry=FakeRegistry(list(pods)), tokenizer=tokenizer,
                   metrics=GatewayMetrics(CollectorRegistry()), default_strategy="kv-sync",
                   max_body_bytes=kw.pop("max_body_bytes", 1 << 20), tokenizer_timeout_s=kw.pop("timeout", 1.0), **kw)


def set_headers(resp_common):
    return {h.header.key: h.header.raw_value.decode() for h in resp_common.header_mutation.set_headers}


async def test_routed_body_sets_destination_headers_and_metadata():
    router = FakeRouter()
    gw = gateway(router, FakeTokenizer())
    out = await run_stream(gw, [headers("POST", "/v1/completions?x=1",
                                        [("x-gateway-destination-endpoint", "6.6.6.6:1"), ("target-pod", "evil"),
                                         ("x-kvgate-pod", "evil"), ("X-Data-Parallel-Rank", "3")]),
                                body({"model": "m", "prompt": "hello"})])
    assert len(out) == 2
    assert set(out[0].request_headers.response.header_mutation.remove_headers) == {
        "x-gateway-destination-endpoint", "target-pod", "x-kvgate-pod", "X-Data-Parallel-Rank"}
    hs = set_headers(out[1].request_body.response)
    # not a data-parallel decision: no rank header, the client's one is gone
    assert hs == {"x-gateway-destination-endpoint": "10.0.0.7:8000", "target-pod": "10.0.0.7:8000",
                  "x-envoy-max-retries": "0"}  # no fallback: Envoy retries on nothing else
    md = out[1].dynamic_metadata
    assert md["envoy.lb"]["x-gateway-destination-endpoint"] == "10.0.0.7:8000"
    assert md["kvgate"]["pod"] == "p0" and md["kvgate"]["strategy"] == "kv-sync" and "rank" not in md["kvgate"]
    assert router.picks[0].token_ids == [1, 2, 3] and router.picks[0].request_id == "rid-1"
    assert router.running == 0  # released when the stream ended


async def test_rank_of_the_decision_is_set_and_the_clients_rank_stripped():
    gw = gateway(FakeRouter(rank=1), FakeTokenizer())
    for client_rank in ([("x-data-parallel-rank", "0")], []):
        out = await run_stream(gw, [headers("POST", "/v1/completions", client_rank),
                                    body({"model": "m", "prompt": "hello"})])
        assert list(out[0].request_headers.response.header_mutation.remove_headers) == [
            k for k, _ in client_rank]
        hs = set_headers(out[1].request_body.response)
        assert hs == {"x-gateway-destination-endpoint": "10.0.0.7:8000", "target-pod": "10.0.0.7:8000",
                      "x-data-parallel-rank": "1", "x-envoy-max-retries": "0"}
        assert out[1].dynamic_metadata["kvgate"]["rank"] == 1
    # Paths routed by load drop a client's rank too: the engine behind them must not be steered either.
    for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/embeddings")):
        if method == "POST":  # a pooling body: its headers' answer carries the removal, the body's the pick
            out = await run_stream(gw, [headers(method, path, [("x-data-parallel-rank", "0")]),
                                        body({"model": "m", "input": "hi"})])
        else:
            out = await run_stream(gw, [headers(method, path, [("x-data-parallel-rank", "0")], eos=True)])
        mutation = out[0].request_headers.response.header_mutation
        assert list(mutation.remove_headers) == ["x-data-parallel-rank"], path
        assert "x-data-parallel-rank" not in set_headers(out[0].request_headers.response)


async def test_target_pod_header_can_be_switched_off():
    out = await run_stream(gateway(FakeRouter(needs_tokens=False), target_pod_header=False),
                           [headers("POST", "/v1/chat/completions"),
                            body({"model": "m", "messages": [{"role": "user", "content": "x"}]})])
    assert set(set_headers(out[1].request_body.response)) == {"x-gateway-destination-endpoint", "x-envoy-max-retries"}


@pytest.mark.parametrize("exc, status, code", [
    (UnknownModelError("zz"), 404, "model_not_found"),
    (NoReadyPodError("m"), 503, "no_ready_pod"),
    (RuntimeError("boom"), 500, "internal_error"),
])
async def test_routing_failures_become_openai_errors(exc, status, code):
    out = await run_stream(gateway(FakeRouter(fail=exc), FakeTokenizer()),
                           [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    imm = out[-1].immediate_response
    assert imm.status.code == status
    err = json.loads(imm.body)["error"]
    assert err["code"] == code and set(err) == {"message", "type", "code", "param"}
    if status == 500:
        assert "rid-1" in err["message"]


async def test_unknown_strategy_header_is_400():
    out = await run_stream(gateway(FakeRouter(), FakeTokenizer()),
                           [headers("POST", "/v1/completions", [("routing-strategy", "bogus")]),
                            body({"model": "m", "prompt": "x"})])
    assert out[-1].immediate_response.status.code == 400
    assert json.loads(out[-1].immediate_response.body)["error"]["code"] == "unknown_routing_strategy"


async def test_oversized_body_is_413_and_empty_post_is_400():
    out = await run_stream(gateway(max_body_bytes=2048), [headers("POST", "/v1/completions"),
                                                          body({"model": "m", "prompt": "x" * 4096})])
    assert out[-1].immediate_response.status.code == 413
    out = await run_stream(gateway(), [headers("POST", "/v1/completions", eos=True)])
    assert out[-1].immediate_response.status.code == 400


@pytest.mark.parametrize("tok", [FakeTokenizer(fail=True), FakeTokenizer(delay=5.0)])
async def test_tokenizer_down_or_slow_routes_on_load(tok):
    router = FakeRouter()
    gw = gateway(router, tok, timeout=0.2)
    out = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    assert out[-1].HasField("request_body")
    assert router.picks[0].token_ids is None
    assert sum(s.value for m in gw.metrics.tokenizer_fallbacks.collect() for s in m.samples
               if s.name.endswith("_total")) == 1


async def test_token_ids_given_directly_skip_the_tokenizer():
    router = FakeRouter()
    await run_stream(gateway(router, FakeTokenizer(fail=True)),
                     [headers("POST", "/v1/completions"), body({"model": "m", "prompt": [5, 6, 7]})])
    assert router.picks[0].token_ids == [5, 6, 7]


async def test_models_any_ready_pod_and_passthrough():
    out = await run_stream(gateway(), [headers("GET", "/v1/models", eos=True)])
    assert set_headers(out[0].request_headers.response)["x-gateway-destination-endpoint"] == "10.0.0.7:8000"
    out = await run_stream(gateway(pods=()), [headers("GET", "/v1/models", eos=True)])
    assert out[0].immediate_response.status.code == 503
    out = await run_stream(gateway(), [headers("GET", "/health", eos=True)])  # read-only: by load too
    assert set_headers(out[0].request_headers.response)["x-gateway-destination-endpoint"] == "10.0.0.7:8000"
    out = await run_stream(gateway(), [headers("GET", "/not-an-engine-path", [("target-pod", "x")], eos=True)])
    common = out[0].request_headers.response
    assert not common.header_mutation.set_headers and list(common.header_mutation.remove_headers) == ["target-pod"]
    assert not out[0].HasField("dynamic_metadata")


class InstantTokenizer:
    """Answers without ever waiting, as a cache hit does."""

    async def tokenize(self, model, item, *, base_url=None):
        return [4, 5, 6]

    async def aclose(self):
        pass


class WaitingTokenizer:
    """Waits on a real timer (a future) before answering, or failing, as a backend call does."""

    def __init__(self, fail=False):
        self.fail = fail

    async def tokenize(self, model, item, *, base_url=None):
        await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        if self.fail:
            raise TokenizerError("refused")
        return [7, 8]

    async def aclose(self):
        pass


@pytest.mark.parametrize("tok, ids, fallbacks", [
    (InstantTokenizer(), [4, 5, 6], 0),
    (WaitingTokenizer(), [7, 8], 0),
    (WaitingTokenizer(fail=True), None, 1),
])
async def test_tokenizer_answers_with_and_without_waiting(tok, ids, fallbacks):
    router = FakeRouter()
    gw = gateway(router, tok, timeout=1.0)
    out = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    assert out[-1].HasField("request_body")
    assert router.picks[0].token_ids == ids
    assert sum(s.value for m in gw.metrics.tokenizer_fallbacks.collect() for s in m.samples
               if s.name.endswith("_total")) == fallbacks
    assert gw.metrics.tokenize_seconds.sum >= (0.01 if isinstance(tok, WaitingTokenizer) and ids else 0)


class ProbedTokenizer(InstantTokenizer):
    """A cache whose probe answers for one prompt: `tokenize` must not be called for it."""

    def __init__(self):
        self.probed, self.called = [], []

    def cached(self, model, item):
        self.probed.append(item)
        return memoryview(array("I", [9, 8, 7])).toreadonly() if item.text == "warm" else None

    async def tokenize(self, model, item, *, base_url=None):
        self.called.append(item)
        return await super().tokenize(model, item, base_url=base_url)


async def test_cache_probe_answers_without_a_tokenize_call():
    router, tok = FakeRouter(), ProbedTokenizer()
    gw = gateway(router, tok, cached_tokens=tok.cached)
    for prompt in ("warm", "cold"):
        out = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": prompt})])
        assert out[-1].HasField("request_body")
    assert [i.text for i in tok.probed] == ["warm", "cold"] and [i.text for i in tok.called] == ["cold"]
    assert list(router.picks[0].token_ids) == [9, 8, 7] and router.picks[1].token_ids == [4, 5, 6]
    assert sum(gw.metrics.tokenize_seconds.counts) == 2


async def test_pass_through_headers_without_reserved_ones_share_one_answer():
    gw = gateway()
    a = await run_stream(gw, [headers("GET", "/not-an-engine-path", eos=True)])
    assert a[0].request_headers.response.header_mutation == pb.HeaderMutation()
    assert gw.metrics.requests.labels("other", "passthrough").value == 1


class FutureTokenizer:
    """`tokenize` returns an awaitable that is not a coroutine (a future resolved a little later)."""

    def tokenize(self, model, item, *, base_url=None):
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, fut.set_result, [9])
        return fut

    async def aclose(self):
        pass


async def test_tokenizer_returning_another_awaitable_is_awaited():
    router = FakeRouter()
    await run_stream(gateway(router, FutureTokenizer()), [headers("POST", "/v1/completions"),
                                                          body({"model": "m", "prompt": "x"})])
    assert router.picks[0].token_ids == [9]


class SlowReleaseRouter(FakeRouter):
    """A router whose release waits (as one sharing counts over the network might)."""

    async def release(self, d):
        await asyncio.sleep(0.01)
        self.running -= 1


@pytest.mark.parametrize("router", [FakeRouter(), SlowReleaseRouter()])
async def test_count_released_when_the_stream_ends_whether_or_not_release_waits(router):
    gw = gateway(router, FakeTokenizer())
    await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    assert router.running == 0
    assert gw.metrics.released.labels("completed").value == 1


async def test_observed_request_carries_the_running_count_its_pick_saw():
    from plugin.observe import Observer
    seen = []

    class Tracker:
        def add_request_count(self, ctx, request_id, model):
            seen.append(ctx.running_at_start)
            return 0

        def done_request_count(self, ctx, request_id, model, term):
            pass

        def done_request_trace(self, ctx, request_id, model, i, o, term):
            pass

    router = FakeRouter()
    router.running = 4  # four already running there: this request is the fifth
    observer = Observer(CollectorRegistry())
    observer.trackers.register(Tracker())
    gw = gateway(router, FakeTokenizer(), observer=observer)
    await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    assert seen == [5]  # the batch the engine profiles learn the decode step time at


def test_sampler_takes_its_share_evenly_spaced():
    from plugin.pipeline import Sampler
    tenth = Sampler(0.1)
    taken = [i for i in range(100) if tenth.take()]
    assert taken == list(range(0, 100, 10))
    assert all(Sampler(1.0).take() for _ in range(5))
    assert not any(Sampler(0.0).take() for _ in range(5))
    third = Sampler(1 / 3)
    assert sum(third.take() for _ in range(300)) == 100


class DoneTracker:
    """A tracker hearing requests done: ("count" or "trace", whether the response was watched) for each."""

    def __init__(self):
        self.done = []

    def add_request_count(self, ctx, request_id, model):
        return 0

    def done_request_count(self, ctx, request_id, model, term):
        self.done.append(("count", ctx.watched))

    def done_request_trace(self, ctx, request_id, model, i, o, term):
        self.done.append(("trace", ctx.watched))


async def test_unsampled_response_asks_envoy_for_nothing_and_tells_trackers_done():
    from plugin.pipeline import Sampler
    from plugin.observe import Observer
    tracker = DoneTracker()
    done = tracker.done
    registry = CollectorRegistry()
    observer = Observer(registry)
    observer.trackers.register(tracker)
    gw = gateway(FakeRouter(), FakeTokenizer(), observer=observer, sampler=Sampler(0.5))
    first = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    second = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    slo = await run_stream(gw, [headers("POST", "/v1/completions", [("x-slo-ttft-ms", "500")]),
                                body({"model": "m", "prompt": "x"})])
    # the first of two is watched: Envoy keeps the shipped mode (response headers sent)
    assert not first[0].HasField("mode_override")
    # the second is not: response headers and body skipped, the request body still whole
    mode = second[0].mode_override
    assert (mode.response_header_mode, mode.response_body_mode, mode.request_body_mode) == (
        ProcessingMode.SKIP, ProcessingMode.NONE, ProcessingMode.BUFFERED)
    assert second[1].request_body.response.header_mutation.set_headers  # still routed
    assert not slo[0].HasField("mode_override")  # SLO targets: always watched
    assert done == [("count", True), ("count", False), ("count", True)]  # none saw a response here
    assert registry.get_sample_value("kvgate_requests_observed_total", {"source": "unsampled"}) == 1


class SharedLimiter:
    """An admission limiter shared over the network: its release waits for the round trip."""

    releases_without_wait = False
    errors = 0
    failing = shares_turns = False

    def __init__(self):
        self.counts = {}

    def withdraw(self, model):
        pass

    async def try_acquire(self, pod, limit, model="", waiter=False, more=False):
        self.counts[pod] = self.counts.get(pod, 0) + 1
        return True

    async def release(self, pod):
        await asyncio.sleep(0.01)
        self.counts[pod] -= 1

    def running(self):
        return {p: n for p, n in self.counts.items() if n}

    async def forget(self, pod):
        self.counts.pop(pod, None)


async def test_a_shared_limiters_release_that_waits_completes_after_the_stream():
    from routing.state.admission import Admission
    router, limiter = FakeRouter(), SharedLimiter()
    gw = gateway(router, FakeTokenizer(), admission=Admission(limiter, max_running=4))
    out = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    assert out[-1].HasField("request_body")
    assert router.running == 0 and limiter.running() == {}  # run_stream drains the pending releases
    assert gw.metrics.released.labels("completed").value == 1


async def test_a_stream_cut_after_its_pick_is_released_once():
    router = FakeRouter()
    gw = gateway(router, FakeTokenizer())
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    proc = ExternalProcessor(gw)
    pb_grpc.add_ExternalProcessorServicer_to_server(proc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = pb_grpc.ExternalProcessorStub(ch).Process()
            await call.write(headers("POST", "/v1/completions"))
            await call.write(body({"model": "m", "prompt": "x"}))
            assert (await call.read()).HasField("request_headers")
            assert (await call.read()).HasField("request_body")
            assert router.running == 1
            call.cancel()  # the client goes away mid-request, without ending the stream
            assert await wait_until_async(lambda: gw.metrics.active_streams.value == 0, timeout=5)
            await proc.drain()
        assert router.running == 0
        # seen by the server as a cancellation or, when the reset lands between reads, as the stream's end
        assert sum(gw.metrics.released.labels(how).value for how in ("cancelled", "completed", "stream_error")) == 1
    finally:
        await server.stop(0)


async def test_session_and_user_headers_reach_the_pick_and_the_session_pod_goes_back():
    import base64
    router = FakeRouter(needs_tokens=False)
    gw = gateway(router)
    # AIBrix's x-session-id wins over llm-d's token and AIBrix's caller key, whatever their order
    out = await run_stream(gw, [headers("POST", "/v1/completions", [
        ("x-aibrix-session-key", "key"), ("x-session-token", "tok"), ("X-Session-Id", " sid "), ("user", "alice")]),
        body({"model": "m", "prompt": "x"})])
    assert (router.picks[0].session, router.picks[0].user) == ("sid", "alice")
    assert base64.b64decode(out[1].dynamic_metadata["kvgate"]["session_id"]).decode() == "10.0.0.7:8000"
    await run_stream(gw, [headers("POST", "/v1/completions", [("x-session-token", "tok"), ("x-aibrix-session-key", "k")]),
                          body({"model": "m", "prompt": "x"})])
    assert router.picks[1].session == "tok"
    # no session: none given back (unless the strategy is session-affinity)
    out = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    assert (router.picks[2].session, router.picks[2].user) == (None, None)
    assert "session_id" not in out[1].dynamic_metadata["kvgate"]
    out = await run_stream(gw, [headers("POST", "/v1/completions", [("routing-strategy", "session-affinity")]),
                                body({"model": "m", "prompt": "x"})])
    assert "session_id" in out[1].dynamic_metadata["kvgate"]


class ElsewhereStore:
    """A response id store whose ids were learned by another replica: nothing here, found on lookup."""

    def __init__(self, ids):
        self.ids, self.lookups = ids, []

    def pod_of(self, response_id):
        return None

    async def lookup(self, response_id):
        self.lookups.append(response_id)
        return self.ids.get(response_id)


async def test_a_stored_response_read_through_another_replica_goes_to_the_pod_that_stored_it():
    other = Pod("p1", "10.0.0.8", 8000, "m")
    store = ElsewhereStore({"resp_x": "p1"})
    gw = gateway(pods=(POD, other), responses=store)
    out = await run_stream(gw, [headers("GET", "/v1/responses/resp_x", eos=True)])
    assert set_headers(out[0].request_headers.response)["x-gateway-destination-endpoint"] == "10.0.0.8:8000"
    out = await run_stream(gw, [headers("POST", "/v1/responses/resp_x/cancel", eos=True)])
    assert set_headers(out[0].request_headers.response)["x-gateway-destination-endpoint"] == "10.0.0.8:8000"
    assert store.lookups == ["resp_x", "resp_x"]
    out = await run_stream(gw, [headers("GET", "/v1/responses/resp_nobody", eos=True)])  # by load, as any other
    ranked = set_headers(out[0].request_headers.response)["x-gateway-destination-endpoint"].split(",")
    assert sorted(ranked) == ["10.0.0.7:8000", "10.0.0.8:8000"]
    outcomes = {s.labels["outcome"]: s.value for m in gw.metrics.response_affinity.collect() for s in m.samples
                if s.name.endswith("_total")}
    assert outcomes["routed"] == 2


# --- one message: the body first, the headers kvgate reads as Envoy attributes (envoy/envoy.yaml's
# one-message routes: request headers skipped, a buffer filter holding them for the router) ----------------

def first_body(obj, attrs, filter_name="envoy.filters.http.ext_proc"):
    """The only message of a one-message request: its body, with the route's request_attributes."""
    from google.protobuf import struct_pb2
    msg = body(obj)
    values = struct_pb2.Struct()
    values.update(attrs)
    msg.attributes[filter_name].CopyFrom(values)
    return msg


ONE_MESSAGE = {"request.path": "/v1/chat/completions", "request.method": "POST", "request.id": "rid-9"}


async def test_one_message_request_is_routed_on_its_body_with_everything_envoy_needs_in_metadata():
    router = FakeRouter(rank=2)
    gw = gateway(router, FakeTokenizer())
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    out = await run_stream(gw, [first_body(chat, {**ONE_MESSAGE, "request.headers['x-session-id']": " sid ",
                                                  "request.headers['user']": "alice",
                                                  "request.headers['routing-strategy']": "least-request"},
                                           filter_name="ext_proc_named_otherwise")])
    assert len(out) == 1 and out[0].HasField("request_body")
    pick = router.picks[0]
    assert (pick.request_id, pick.session, pick.user, pick.strategy) == ("rid-9", "sid", "alice", "least-request")
    md = out[0].dynamic_metadata
    assert md["envoy.lb"]["x-gateway-destination-endpoint"] == "10.0.0.7:8000"
    # Envoy cannot apply header mutations to headers it already let go of: its route sets them from these
    assert (md["kvgate"]["retries"], md["kvgate"]["target_pod"], md["kvgate"]["rank"]) == (0, "10.0.0.7:8000", 2)
    assert router.running == 0  # released when the stream ended
    assert gw.metrics.one_message.value == 1


async def test_one_message_bad_header_values_and_unknown_paths():
    gw = gateway(FakeRouter(), FakeTokenizer())
    out = await run_stream(gw, [first_body({"model": "m", "prompt": "x"},
                                           {**ONE_MESSAGE, "request.path": "/v1/completions",
                                            "request.headers['x-slo-ttft-ms']": "soon"})])
    assert out[0].immediate_response.status.code == 400
    assert json.loads(out[0].immediate_response.body)["error"]["code"] == "invalid_slo"
    out = await run_stream(gw, [first_body(b"not json", {**ONE_MESSAGE, "request.path": "/v1/completions"})])
    assert out[0].immediate_response.status.code == 400
    # paths routed at their headers, sent in one message by a route configured so: the same answer, on the body
    out = await run_stream(gw, [first_body(b"{}", {**ONE_MESSAGE, "request.path": "/tokenize"})])
    assert out[0].dynamic_metadata["kvgate"]["strategy"] == "any"
    assert out[0].dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"] == "10.0.0.7:8000"
    out = await run_stream(gw, [first_body(b"{}", {**ONE_MESSAGE, "request.path": "/v1/elsewhere"})])
    assert out[0] == pb.ProcessingResponse(request_body=pb.BodyResponse())  # passed through
    # no attributes at all (headers skipped, no request_attributes): nothing to route by, and never unrouted
    out = await run_stream(gw, [body({"model": "m", "prompt": "x"})])
    assert out[0].immediate_response.status.code == 500
    assert json.loads(out[0].immediate_response.body)["error"]["code"] == "gateway_misconfigured"


async def test_one_message_requests_are_unwatched_and_the_sampler_watches_the_rest_for_them():
    from plugin.pipeline import Sampler
    from plugin.observe import Observer
    tracker = DoneTracker()
    observer = Observer(CollectorRegistry())
    observer.trackers.register(tracker)
    gw = gateway(FakeRouter(), FakeTokenizer(), observer=observer, sampler=Sampler(0.25))
    prompt = {"model": "m", "prompt": "x"}
    one = {**ONE_MESSAGE, "request.path": "/v1/completions"}
    for _ in range(3):  # Envoy sends three of four in one message: those cannot be watched...
        await run_stream(gw, [first_body(prompt, one)])
    two = [await run_stream(gw, [headers("POST", "/v1/completions"), body(prompt)]) for _ in range(2)]
    # ...so the requests it sends in two are all watched: a quarter of all requests, as KVGATE_OBSERVE_SAMPLE says
    assert [t[0].HasField("mode_override") for t in two] == [False, False]
    assert tracker.done == [("count", False)] * 3 + [("count", True)] * 2


def test_sampler_raises_its_share_for_the_calls_it_could_not_take():
    from plugin.pipeline import Sampler
    s = Sampler(0.1)
    taken = 0
    for i in range(1000):
        if i % 10 < 8:
            s.passed()  # 80% sent in one message
        else:
            taken += s.take()
    assert 95 <= taken <= 105  # a tenth of all, from the fifth that could be watched
    full = Sampler(0.1)
    for _ in range(50):
        full.passed()
    assert all(full.take() for _ in range(5))  # fewer watchable than the share: every one
    plain = Sampler(0.1)
    assert [i for i in range(30) if plain.take()] == [0, 10, 20]  # none passed: as before
    # every response asked for, yet some cannot be watched: the first such one is worth a warning, once
    every = Sampler(1.0)
    assert [every.passed(), every.passed()] == [True, False] and not Sampler(0.5).passed()


async def test_a_watched_route_routes_in_one_message_and_its_watch_stream_fills_in_the_watch():
    """On a watched route (xds.route_name kvgate-watched-*) the one-message answer names this replica in the
    kvgate metadata and the request's Watch waits for its watch stream (observability mode: read, never
    answered), whose end gives the trackers the response's tokens; without Envoy's request id the two
    streams cannot be matched, so such a request is unwatched as on any one-message route."""
    from plugin.observe import Observer
    from plugin.watch import WatchRelay
    from helpers import sse, watch_chunk as chunk, watch_headers
    tracker = DoneTracker()
    observer = Observer(CollectorRegistry())
    observer.trackers.register(tracker)
    relay = WatchRelay("gw-here", served=lambda d, e: None, served_metric=GatewayMetrics(CollectorRegistry()).served,
                       registry=CollectorRegistry())
    gw = gateway(FakeRouter(), FakeTokenizer(), observer=observer, relay=relay)
    prompt = {"model": "m", "prompt": "x"}
    watched = {**ONE_MESSAGE, "request.path": "/v1/completions", "xds.route_name": "kvgate-watched-completions"}
    out = await run_stream(gw, [first_body(prompt, watched)])
    assert out[0].dynamic_metadata.fields["kvgate"].struct_value.fields["gw"].string_value == "gw-here"
    assert relay.waiting == 1 and tracker.done == []  # the request ended; its Watch waits for the word
    usage = sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    answers = await run_stream(gw, [watch_headers("rid-9", "gw-here", path="/v1/completions"),
                                    chunk(sse({"choices": [{"text": "a"}]})),
                                    chunk(sse({"choices": [{"text": "b"}]}) + usage, end=True)])
    assert answers == [] and relay.waiting == 0
    assert tracker.done == [("trace", True)]
    assert observer.metrics.observed.labels("usage").value == 1
    unnamed = {k: v for k, v in watched.items() if k != "request.id"}
    await run_stream(gw, [first_body(prompt, unnamed)])
    assert relay.waiting == 0 and tracker.done == [("trace", True), ("count", False)]


def test_sampler_counts_responses_watched_from_their_own_stream():
    from plugin.pipeline import Sampler

    def taken(share: float) -> int:
        """Of 1,000 requests: a tenth on the watched routes, 80% one message unwatched, a tenth in two messages."""
        s = Sampler(share)
        n = 0
        for i in range(1000):
            if i % 10 == 0:
                s.relayed()
            elif i % 10 < 9:
                s.passed()
            else:
                n += s.take()
        return n
    assert taken(0.1) <= 2  # the watched routes give the share already
    assert 95 <= taken(0.2) <= 105  # the other tenth of all from the two-message ones
