"""Envoy's external processor: one gRPC stream per HTTP request, speaking the Gateway API
Inference Extension's Endpoint Picker protocol (v1.0.0).

Headers arrive first (the client's routing headers are stripped there), then the
buffered body; the answer to the body names the upstream pod, followed by the next-best
pods to retry on (`ip:port,ip:port,...`, the same list in the
`x-gateway-destination-endpoint` header and in `envoy.lb` dynamic metadata) and, by
default, the pod alone in AIBrix's `target-pod` header; for a data-parallel pod it also names the
rank in `x-data-parallel-rank` (vLLM and SGLang pin the request to that rank). The request counts as running on its
pod until Envoy closes the stream, which it does when the HTTP request ends.

The protocol's other clauses, one method each: the data plane's subset hint
(`envoy.lb.subset_hint` metadata) limits the pick (503 when it leaves nothing); a request whose
objective (`x-gateway-inference-objective`) is sheddable gets 429 when every eligible pod is
saturated; the endpoint that served the request (`envoy.lb` `x-gateway-destination-endpoint-served`
metadata on the response headers) takes the request's running count; with FULL_DUPLEX_STREAMED
bodies the request body is gathered, the pick answered on the headers and the body sent back whole,
and response body chunks are sent back as they come.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from types import CoroutineType
from typing import AsyncIterator, Awaitable, Callable, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from plugin import observe
from plugin.admit import admit
from plugin.metrics import GatewayMetrics
from plugin.request import (CHAT, MODELS, ROUTED_POST_PATHS, ClientError, InferenceRequest,
                            bad_request, parse_body)
from routing.errors import (NoEligibleEndpointError, NoReadyPodError, RoutingError, SaturatedError,
                            UnknownModelError, UnknownStrategyError)
from routing.state.admission import Admission
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Decision, RouteRequest, Router
from plugin.throttle import LogThrottle
from tokenizer.types import PromptInput, TokenizeInput, Tokenizer, TokenizerError

log = logging.getLogger("kvgate.extproc")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
TARGET_POD_HEADER = "target-pod"
STRATEGY_HEADER = "routing-strategy"
DP_RANK_HEADER = "x-data-parallel-rank"
# Envoy's per-request retry count: as many retries as the ranked list has fallbacks, so Envoy's retries
# walk exactly kvgate's list (beyond it, override_host would fall to any pool endpoint).
RETRIES_HEADER = "x-envoy-max-retries"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # the data plane's subset hint (request metadata)
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"  # in LB_NAMESPACE on the response path
OBJECTIVE_HEADER = "x-gateway-inference-objective"
SLO_TTFT_HEADER, SLO_TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"  # the request's latency targets
POD_RESPONSE_HEADER = "x-kvgate-pod"
KVGATE_NAMESPACE = "kvgate"  # Envoy copies these into the client's x-kvgate-pod / -strategy / -rank
# Headers only kvgate may set: whatever a client sends under these names is dropped (a client
# choosing the rank would defeat the routing as surely as one choosing the pod).
RESERVED_HEADERS = frozenset({DESTINATION_HEADER, TARGET_POD_HEADER, DP_RANK_HEADER})
RESERVED_PREFIX = "x-kvgate-"

# The request headers kvgate reads (a header's key -> what it is); every other one is passed over.
_PATH, _METHOD, _STRATEGY, _REQUEST_ID, _OBJECTIVE, _SLO = range(6)
_READ_HEADERS = {":path": _PATH, ":method": _METHOD, STRATEGY_HEADER: _STRATEGY, "x-request-id": _REQUEST_ID,
                 OBJECTIVE_HEADER: _OBJECTIVE, SLO_TTFT_HEADER: _SLO, SLO_TPOT_HEADER: _SLO}

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# The answer to headers that carry nothing to remove: built once, never mutated, shared by streams.
_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_HEADERS_UNWATCHED = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=observe.UNWATCHED)
_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
_RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class Sampler:
    """Takes `share` of the calls, evenly spaced (share 0.25: every fourth), deterministically."""

    __slots__ = ("share", "_credit")

    def __init__(self, share: float) -> None:
        self.share = share
        self._credit = 1.0  # the first call is taken

    def take(self) -> bool:
        if self.share >= 1.0:
            return True
        if self.share <= 0.0:
            return False
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            self._credit += self.share
            return True
        self._credit += self.share
        return False


@dataclass
class Gateway:
    """What the processor needs, built once by plugin.app."""

    router: Router
    registry: PodRegistry
    tokenizer: Tokenizer | None
    metrics: GatewayMetrics
    default_strategy: str
    max_body_bytes: int
    tokenizer_timeout_s: float
    tokenizer_url: str | None = None
    target_pod_header: bool = True
    # False for a pod whose engine refused the last /metrics scrape; None: no such knowledge.
    reachable: Callable[[str], bool] | None = None
    # The tokenizer cache's whole-request probe (CachedTokenizer.cached): ids without a copy or an await.
    cached_tokens: Callable[[str, TokenizeInput], Sequence[int] | None] | None = None
    # The tokenizer cache's tokenize for readers of the ids (CachedTokenizer.tokenize_ids: an array, not a list
    # of Python ints); None: `tokenizer.tokenize`.
    tokenize_ids: Callable[..., Awaitable[Sequence[int]]] | None = None
    # Objectives (the x-gateway-inference-objective header) whose requests may be shed (429) under saturation.
    sheddable_objectives: frozenset[str] = frozenset()
    # Watches routed responses (TTFT, TPOT, tokens; the request trackers); None: responses not read.
    observer: observe.Observer | None = None
    # Which routed responses the observer watches (besides the slo strategy's and SLO-targeted ones, always).
    sampler: Sampler = field(default_factory=lambda: Sampler(1.0))
    # A per-pod running limit, checked and counted atomically after the pick; None: no limit.
    admission: Admission | None = None


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _set_header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                                      append_action=_OVERWRITE)


def _immediate(err: ClientError, request_id: str) -> pb.ProcessingResponse:
    headers = pb.HeaderMutation(set_headers=[
        _set_header("content-type", "application/json"),
        _set_header("x-request-id", request_id),
    ])
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers.set_headers.append(_set_header("retry-after", str(retry_after)))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status), headers=headers, body=err.to_json(),
        details=f"kvgate_{err.code or err.type}"))


class _Resumed:
    """Awaitable that continues a coroutine already run up to its first suspension (`pending` is
    what it yielded there), exactly as `await coro` would have continued it.

    Still pays (measured on this machine, a coroutine that answers without waiting): run-then-resume
    1.4-2.2 us against 12.6-15.6 us for `async with asyncio.timeout_at(...)` around a plain await; that is
    every cold request on the local tokenizer (it encodes short inputs synchronously) and every release
    (the counts change synchronously), where the alternative is a timer or a task per request."""

    __slots__ = ("_coro", "_pending")

    def __init__(self, coro, pending) -> None:
        self._coro, self._pending = coro, pending

    def __await__(self):
        coro, value = self._coro, self._pending
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # e.g. the timeout's cancellation: delivered where the coroutine waits
                try:
                    value = coro.throw(e)
                except StopIteration as done:
                    return done.value
                continue
            try:
                value = coro.send(sent)
            except StopIteration as done:
                return done.value


async def _finish(coro, pending):
    """The rest of a coroutine run up to its first suspension, as a task's coroutine."""
    return await _Resumed(coro, pending)


class _Stream:
    """The state of one HTTP request's ext_proc stream."""

    __slots__ = ("gw", "fallback_log", "answers", "metric_children", "path", "method", "strategy", "request_id",
                 "decision", "kind", "subset", "objective", "streamed_request", "streamed_response", "chunks",
                 "held_remove", "watch", "slo", "admitted", "watched", "sampler")

    def __init__(self, gw: Gateway, fallback_log: LogThrottle, answers: dict, metric_children: dict,
                 sampler: "Sampler") -> None:
        self.gw = gw
        self.sampler = sampler
        self.fallback_log = fallback_log
        # By (pod, endpoint, strategy, rank, fallbacks): the routed answer (built once, never mutated,
        # shared by streams); by (strategy, pod): its metric children.
        self.answers = answers
        self.metric_children = metric_children
        self.path = ""
        self.method = ""
        self.strategy: str | None = None
        self.request_id = ""
        self.decision: Decision | None = None
        self.kind = "other"
        # EPP protocol state: the data plane's subset hint (None: any pod of the pool), the request's
        # objective, the body modes (FULL_DUPLEX_STREAMED: gather the request body, echo the response's)
        # and, while a streamed request body is gathered, its chunks and the header removals held back.
        self.subset: frozenset[str] | None = None
        self.objective = ""
        self.streamed_request = False
        self.streamed_response = False
        self.chunks: list[bytes] | None = None
        self.held_remove: list[str] | None = None
        self.watch: observe.Watch | None = None
        self.slo: dict[str, float] | None = None  # header -> seconds
        self.admitted: str | None = None  # the pod admission counted this request on
        self.watched = True  # the response will be watched (if there is an observer)

    # --- EPP protocol clauses ------------------------------------------------------------
    def read_context(self, msg: pb.ProcessingRequest) -> None:
        """The first message: the body modes Envoy uses and the subset hint, if any."""
        if msg.HasField("protocol_config"):
            pc = msg.protocol_config
            self.streamed_request = pc.request_body_mode == FULL_DUPLEX
            self.streamed_response = pc.response_body_mode == FULL_DUPLEX
        if msg.HasField("metadata_context"):
            self.subset = subset_hint(msg.metadata_context)

    def sheddable(self) -> bool:
        return bool(self.objective) and self.objective in self.gw.sheddable_objectives

    def on_response_headers(self, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        answer = self._served(msg)
        if self.watch is None:
            return answer
        return observe.response_headers(self.watch, msg, answer, self.streamed_response)

    def _served(self, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """Account the request to the endpoint that served it (a fallback, after a retry) and name
        that pod in x-kvgate-pod."""
        served = served_endpoint(msg)
        d = self.decision
        if not served or d is None:
            return _RESPONSE_HEADERS_CONTINUE
        m = self.gw.metrics
        if served == d.pod.endpoint:
            m.served.labels("picked").inc()
            return _RESPONSE_HEADERS_CONTINUE
        pod = self.gw.router.served(d, served)
        if pod is None:
            m.served.labels("unknown").inc()
            return _RESPONSE_HEADERS_CONTINUE
        m.served.labels("fallback").inc()
        if self.watch is not None:
            self.watch.served_by(pod.name)
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[_set_header(POD_RESPONSE_HEADER, pod.name)]))))

    def on_response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if self.watch is not None:
            self.watch.on_chunk(msg.body)
        if not self.streamed_response:
            return _RESPONSE_BODY_CONTINUE
        return pb.ProcessingResponse(response_body=_echo(msg))

    async def on_streamed_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse | list[pb.ProcessingResponse] | None:
        """FULL_DUPLEX_STREAMED: Envoy keeps nothing of the body, so every chunk comes back; a routed
        request's chunks are gathered until the last, then the pick answers the held headers and the
        body goes back whole."""
        if self.chunks is None:  # not a routed path: each chunk straight back
            return pb.ProcessingResponse(request_body=_echo(msg))
        self.chunks.append(msg.body)
        size = sum(len(c) for c in self.chunks)
        if size > self.gw.max_body_bytes:
            parse_body(self.path, b"".join(self.chunks), self.gw.max_body_bytes)  # raises the 413
        if not msg.end_of_stream:
            return None
        return await self._finish_streamed(end_of_stream=True)

    async def on_request_trailers(self) -> list[pb.ProcessingResponse]:
        """Trailers end a streamed request body whose last chunk did not."""
        done = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        if self.chunks is None:
            return [done]
        return [*await self._finish_streamed(end_of_stream=False), done]

    async def _finish_streamed(self, *, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        raw = b"".join(self.chunks or ())
        self.chunks = None
        d = await self._decide(raw)
        head = self._routed(d.pod, d.strategy, body=False, remove=self.held_remove, rank=d.rank,
                            fallbacks=d.fallbacks)
        body = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=raw, end_of_stream=end_of_stream)))))
        return [head, body]

    # --- phases -----------------------------------------------------------------------
    def on_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        remove: list[str] | None = None
        for h in msg.headers.headers:
            key = h.key.lower()
            which = _READ_HEADERS.get(key)
            if which is None:  # most headers: only whether a client set one of kvgate's own
                if key in RESERVED_HEADERS or key.startswith(RESERVED_PREFIX):
                    if remove is None:
                        remove = []
                    remove.append(h.key)
                continue
            value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
            if which == _PATH:
                self.path = value.split("?", 1)[0]
            elif which == _METHOD:
                self.method = value
            elif which == _STRATEGY:
                self.strategy = value.strip() or None
            elif which == _REQUEST_ID:
                self.request_id = value
            elif which == _OBJECTIVE:
                self.objective = value.strip()
            else:  # an SLO target
                ms = observe.milliseconds(value)
                if ms is None:
                    return self._error(bad_request(f"{key}: expected a positive number of milliseconds",
                                                   code="invalid_slo", param=key))
                if self.slo is None:
                    self.slo = {}
                self.slo[key] = ms / 1000.0
        if not self.request_id:
            self.request_id = uuid.uuid4().hex
        if self.method == "POST" and self.path in ROUTED_POST_PATHS:
            self.kind = "chat" if self.path == CHAT else "completion"
            if msg.end_of_stream:  # no body will follow
                return self._error(bad_request("request body is empty; expected a JSON object", code="invalid_json"))
            if self.streamed_request:  # the answer to the headers waits for the whole body
                self.chunks, self.held_remove = [], remove
                return None
            if self.gw.observer is not None and not self._watch_response():
                # Envoy sends nothing of this response (the override is honoured in this answer only)
                self.watched = False
                if not remove:
                    return _HEADERS_UNWATCHED
                answer = _continue_headers(remove)
                answer.mode_override.CopyFrom(observe.UNWATCHED)
                return answer
            return _continue_headers(remove)
        if self.method == "GET" and self.path == MODELS:
            self.kind = "models"
            return self._route_any(remove or [])
        self.gw.metrics.requests.labels("other", "passthrough").inc()
        return _continue_headers(remove)

    def _watch_response(self) -> bool:
        """Watch this response? Always for the slo strategy and requests with SLO targets (their
        attainment, the prefill queue); else a sample (KVGATE_OBSERVE_SAMPLE)."""
        if self.slo is not None or (self.strategy or self.gw.default_strategy) == "slo":
            return True
        return self.sampler.take()

    async def on_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse | list[pb.ProcessingResponse] | None:
        if self.streamed_request:
            return await self.on_streamed_body(msg)
        if self.kind not in ("chat", "completion"):  # a body on a pass-through path
            return _BODY_CONTINUE
        d = await self._decide(msg.body)
        key = (d.pod.name, d.pod.endpoint, d.strategy, d.rank, d.fallbacks)
        response = self.answers.get(key)
        if response is None:
            if len(self.answers) > 4096:  # pods churn: keep the memo bounded
                self.answers.clear()
            response = self.answers[key] = self._routed(d.pod, d.strategy, body=True, rank=d.rank,
                                                        fallbacks=d.fallbacks)
        return response

    async def _decide(self, raw: bytes) -> Decision:
        """Parse, tokenize and pick (within the subset hint; shedding a sheddable request under saturation)."""
        started = time.perf_counter()
        request = parse_body(self.path, raw, self.gw.max_body_bytes)
        strategy = self.strategy or self.gw.default_strategy
        token_ids = await self._tokens(request, strategy)
        slo = self.slo or {}
        self.decision = d = await self.gw.router.pick(RouteRequest(
            model=request.model, token_ids=token_ids, strategy=strategy, request_id=self.request_id,
            slo_ttft_s=slo.get(SLO_TTFT_HEADER), slo_tpot_s=slo.get(SLO_TPOT_HEADER)),
            subset=self.subset, sheddable=self.sheddable())
        if self.gw.admission is not None:
            d, self.admitted = await admit(self.gw.admission, self.gw.router, self.gw.registry, d, request.model)
            self.decision = d
        children = self.metric_children.get((d.strategy, d.pod.name, self.kind))
        if children is None:
            if len(self.metric_children) > 4096:
                self.metric_children.clear()
            m = self.gw.metrics
            children = self.metric_children[(d.strategy, d.pod.name, self.kind)] = (
                m.decision_seconds.labels(d.strategy), m.decisions.labels(d.strategy, d.pod.name),
                m.requests.labels(self.kind, "routed"), m.prefix_blocks.labels("total"),
                m.prefix_blocks.labels("cached"))
        seconds, decided, routed, total_blocks, cached_blocks = children
        seconds.observe(time.perf_counter() - started)
        decided.inc()
        routed.inc()
        if d.total_blocks:
            total_blocks.inc(d.total_blocks)
            cached_blocks.inc(d.matched_blocks)
        if self.gw.observer is not None:
            # running: the batch the engine profiles learn the decode step time at
            self.watch = self.gw.observer.start(self.request_id, request.model, d.pod.name, tokens=token_ids,
                                                decision=d, running=d.running,
                                                slo_ttft_s=slo.get(SLO_TTFT_HEADER),
                                                slo_tpot_s=slo.get(SLO_TPOT_HEADER), watched=self.watched)
        return d

    # --- helpers ----------------------------------------------------------------------
    async def _tokens(self, request: InferenceRequest, strategy: str) -> Sequence[int] | None:
        if not self.gw.router.needs_tokens(strategy):
            return None
        item = request.item
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return list(item.token_ids)
        if self.gw.tokenizer is None:
            return None
        started = time.perf_counter()
        if self.gw.cached_tokens is not None:
            ids = self.gw.cached_tokens(request.model, item)
            if ids is not None:
                self.gw.metrics.tokenize_seconds.observe(time.perf_counter() - started)
                return ids
        base_url = self.gw.tokenizer_url
        if not base_url:
            pods = self.gw.registry.ready_pods(request.model)
            if not pods:
                return None  # pick() answers 404 or 503
            base_url = pods[hash(self.request_id) % len(pods)].base_url
        deadline = asyncio.get_running_loop().time() + self.gw.tokenizer_timeout_s
        try:
            # Run the call up to its first wait: a cached answer comes back without one and needs no timer
            # (a timeout only fires where the call waits). Otherwise the rest runs under the same deadline.
            call = (self.gw.tokenize_ids or self.gw.tokenizer.tokenize)(request.model, item, base_url=base_url)
            if type(call) is not CoroutineType:  # some other awaitable: awaited whole, under the deadline
                async with asyncio.timeout_at(deadline):
                    ids = await call
            else:
                try:
                    pending = call.send(None)
                except StopIteration as done:
                    ids = done.value
                else:
                    async with asyncio.timeout_at(deadline):  # no extra task, unlike wait_for
                        ids = await _Resumed(call, pending)
        except (TokenizerError, asyncio.TimeoutError) as e:
            reason = "timeout" if isinstance(e, asyncio.TimeoutError) else "error"
            self.gw.metrics.tokenizer_fallbacks.labels(reason).inc()
            self.fallback_log.log(log, logging.WARNING, "tokenizer", "tokenization failed (%s: %s); routing on load alone",
                                  reason, e)
            return None
        self.gw.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        return ids

    def _route_any(self, remove: list[str]) -> pb.ProcessingResponse:
        pods = [p for p in self.gw.registry.pods() if p.ready]
        if self.subset is not None:
            pods = [p for p in pods if p.endpoint in self.subset]
            if not pods:
                return self._error(ClientError(503, "no ready pod among the endpoints the gateway allowed",
                                               type_="service_unavailable", code="no_eligible_endpoint"))
        if self.gw.reachable is not None:
            # Skip engines that refuse connections: they would answer 503.
            pods = [p for p in pods if self.gw.reachable(p.name)] or pods
        if not pods:
            return self._error(ClientError(503, "no ready pod", type_="service_unavailable", code="no_ready_pod"))
        first = hash(self.request_id) % len(pods)
        pod = pods[first]
        rest = tuple(pods[(first + i) % len(pods)].endpoint for i in range(1, min(len(pods), 4)))
        self.gw.metrics.requests.labels("models", "routed").inc()
        return self._routed(pod, "any", body=False, remove=remove, fallbacks=rest)

    def _routed(self, pod: Pod, strategy: str, *, body: bool, remove: list[str] | None = None,
                rank: int | None = None, fallbacks: tuple[str, ...] = ()) -> pb.ProcessingResponse:
        # The ranked list, primary first: header and metadata carry the same value (the protocol requires it).
        endpoint = ",".join((pod.endpoint, *fallbacks)) if fallbacks else pod.endpoint
        headers = [_set_header(DESTINATION_HEADER, endpoint), _set_header(RETRIES_HEADER, str(len(fallbacks)))]
        if self.gw.target_pod_header:
            headers.append(_set_header(TARGET_POD_HEADER, pod.endpoint))
        ours = {"pod": pod.name, "strategy": strategy}
        if rank is not None:
            headers.append(_set_header(DP_RANK_HEADER, str(rank)))
            ours["rank"] = rank
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers, remove_headers=remove or []))
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoint}, KVGATE_NAMESPACE: ours})
        if body:
            return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)

    def _error(self, err: ClientError) -> pb.ProcessingResponse:
        self.gw.metrics.errors.labels(str(err.status), err.code or err.type).inc()
        self.gw.metrics.requests.labels(self.kind, "rejected").inc()
        return _immediate(err, self.request_id)

    def error_for(self, exc: BaseException) -> pb.ProcessingResponse:
        if isinstance(exc, ClientError):
            return self._error(exc)
        if isinstance(exc, UnknownModelError):
            return self._error(ClientError(404, str(exc), code="model_not_found", param="model"))
        if isinstance(exc, UnknownStrategyError):
            return self._error(ClientError(400, str(exc), code="unknown_routing_strategy", param=STRATEGY_HEADER))
        if isinstance(exc, NoReadyPodError):
            return self._error(ClientError(503, str(exc), type_="service_unavailable", code="no_ready_pod"))
        if isinstance(exc, NoEligibleEndpointError):
            return self._error(ClientError(503, str(exc), type_="service_unavailable", code="no_eligible_endpoint"))
        if isinstance(exc, SaturatedError):
            return self._error(ClientError(429, str(exc), type_="rate_limit_exceeded", code="saturated"))
        if isinstance(exc, RoutingError):
            return self._error(ClientError(503, str(exc), type_="service_unavailable", code="routing_failed"))
        log.error("request %s: internal error", self.request_id, exc_info=exc)
        return self._error(ClientError(500, f"internal error in kvgate (request id {self.request_id})",
                                       type_="internal_error", code="internal_error"))


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._fallback_log = LogThrottle(10.0)  # one warning per 10 s, with a count of the rest
        self._answers: dict = {}
        self._metric_children: dict = {}
        self._releases: set[asyncio.Task] = set()

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context) -> AsyncIterator[pb.ProcessingResponse]:  # noqa: N802
        stream = _Stream(self.gw, self._fallback_log, self._answers, self._metric_children, self.gw.sampler)
        self.gw.metrics.active_streams.inc()
        how = "completed"
        try:
            async for msg in request_iterator:
                which = msg.WhichOneof("request")
                try:
                    if which == "request_headers":
                        stream.read_context(msg)
                        response = stream.on_headers(msg.request_headers)
                    elif which == "request_body":
                        response = await stream.on_body(msg.request_body)
                    elif which == "response_headers":
                        response = stream.on_response_headers(msg)
                    elif which == "response_body":
                        response = stream.on_response_body(msg.response_body)
                    elif which == "request_trailers":
                        response = await stream.on_request_trailers()
                    else:
                        response = _pass_through(which)
                except Exception as exc:  # every failure becomes an answer: a request never hangs
                    response = stream.error_for(exc)
                if type(response) is list:  # a streamed body's pick: the held headers' answer, then the body
                    for r in response:
                        yield r
                elif response is not None:
                    yield response
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except Exception:
            how = "stream_error"
            raise
        finally:
            self.gw.metrics.active_streams.dec()
            if stream.watch is not None:
                stream.watch.close()
            if stream.decision is not None:
                # No await here (a cancelled stream must not wait): the release runs now if it needs no wait
                # (the router's own counts), else it finishes in a task of its own.
                release = self._release(stream.decision, how, stream.admitted)
                try:
                    pending = release.send(None)
                except StopIteration:
                    pass
                else:
                    task = asyncio.get_running_loop().create_task(_finish(release, pending))
                    self._releases.add(task)
                    task.add_done_callback(self._releases.discard)

    async def _release(self, decision: Decision, how: str, admitted: str | None = None) -> None:
        try:
            await self.gw.router.release(decision)
            if admitted is not None and self.gw.admission is not None:
                await self.gw.admission.release(admitted)
            self.gw.metrics.released.labels(how).inc()
        except Exception:
            log.exception("releasing the count of a request on %s failed", decision.pod.name)

    async def drain(self) -> None:
        """Wait for pending releases (at shutdown)."""
        if self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)


def _continue_headers(remove: list[str] | None) -> pb.ProcessingResponse:
    if not remove:
        return _HEADERS_CONTINUE
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=remove))))


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints the data plane allows (`envoy.lb.subset_hint`), None when it sets no hint. The
    value is a list of `ip:port` strings or one comma-separated string (both occur in the wild)."""
    ns = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    which = value.WhichOneof("kind")
    if which == "string_value":
        items = [value.string_value]
    elif which == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    else:
        items = []
    return frozenset(e.strip() for item in items for e in item.split(",") if e.strip())


def served_endpoint(msg: pb.ProcessingRequest) -> str:
    """The endpoint that served the request: `envoy.lb` `x-gateway-destination-endpoint-served` metadata
    (the protocol's place), else the response header of that name; empty when neither is there."""
    ns = msg.metadata_context.filter_metadata.get(LB_NAMESPACE) if msg.HasField("metadata_context") else None
    if ns is not None and SERVED_KEY in ns.fields:
        return ns.fields[SERVED_KEY].string_value.strip()
    for h in msg.response_headers.headers.headers:
        if h.key.lower() == SERVED_KEY:
            return _header_value(h).strip()
    return ""


def _echo(msg: pb.HttpBody) -> pb.BodyResponse:
    """A FULL_DUPLEX_STREAMED chunk sent back unchanged (Envoy forwards only what it gets back)."""
    return pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=msg.body, end_of_stream=msg.end_of_stream))))


def _pass_through(which: str | None) -> pb.ProcessingResponse | None:
    """Phases kvgate does not act on (only sent if Envoy is configured to)."""
    if which == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    if which == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    if which == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    if which == "response_trailers":
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return None
