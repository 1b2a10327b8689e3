"""Watching routed responses: time to first token, time per output token, prompt and completion
tokens, and the pod that served each request; fed to Prometheus and to the request trackers.

The cost is kept to what the ext_proc protocol makes unavoidable. Envoy's filter sends no response
body by default (`response_body_mode: NONE`); the answer to a routed request's response headers turns
the body on for that response alone (`mode_override`, allowed by `allow_mode_override`): STREAMED for an
event stream, so SSE chunks pass on as they come, BUFFERED_PARTIAL for a JSON answer, which then comes
in one message (STREAMED would take two: the body and the end of the stream); pass-through requests pay
nothing. Each chunk is answered with one prebuilt
empty message; the chunk itself is only searched for bytes, never decoded: the first chunk's arrival is
the first token; a chunk holding `"usage"` has its token counts read by a regular expression; a stream
without usage has its completion tokens counted as its `data: {` events (one token each, as vLLM
streams them) less the usage-only ones. A JSON (non-streamed) response keeps only its tail, where
vLLM puts `usage`; it has no first token to time, so it gives tokens but no TTFT or TPOT.

The request trackers see AIBrix's contract: `add_request_count` once routed, then one `done_*`: with
the tokens when known, else without (a failed or cut response). Their `ctx` is the `Observation`.
"""
from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Callable, Protocol

from prometheus_client import CollectorRegistry

from plugin.metrics import LoopCounter, LoopHistogram
from routing.learning.tracking import TrackerRegistry

if TYPE_CHECKING:
    from routing.pods import Pod
    from routing.router import Decision

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
# OpenAI's usage names, and the Responses and Messages APIs' (`input_tokens`, `output_tokens`)
_PROMPT = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_EVENT = b"data: {"
_USAGE = b'"usage"'
_USAGE_ONLY = b'"choices":[]'
_ROLE_ONLY = b'"delta":{"role":"assistant","content":""}'  # the chunk opening a chat stream: no token
_TAIL = 512  # bytes of a JSON response kept for its usage
# The event carrying output tokens in the Responses and Messages APIs' streams, which open with events that
# carry none (response.created, message_start, ...): their first token is the first such event, and their
# tokens are counted as these events (one token each, as vLLM streams them).
TOKEN_EVENTS = {"responses": b'"type":"response.output_text.delta"', "messages": b'"type":"content_block_delta"'}


class ObserveMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.ttft = LoopHistogram("kvgate_request_ttft_seconds",
                                  "Time from the routing answer to the first streamed response chunk, by model and pod",
                                  ["model", "pod"], registry, buckets=TTFT_BUCKETS)
        self.tpot = LoopHistogram("kvgate_request_tpot_seconds",
                                  "Time per output token after the first (streamed responses), by model and pod",
                                  ["model", "pod"], registry, buckets=TPOT_BUCKETS)
        self.prompt_tokens = LoopCounter("kvgate_request_prompt_tokens", "Prompt tokens of served requests, by model and pod",
                                         ["model", "pod"], registry)
        self.completion_tokens = LoopCounter("kvgate_request_completion_tokens",
                                             "Completion tokens of served requests, by model and pod",
                                             ["model", "pod"], registry)
        self.observed = LoopCounter("kvgate_requests_observed",
                                    "Routed requests whose response was watched, by how their tokens were known: "
                                    "usage, counted (stream without usage), none (failed or cut)", ["source"], registry)
        self.slo = LoopCounter("kvgate_slo_requests",
                               "Streamed requests by model and whether they met both their TTFT and TPOT targets "
                               "(x-slo-ttft-ms / x-slo-tpot-ms, else KVGATE_SLO_TARGETS)", ["model", "met"], registry)


class Observation:
    """One routed request, as the trackers see it (their `ctx`): its fields, every one set by `Watch`
    (a request's Watch is its Observation, filled in as its response comes)."""

    __slots__ = ("request_id", "model", "pod", "routed_at", "prompt_tokens", "uncached_tokens", "running_at_start",
                 "completion_tokens", "usage", "status", "streamed", "first_at", "last_at", "events", "term",
                 "slo_ttft_s", "slo_tpot_s", "watched")
    request_id: str
    model: str
    pod: str  # the serving pod's name (the picked one until the data plane names another)
    routed_at: float  # the observer's clock at the routing answer (0.0: not watched, not read)
    prompt_tokens: int  # usage's, else the tokenized prompt's length (0: unknown, or not watched)
    uncached_tokens: int  # prompt tokens the pod did not hold at routing (index), 0 when unknown
    running_at_start: int  # requests running on the pod when this one was routed (this one included)
    completion_tokens: int
    usage: bool  # token counts from the engine's usage
    status: int
    streamed: bool
    first_at: float  # first response chunk (streamed)
    last_at: float
    events: int  # SSE events carrying choices
    term: int
    slo_ttft_s: float | None  # the request's own targets (headers), None: the model's defaults
    slo_tpot_s: float | None
    watched: bool  # False: Envoy sends nothing of the response (not sampled); only its end is seen

    @property
    def ttft(self) -> float | None:
        return self.first_at - self.routed_at if self.streamed and self.first_at else None

    @property
    def tpot(self) -> float | None:
        if not self.streamed or not self.first_at or self.completion_tokens < 2:
            return None
        return (self.last_at - self.first_at) / (self.completion_tokens - 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in Observation.__slots__)})"


class Sink(Protocol):
    """Whom a Watch tells what it read: the Observer, or plugin.watch's side reading another replica's response."""

    clock: Callable[[], float]
    on_first_token: Callable[[str], None] | None

    def finish(self, o: "Watch") -> None: ...


class Watch(Observation):
    """One routed response being watched (see the module doc); itself the request's Observation."""

    __slots__ = ("_observer", "_tail", "_done", "_marker")

    def __init__(self, observer: Sink, request_id: str, model: str, pod: str, routed_at: float = 0.0,
                 prompt_tokens: int = 0, uncached_tokens: int = 0, running_at_start: int = 0,
                 slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, watched: bool = True,
                 marker: bytes | None = None) -> None:
        self._observer = observer
        self._marker = marker  # TOKEN_EVENTS' of the request's API (None: every `data: {` event is a token)
        self._tail = b""
        self._done = False
        self.request_id = request_id
        self.model = model
        self.pod = pod
        self.routed_at = routed_at
        self.prompt_tokens = prompt_tokens
        self.uncached_tokens = uncached_tokens
        self.running_at_start = running_at_start
        self.completion_tokens = 0
        self.usage = False
        self.status = 0
        self.streamed = False
        self.first_at = 0.0
        self.last_at = 0.0
        self.events = 0
        self.term = 0
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self.watched = watched

    def served_by(self, pod: str) -> None:
        """The data plane named another pod (a retry on a fallback)."""
        self.pod = pod

    def on_headers(self, status: int, content_type: str) -> bool:
        """The response's status and type; True when its body should be watched."""
        self.status = status
        self.streamed = content_type.startswith("text/event-stream")
        return status == 200

    def on_chunk(self, body: bytes) -> None:
        if not body:
            return
        observer = self._observer
        if self._marker is not None and self.streamed:
            self._on_events(body)
            return
        now = observer.clock()
        if not self.last_at and observer.on_first_token is not None:  # the first chunk (first_at only with last_at)
            observer.on_first_token(self.request_id)
        if self.streamed:
            if not self.first_at:
                self.first_at = now
            self.last_at = now
            events = body.count(_EVENT)
            if not self.events and _ROLE_ONLY in body:
                events -= 1
            if _USAGE in body:
                events -= body.count(_USAGE_ONLY)
                self._read_usage(body)
            self.events += events
        else:
            tail = self._tail
            self._tail = (tail + body)[-_TAIL:] if tail else body[-_TAIL:]
            self.last_at = now

    def _on_events(self, body: bytes) -> None:
        """A chunk of a Responses or Messages stream: tokens are its token events alone."""
        assert self._marker is not None  # as on_chunk found it
        events = body.count(self._marker)
        if events:
            observer = self._observer
            now = observer.clock()
            if not self.first_at:
                self.first_at = now
                if observer.on_first_token is not None:
                    observer.on_first_token(self.request_id)
            self.last_at = now
            self.events += events
        if _USAGE in body:
            self._read_usage(body)

    def _read_usage(self, text: bytes) -> None:
        prompt = _PROMPT.findall(text)
        if prompt:
            completion = _COMPLETION.findall(text)
            if completion:
                self.prompt_tokens = int(prompt[-1])
                self.completion_tokens = int(completion[-1])
                self.usage = True

    def relayed_first(self, streamed: bool) -> None:
        """The stream reading this response for another (plugin.watch) counted its first token: now."""
        if self.last_at or self._done:
            return
        observer = self._observer
        now = observer.clock()
        self.status = 200
        self.streamed = streamed
        if streamed:
            self.first_at = now
        self.last_at = now
        if observer.on_first_token is not None:
            observer.on_first_token(self.request_id)

    def request_ended(self) -> None:
        """The request's own stream ended while another stream reads its response (plugin.watch): its prefill is
        over whatever that stream says later (the first-token hook, idempotent: the slo strategy's queue)."""
        if not self._done and self._observer.on_first_token is not None:
            self._observer.on_first_token(self.request_id)

    def relayed_end(self, status: int, streamed: bool, usage: bool, prompt_tokens: int, completion_tokens: int,
                    span_s: float) -> None:
        """The stream reading this response for another (plugin.watch) saw its end: what it counted (`span_s`:
        its first to last token, timed there), then closed as if read here."""
        if self._done:
            return
        self.status = status
        self.streamed = streamed
        if usage:
            self.usage = True
            self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        if streamed and self.first_at:
            self.last_at = self.first_at + span_s
        self.close()

    def close(self) -> None:
        """The HTTP stream ended: record what was seen and tell the trackers (once)."""
        if self._done:
            return
        self._done = True
        observer = self._observer
        if observer.on_first_token is not None:
            observer.on_first_token(self.request_id)  # idempotent: a request cut before its first token
        if not self.streamed:
            if self._tail and _USAGE in self._tail:
                self._read_usage(self._tail)
        elif not self.usage and self.status == 200 and self.events:
            self.completion_tokens = self.events
        observer.finish(self)


class _Unwatched(Watch):
    """A routed request whose response is not watched (not sampled): Envoy sends none of it, and
    should a chunk come all the same only its arrival counts (the first-token hook, at the first one);
    its end tells the trackers it is done, without usage. Its prompt size and clock reading, read only
    with a watched response's, are not taken (0)."""

    __slots__ = ()

    def on_chunk(self, body: bytes) -> None:
        if body and not self.last_at and (self._marker is None or self._marker in body):
            observer = self._observer
            now = observer.clock()
            if observer.on_first_token is not None:
                observer.on_first_token(self.request_id)
            self.last_at = now

    # close() is Watch's: with no body kept and no event counted, it reads nothing and tells the trackers.


class Observer:
    """Process-wide: metrics and trackers; starts a Watch per routed request."""

    def __init__(self, registry: CollectorRegistry | None, trackers: TrackerRegistry | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 slo_targets: Callable[[str, float | None, float | None], tuple[float, float]] | None = None,
                 on_first_token: Callable[[str], None] | None = None) -> None:
        self.metrics = ObserveMetrics(registry)
        # told a request's id at its first response chunk (or its end): the slo strategy's prefill queue
        self.on_first_token = on_first_token
        self.slo_targets = slo_targets
        self.trackers = trackers if trackers is not None else TrackerRegistry()
        self.clock = clock
        self._children: dict = {}
        self._observed: dict = {}  # source -> its kvgate_requests_observed child (made at its first use)

    def start(self, request_id: str, model: str, pod: str, *, tokens=None, decision=None, running: int = 0,
              slo_ttft_s: float | None = None, slo_tpot_s: float | None = None, watched: bool = True,
              marker: bytes | None = None) -> Watch:
        """A routed request: `tokens` its prompt's ids if tokenized, `decision` the Router's (how many
        of the prompt's blocks the pod held)."""
        if watched:
            prompt = len(tokens) if tokens else 0
            uncached = prompt
            if prompt and decision is not None and decision.total_blocks:
                uncached = prompt - prompt * decision.matched_blocks // decision.total_blocks
            w = Watch(self, request_id, model, pod, self.clock(), prompt, uncached, running, slo_ttft_s, slo_tpot_s,
                      True, marker)
        else:
            w = _Unwatched(self, request_id, model, pod, 0.0, 0, 0, running, slo_ttft_s, slo_tpot_s, False, marker)
        w.term = self.trackers.add_request_count(w, request_id, model)
        return w

    def _series(self, model: str, pod: str):
        key = (model, pod)
        s = self._children.get(key)
        if s is None:
            if len(self._children) > 4096:
                self._children.clear()
            m = self.metrics
            s = self._children[key] = (m.ttft.labels(model, pod), m.tpot.labels(model, pod),
                                       m.prompt_tokens.labels(model, pod), m.completion_tokens.labels(model, pod))
        return s

    def finish(self, o: Watch) -> None:
        if not o.watched:  # not sampled: done, without usage
            source = "unsampled"
        elif o.status != 200 or not (o.usage or o.completion_tokens > 0):
            source = "none"  # failed or cut: done, without usage
        else:
            source = "usage" if o.usage else "counted"
        c = self._observed.get(source)
        if c is None:
            c = self._observed[source] = self.metrics.observed.labels(source)
        c.inc()
        if source == "unsampled" or source == "none":
            self.trackers.done_request_count(o, o.request_id, o.model, o.term)
            return
        ttft_h, tpot_h, prompt_c, completion_c = self._series(o.model, o.pod)
        ttft, tpot = o.ttft, o.tpot  # None without a timed first token (tpot: nor without 2 tokens)
        if ttft is not None:
            ttft_h.observe(ttft)
        if tpot is not None:
            tpot_h.observe(tpot)
        prompt_c.inc(o.prompt_tokens)
        if ttft is not None and self.slo_targets is not None:
            t_ttft, t_tpot = self.slo_targets(o.model, o.slo_ttft_s, o.slo_tpot_s)
            met = ttft <= t_ttft and (tpot is None or tpot <= t_tpot)
            self.metrics.slo.labels(o.model, "true" if met else "false").inc()
        completion_c.inc(o.completion_tokens)
        self.trackers.done_request_trace(o, o.request_id, o.model, o.prompt_tokens, o.completion_tokens, o.term)


# --- the ext_proc side: response headers read, the body's mode turned on -------------------------
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402

_MODE = processing_mode_pb2.ProcessingMode


def _mode(response_header_mode: int, response_body_mode: int):
    """The shipped processing mode with the response's two modes replaced (an override replaces the
    whole mode, so the rest must be restated: the request body BUFFERED, trailers skipped)."""
    return _MODE(request_header_mode=_MODE.SEND, response_header_mode=response_header_mode,
                 request_body_mode=_MODE.BUFFERED, response_body_mode=response_body_mode,
                 request_trailer_mode=_MODE.SKIP, response_trailer_mode=_MODE.SKIP)


def _override(body_mode: int) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(), mode_override=_mode(_MODE.SEND, body_mode))


# The answer to a routed request's headers when its response will not be watched: Envoy sends neither
# the response headers nor the body (two ext_proc messages fewer); the stream still ends with the HTTP
# stream (the request's count is released then).
UNWATCHED = _mode(_MODE.SKIP, _MODE.NONE)


# A token stream chunk by chunk (TTFT, TPOT); any other body in one message: Envoy's STREAMED mode costs a
# message (and a round trip through kvgate) per chunk and one more for the end of the stream, where
# BUFFERED_PARTIAL sends a whole JSON answer once (Envoy documents BUFFERED as failing a body past its
# buffer limit; BUFFERED_PARTIAL sends what fits instead).
_CONTINUE_STREAMED = _override(_MODE.STREAMED)
_CONTINUE_WHOLE = _override(_MODE.BUFFERED_PARTIAL)


def body_on(streamed: bool, answer: pb.ProcessingResponse | None = None) -> pb.ProcessingResponse:
    """The answer to response headers that turns the body on: STREAMED for an event stream, BUFFERED_PARTIAL
    (one message) for anything else; `answer`'s header mutation kept when it has one (a new message: the
    prebuilt answers are never mutated)."""
    turn_on = _CONTINUE_STREAMED if streamed else _CONTINUE_WHOLE
    if answer is None or not answer.response_headers.HasField("response"):
        return turn_on
    out = pb.ProcessingResponse()
    out.CopyFrom(answer)
    out.mode_override.CopyFrom(turn_on.mode_override)
    return out


def status_and_type(msg: pb.ProcessingRequest) -> tuple[int, str]:
    """The response headers' status and content type (lower case; "" when absent)."""
    status, ctype = 0, ""
    for h in msg.response_headers.headers.headers:
        key = h.key.lower()
        if key == ":status":
            raw = h.raw_value
            status = int((raw or h.value.encode()) or 0)
        elif key == "content-type":
            raw = h.raw_value
            ctype = (raw.decode("latin-1") if raw else h.value).lower()
    return status, ctype


def response_headers(watch: Watch, msg: pb.ProcessingRequest, answer: pb.ProcessingResponse,
                     body_sent: bool) -> pb.ProcessingResponse:
    """Read the response's status and content type into `watch`; when its body is worth watching and
    Envoy would not send it (`body_sent` False), the answer turns the body on: STREAMED for an event
    stream, BUFFERED_PARTIAL (one message) for anything else."""
    status, ctype = status_and_type(msg)
    if not watch.on_headers(status, ctype) or body_sent:
        return answer
    return body_on(watch.streamed, answer)


def served_fallback(served: Callable[["Decision", str], "Pod | None"], metric: LoopCounter, decision: "Decision",
                    endpoint: str) -> "Pod | None":
    """The data plane named `endpoint` as the one that served `decision`'s request: counted in `metric`
    (kvgate_served_requests_total: picked, fallback, unknown) and, for a fallback, its pod, which `served`
    (Router.served) moved the request's running count to; None for the picked pod or an unknown endpoint."""
    if endpoint == decision.pod.endpoint:
        metric.labels("picked").inc()
        return None
    pod = served(decision, endpoint)
    metric.labels("unknown" if pod is None else "fallback").inc()
    return pod


def milliseconds(text: str) -> float | None:
    """A latency target header's value: a positive, finite number of milliseconds, else None."""
    try:
        v = float(text.strip())
    except ValueError:
        return None
    return v if 0 < v < float("inf") else None
