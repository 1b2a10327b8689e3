"""Admission: an atomic check-and-count of running requests against a per-pod limit, so that
gateways admitting at the same time never put a pod past it, and a fair per-model wait when every
eligible pod is full.

- `LocalLimiter` (one process) and `RedisLimiter` (replicas sharing Redis) implement
  `try_acquire(pod, limit)` / `release(pod)`. In Redis one Lua script sums the pod's count over every
  live gateway's hash (`<prefix>gw:<id>`, listed in `<prefix>gateways`; a gateway's hash expires when
  it stops heartbeating) and increments this gateway's only when the sum is below the limit: the
  check and the count are one atomic step. Once a Redis operation fails (down, unreachable, too slow)
  a replica admits on its own requests alone, the limit holding per replica, without asking Redis
  until its heartbeat finds it answering again (failures counted in `errors`, logged once per
  outage); those requests' releases touch nothing in Redis, and the releases Redis missed are paid
  by the heartbeat, so no count is left behind.
- `Admission.admit(model, candidates)` takes the first candidate with room; when none has room the
  request waits, in its model's FIFO queue, for up to `max_wait_s`. Every release wakes one waiter,
  the models taking turns (round robin), so a model with a long queue cannot starve another. A
  request that waited out its time gets None: the caller answers 429 with `Retry-After`.
- Over replicas sharing Redis the turns are the fleet's, not each replica's (a replica's releases wake
  its own waiters at once, and the others' only find room by polling: per-replica turns let the
  models queued where rooms free take them all). The same script keeps the models wanting room (a
  sorted set: each model's claim lapses `want_s` after its last refusal unless its first waiter, who
  tries every `poll_s`, renews it; an admitted waiter's claim stays while its replica has more of its
  model waiting, and a replica whose last waiter of a model gives up drops the claim) and the model
  last admitted from a wait: a waiter is admitted only when its model is the next wanting one after
  that (by name, cyclically), and a new request only when no model wants room anywhere. Room whose
  turn belongs to a model waiting at another replica stays free until that replica's waiter polls
  (`poll_s`). While Redis fails, each replica's own queues take the turns again. A cancellation the
  Redis client swallowed (routing.background.cancel_swallowed) still ends the request's wait.
- A pod that leaves discovery keeps its count for `deleted_keep_s` (AIBrix keeps a snapshot of
  recently deleted pods): re-created within that window, it starts with the requests still running
  on it, and their releases count against it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Protocol, Sequence

from redis.exceptions import RedisError

from routing.background import BackgroundLoop, cancel_swallowed

log = logging.getLogger(__name__)


class Limiter(Protocol):
    # True when `release` completes without waiting (the counts live in this process): a caller may then
    # release where a cancellation could otherwise cut a round trip short.
    releases_without_wait: bool
    errors: int  # failed operations of a shared store

    @property
    def failing(self) -> bool: ...  # deciding on this replica's own counts, the shared store having failed

    @property
    def shares_turns(self) -> bool: ...  # the models' turns kept with the counts, over every replica

    async def try_acquire(self, pod: str, limit: int, model: str = "", waiter: bool = False,
                          more: bool = False) -> bool | None:
        """True: admitted on `pod`. False: `pod` is full. None (limiters that share turns): not this
        request's turn, on any pod (another model's waiter is due, or, for a new request, someone waits).
        `more`: this replica has more waiters of `model` (a waiter admitted keeps its model's claim)."""

    async def release(self, pod: str) -> None: ...

    def withdraw(self, model: str) -> None:
        """The last waiter of `model` at this replica gave up (timed out, or its client left): a limiter that
        shares turns drops the model's claim to one now (waiters of it elsewhere claim it again when they try)
        rather than hold room for it until the claim lapses."""

    def running(self) -> dict[str, int]: ...

    async def forget(self, pod: str) -> None: ...


class LocalLimiter:
    releases_without_wait = True
    errors = 0
    failing = False
    shares_turns = False  # one process: Admission's own queues take the turns

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    async def try_acquire(self, pod: str, limit: int, model: str = "", waiter: bool = False,
                          more: bool = False) -> bool | None:
        n = self._counts.get(pod, 0)
        if n >= limit:
            return False
        self._counts[pod] = n + 1
        return True

    def withdraw(self, model: str) -> None:
        pass

    async def release(self, pod: str) -> None:
        n = self._counts.get(pod, 0) - 1
        if n > 0:
            self._counts[pod] = n
        else:
            self._counts.pop(pod, None)

    def running(self) -> dict[str, int]:
        return dict(self._counts)

    async def forget(self, pod: str) -> None:
        self._counts.pop(pod, None)


# KEYS[1] the gateways set, KEYS[2] this gateway's hash, KEYS[3] the models wanting room (a sorted set, each
# scored with when its claim lapses), KEYS[4] the model whose waiter was admitted last.
# ARGV: prefix, pod, limit, ttl ms, gateway id, model ('' : none, a plain check), '1' for a waiter, want ms,
# '1' when this gateway has more waiters of the model (an admitted waiter's claim is then kept, else dropped).
# Returns 1 (admitted), 0 (the pod is full) or -1 (not this request's turn: another model's, or someone waits).
_ACQUIRE = """
local model, waiter, want = ARGV[6], ARGV[7] == '1', tonumber(ARGV[8])
local now = 0
local function claim()  -- the model wants room: its claim to a turn, renewed
  redis.call('ZADD', KEYS[3], now + want, model)
  redis.call('PEXPIRE', KEYS[3], want * 10)
end
if model ~= '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local names, others = {model}, false
  for _, m in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
    if m ~= model then table.insert(names, m); others = true end
  end
  local turn = true
  if waiter then
    if others then
      table.sort(names)
      local last = redis.call('GET', KEYS[4]) or ''
      local nxt = names[1]
      for _, m in ipairs(names) do
        if m > last then nxt = m; break end
      end
      turn = nxt == model
    end
  elseif redis.call('ZCARD', KEYS[3]) > 0 then
    turn = false
  end
  if not turn then
    claim()
    return -1
  end
end
local total = 0
local ids = redis.call('SMEMBERS', KEYS[1])
for _, id in ipairs(ids) do
  local key = ARGV[1] .. 'gw:' .. id
  if redis.call('EXISTS', key) == 1 then
    total = total + tonumber(redis.call('HGET', key, ARGV[2]) or '0')
  elseif id ~= ARGV[5] then
    redis.call('SREM', KEYS[1], id)
  end
end
if total >= tonumber(ARGV[3]) then
  if waiter and model ~= '' then claim() end
  return 0
end
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[1], ARGV[5])
if waiter and model ~= '' then
  redis.call('SET', KEYS[4], model, 'PX', 60000)
  if ARGV[9] == '1' then
    claim()
  else
    redis.call('ZREM', KEYS[3], model)
  end
end
return 1
"""
# KEYS[1] this gateway's hash; ARGV: pod, how many requests ended
_RELEASE = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], -tonumber(ARGV[2]))
if n <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return n
"""
_FAILED = (RedisError, OSError, asyncio.TimeoutError)  # Redis down, unreachable, or slower than the client's timeout


class RedisLimiter(BackgroundLoop):
    """Counts shared by gateway replicas; this gateway's part expires `ttl_s` after it stops heartbeating."""

    releases_without_wait = False  # a round trip to Redis

    def __init__(self, client: Any, gateway_id: str = "", *, prefix: str = "kvgate:{admit}:", ttl_s: float = 5.0,
                 want_s: float = 0.5) -> None:
        self._r = client
        self._want_ms = int(want_s * 1000)  # a model's claim to a turn lapses unless a waiter of it renews it
        self.gateway_id = gateway_id or f"{socket.gethostname()}-{os.getpid()}"
        self._prefix = prefix
        self._set = f"{prefix}gateways"
        self._key = f"{prefix}gw:{self.gateway_id}"
        self._turn_keys = [f"{prefix}wanting", f"{prefix}turn"]
        self._ttl_ms = int(ttl_s * 1000)
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._mine: dict[str, int] = {}  # requests this gateway admitted and that still run, by pod
        self._local: dict[str, int] = {}  # of those, admitted while Redis failed: not counted there
        self._owed: dict[str, int] = {}  # releases Redis missed, paid by the heartbeat
        self._task: asyncio.Task | None = None
        self._withdrawing: set[asyncio.Task] = set()
        self.errors = 0
        self._failing = False

    async def try_acquire(self, pod: str, limit: int, model: str = "", waiter: bool = False,
                          more: bool = False) -> bool | None:
        if not self._failing:
            try:
                ok = await self._acquire(keys=[self._set, self._key, *self._turn_keys],
                                         args=[self._prefix, pod, limit, self._ttl_ms, self.gateway_id, model,
                                               "1" if waiter else "0", self._want_ms, "1" if more else "0"])
            except _FAILED as e:
                self._failed("admit", e)
            else:
                if ok == 1:
                    self._mine[pod] = self._mine.get(pod, 0) + 1
                return None if ok == -1 else ok == 1
        # Redis failing (the heartbeat probes it; requests do not wait on it meanwhile): the limit holds over
        # this replica's own requests.
        if self._mine.get(pod, 0) >= limit:
            return False
        self._local[pod] = self._local.get(pod, 0) + 1
        self._mine[pod] = self._mine.get(pod, 0) + 1
        return True

    async def release(self, pod: str) -> None:
        if self._mine.get(pod, 0) <= 0:
            return
        self._mine[pod] -= 1
        if self._local.get(pod, 0) > 0:  # one Redis never counted (which request ends does not matter)
            self._local[pod] -= 1
            return
        if not self._failing:
            try:
                await self._release(keys=[self._key], args=[pod, 1])
                return
            except _FAILED as e:
                self._failed("release", e)
        self._owed[pod] = self._owed.get(pod, 0) + 1

    def running(self) -> dict[str, int]:
        return {p: n for p, n in self._mine.items() if n > 0}

    @property
    def failing(self) -> bool:
        """Whether this replica admits on its own requests alone, Redis having failed (until it answers)."""
        return self._failing

    @property
    def shares_turns(self) -> bool:
        return not self._failing

    def withdraw(self, model: str) -> None:
        if self._failing:
            return
        task = asyncio.get_running_loop().create_task(self._withdraw(model))
        self._withdrawing.add(task)  # kept until done (the loop holds tasks weakly)
        task.add_done_callback(self._withdrawing.discard)

    async def _withdraw(self, model: str) -> None:
        try:
            await self._r.zrem(self._turn_keys[0], model)
        except _FAILED as e:
            self._failed("withdraw", e)

    async def forget(self, pod: str) -> None:
        for counts in (self._mine, self._local, self._owed):
            counts.pop(pod, None)
        try:
            await self._r.hdel(self._key, pod)
        except _FAILED as e:
            self._failed("forget", e)

    def _failed(self, op: str, e: BaseException) -> None:
        self.errors += 1
        if not self._failing:
            self._failing = True
            log.warning("admission: Redis failed (%s: %s): this replica admits on its own requests alone, the "
                        "limit holding per replica, until Redis answers", op, str(e) or type(e).__name__)

    def _answered(self) -> None:
        if self._failing:
            self._failing = False
            log.info("admission: Redis answers again: admission counts are shared")

    async def _run(self) -> None:  # the heartbeat, the releases Redis missed, and the probe while it fails
        while True:
            await asyncio.sleep(self._ttl_ms / 5000)
            try:
                if self._failing:
                    await self._r.ping()
                for pod, n in list(self._owed.items()):
                    await self._release(keys=[self._key], args=[pod, n])
                    left = self._owed.get(pod, 0) - n  # more missed meanwhile, or the pod forgotten
                    if left > 0:
                        self._owed[pod] = left
                    else:
                        self._owed.pop(pod, None)
                if any(self._mine.values()):
                    await self._r.pexpire(self._key, self._ttl_ms)
            except _FAILED as e:
                self._failed("heartbeat", e)
            else:
                self._answered()


class Admission:
    def __init__(self, limiter: Limiter, *, max_running: int, max_wait_s: float = 3.0, retry_after_s: int = 1,
                 deleted_keep_s: float = 30.0, poll_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limiter = limiter
        self.max_running = max_running
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self.deleted_keep_s = deleted_keep_s
        self.poll_s = poll_s  # a waiter also tries again this often: room freed by another gateway wakes no one here
        self._clock = clock
        self._queues: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()  # model -> waiters
        self._deleted: dict[str, float] = {}  # pod -> when it left discovery
        self._woken: set[asyncio.Future] = set()  # waiters woken by a release here, not done trying yet
        # model -> its waiters here, in its queue or out of it trying (a waiter tries out of the queue, and the
        # next one, then the queue's first, may try meanwhile): what `more` and `withdraw` are told
        self._waiters: dict[str, int] = {}
        self._outcomes = {"at_once": 0, "after_wait": 0, "timed_out": 0, "cancelled": 0}  # by how admit() ended
        self._wait_s = 0.0  # seconds waited in all, by the requests that waited

    @property
    def releases_without_wait(self) -> bool:
        """Whether `release` completes without waiting (its limiter's counts live in this process)."""
        return self.limiter.releases_without_wait

    @property
    def waiting(self) -> int:
        """Requests waiting for room here: in their model's queue, or out of it asking the limiter."""
        return sum(self._waiters.values())

    def stats(self) -> dict:
        """Requests by how admission ended for them (at_once, after_wait, timed_out: answered 429, cancelled:
        the client left while it waited), those waiting now, the seconds waited in all (wait_seconds), and the
        limiter's failed operations of its shared store (limiter_errors) and whether it decides on this
        replica's own counts now, that store having failed (limiter_failing)."""
        return {**self._outcomes, "waiting": self.waiting, "wait_seconds": self._wait_s,
                "limiter_errors": self.limiter.errors, "limiter_failing": self.limiter.failing}

    async def _try(self, candidates: Sequence[str], model: str, waiter: bool) -> str | None:
        more = self._waiters.get(model, 0) > (1 if waiter else 0)  # waiters of the model here besides this one
        for pod in candidates:
            got = await self.limiter.try_acquire(pod, self.max_running, model, waiter, more)
            if cancel_swallowed():
                if got:
                    await self.limiter.release(pod)
                raise asyncio.CancelledError
            if got:
                return pod
            if got is None:  # not this request's turn, on any pod
                return None
        return None

    async def admit(self, model: str, candidates: Sequence[str]) -> str | None:
        """The first candidate pod with room (counted as running until `release`), waiting in the
        model's queue while none has; None after `max_wait_s`."""
        # No overtaking anyone waiting, here or (a limiter that shares turns) at another replica.
        got = await self._try(candidates, model, waiter=False) if not self.waiting else None
        if got is not None:
            self._outcomes["at_once"] += 1
            return got
        began = self._clock()
        deadline = began + self.max_wait_s
        queue = self._queues.setdefault(model, deque())
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue.append(fut)
        self._waiters[model] = self._waiters.get(model, 0) + 1
        admitted = False
        try:
            while True:
                left = deadline - self._clock()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(asyncio.shield(fut), min(left, self.poll_s))
                except asyncio.TimeoutError:
                    # Room may have been freed by another gateway (its releases wake no one here):
                    # the waiter whose turn it is tries, as if woken (where the limiter shares the
                    # turns, the first waiter of each model: the limiter says whose turn it is); not
                    # while a waiter woken here tries (that room is the woken one's: racing it for it
                    # would take its model's turn).
                    if fut not in self._woken and (self._woken or not self._may_try(model, fut)):
                        continue
                    if fut not in self._woken:
                        self._queues.move_to_end(model)
                if fut in queue:
                    queue.remove(fut)
                got = await self._try(candidates, model, waiter=True)
                self._woken.discard(fut)
                if got is not None:
                    self._outcomes["after_wait"] += 1
                    admitted = True
                    return got
                fut = loop.create_future()  # another gateway took the room: first in line for the next
                queue = self._queues.setdefault(model, deque())  # (emptied and dropped meanwhile, maybe)
                queue.appendleft(fut)
                self._queues.move_to_end(model, last=False)  # and the turn stays this model's
        except asyncio.CancelledError:
            self._outcomes["cancelled"] += 1
            raise
        finally:
            self._woken.discard(fut)
            if fut in queue:
                queue.remove(fut)
            self._drop_empty(model)
            self._wait_s += self._clock() - began
            left = self._waiters[model] - 1
            if left:
                self._waiters[model] = left
            else:
                del self._waiters[model]
                if not admitted:  # its last waiter here gave up
                    self.limiter.withdraw(model)
        self._outcomes["timed_out"] += 1
        return None

    def _may_try(self, model: str, fut: asyncio.Future) -> bool:
        if self.limiter.shares_turns:
            return self._queues[model][0] is fut
        return self._my_turn(model, fut)

    def _my_turn(self, model: str, fut: asyncio.Future) -> bool:
        first = next((m for m, q in self._queues.items() if q), None)
        return first == model and self._queues[model][0] is fut

    def _drop_empty(self, model: str) -> None:
        q = self._queues.get(model)
        if q is not None and not q:
            del self._queues[model]

    async def release(self, pod: str) -> None:
        await self.limiter.release(pod)
        self.wake()

    def wake(self) -> None:
        """One waiter gets to try again: the next model in turn with a waiter, its oldest."""
        for _ in range(len(self._queues)):
            model, queue = next(iter(self._queues.items()))
            self._queues.move_to_end(model)  # the next release goes to the next model
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)
                    self._woken.add(fut)
                    return

    # --- discovery -----------------------------------------------------------------------------
    def pods_removed(self, names: Sequence[str]) -> None:
        now = self._clock()
        for n in names:
            self._deleted[n] = now

    def pods_added(self, names: Sequence[str]) -> list[str]:
        """Pods back within the window keep their counts; returns those."""
        now = self._clock()
        kept = [n for n in names if n in self._deleted and now - self._deleted[n] <= self.deleted_keep_s]
        for n in names:
            self._deleted.pop(n, None)
        return kept

    async def expire_deleted(self) -> list[str]:
        """Pods gone longer than the window: their counts are dropped (returns them)."""
        now = self._clock()
        gone = [n for n, at in self._deleted.items() if now - at > self.deleted_keep_s]
        for n in gone:
            del self._deleted[n]
            await self.limiter.forget(n)
        return gone
