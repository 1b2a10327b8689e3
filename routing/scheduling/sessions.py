"""Session affinity: a session's requests go back to the pod that served it, while that pod is up and
not saturated.

The session comes from the client: AIBrix's `x-session-id` (the pod's `ip:port`, base64, as AIBrix
returns it), llm-d's `x-session-token` (the pod's `namespace/name`, base64) or any other value of
either, or of AIBrix's `x-aibrix-session-key` (an opaque key). A token that names a pod picks that pod;
an opaque key picks the pod kvgate last sent the session to (`SessionStore`: bounded, with a TTL, shared
between gateway replicas through Redis when one is configured). A pod that is down, not ready, set aside
by a filter or saturated (its engine's own numbers) gets no preference: the rest of the strategy decides,
and the session follows its pick (counted by outcome)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

from routing.background import cancel_swallowed
from routing.pods import Pod
from routing.scheduling.scoring import PickContext, Scorer
from routing.state.engine_metrics import EngineMetrics, Saturation

log = logging.getLogger(__name__)

MAX_SESSION_LEN = 256  # longer header values are not sessions (AIBrix's limit on its session key)

# What the scorer saw, for kvgate_routing_session_total{outcome}:
KEPT = "kept"  # the session's pod was up and not saturated: it was preferred
NEW = "new"  # a session kvgate knows no pod for
UNAVAILABLE = "unavailable"  # its pod is down, not ready, unknown or set aside by a filter: no preference
SATURATED = "saturated"  # its pod is saturated: no preference
OVERRULED = "overruled"  # preferred, but the strategy's other scorers picked another pod
OUTCOMES = (KEPT, NEW, UNAVAILABLE, SATURATED, OVERRULED)


def token_target(token: str, pods: Sequence[Pod]) -> list[Pod]:
    """The candidates a session token names: base64 of `ip:port` (AIBrix) or of `namespace/name` or
    `name` (llm-d); [] when it names none of them (then it is an opaque key)."""
    try:
        text = base64.b64decode(token, validate=True).decode()
    except (binascii.Error, ValueError):
        return []
    name = text.rpartition("/")[2]
    return [p for p in pods if p.endpoint == text or p.pod_name == name]


class SessionStore:
    """Session key -> the pod name its requests last went to: at most `capacity` sessions (least recently
    used dropped first), each forgotten `ttl_s` after its last request. With a Redis client, shared
    between gateway replicas: `load` (before a pick) reads a session this gateway has not seen within
    `recheck_s`, `put` writes in the background; a Redis failure leaves the local map answering
    (checked again after a back-off)."""

    def __init__(self, ttl_s: float = 1800.0, capacity: int = 100_000, *, redis: Any = None,
                 key_prefix: str = "kvgate:{session}:", op_timeout_s: float = 0.05, recheck_s: float = 1.0,
                 owns_redis: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or capacity < 1:
            raise ValueError("ttl_s and capacity must be positive")
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._redis = redis
        self._owns_redis = owns_redis  # close() closes the client too
        self._prefix = key_prefix
        self._timeout = op_timeout_s
        self._recheck = recheck_s
        self._clock = clock
        self._map: OrderedDict[str, tuple[str, float, float]] = OrderedDict()  # key -> (pod, expires, read at)
        self._pending: dict[str, str] = {}  # key -> pod, to write to Redis
        self._wake = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._down_until = 0.0
        self.on_outcome: Callable[[str], None] = lambda outcome: None
        self.redis_errors = 0

    @property
    def shared(self) -> bool:
        return self._redis is not None

    def get(self, key: str) -> str | None:
        entry = self._map.get(key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._map[key]
            return None
        return entry[0]

    def put(self, key: str, pod: str) -> None:
        now = self._clock()
        old = self._map.get(key)
        self._map[key] = (pod, now + self.ttl_s, now)
        self._map.move_to_end(key)
        if len(self._map) > self.capacity:
            self._map.popitem(last=False)
        if self._redis is not None and (old is None or old[0] != pod or now - old[2] >= self._recheck):
            self._pending[key] = pod  # a new or moved session, or one not refreshed there lately (its TTL)
            self._wake.set()

    def forget_pod(self, pod: str) -> None:
        for key in [k for k, (p, _, _) in self._map.items() if p == pod or p.partition("#")[0] == pod]:
            del self._map[key]

    def __len__(self) -> int:
        return len(self._map)

    def _redis_key(self, key: str) -> str:
        return self._prefix + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    async def load(self, key: str) -> None:
        """Before a pick: the session's pod as the other gateways left it (Redis), unless this gateway read
        or wrote it within `recheck_s`. Bounded by `op_timeout_s`; never raises."""
        if self._redis is None:
            return
        now = self._clock()
        entry = self._map.get(key)
        if (entry is not None and now - entry[2] < self._recheck) or now < self._down_until:
            return
        try:
            async with asyncio.timeout(self._timeout):
                value = await self._redis.get(self._redis_key(key))
        except Exception as e:  # noqa: BLE001 - any Redis failure: local answers, checked again later
            self._failed("get", e)
            return
        if cancel_swallowed():  # the client left during the read, and Redis's client went on
            raise asyncio.CancelledError
        if value is None:
            if entry is not None:  # another gateway's TTL ran out, or ours never reached it: ours stands
                self._map[key] = (entry[0], entry[1], now)
            return
        pod = value.decode() if isinstance(value, bytes) else str(value)
        self._map[key] = (pod, now + self.ttl_s, now)
        self._map.move_to_end(key)
        if len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def _failed(self, op: str, e: BaseException) -> None:
        self.redis_errors += 1
        self._down_until = self._clock() + 1.0
        log.warning("sessions: Redis %s failed (%s: %s); local sessions for 1 s", op, type(e).__name__, e)

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, {}
            if not batch or self._clock() < self._down_until:
                continue
            try:
                async with asyncio.timeout(self._timeout * 4):
                    pipe = self._redis.pipeline(transaction=False)
                    for key, pod in batch.items():
                        pipe.set(self._redis_key(key), pod, px=int(self.ttl_s * 1000))
                    await pipe.execute()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                self._failed("set", e)

    async def flush(self) -> None:
        """Write what is pending now (tests, shutdown)."""
        if self._redis is None or not self._pending:
            return
        batch, self._pending = self._pending, {}
        pipe = self._redis.pipeline(transaction=False)
        for key, pod in batch.items():
            pipe.set(self._redis_key(key), pod, px=int(self.ttl_s * 1000))
        await pipe.execute()

    async def start(self) -> None:
        if self._redis is not None and self._writer is None:
            self._writer = asyncio.create_task(self._write_loop(), name="kvgate-sessions")

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
        if self._redis is not None:
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - shutting down: the other gateways keep their view
                pass
            if self._owns_redis:
                await self._redis.aclose()


class SessionAffinityScorer(Scorer):
    """1 for the pod the request's session belongs to (a token naming it, or the pod kvgate last sent the
    session to), 0 for the others; nothing at all (the rest of the strategy decides) when the session is
    new, its pod is not among the candidates (down, not ready, set aside) or saturated. The session then
    follows the pick."""

    name = "session"
    needs_tokens = False

    def __init__(self, store: SessionStore, engines: EngineMetrics | None = None,
                 saturation: Saturation | None = None) -> None:
        self._store = store
        self._engines = engines
        self._saturation = saturation or Saturation()

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        key = ctx.request.session
        if not key or len(key) > MAX_SESSION_LEN:
            return {}
        ctx.state[self.name] = None  # picked(): remember the pod; the preferred one, if any
        named = token_target(key, pods)
        if not named:
            pod = self._store.get(key)
            if pod is None:
                self._store.on_outcome(NEW)
                return {}
            named = [p for p in pods if p.name == pod]
            if not named:
                self._store.on_outcome(UNAVAILABLE)
                return {}
        if self._engines is not None:
            get, saturated = self._engines.get, self._saturation.saturated
            named = [p for p in named if not saturated(get(p.pod_name, p.rank))]
            if not named:
                self._store.on_outcome(SATURATED)
                return {}
        ctx.state[self.name] = {p.name for p in named}
        return dict.fromkeys(ctx.state[self.name], 1.0)

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        if self.name not in ctx.state:
            return
        preferred = ctx.state[self.name]
        if preferred is not None:
            self._store.on_outcome(KEPT if pod.name in preferred else OVERRULED)
        key = ctx.request.session
        assert key is not None  # score() set the state
        self._store.put(key, pod.name)

    def pods_changed(self, added: Sequence[Pod], removed: Sequence[Pod]) -> None:
        for p in removed:
            self._store.forget_pod(p.name)
