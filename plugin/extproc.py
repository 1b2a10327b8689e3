"""Envoy's external processor: one gRPC stream per HTTP request.

Headers arrive first (the client's routing headers are stripped there), then the
buffered body; the answer to the body names the upstream pod in the
`x-gateway-destination-endpoint` header, in `envoy.lb` dynamic metadata and, by
default, in AIBrix's `target-pod` header; for a data-parallel pod it also names the
rank in `x-data-parallel-rank` (vLLM and SGLang pin the request to that rank). The request counts as running on its
pod until Envoy closes the stream, which it does when the HTTP request ends.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from types import CoroutineType
from typing import AsyncIterator, Callable, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from plugin.metrics import GatewayMetrics
from plugin.request import (CHAT, MODELS, ROUTED_POST_PATHS, ClientError, InferenceRequest,
                            bad_request, parse_body)
from routing.errors import NoReadyPodError, RoutingError, UnknownModelError, UnknownStrategyError
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Decision, RouteRequest, Router
from tokenizer.throttle import LogThrottle
from tokenizer.types import PromptInput, TokenizeInput, Tokenizer, TokenizerError

log = logging.getLogger("kvgate.extproc")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
TARGET_POD_HEADER = "target-pod"
STRATEGY_HEADER = "routing-strategy"
DP_RANK_HEADER = "x-data-parallel-rank"
LB_NAMESPACE = "envoy.lb"
KVGATE_NAMESPACE = "kvgate"  # Envoy copies these into the client's x-kvgate-pod / -strategy / -rank
# Headers only kvgate may set: whatever a client sends under these names is dropped (a client
# choosing the rank would defeat the routing as surely as one choosing the pod).
RESERVED_HEADERS = frozenset({DESTINATION_HEADER, TARGET_POD_HEADER, DP_RANK_HEADER})
RESERVED_PREFIX = "x-kvgate-"

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# The answer to headers that carry nothing to remove: built once, never mutated, shared by streams.
_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())


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

    def __init__(self, gw: Gateway, fallback_log: LogThrottle, answers: dict) -> None:
        self.gw = gw
        self.fallback_log = fallback_log
        # By (pod, endpoint, strategy): the routed answer (built once, never mutated, shared by streams)
        # and its metric children.
        self.answers = answers
        self.path = ""
        self.method = ""
        self.strategy: str | None = None
        self.request_id = ""
        self.decision: Decision | None = None
        self.kind = "other"

    # --- phases -----------------------------------------------------------------------
    def on_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        remove: list[str] | None = None
        for h in msg.headers.headers:
            key = h.key.lower()
            if key[:1] == ":":
                if key == ":path":
                    self.path = _header_value(h).split("?", 1)[0]
                elif key == ":method":
                    self.method = _header_value(h)
            elif key == STRATEGY_HEADER:
                self.strategy = _header_value(h).strip() or None
            elif key == "x-request-id":
                self.request_id = _header_value(h)
            elif key in RESERVED_HEADERS or key.startswith(RESERVED_PREFIX):
                if remove is None:
                    remove = []
                remove.append(h.key)
        if not self.request_id:
            self.request_id = uuid.uuid4().hex
        if self.method == "POST" and self.path in ROUTED_POST_PATHS:
            self.kind = "chat" if self.path == CHAT else "completion"
            if msg.end_of_stream:  # no body will follow
                return self._error(bad_request("request body is empty; expected a JSON object", code="invalid_json"))
            return _continue_headers(remove)
        if self.method == "GET" and self.path == MODELS:
            self.kind = "models"
            return self._route_any(remove or [])
        self.gw.metrics.requests.labels("other", "passthrough").inc()
        return _continue_headers(remove)

    async def on_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if self.kind not in ("chat", "completion"):  # a body on a pass-through path
            return _BODY_CONTINUE
        started = time.perf_counter()
        request = parse_body(self.path, msg.body, self.gw.max_body_bytes)
        strategy = self.strategy or self.gw.default_strategy
        token_ids = await self._tokens(request, strategy)
        self.decision = await self.gw.router.pick(RouteRequest(
            model=request.model, token_ids=token_ids, strategy=strategy, request_id=self.request_id))
        m, d = self.gw.metrics, self.decision
        key = (d.pod.name, d.pod.endpoint, d.strategy, d.rank)
        routed = self.answers.get(key)
        if routed is None:
            if len(self.answers) > 4096:  # pods churn: keep the memo bounded
                self.answers.clear()
            routed = self.answers[key] = (self._routed(d.pod, d.strategy, body=True, rank=d.rank),
                                          m.decision_seconds.labels(d.strategy), m.decisions.labels(d.strategy, d.pod.name))
        response, seconds, decided = routed
        seconds.observe(time.perf_counter() - started)
        decided.inc()
        m.requests.labels(self.kind, "routed").inc()
        if d.total_blocks:
            m.prefix_blocks.labels("total").inc(d.total_blocks)
            m.prefix_blocks.labels("cached").inc(d.matched_blocks)
        return response

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
            call = self.gw.tokenizer.tokenize(request.model, item, base_url=base_url)
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
        if self.gw.reachable is not None:
            # Skip engines that refuse connections: they would answer 503.
            pods = [p for p in pods if self.gw.reachable(p.name)] or pods
        if not pods:
            return self._error(ClientError(503, "no ready pod", type_="service_unavailable", code="no_ready_pod"))
        pod = pods[hash(self.request_id) % len(pods)]
        self.gw.metrics.requests.labels("models", "routed").inc()
        return self._routed(pod, "any", body=False, remove=remove)

    def _routed(self, pod: Pod, strategy: str, *, body: bool, remove: list[str] | None = None,
                rank: int | None = None) -> pb.ProcessingResponse:
        endpoint = pod.endpoint
        headers = [_set_header(DESTINATION_HEADER, endpoint)]
        if self.gw.target_pod_header:
            headers.append(_set_header(TARGET_POD_HEADER, endpoint))
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
        self._releases: set[asyncio.Task] = set()

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context) -> AsyncIterator[pb.ProcessingResponse]:  # noqa: N802
        stream = _Stream(self.gw, self._fallback_log, self._answers)
        self.gw.metrics.active_streams.inc()
        how = "completed"
        try:
            async for msg in request_iterator:
                which = msg.WhichOneof("request")
                try:
                    if which == "request_headers":
                        response = stream.on_headers(msg.request_headers)
                    elif which == "request_body":
                        response = await stream.on_body(msg.request_body)
                    else:
                        response = _pass_through(which)
                except Exception as exc:  # every failure becomes an answer: a request never hangs
                    response = stream.error_for(exc)
                if response is not None:
                    yield response
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except Exception:
            how = "stream_error"
            raise
        finally:
            self.gw.metrics.active_streams.dec()
            if stream.decision is not None:
                # No await here (a cancelled stream must not wait): the release runs now if it needs no wait
                # (the router's own counts), else it finishes in a task of its own.
                release = self._release(stream.decision, how)
                try:
                    pending = release.send(None)
                except StopIteration:
                    pass
                else:
                    task = asyncio.get_running_loop().create_task(_finish(release, pending))
                    self._releases.add(task)
                    task.add_done_callback(self._releases.discard)

    async def _release(self, decision: Decision, how: str) -> None:
        try:
            await self.gw.router.release(decision)
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
