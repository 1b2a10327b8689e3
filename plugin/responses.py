"""Where each stored Responses API conversation lives: response id -> the pod that answered it.

vLLM keeps a response (with `store`, the default, and VLLM_ENABLE_RESPONSES_API_STORE=1) in the memory of the
engine that produced it; a later request naming it in `previous_response_id` works only there (any other
engine answers 404). kvgate learns the id from the answer it routed: the JSON body's top-level `id` or, for a
stream, the `response.created` event's `response.id` (both `resp_...`, the first such id in the body), read
from the first bytes of the response (at most READ_LIMIT of them) on the pod that served it. A request
continuing that conversation goes to that pod while it is ready; otherwise it is routed as any other (the
engine will answer 404, as vLLM would to a conversation it lost).

The map is bounded (least recently learned or used first out). Each gateway replica learns from the
responses it routed; with Redis (`SharedResponseStore`) each learned id is also written there (batched, in the
background, with a TTL), and an id a replica did not learn is looked up there (one GET under a short timeout),
so a continuation routed by either replica finds the engine.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from typing import Any

from plugin.throttle import LogThrottle
from routing.background import cancel_swallowed

log = logging.getLogger("kvgate.responses")

READ_LIMIT = 8192  # bytes of a response searched for its id
_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,200})"')


class ResponseStore:
    """Response id -> pod name, bounded to `limit` entries."""

    __slots__ = ("limit", "_pods")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the response id map needs room for at least one id")
        self.limit = limit
        self._pods: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: str, pod: str) -> None:
        pods = self._pods
        pods[response_id] = pod
        pods.move_to_end(response_id)
        if len(pods) > self.limit:
            pods.popitem(last=False)

    def pod_of(self, response_id: str) -> str | None:
        """The pod this replica learned for `response_id` (no wait)."""
        pod = self._pods.get(response_id)
        if pod is not None:
            self._pods.move_to_end(response_id)
        return pod

    async def lookup(self, response_id: str) -> str | None:
        """The pod of `response_id`, wherever this store knows it from."""
        return self.pod_of(response_id)

    async def close(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._pods)


class SharedResponseStore(ResponseStore):
    """A ResponseStore whose ids are shared through Redis (`kvgate:resp:<id>` -> pod name, expiring after
    `ttl_s`): every learned id is written, in batches of what was learned meanwhile; an id not known here is
    read from there, within `timeout_s` (a slow or absent Redis means the request is routed as any other).
    Failures are counted (`errors`) and logged at most once per 10 s."""

    __slots__ = ("_redis", "_ttl_ms", "_timeout_s", "_prefix", "_pending", "_flushing", "errors", "_log",
                 "_tasks")

    def __init__(self, limit: int, redis: Any, *, ttl_s: float, timeout_s: float = 0.05,
                 prefix: str = "kvgate:resp:") -> None:
        super().__init__(limit)
        self._redis = redis
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._timeout_s = timeout_s
        self._prefix = prefix
        self._pending: dict[str, str] = {}
        self._flushing = False
        self.errors = 0
        self._log = LogThrottle(10.0)
        self._tasks: set[asyncio.Task] = set()

    def learn(self, response_id: str, pod: str) -> None:
        super().learn(response_id, pod)
        if len(self._pending) < self.limit:
            self._pending[response_id] = pod
        if not self._flushing:
            self._flushing = True
            task = asyncio.get_running_loop().create_task(self._flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, {}
                pipe = self._redis.pipeline(transaction=False)
                for rid, pod in batch.items():
                    pipe.set(self._prefix + rid, pod, px=self._ttl_ms)
                try:
                    async with asyncio.timeout(1.0):
                        await pipe.execute()
                except Exception as e:  # Redis down or slow: these ids stay known here only
                    self._failed("write", e)
                    return
        finally:
            self._flushing = False

    async def lookup(self, response_id: str) -> str | None:
        pod = self.pod_of(response_id)
        if pod is not None:
            return pod
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout_s):
                raw = await self._redis.get(self._prefix + response_id)
        except Exception as e:
            self._failed("read", e, time.monotonic() - started)
            return None
        if cancel_swallowed():  # the client left during the read, and Redis's client went on
            raise asyncio.CancelledError
        if raw is None:
            return None
        pod = raw.decode() if isinstance(raw, bytes) else str(raw)
        super().learn(response_id, pod)
        return pod

    def _failed(self, what: str, e: BaseException, waited: float | None = None) -> None:
        self.errors += 1
        after = f" after {waited * 1000:.0f} ms" if waited is not None else ""
        self._log.log(log, logging.WARNING, what, "response ids: Redis %s failed%s (%s: %s)", what, after,
                      type(e).__name__, e)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._redis.aclose()


class IdReader:
    """Finds a response's id in its first READ_LIMIT bytes, fed chunk by chunk."""

    __slots__ = ("_head", "done")

    def __init__(self) -> None:
        self._head = b""
        self.done = False

    def feed(self, chunk: bytes) -> str | None:
        """The id once found (then `done`), else None; gives up (`done`) past READ_LIMIT bytes."""
        if self.done or not chunk:
            return None
        head = self._head + chunk[:READ_LIMIT - len(self._head)]
        m = _ID.search(head)
        if m is not None:
            self.done = True
            self._head = b""
            return m.group(1).decode()
        if len(head) >= READ_LIMIT:
            self.done = True
            head = b""
        self._head = head
        return None
