"""Watching routed responses from a stream Envoy never waits on (envoy/envoy.yaml's watched routes).

On a watched route Envoy sends the request to kvgate in one message (the body, as on the one-message routes) and
turns on a second ext_proc filter, `kvgate.watch`, in observability mode: Envoy sends it the response headers
and every body chunk and goes on without waiting for an answer (measured on Envoy 1.40: the client's chunks came
every ~22 ms while that processor slept 200 ms per message). The watch stream is a gRPC stream of its own and
lands on any kvgate replica. That replica reads the response with a plugin.observe Watch of its own and tells
the replica that routed the request (named in the routing answer's `kvgate` metadata, which Envoy forwards) two
words: `first` at the first token, `end` with what it counted. The routing replica made the request's Watch at
the pick, as for any watched response; the words fill it in as if it had read the response itself (its first
token is timed when the word arrives: a call here, a Redis round trip from another replica). Its own stream
ends with the HTTP stream, usually before the watch stream's backlog is read: the Watch then waits up to
`wait_s` for its `end`, and closes with what it has when none comes.

A word to this replica is a call; to another, a PUBLISH on that replica's channel (KVGATE_REDIS_URL). A word
for a replica out of reach (no Redis), for a request its replica no longer waits for, or a stream that names no
request or replica is counted (kvgate_watch_words) and dropped: the routing replica's Watch then closes after
its wait like a response cut short (the trackers told it is done, without usage), and nothing else is lost.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from plugin import observe
from plugin.metrics import LoopCounter
from plugin.request import KINDS
from routing.background import BackgroundLoop, follow_channel
from routing.pods import Pod
from routing.router import Decision

log = logging.getLogger("kvgate.watch")

# envoy/envoy.yaml's watched routes are named with this prefix; the routing filter reads the route's name
# (request attribute xds.route_name) to know the response will be watched from a stream of its own.
WATCHED_ROUTE_PREFIX = "kvgate-watched"
ROUTE_ATTRIBUTE = "xds.route_name"
# Forwarded to the watch stream: the request's id and path (response_attributes), the routing replica (the
# routing answer's `kvgate` metadata, key GATEWAY_KEY).
GATEWAY_KEY = "gw"
CHANNEL_PREFIX = "kvgate:watch:"  # + a replica's id: the Redis channel its words come in on

FIRST, END = "f", "e"
# The words, as JSON arrays:
#   [FIRST, request id, streamed, served endpoint]
#   [END, request id, status, streamed, usage, prompt tokens, completion tokens, first to last token (s)]
_FIRST_LEN, _END_LEN = 4, 8


class WatchMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.words = LoopCounter(
            "kvgate_watch_words", "Words about a watched response between the replica reading its watch stream and "
            "the one that routed it (envoy/envoy.yaml's watched routes), by word and outcome: sent (to another "
            "replica, through Redis), local (to this one), applied, unknown (no request waiting for it here), "
            "unreachable (another replica, no Redis), failed (Redis refused it), bad (not a word)",
            ["word", "outcome"], registry=registry)
        self.waits = LoopCounter(
            "kvgate_watch_waits", "Routed requests watched from another stream, by how their Watch closed: ended "
            "(the end word came), expired (none within KVGATE_WATCH_WAIT_S of the request's end: closed as cut), "
            "duplicate (another request of its id waited already: closed at its own end, as cut)",
            ["outcome"], registry=registry)
        self.streams = LoopCounter(
            "kvgate_watch_streams", "Watch streams (kvgate.watch, observability mode), by outcome: read, unnamed "
            "(no request id or routing replica: not read), unread (not opened by the response headers: a filter "
            "not configured as envoy/envoy.yaml's)", ["outcome"], registry=registry)


class _Waiting:
    """A routed request's Watch, waiting for the words of the stream that reads its response."""

    __slots__ = ("watch", "decision", "timer")

    def __init__(self, watch: observe.Watch, decision: Decision) -> None:
        self.watch = watch
        self.decision = decision
        self.timer: asyncio.TimerHandle | None = None


class _Reading:
    """The watch stream's side: the observer of its own Watch, which sends the end word when the Watch closes."""

    __slots__ = ("relay", "gateway", "on_first_token", "clock")

    def __init__(self, relay: "WatchRelay", gateway: str) -> None:
        self.relay = relay
        self.gateway = gateway
        # the first word is sent by the stream's reader, once a token is counted
        self.on_first_token: Callable[[str], None] | None = None
        self.clock: Callable[[], float] = relay.clock

    def finish(self, w: observe.Watch) -> None:
        span = w.last_at - w.first_at if w.first_at else 0.0
        self.relay.send(self.gateway, [END, w.request_id, w.status, w.streamed, w.usage, w.prompt_tokens,
                                       w.completion_tokens, span])


class WatchRelay:
    """Both sides of watching from another stream: the routed requests waiting for words (`expect`,
    `routed_end`, `apply`) and the reading of watch streams (`read`)."""

    def __init__(self, gateway_id: str, *, served: Callable[[Decision, str], Pod | None], served_metric: LoopCounter,
                 registry: CollectorRegistry | None = None, wait_s: float = 5.0,
                 clock: Callable[[], float] | None = None) -> None:
        self.gateway_id = gateway_id
        self.wait_s = wait_s
        self.metrics = WatchMetrics(registry)
        self._served = served
        # kvgate_served_requests_total (plugin.metrics), counted here as the request's own stream counts it
        self._served_metric = served_metric
        self.clock = clock if clock is not None else time.perf_counter
        self._waiting: dict[str, _Waiting] = {}
        self.publish: Callable[[str, bytes], Any] | None = None  # (replica, data) -> awaitable; RedisWords'
        self._sends: set[asyncio.Task] = set()
        # request id -> the publish of its first word while under way: its end word leaves after it (each word is
        # its own task over the pool's connections, and an end word first ends the wait the first word fills in)
        self._firsts: dict[str, asyncio.Task] = {}

    # --- the routing replica ---------------------------------------------------------------
    def expect(self, request_id: str, watch: observe.Watch, decision: Decision) -> bool:
        """A request routed on a watched route: its Watch takes the words of the stream that reads its response.
        False when a request of that id waits already (a client's own x-request-id, sent twice at once): the
        words could not tell the two apart, so this one is not watched from a stream of its own."""
        if request_id in self._waiting:
            self.metrics.waits.labels("duplicate").inc()
            return False
        self._waiting[request_id] = _Waiting(watch, decision)
        return True

    def routed_end(self, request_id: str) -> None:
        """The request's own stream ended: its Watch waits up to `wait_s` for the end word."""
        waiting = self._waiting.get(request_id)
        if waiting is None or waiting.timer is not None:
            return
        waiting.watch.request_ended()
        waiting.timer = asyncio.get_running_loop().call_later(self.wait_s, self._expire, request_id)

    def _expire(self, request_id: str) -> None:
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            self.metrics.waits.labels("expired").inc()
            waiting.watch.close()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def apply(self, word: list) -> None:
        """A word from the stream that read a response routed here."""
        kind = word[0]
        waiting = self._waiting.get(word[1])
        if waiting is None:
            self.metrics.words.labels(kind, "unknown").inc()
            return
        self.metrics.words.labels(kind, "applied").inc()
        watch = waiting.watch
        if kind == FIRST:
            watch.relayed_first(word[2])
            if word[3]:  # the endpoint that served it (a fallback after a retry: the count moves)
                pod = observe.served_fallback(self._served, self._served_metric, waiting.decision, word[3])
                if pod is not None:
                    watch.served_by(pod.name)
            return
        del self._waiting[word[1]]
        if waiting.timer is not None:
            waiting.timer.cancel()
        self.metrics.waits.labels("ended").inc()
        watch.relayed_end(word[2], word[3], word[4], word[5], word[6], word[7])

    def apply_data(self, data: bytes) -> None:
        """A word as it comes from Redis: checked, then applied (a bad one counted and dropped)."""
        word = _parse(data)
        if word is None:
            self.metrics.words.labels("?", "bad").inc()
            log.debug("watch: dropped a word that is not one: %r", data[:200])
            return
        self.apply(word)

    # --- the replica reading a watch stream --------------------------------------------------
    def send(self, gateway: str, word: list) -> None:
        if gateway == self.gateway_id:
            self.metrics.words.labels(word[0], "local").inc()
            self.apply(word)
            return
        if self.publish is None:
            self.metrics.words.labels(word[0], "unreachable").inc()
            return
        request_id = word[1]
        before = self._firsts.pop(request_id, None) if word[0] == END else None
        task = asyncio.get_running_loop().create_task(self._publish(gateway, word, before))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        if word[0] == FIRST:
            self._firsts[request_id] = task
            task.add_done_callback(lambda t: self._firsts.pop(request_id, None) if self._firsts.get(request_id) is t
                                   else None)

    async def _publish(self, gateway: str, word: list, before: asyncio.Task | None = None) -> None:
        assert self.publish is not None  # as send found it
        if before is not None and not before.done():
            await asyncio.wait((before,))  # its request's first word out first (failed or not)
        try:
            await self.publish(gateway, json.dumps(word, separators=(",", ":")).encode())
            self.metrics.words.labels(word[0], "sent").inc()
        except Exception as e:  # Redis down: the routing replica's Watch closes after its wait
            self.metrics.words.labels(word[0], "failed").inc()
            log.warning("watch: could not tell replica %s about request %s: %s", gateway, word[1], e)

    def unread(self, which: str | None) -> None:
        """A watch stream whose first message is not the response headers (envoy/envoy.yaml's filter skips the
        request's): not read; told once in the log."""
        if not self.metrics.streams.labels("unread").value:
            log.warning("watch: a kvgate.watch stream opened with %s, not the response headers: not read (its "
                        "filter must skip the request's messages, request_header_mode SKIP, as envoy/envoy.yaml's)",
                        which)
        self.metrics.streams.labels("unread").inc()

    async def read(self, first: pb.ProcessingRequest, served: str, rest: AsyncIterator[pb.ProcessingRequest]) -> None:
        """A kvgate.watch stream (Envoy waits for no answer): its first message the response headers, with the
        request's id and path (attributes) and its routing replica (forwarded metadata); then the body chunks."""
        request_id, path = _attributes(first)
        gateway = _gateway(first)
        if not request_id or not gateway:
            self.metrics.streams.labels("unnamed").inc()
            return  # the stream closes: Envoy sends nothing more of it
        self.metrics.streams.labels("read").inc()
        reading = _Reading(self, gateway)
        w = observe.Watch(reading, request_id, "", "", marker=observe.TOKEN_EVENTS.get(KINDS.get(path, "")))
        status, ctype = observe.status_and_type(first)
        if w.on_headers(status, ctype) and not first.response_headers.end_of_stream:
            sent_first = False
            async for msg in rest:
                if not msg.HasField("response_body"):
                    continue
                body = msg.response_body
                w.on_chunk(body.body)
                if not sent_first and w.last_at:  # a token counted (a JSON answer: its first chunk)
                    sent_first = True
                    self.send(gateway, [FIRST, request_id, w.streamed, served])
                if body.end_of_stream:
                    break
        w.close()

    async def aclose(self) -> None:
        """At shutdown: the words being sent, then every waiting Watch closed with what it has."""
        if self._sends:
            await asyncio.gather(*list(self._sends), return_exceptions=True)
        for request_id in list(self._waiting):
            waiting = self._waiting.pop(request_id)
            if waiting.timer is not None:
                waiting.timer.cancel()
            waiting.watch.close()


class RedisWords(BackgroundLoop):
    """The words between replicas: PUBLISH on a replica's channel; this replica's channel read in the
    background (resubscribed after a lost connection)."""

    def __init__(self, client: Any, relay: WatchRelay, *, retry_s: float = 1.0) -> None:
        self._client = client
        self._relay = relay
        self._retry_s = retry_s
        self._failing = False  # told once in the log until it reads again
        # set once the first subscription to this replica's channel succeeded or failed (App.start waits a moment
        # for it: words published before it reads are lost)
        self.first_try = asyncio.Event()
        relay.publish = self.publish

    async def publish(self, gateway: str, data: bytes) -> None:
        await self._client.publish(CHANNEL_PREFIX + gateway, data)

    async def _run(self) -> None:
        await follow_channel(self._client, self._channel, self._relay.apply_data, retry_s=self._retry_s,
                             subscribed=self._subscribed, ended=self._ended)

    @property
    def _channel(self) -> str:
        return CHANNEL_PREFIX + self._relay.gateway_id

    def _subscribed(self) -> None:
        self.first_try.set()
        if self._failing:
            self._failing = False
            log.info("watch: reading Redis channel %s again", self._channel)

    def _ended(self, e: BaseException | None) -> None:
        if e is None:  # the stream just ended: subscribed again, nothing to tell
            return
        self.first_try.set()
        (log.debug if self._failing else log.warning)(
            "watch: reading Redis channel %s failed (%s); again every %.1f s, words from other replicas lost "
            "meanwhile", self._channel, e, self._retry_s)
        self._failing = True

    async def aclose(self) -> None:
        await super().aclose()
        await self._client.aclose()


def _attributes(msg: pb.ProcessingRequest) -> tuple[str, str]:
    """The request's id and path, from the watch stream's response attributes (whatever filter name they are
    filed under)."""
    request_id = path = ""
    for struct in msg.attributes.values():
        fields = struct.fields
        if "request.id" in fields:
            request_id = fields["request.id"].string_value
        if "request.path" in fields:
            path = fields["request.path"].string_value.split("?", 1)[0]
    return request_id, path


def _gateway(msg: pb.ProcessingRequest) -> str:
    """The routing replica, from the routing answer's `kvgate` metadata as Envoy forwards it."""
    if not msg.HasField("metadata_context"):
        return ""
    ns = msg.metadata_context.filter_metadata.get("kvgate")
    if ns is None or GATEWAY_KEY not in ns.fields:
        return ""
    return ns.fields[GATEWAY_KEY].string_value


def _parse(data: bytes) -> list | None:
    """A word from Redis, or None when it is not one (any other shape or type)."""
    try:
        word = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(word, list) or len(word) < 2 or not isinstance(word[1], str):
        return None
    if word[0] == FIRST and len(word) == _FIRST_LEN and isinstance(word[2], bool) and isinstance(word[3], str):
        return word
    if word[0] == END and len(word) == _END_LEN and isinstance(word[2], int) and isinstance(word[3], bool) \
            and isinstance(word[4], bool) and all(isinstance(v, int) and v >= 0 for v in word[5:7]) \
            and isinstance(word[7], (int, float)) and word[7] >= 0:
        return word
    return None
