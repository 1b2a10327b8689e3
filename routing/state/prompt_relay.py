"""Every gateway replica's running prompts (routing.state.prompts), through Redis.

A replica counts what the pods of its own running requests hold or are prefilling; the others' reach it with
their engines' events, a queue and a prefill after their picks. Envoy deals a tenant's burst over the replicas,
so each saw half of it: bench routing behind 2 replicas, the replicas' running prompts shared without lag, 3
seeds: W5 (an engine joining) TTFT mean 54.5 -> 44.4 ms, p90 138 -> 100; W4 hit rate 63.58 -> 64.54%; W9 49.12 ->
49.71% (docs/BENCHMARKS.md, routing).

Each replica publishes its changes on one channel and applies the others' to its RunningPrompts, in the
background: a pick waits for no Redis round trip, and the changes made while a publish is under way leave
together in the next message; a request's end, which nothing waits for (its blocks stay cached after it), goes
with the next message or END_DELAY_S later. Each message costs every replica a wake-up of its event loop: on this
machine a request's add and end cost ~0.7 ms of CPU over two replicas at 200 requests a second, ~0.1 ms back to
back (docs/BENCHMARKS.md). An add leaves at once, not batched over a few milliseconds: the replicas a burst is
dealt over pick its requests within milliseconds of each other (tried, 8e85aa6 then reverted: adds sent 5 ms
later spared bench path's one-at-a-time requests 0.2 ms of wake-ups on the two cores they share with Envoy and
the engines, and left such a burst 5 ms to split: in the bake-off a new tenant's conversations picked 2-3 ms
apart by the two replicas went to two engines). A prompt its pod held but for its last two blocks at the pick
is not sent at all (routing.state.prompts: the others have what it shares from the index), counted as kept. A
peer's claim ends with its "end", or `ttl_s` after it came (a message lost, a replica gone): by then its prompt's
blocks are in the index from its engine's events, if anywhere.

Wire: the gateway id, a newline, then msgpack [change, ...], each change ["add", ticket, target, pod, rank,
[key, ...]], ["move", ticket, target, pod, rank] or ["end", ticket] (a replica reads its own messages too, and
skips them unread). A message that is not one is counted and skipped.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable

import msgpack
from prometheus_client import CollectorRegistry, Counter

from routing.background import BackgroundLoop, follow_channel
from routing.state.prompts import RunningPrompts

log = logging.getLogger(__name__)

CHANNEL = "kvgate:{prompts}"
PEER_TTL_S = 30.0
END_DELAY_S = 0.1  # a request's end waits at most this long for a message to go with
MAX_PENDING = 4096  # changes waiting for Redis (a stuck publish): the oldest dropped past this, counted
PUBLISH_TIMEOUT_S = 1.0
MAX_KEYS = 8192  # RunningPrompts' own bound on a prompt's keys


class BadChanges(ValueError):
    """A message on the channel that is not a gateway's changes."""


def encode(gateway: str, changes: list[list]) -> bytes:
    return gateway.encode() + b"\n" + msgpack.packb(changes)


def sender(data: bytes) -> bytes:
    """The gateway id a message names, unread otherwise."""
    return data.partition(b"\n")[0]


def decode(data: bytes) -> tuple[str, list[list]]:
    """(gateway, changes), each change checked; BadChanges otherwise."""
    head, sep, body = data.partition(b"\n")
    try:
        gateway = head.decode()
        changes = msgpack.unpackb(body)
    except Exception as e:  # noqa: BLE001 - any undecodable payload is a bad message
        raise BadChanges(f"not gateway and changes: {type(e).__name__}: {e}") from None
    if not sep or not gateway or not isinstance(changes, list):
        raise BadChanges("not gateway and changes")
    for c in changes:
        if not isinstance(c, list) or not c:
            raise BadChanges(f"not a change: {c!r:.80}")
        kind = c[0]
        if kind == "end":
            ok = len(c) == 2 and _int(c[1])
        elif kind in ("add", "move"):
            ok = (len(c) == (6 if kind == "add" else 5) and _int(c[1]) and isinstance(c[2], str)
                  and isinstance(c[3], str) and _int(c[4]))
            if ok and kind == "add":
                keys = c[5]
                ok = isinstance(keys, list) and 0 < len(keys) <= MAX_KEYS and _keys(keys)
        else:
            ok = False
        if not ok:
            raise BadChanges(f"not a change: {c!r:.80}")
    return gateway, changes


def _int(x: object) -> bool:
    return type(x) is int and x >= 0


def _keys(keys: list) -> bool:
    """Block keys: integers >= 0 (a float or a bool among them would only never match: not worth a loop)."""
    try:
        return min(keys) >= 0 and type(keys[0]) is int
    except TypeError:  # a string or a list among them
        return False


def apply_change(prompts: RunningPrompts, gateway: str, change: list) -> None:
    """Another replica's change (checked by `decode`) to `prompts`, its ticket made (gateway, ticket)."""
    kind, ticket = change[0], (gateway, change[1])
    if kind == "add":
        prompts.peer_added(ticket, change[2], change[3], change[4], change[5])
    elif kind == "move":
        prompts.peer_moved(ticket, change[2], change[3], change[4])
    else:
        prompts.peer_removed(ticket)


class PromptRelay(BackgroundLoop):
    """This replica's running-prompt changes to the others and theirs to `prompts`, through `client` (an
    asyncio Redis client: publish and pubsub). Redis unreachable: the changes made meanwhile are dropped
    (counted), the reading resubscribes every `retry_s`, and each replica counts its own requests, as without."""

    def __init__(self, client: Any, prompts: RunningPrompts, gateway_id: str, *, ttl_s: float = PEER_TTL_S,
                 retry_s: float = 1.0, end_delay_s: float = END_DELAY_S, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._prompts = prompts
        if not gateway_id or "\n" in gateway_id:
            raise ValueError(f"a gateway id is one line of text, not {gateway_id!r}")
        self.gateway_id = gateway_id
        self._me = gateway_id.encode()
        self._ttl = ttl_s
        self._retry_s = retry_s
        self._clock = clock
        self._pending: list[list] = []  # adds and moves, sent at once
        self._ends: list[list] = []  # ends, sent with the next message or END_DELAY_S after the first
        self._ends_due = 0.0
        self._end_delay = end_delay_s
        self._wake = asyncio.Event()
        self._expires: dict[tuple[str, int], float] = {}  # a peer's ticket -> when its claim ends
        self._order: deque[tuple[float, tuple[str, int]]] = deque()  # (expiry, ticket), in arrival order
        self._failing = {"publish": False, "read": False}  # told once in the log until it works again
        self._bad_told = False  # the first bad message is told in the log, the others counted
        self.changes = Counter(
            "kvgate_prompt_relay_changes_total", "Running-prompt changes between gateway replicas (a request's "
            "prompt counted on its pod until it ends; routing.state.prompt_relay), by outcome: sent, kept (not "
            "sent: its pod held all but its last two blocks already), applied (a peer's), expired (a peer's claim "
            "that no end came for within its TTL), dropped (not sent: Redis refused them), bad (a message that is "
            "not one)", ["outcome"],
            registry=registry if registry is not None else CollectorRegistry())
        # set once the first subscription succeeded or failed (a caller may wait a moment for it)
        self.first_try = asyncio.Event()
        prompts.listener = self._changed

    @property
    def peer_claims(self) -> int:
        """The other replicas' running requests counted here."""
        return len(self._expires)

    def _changed(self, change: list) -> None:
        if change[0] == "keep":  # counted here alone (routing.state.prompts: UNTOLD_BLOCKS)
            self.changes.labels("kept").inc()
            return
        waiting = self._ends if change[0] == "end" else self._pending
        if len(waiting) >= MAX_PENDING:  # Redis has not taken the last ones yet: the oldest go
            del waiting[:len(waiting) // 2]
            self.changes.labels("dropped").inc(MAX_PENDING - len(waiting))
        if change[0] == "end":  # not urgent: the blocks stay cached a while after their request ends
            if not self._ends:
                self._ends_due = self._clock() + self._end_delay
            self._ends.append(change)
            return
        self._pending.append(change)
        self._wake.set()

    def apply(self, data: bytes) -> None:
        """One message from the channel: a peer's changes applied to the running prompts (this replica's own
        skipped), or counted as bad."""
        if sender(data) == self._me:
            return  # its own, counted already
        try:
            gateway, changes = decode(data)
        except BadChanges as e:
            self.changes.labels("bad").inc()
            (log.debug if self._bad_told else log.warning)(
                "prompt relay: a message on %s skipped (%s); counted in kvgate_prompt_relay_changes_total"
                "{outcome=\"bad\"}", CHANNEL, e)
            self._bad_told = True
            return
        prompts, now = self._prompts, self._clock()
        for c in changes:
            apply_change(prompts, gateway, c)
            ticket = (gateway, c[1])
            if c[0] == "add":
                at = self._expires[ticket] = now + self._ttl
                self._order.append((at, ticket))
            elif c[0] == "end":
                self._expires.pop(ticket, None)
        self.changes.labels("applied").inc(len(changes))
        self.expire()

    def expire(self) -> None:
        """Peers' claims past their TTL ended."""
        now, order, expires = self._clock(), self._order, self._expires
        while order and order[0][0] <= now:
            at, ticket = order.popleft()
            if expires.get(ticket) == at:  # not ended, nor added again since
                del expires[ticket]
                self._prompts.peer_removed(ticket)
                self.changes.labels("expired").inc()

    async def _run(self) -> None:
        await asyncio.gather(self._send_loop(), self._read_loop())

    async def _send_loop(self) -> None:
        while True:
            # an end does not wake this loop: it looks every END_DELAY_S (an end goes at most twice that late)
            wait = self._end_delay if not self._ends else max(0.0, self._ends_due - self._clock())
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            self.expire()
            batch, self._pending = self._pending, []
            if batch or (self._ends and self._clock() >= self._ends_due):
                batch += self._ends  # the ends go with any message, else once END_DELAY_S has passed
                self._ends = []
            if not batch:
                continue
            try:
                async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                    await self._client.publish(CHANNEL, encode(self.gateway_id, batch))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis gone: this replica's changes are not shared meanwhile
                self.changes.labels("dropped").inc(len(batch))
                self._failed("publish", e)
                continue
            self.changes.labels("sent").inc(len(batch))
            self._recovered("publish")

    async def _read_loop(self) -> None:
        await follow_channel(self._client, CHANNEL, self.apply, retry_s=self._retry_s,
                             subscribed=self._subscribed, ended=self._unsubscribed)

    def _subscribed(self) -> None:
        self.first_try.set()
        self._recovered("read")

    def _unsubscribed(self, e: BaseException | None) -> None:
        if e is not None:
            self.first_try.set()
            self._failed("read", e)

    def _failed(self, what: str, e: BaseException) -> None:
        (log.debug if self._failing[what] else log.warning)(
            "prompt relay: %s on Redis channel %s failed (%s: %s); each replica counts its own running prompts "
            "meanwhile", what, CHANNEL, type(e).__name__, e)
        self._failing[what] = True

    def _recovered(self, what: str) -> None:
        if self._failing[what]:
            self._failing[what] = False
            log.info("prompt relay: %s on Redis channel %s works again", what, CHANNEL)

    async def aclose(self) -> None:
        self._prompts.listener = None
        await super().aclose()
        await self._client.aclose()


class LocalRelay:
    """The same sharing between Routers in one process (bench routing's replicas), without Redis or lag."""

    def __init__(self) -> None:
        self._members: list[tuple[str, RunningPrompts]] = []

    def join(self, gateway_id: str, prompts: RunningPrompts) -> None:
        self._members.append((gateway_id, prompts))
        prompts.listener = lambda change: self._tell(gateway_id, change)

    def _tell(self, gateway: str, change: list) -> None:
        if change[0] == "keep":
            return
        for other, prompts in self._members:
            if other != gateway:
                apply_change(prompts, gateway, change)
