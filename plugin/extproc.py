"""Envoy's external processor: one gRPC stream per HTTP request, speaking the Gateway API
Inference Extension's Endpoint Picker protocol (v1.0.0).

Headers arrive first (the client's routing headers are stripped there), then the
buffered body; or, on envoy/envoy.yaml's one-message routes, the body alone, carrying the
headers kvgate reads as Envoy attributes (request headers skipped; a buffer filter holds them
for the router, which sets the headers named below from the answer's metadata). The answer to
the body names the upstream pod, followed by the next-best pods to retry on (`ip:port,ip:port,...`,
the same list in the `x-gateway-destination-endpoint` header and in `envoy.lb` dynamic metadata)
and, by default, the pod alone in AIBrix's `target-pod` header; for a data-parallel pod it also
names the rank in `x-data-parallel-rank` (vLLM and SGLang pin the request to that rank). The
request counts as running on its pod until Envoy closes the stream, which it does when the HTTP
request ends.

The protocol's other clauses, one method each: the data plane's subset hint
(`envoy.lb.subset_hint` metadata) limits the pick (503 when it leaves nothing); a request whose
objective (`x-gateway-inference-objective`) is sheddable gets 429 when every eligible pod is
saturated; the endpoint that served the request (`envoy.lb` `x-gateway-destination-endpoint-served`
metadata on the response headers) takes the request's running count; with FULL_DUPLEX_STREAMED
bodies the request body is gathered, the pick answered on the headers and the body sent back whole,
and response body chunks are sent back as they come.

This module is the protocol alone: message dispatch, the body modes, the clauses above and the
ProcessingResponses. What is done with a routed request (parse, tokenize, pick, admit, record,
observe) is plugin.pipeline's; a stream fills in its RequestContext from the headers and runs the
pipeline on the body.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import AsyncIterator

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from plugin import observe
from plugin.pd import PD_KINDS
from plugin.pipeline import (PREVIOUS_RESPONSE, SLO_TPOT_HEADER, SLO_TTFT_HEADER, Gateway, Pipeline, RequestContext,
                             build)
from plugin.request import (KINDS, MESSAGES, POOLING_PATHS, READ_ONLY, RESPONSES, ROUTED_POST_PATHS, ClientError,
                            bad_request, parse_body)
from plugin.responses import IdReader
from plugin.watch import GATEWAY_KEY, ROUTE_ATTRIBUTE, WATCHED_ROUTE_PREFIX
from routing.errors import (NoEligibleEndpointError, NoReadyPodError, RoutingError, SaturatedError,
                            UnknownModelError, UnknownStrategyError)
from routing.pods import Pod
from routing.router import Decision

log = logging.getLogger("kvgate.extproc")

RESPONSE_PREFIX = RESPONSES + "/"  # GET /v1/responses/{id}, POST /v1/responses/{id}/cancel

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
POD_RESPONSE_HEADER = "x-kvgate-pod"
KVGATE_NAMESPACE = "kvgate"  # Envoy copies these into the client's x-kvgate-pod / -strategy / -rank
# Headers only kvgate may set: whatever a client sends under these names is dropped (a client
# choosing the rank would defeat the routing as surely as one choosing the pod).
RESERVED_HEADERS = frozenset({DESTINATION_HEADER, TARGET_POD_HEADER, DP_RANK_HEADER})
RESERVED_PREFIX = "x-kvgate-"

# A request's session, as AIBrix (x-session-id: a pod it returned; x-aibrix-session-key: the caller's key) and
# llm-d (x-session-token) clients send it; the first of these present wins. `user`: AIBrix's user (vtc-basic).
SESSION_HEADERS = ("x-session-id", "x-session-token", "x-aibrix-session-key")
USER_HEADER = "user"

# The request headers kvgate reads (a header's key -> what it is); every other one is passed over.
_PATH, _METHOD, _STRATEGY, _REQUEST_ID, _OBJECTIVE, _SLO, _SESSION, _USER, _AUTHORIZATION = range(9)
# authorization: the pd strategy's prefill leg carries the client's credentials, as Envoy does to the decode engine
_READ_HEADERS = {":path": _PATH, ":method": _METHOD, STRATEGY_HEADER: _STRATEGY, "x-request-id": _REQUEST_ID,
                 OBJECTIVE_HEADER: _OBJECTIVE, SLO_TTFT_HEADER: _SLO, SLO_TPOT_HEADER: _SLO,
                 **dict.fromkeys(SESSION_HEADERS, _SESSION), USER_HEADER: _USER, "authorization": _AUTHORIZATION}

# One message: the Envoy attributes (a route's request_attributes) standing for headers kvgate reads.
_ATTRIBUTE_HEADERS = {"request.path": ":path", "request.method": ":method", "request.id": "x-request-id"}
_HEADER_ATTRIBUTE = "request.headers['"  # request.headers['routing-strategy'], ...

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# The answer to headers that carry nothing to remove: built once, never mutated, shared by streams.
_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_HEADERS_UNWATCHED = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=observe.UNWATCHED)
_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
LOOKUP = pb.ProcessingResponse()  # on_headers' word that its answer needs an await (on_stored_lookup)
_RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _set_header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                                      append_action=_OVERWRITE)


def _immediate(err: ClientError, request_id: str, anthropic: bool = False) -> pb.ProcessingResponse:
    headers = pb.HeaderMutation(set_headers=[
        _set_header("content-type", "application/json"),
        _set_header("x-request-id", request_id),
    ])
    if err.retry_after is not None:
        headers.set_headers.append(_set_header("retry-after", str(err.retry_after)))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status), headers=headers,
        body=err.to_anthropic_json() if anthropic else err.to_json(),
        details=f"kvgate_{err.code or err.type}"))


def _stored_id(path: str) -> str:
    """The response id in a RESPONSE_PREFIX path (`/v1/responses/{id}[/cancel]`)."""
    return path[len(RESPONSE_PREFIX):].split("/", 1)[0]


class _Stream:
    """The protocol state of one HTTP request's ext_proc stream; the request's own state is `ctx`."""

    __slots__ = ("gw", "pipeline", "answers", "ctx", "method", "streamed_request", "streamed_response", "chunks",
                 "held_remove", "served_pod", "id_reader")

    def __init__(self, gw: Gateway, pipeline: Pipeline, answers: dict) -> None:
        self.gw = gw
        self.pipeline = pipeline
        # By (pod, endpoint, strategy, rank, fallbacks): the routed answer (built once, never mutated,
        # shared by streams).
        self.answers = answers
        self.ctx = RequestContext()
        self.method = ""
        # The body modes (FULL_DUPLEX_STREAMED: gather the request body, echo the response's) and, while a
        # streamed request body is gathered, its chunks and the header removals held back.
        self.streamed_request = False
        self.streamed_response = False
        self.chunks: list[bytes] | None = None
        self.held_remove: list[str] | None = None
        # A Responses API answer's pod and the reader of its id (plugin.responses), while it is looked for.
        self.served_pod = ""
        self.id_reader: IdReader | None = None

    # --- EPP protocol clauses ------------------------------------------------------------
    def read_context(self, msg: pb.ProcessingRequest) -> None:
        """The first message: the body modes Envoy uses and the subset hint, if any."""
        if msg.HasField("protocol_config"):
            pc = msg.protocol_config
            self.streamed_request = pc.request_body_mode == FULL_DUPLEX
            self.streamed_response = pc.response_body_mode == FULL_DUPLEX
        if msg.HasField("metadata_context"):
            self.ctx.subset = subset_hint(msg.metadata_context)

    def on_response_headers(self, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        answer = self._served(msg)
        watch = self.ctx.watch
        if watch is not None:
            answer = observe.response_headers(watch, msg, answer, self.streamed_response)
        if self.ctx.kind == "responses" and self.gw.responses is not None and self.ctx.decision is not None:
            answer = self._read_response_id(msg, answer)
        return answer

    def _read_response_id(self, msg: pb.ProcessingRequest, answer: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """A Responses API answer: its id is read from its body (plugin.responses), which is turned on when
        nothing else turned it on."""
        status, ctype = observe.status_and_type(msg)
        if status != 200:
            return answer
        d = self.ctx.decision
        assert d is not None  # as on_response_headers found it
        self.served_pod = self.served_pod or d.pod.name
        self.id_reader = IdReader()
        if self.streamed_response or answer.HasField("mode_override"):
            return answer
        return observe.body_on(ctype.startswith("text/event-stream"), answer)

    def _served(self, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """Account the request to the endpoint that served it (a fallback, after a retry) and name
        that pod in x-kvgate-pod."""
        served = served_endpoint(msg)
        d = self.ctx.decision
        if not served or d is None:
            return _RESPONSE_HEADERS_CONTINUE
        pod = observe.served_fallback(self.gw.router.served, self.gw.metrics.served, d, served)
        if pod is None:
            return _RESPONSE_HEADERS_CONTINUE
        self.served_pod = pod.name
        if self.ctx.watch is not None:
            self.ctx.watch.served_by(pod.name)
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[_set_header(POD_RESPONSE_HEADER, pod.name)]))))

    def on_response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if self.ctx.watch is not None:
            self.ctx.watch.on_chunk(msg.body)
        reader = self.id_reader
        if reader is not None:
            found = reader.feed(msg.body)
            if found is not None:
                assert self.gw.responses is not None  # set only with a store (_read_response_id)
                self.gw.responses.learn(found, self.served_pod)
                self.gw.metrics.response_ids.inc()
            if reader.done:
                self.id_reader = None
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
            parse_body(self.ctx.path, b"".join(self.chunks), self.gw.max_body_bytes)  # raises the 413
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
        if self.ctx.body_out is not None:  # the pd strategy's decode body (Envoy drops content-length in this mode)
            raw, self.ctx.body_out = self.ctx.body_out, None
        head = self._routed(d.pod, d.strategy, body=False, remove=self.held_remove, rank=d.rank,
                            fallbacks=d.fallbacks, session=self._session_answer(d), pd=self.ctx.pd_mode)
        body = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=raw, end_of_stream=end_of_stream)))))
        return [head, body]

    # --- phases -----------------------------------------------------------------------
    def on_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse | None:
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
            if not self._read(which, key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value):
                return self._bad_slo(key)
        return self._on_path(remove, msg.end_of_stream)

    def on_attributes(self, msg: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        """One message: the body came first, the headers kvgate reads as the route's Envoy attributes (whatever
        the filter's name they are filed under). None: the body decides; else the answer, given on the body."""
        self.gw.metrics.one_message.inc()
        watched_route = False
        for struct in msg.attributes.values():
            for name, value in struct.fields.items():
                key = _ATTRIBUTE_HEADERS.get(name)
                if key is None:
                    if name == ROUTE_ATTRIBUTE:  # a watched route: a stream of its own reads the response
                        watched_route = value.string_value.startswith(WATCHED_ROUTE_PREFIX)
                        continue
                    if not (name.startswith(_HEADER_ATTRIBUTE) and name.endswith("']")):
                        continue
                    key = name[len(_HEADER_ATTRIBUTE):-2].lower()
                which = _READ_HEADERS.get(key)
                if which is not None and value.WhichOneof("kind") == "string_value" \
                        and not self._read(which, key, value.string_value):
                    return self._bad_slo(key)
        if not self.ctx.path:  # Envoy skips the headers but sends none of them: nothing to route by (fail closed)
            return self._error(ClientError(
                500, "the gateway is misconfigured: Envoy sent kvgate a request body without its headers and without "
                "the request.path attribute (ext_proc request_attributes, as in envoy/envoy.yaml)",
                type_="internal_error", code="gateway_misconfigured"))
        return self._on_path(None, False, one_message=True, watched_route=watched_route)

    def _read(self, which: int, key: str, value: str) -> bool:
        """One header kvgate reads into the request's context; False: an SLO target that is not one."""
        ctx = self.ctx
        if which == _PATH:
            ctx.path = value.split("?", 1)[0]
        elif which == _METHOD:
            self.method = value
        elif which == _STRATEGY:
            ctx.strategy = value.strip() or None
        elif which == _REQUEST_ID:
            ctx.request_id = value
        elif which == _OBJECTIVE:
            ctx.objective = value.strip()
        elif which == _AUTHORIZATION:
            ctx.authorization = value
        elif which == _SESSION:
            value = value.strip()
            rank = SESSION_HEADERS.index(key)
            if value and (ctx.session is None or rank < ctx.session_rank):
                ctx.session, ctx.session_rank = value, rank
        elif which == _USER:
            ctx.user = value.strip() or None
        else:  # an SLO target
            ms = observe.milliseconds(value)
            if ms is None:
                return False
            if ctx.slo is None:
                ctx.slo = {}
            ctx.slo[key] = ms / 1000.0
        return True

    def _bad_slo(self, key: str) -> pb.ProcessingResponse:
        return self._error(bad_request(f"{key}: expected a positive number of milliseconds",
                                       code="invalid_slo", param=key))

    def _on_path(self, remove: list[str] | None, end_of_stream: bool, one_message: bool = False,
                 watched_route: bool = False) -> pb.ProcessingResponse | None:
        """What the request's path and method ask, once its headers are read (`one_message`: read from the
        attributes of a body that came first; Envoy sends nothing more of the request and applies no header;
        `watched_route`: its response is read by a watch stream of its own, plugin.watch)."""
        ctx = self.ctx
        envoy_id = bool(ctx.request_id)  # Envoy's request id, which the watch stream is told too
        if not envoy_id:
            ctx.request_id = uuid.uuid4().hex
        path = ctx.path
        method = self.method
        pooling = path in POOLING_PATHS
        if method == "POST" and (path in ROUTED_POST_PATHS or pooling):
            ctx.kind = "pooling" if pooling else KINDS[path]
            if end_of_stream:  # no body will follow
                return self._error(bad_request("request body is empty; expected a JSON object", code="invalid_json"))
            if one_message:  # Envoy sends nothing of this response: a watch stream reads it on a watched route
                if watched_route and self.gw.relay is not None and self.gw.observer is not None and envoy_id:
                    ctx.relayed = True
                    self.gw.sampler.relayed()
                    return None
                ctx.watched = False
                if self.gw.observer is not None and self.gw.sampler.passed():
                    log.warning("Envoy sends requests in one ext_proc message, unwatched (envoy/envoy.yaml's one-message "
                                "routes), though KVGATE_OBSERVE_SAMPLE=1 asks for every response: set Envoy's runtime "
                                "key kvgate.watch_percent to 100 (each response read from a stream of its own)")
                return None
            if self.streamed_request:  # the answer to the headers waits for the whole body
                self.chunks, self.held_remove = [], remove
                return None
            # A Responses API answer is read for its id (plugin.responses): never unwatched.
            if self.gw.observer is not None and not (path == RESPONSES and self.gw.responses is not None) \
                    and not self._watch_response():
                # Envoy sends nothing of this response (the override is honoured in this answer only)
                ctx.watched = False
                if not remove:
                    return _HEADERS_UNWATCHED
                answer = _continue_headers(remove)
                answer.mode_override.CopyFrom(observe.UNWATCHED)
                return answer
            return _continue_headers(remove)
        if path.startswith(RESPONSE_PREFIX):  # GET /v1/responses/{id}, POST /v1/responses/{id}/cancel
            ctx.kind = "read_only"
            self.gw.metrics.read_only.labels(RESPONSE_PREFIX + "{id}").inc()
            store, response_id = self.gw.responses, _stored_id(path)
            if store is None or not response_id:
                return self._route_any(remove or [])
            name = store.pod_of(response_id)
            if name is None:  # learned by another replica, perhaps: Process awaits on_stored_lookup
                self.held_remove = remove
                return LOOKUP
            return self._route_any(remove or [], self._ready(name))
        if (method, path) in READ_ONLY:
            ctx.kind = "models" if path == "/v1/models" else "read_only"
            self.gw.metrics.read_only.labels(path).inc()
            return self._route_any(remove or [])
        self.gw.metrics.read_only.labels("other").inc()
        self.gw.metrics.requests.labels("other", "passthrough").inc()
        return _continue_headers(remove)

    def longer_timeout(self) -> pb.ProcessingResponse | None:
        """For a buffered body the `pd` strategy may split, the answer that extends Envoy's wait for the next one
        (override_message_timeout, bounded by the filter's max_message_timeout): two prefill legs and the rest."""
        pd = self.gw.pd
        if pd is None or self.streamed_request or self.ctx.kind not in PD_KINDS:
            return None
        if not pd.may_split(self.ctx.strategy or self.gw.default_strategy):
            return None
        return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
            seconds=min(120, int(2 * pd.timeout_s) + 5)))

    def _watch_response(self) -> bool:
        """Watch this response? Always for the slo strategy and requests with SLO targets (their
        attainment, the prefill queue); else a sample (KVGATE_OBSERVE_SAMPLE)."""
        strategy = self.ctx.strategy or self.gw.default_strategy
        if self.ctx.slo is not None or strategy == "slo" or ("," in strategy and _names_slo(strategy)):
            return True
        return self.gw.sampler.take()

    async def on_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse | list[pb.ProcessingResponse] | None:
        if self.streamed_request:
            return await self.on_streamed_body(msg)
        if self.ctx.kind not in _ROUTED_KINDS:  # a body on a pass-through path
            return _BODY_CONTINUE
        d = await self._decide(msg.body)
        session = self._session_answer(d)
        if self.ctx.pd_mode is not None:  # the pd strategy: how it is served, and the decode body if rewritten
            body_out, self.ctx.body_out = self.ctx.body_out, None
            return self._routed(d.pod, d.strategy, body=True, rank=d.rank, fallbacks=d.fallbacks, session=session,
                                pd=self.ctx.pd_mode, body_out=body_out)
        key = (d.pod.name, d.pod.endpoint, d.strategy, d.rank, d.fallbacks, session)
        response = self.answers.get(key)
        if response is None:
            if len(self.answers) > 4096:  # pods churn: keep the memo bounded
                self.answers.clear()
            response = self.answers[key] = self._routed(d.pod, d.strategy, body=True, rank=d.rank,
                                                        fallbacks=d.fallbacks, session=session)
        return response

    def _session_answer(self, d: Decision) -> bool:
        """Tell the client its session's pod (AIBrix's x-session-id: the pod's `ip:port`, base64, which Envoy
        copies from kvgate's metadata) when it sent a session or asked for session affinity."""
        return self.ctx.session is not None or d.strategy == "session-affinity"

    async def _decide(self, raw: bytes) -> Decision:
        """The request pipeline on the body (plugin.pipeline): its decision."""
        self.ctx.body = raw
        d = await self.pipeline.run(self.ctx)
        assert d is not None  # the gateway's pipeline always has its pick step
        return d

    # --- helpers ----------------------------------------------------------------------
    async def on_stored_lookup(self) -> pb.ProcessingResponse:
        """The headers' answer for a stored response's path whose id this replica has not learned: the store
        looks it up where the replicas share ids (plugin.responses; bounded wait), else routed by load."""
        store = self.gw.responses
        assert store is not None  # on_headers answers LOOKUP only with a store
        name = await store.lookup(_stored_id(self.ctx.path))
        return self._route_any(self.held_remove or [], self._ready(name))

    def _ready(self, name: str | None) -> Pod | None:
        """The pod named `name` (one that stored a Responses API response, plugin.responses) if it is ready."""
        pod = self.gw.registry.get(name) if name is not None else None
        return pod if pod is not None and pod.ready else None

    def _route_any(self, remove: list[str], stored: Pod | None = None) -> pb.ProcessingResponse:
        """A path routed by load (or to `stored`, the pod holding the response it names) at its headers."""
        if stored is not None and (self.ctx.subset is None or stored.endpoint in self.ctx.subset):
            self.gw.metrics.response_affinity.labels("routed").inc()
            return self._routed(stored, PREVIOUS_RESPONSE, body=False, remove=remove)
        pods = [p for p in self.gw.registry.pods() if p.ready]
        subset = self.ctx.subset
        if subset is not None:
            pods = [p for p in pods if p.endpoint in subset]
            if not pods:
                return self._error(ClientError(503, "no ready pod among the endpoints the gateway allowed",
                                               type_="service_unavailable", code="no_eligible_endpoint"))
        if self.gw.reachable is not None:
            # Skip engines that refuse connections: they would answer 503.
            pods = [p for p in pods if self.gw.reachable(p.name)] or pods
        if not pods:
            return self._error(ClientError(503, "no ready pod", type_="service_unavailable", code="no_ready_pod"))
        # By load: the fewest running requests (this gateway's view of every gateway's counts), ties spread by
        # the request id; the next ones the fallbacks.
        running = self.gw.running() if self.gw.running is not None else {}
        spread = hash(self.ctx.request_id)
        n = len(pods)
        order = sorted(range(n), key=lambda i: (running.get(pods[i].name, 0), (i - spread) % n))
        pod = pods[order[0]]
        rest = tuple(pods[i].endpoint for i in order[1:4])
        self.gw.metrics.requests.labels(self.ctx.kind, "routed").inc()
        return self._routed(pod, "any", body=False, remove=remove, fallbacks=rest)

    def _routed(self, pod: Pod, strategy: str, *, body: bool, remove: list[str] | None = None,
                rank: int | None = None, fallbacks: tuple[str, ...] = (), session: bool = False,
                pd: str | None = None, body_out: bytes | None = None) -> pb.ProcessingResponse:
        # The ranked list, primary first: header and metadata carry the same value (the protocol requires it).
        endpoint = ",".join((pod.endpoint, *fallbacks)) if fallbacks else pod.endpoint
        headers = [_set_header(DESTINATION_HEADER, endpoint), _set_header(RETRIES_HEADER, str(len(fallbacks)))]
        if self.gw.target_pod_header:
            headers.append(_set_header(TARGET_POD_HEADER, pod.endpoint))
        # The rank and retries stay numbers in the Struct. What Envoy's route sets as headers from them (one
        # message: the headers went on before this answer, so its header mutations are not applied): retries,
        # target_pod, rank.
        ours: dict[str, object] = {"pod": pod.name, "strategy": strategy, "retries": len(fallbacks)}
        if self.gw.relay is not None:  # the replica a watch stream tells what it read (plugin.watch)
            ours[GATEWAY_KEY] = self.gw.relay.gateway_id
        if self.gw.target_pod_header:
            ours["target_pod"] = pod.endpoint
        if rank is not None:
            headers.append(_set_header(DP_RANK_HEADER, str(rank)))
            ours["rank"] = rank
        if pd is not None:
            ours["pd"] = pd
        if body_out is not None:  # BUFFERED with request headers sent: Envoy keeps content-length, ours to set
            headers.append(_set_header("content-length", str(len(body_out))))
        if session:
            ours["session_id"] = base64.b64encode(pod.endpoint.encode()).decode()
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers, remove_headers=remove or []))
        if body_out is not None:
            common.body_mutation.body = body_out
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoint}, KVGATE_NAMESPACE: ours})
        if body:
            return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)

    def _error(self, err: ClientError) -> pb.ProcessingResponse:
        self.gw.metrics.errors.labels(str(err.status), err.code or err.type).inc()
        self.gw.metrics.requests.labels(self.ctx.kind, "rejected").inc()
        if self.gw.mix is not None:  # the strategy as asked only when it is one: a header's value is the client's
            strategy = self.ctx.strategy if self.ctx.strategy in self.gw.router.strategy_names() else "-"
            self.gw.mix.record(strategy or "-", f"rejected:{err.status}:{err.code or err.type}")
        return _immediate(err, self.ctx.request_id, anthropic=self.ctx.path == MESSAGES)

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
        request_id = self.ctx.request_id
        log.error("request %s: internal error", request_id, exc_info=exc)
        return self._error(ClientError(500, f"internal error in kvgate (request id {request_id})",
                                       type_="internal_error", code="internal_error"))


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.pipeline = build(gw)
        self._answers: dict = {}
        self._releases: set[asyncio.Task] = set()
        # Whether a release never waits: the router's counts and a local limiter's change in this process. A
        # shared limiter's round trip runs in a task, which the stream's reset (Envoy's close) cannot cut.
        self._releases_now = gw.admission is None or gw.admission.releases_without_wait

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context) -> AsyncIterator[pb.ProcessingResponse]:  # noqa: N802
        stream = _Stream(self.gw, self.pipeline, self._answers)
        ctx = stream.ctx
        self.gw.metrics.active_streams.inc()
        how = "completed"
        ended = False
        try:
            first = True
            async for msg in request_iterator:
                which = msg.WhichOneof("request")
                if first and msg.observability_mode:  # a watched route's watch stream: read, never answered
                    if self.gw.relay is not None:
                        if which == "response_headers":
                            await self.gw.relay.read(msg, served_endpoint(msg), request_iterator)
                        else:
                            self.gw.relay.unread(which)
                    break
                try:
                    if which == "request_headers":
                        stream.read_context(msg)
                        response = stream.on_headers(msg.request_headers)
                        if response is LOOKUP:
                            response = await stream.on_stored_lookup()
                    elif which == "request_body":
                        response = None
                        if first:  # one message: the headers kvgate reads came as attributes
                            stream.read_context(msg)
                            response = stream.on_attributes(msg)
                            if response is LOOKUP:
                                response = await stream.on_stored_lookup()
                            if response is not None:
                                response = _as_body_answer(response)
                        if response is None:
                            longer = stream.longer_timeout()
                            if longer is not None:  # the pd strategy's prefill leg may outlast Envoy's message_timeout
                                yield longer
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
                first = False
                if type(response) is list:  # a streamed body's pick: the held headers' answer, then the body
                    for r in response:
                        yield r
                elif response is not None:
                    yield response
            ended = True
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except Exception:
            how = "stream_error"
            raise
        finally:
            self.gw.metrics.active_streams.dec()
            if ctx.watch is not None:
                if ctx.relayed and self.gw.relay is not None:  # its watch stream's end word closes it
                    self.gw.relay.routed_end(ctx.request_id)
                else:
                    ctx.watch.close()
            if ctx.pd_plan is not None and ctx.pd_plan.prefill is not None:
                # a prefill leg that never ran (a 429 from admission); idempotent after the leg's own release
                self.gw.router.release_now(ctx.pd_plan.prefill)
            # A stream cut short (cancelled, failed, closed) must not wait, nor a release that waits be cut:
            # either runs in a task of its own.
            later = ctx.decision is not None and (not ended or (ctx.admitted is not None and not self._releases_now))
            if later:
                assert ctx.decision is not None  # part of `later`
                task = asyncio.get_running_loop().create_task(self._release(ctx.decision, how, ctx.admitted))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)
        if ctx.decision is not None and not later:
            # Envoy ended the stream and the release needs no wait: it is done here, before the stream closes.
            await self._release(ctx.decision, how, ctx.admitted)

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


_ROUTED_KINDS = frozenset((*KINDS.values(), "pooling"))


def _names_slo(mix: str) -> bool:
    """A weighted mix naming `slo` is `slo` (AIBrix: exclusive)."""
    return any(part.partition(":")[0].strip() == "slo" for part in mix.split(","))


def _as_body_answer(answer: pb.ProcessingResponse) -> pb.ProcessingResponse:
    """One message: an answer made for the headers (routed by load, passed through), given on the body."""
    if not answer.HasField("request_headers"):
        return answer  # an immediate response
    if not answer.request_headers.HasField("response") and not answer.HasField("dynamic_metadata"):
        return _BODY_CONTINUE
    body = pb.ProcessingResponse(request_body=pb.BodyResponse(response=answer.request_headers.response))
    if answer.HasField("dynamic_metadata"):
        body.dynamic_metadata.CopyFrom(answer.dynamic_metadata)
    return body


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
