"""Running-request counts per pod: in-process, or shared by every gateway replica through Redis.

Redis layout (one hash slot, so a Redis Cluster works too):
  `{prefix}gw:<gateway id>`  hash pod -> running count of that gateway, plus field `~`;
                             PEXPIRE ttl, rewritten whole by its gateway at each change
                             and every heartbeat, so a dead gateway's counts vanish within ttl.
  `{prefix}gateways`         set of gateway ids (readers drop ids whose hash expired).
  `{prefix}changed`          channel: every write publishes its gateway's id there.
A pod's total is this gateway's exact local count plus the sum over the other live
gateways, read by one Lua script and cached for `read_max_age_s`; the script that writes this
gateway's state answers with the same sums, so every write refreshes the view too. With `notified`,
a gateway listens on the channel and reads only when another gateway has written since its view was
read (or the view is two heartbeats old, or it is not listening): most picks find nothing changed (a
request that begins and ends within the write interval is never written), and a read costs a replica
as much CPU as a third of its decision (docs/BENCHMARKS.md, path). A gateway of a version that does
not publish is then read at the others' heartbeats, at most two heartbeats late.

The local count changes synchronously at the pick, so the next pick on this gateway sees it
before any I/O. Writes never wait on the request path (a background writer publishes changes and
heartbeats); with `write_interval_s` a change goes out that long after it was made, with every
change made meanwhile, and not at all when they undid each other (a request that began and ended
within it). With `stale_ok_s` > 0 reads do not wait either once a view exists: a pick whose view is
older than `read_max_age_s` but within `stale_ok_s` uses what it has and asks the background writer
for a view: after its interval, the write then due brings it back, or else a read of its own. Redis is never awaited for longer than `op_timeout_s`; after a failure a
circuit breaker keeps it out of the request path for a back-off, and the next successful
write republishes the whole local state, so counts reconverge when Redis returns.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import sys
import time
from typing import Protocol
from urllib.parse import urlsplit

from routing.background import follow_channel
from routing.metrics import RoutingMetrics
from routing.state.resp import LeanRedis, shared_state_client

log = logging.getLogger(__name__)


class RunningCounts(Protocol):
    def add(self, pod: str, delta: int) -> None:
        """Change this gateway's count for `pod` now (synchronously); shared asynchronously."""
        ...

    def totals(self) -> dict[str, int]:
        """Running requests per pod over every live gateway, as known now (never blocks)."""
        ...

    async def refresh(self) -> None:
        """Bring other gateways' counts up to date if the cached view is stale; bounded in time."""
        ...

    def local(self) -> dict[str, int]: ...

    def snapshot(self) -> dict: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class LocalCounts:
    """In-process counts: the single-gateway default when no Redis URL is configured."""

    def __init__(self) -> None:
        self._local: dict[str, int] = {}

    def add(self, pod: str, delta: int) -> None:
        _apply(self._local, pod, delta)

    def totals(self) -> dict[str, int]:
        return dict(self._local)

    def local(self) -> dict[str, int]:
        return dict(self._local)

    async def refresh(self) -> None:
        return None

    def snapshot(self) -> dict:
        return {"backend": "local", "local": self.local(), "totals": self.totals()}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _apply(counts: dict[str, int], pod: str, delta: int) -> None:
    value = counts.get(pod, 0) + delta
    if value < 0:
        log.warning("running count of %s would go below zero (%d); clamped", pod, value)
        value = 0
    if value:
        counts[pod] = value
    else:
        counts.pop(pod, None)


def redact_url(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = f":{parts.port}" if parts.port else ""
    return parts._replace(netloc=f"{user}:***@{host}{port}").geturl()


def cert_verification_error(e: BaseException | None) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind `e` (redis-py wraps it in its ConnectionError)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, ssl.SSLCertVerificationError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def describe_cert_failure(url_shown: str, err: ssl.SSLCertVerificationError) -> str:
    """What failed and why, in words a user can act on."""
    text = (f"TLS certificate verification of Redis {url_shown} failed: {err.verify_message} "
            f"(OpenSSL verify code {err.verify_code}). Check the server's certificate and the CA given in "
            f"KVGATE_REDIS_URL's ssl_ca_certs option")
    if sys.version_info >= (3, 13):
        text += (" (this Python verifies with X.509 strict checks: a CA needs basicConstraints CA:TRUE marked "
                 "critical, keyUsage keyCertSign and a subject key identifier; a server certificate a "
                 "subjectAltName and an authority key identifier)")
    return text + "."


def default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# The other gateways' counts, summed (ARGV[1]: the hashes' key prefix, ARGV[2]: this gateway's id): the reply of
# both scripts below, so that every write brings the view back with it.
_SUM_OTHERS = """
local ids = redis.call('SMEMBERS', KEYS[#KEYS])
local sums = {}
local live = 0
for _, id in ipairs(ids) do
  if id ~= ARGV[2] then
    local h = redis.call('HGETALL', ARGV[1] .. id)
    if #h == 0 then
      redis.call('SREM', KEYS[#KEYS], id)
    else
      live = live + 1
      for i = 1, #h, 2 do
        if h[i] ~= '~' then sums[h[i]] = (sums[h[i]] or 0) + tonumber(h[i + 1]) end
      end
    end
  end
end
local out = {live}
for k, v in pairs(sums) do out[#out + 1] = k; out[#out + 1] = v end
return out
"""

_READ = _SUM_OTHERS

# This gateway's whole state (ARGV[3]: the key TTL in ms; ARGV[4]: the channel told of the write; ARGV[5..]: pod,
# count pairs), then the others' sums. The PUBLISH may fail (a Redis user without channel rights: Redis 7's default
# for a new ACL user): pcall, so the write stands and the others read by age, as without the channel.
_SYNC = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], '~', '1', unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[2])
redis.pcall('PUBLISH', ARGV[4], ARGV[2])
""" + _SUM_OTHERS


class RedisCounts:
    """Counts shared through Redis; see the module docstring for the layout and failure model."""

    def __init__(self, url: str, gateway_id: str = "", *, key_prefix: str = "kvgate:{running}:",
                 ttl_s: float = 5.0, heartbeat_s: float = 1.0, read_max_age_s: float = 0.005,
                 op_timeout_s: float = 0.1, backoff_min_s: float = 0.2, backoff_max_s: float = 2.0,
                 stale_ok_s: float = 0.0, write_interval_s: float = 0.0, notified: bool = False,
                 metrics: RoutingMetrics | None = None) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"KVGATE_REDIS_URL: expected redis://, rediss:// or unix://, got {redact_url(url)!r}")
        if heartbeat_s >= ttl_s:
            raise ValueError("heartbeat must be shorter than the key TTL")
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.gateway_id = gateway_id or default_gateway_id()
        self._url_shown = redact_url(url)
        # kvgate's own client where it serves the URL (every call below runs under asyncio.timeout(op_timeout_s)),
        # else redis-py's (TLS, other options)
        self._redis = shared_state_client(url, decode=True, connect_timeout_s=op_timeout_s * 2,
                                          socket_timeout=op_timeout_s * 2, retry=Retry(NoBackoff(), 0))
        self._sync = self._redis.register_script(_SYNC)
        self._read = self._redis.register_script(_READ)
        self._key = f"{key_prefix}gw:{self.gateway_id}"
        self._gw_prefix = f"{key_prefix}gw:"
        self._set_key = f"{key_prefix}gateways"
        self._channel = f"{key_prefix}changed"
        self._url = url
        self._ttl_ms = int(ttl_s * 1000)
        self._ttl_s = ttl_s
        self._heartbeat_s = heartbeat_s
        self._max_age = read_max_age_s
        # A pick may use a view up to this old while a fresher one is read in the background: no Redis
        # round trip on the request path once a view exists (0: every stale pick waits for the read).
        self._stale_ok = max(stale_ok_s, read_max_age_s)
        # A change goes out this long after it was made: the changes of a burst of picks and releases go out
        # as one write (other gateways see them at most this much later), not one per change, and after
        # the answer that made the first of them.
        self._write_interval = write_interval_s
        self._timeout = op_timeout_s
        self._backoff_min, self._backoff_max = backoff_min_s, backoff_max_s
        self._metrics = metrics or RoutingMetrics()

        self._local: dict[str, int] = {}
        self._others: dict[str, int] = {}
        self._others_at = float("-inf")
        self._live_others = 0
        self._reading: asyncio.Future | None = None
        self._dirty = asyncio.Event()
        # With `write_interval_s`: the timer that sets _dirty that long after the first change not yet gone out, so the
        # writer wakes once per write (not at the change and again after sleeping out the interval)
        self._due: asyncio.TimerHandle | None = None
        self._writer: asyncio.Task | None = None
        # One write in flight at a time: each rewrites the whole hash from the state it took, and two
        # writes on two pooled connections could land out of order (the older state last).
        self._write_lock = asyncio.Lock()
        # What the last successful write left in Redis, and when: a change undone before it went out needs no write.
        self._written: dict[str, int] | None = None
        self._written_at = float("-inf")
        self._want_view = False  # a pick found the view stale: the writer reads one if it has nothing to write
        # With `notified`: the other gateways' writes heard on the channel (a count), the count the view was read
        # at, and whether the channel is listened to now (else views are read by age, as without).
        self._notified = notified
        self._heard = 0
        self._view_heard = -1
        self.listening = False
        self._listener: asyncio.Task | None = None
        self._down_until = 0.0
        self._backoff = backoff_min_s
        self.up = False
        self.failures = 0
        self._cert_reported = False
        self._closing = False

    # -- the request path ------------------------------------------------------------------

    def add(self, pod: str, delta: int) -> None:
        _apply(self._local, pod, delta)
        self._write_soon()

    def _write_soon(self) -> None:
        """The writer goes `write_interval_s` from the first change not yet gone out (every change made meanwhile goes
        with it, after the answer that made the first), at once without an interval or before the writer runs."""
        if self._write_interval <= 0 or self._writer is None:
            self._dirty.set()
        elif self._due is None:
            self._due = asyncio.get_running_loop().call_later(self._write_interval, self._due_now)

    def _due_now(self) -> None:
        self._due = None
        self._dirty.set()

    def local(self) -> dict[str, int]:
        return dict(self._local)

    def totals(self) -> dict[str, int]:
        out = dict(self._local)
        if time.monotonic() - self._others_at <= self._ttl_s:  # older than a key TTL: unknown, not "still busy"
            for pod, n in self._others.items():
                out[pod] = out.get(pod, 0) + n
        return out

    async def refresh(self) -> None:
        now = time.monotonic()
        age = now - self._others_at
        if age <= self._max_age or now < self._down_until:
            return
        if self.listening and self._heard == self._view_heard and age <= 2 * self._heartbeat_s:
            return  # no other gateway has written since this view was read
        if age <= self._stale_ok and self._writer is not None and self._write_interval > 0:
            # For the next picks, from the background writer once its interval is over (after this pick's answer):
            # with the write then due, else by a read of its own.
            self._want_view = True
            self._write_soon()
            return
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_others())
        if age <= self._stale_ok:
            return  # the read lands for the next picks; this one uses the view it has
        reading = self._reading
        # shield: a cancelled pick must not cancel the read other picks share
        await asyncio.shield(reading)

    async def _read_others(self) -> None:
        heard = self._heard  # a write heard from now on may have missed this read
        try:
            async with asyncio.timeout(self._timeout):  # not wait_for: no task of its own per read
                reply = await self._read(keys=[self._set_key], args=[self._gw_prefix, self.gateway_id])
            self._take_view(reply, heard)
            self._ok()
        except Exception as e:
            self._failed("read", e)
        finally:
            self._reading = None

    def _take_view(self, reply: list, heard: int) -> None:
        """The other gateways' counts as a script answered them: [live gateways, pod, count, pod, count, ...],
        read after `heard` of their writes were heard."""
        self._view_heard = heard
        self._live_others = int(reply[0])
        self._others = {reply[i]: int(reply[i + 1]) for i in range(1, len(reply), 2) if int(reply[i + 1]) > 0}
        self._others_at = time.monotonic()

    # -- the background writer (heartbeat) -------------------------------------------------------

    async def _write_loop(self) -> None:
        while not self._closing:
            if not self._dirty.is_set():
                # asyncio.timeout, not wait_for (3.11's can swallow a cancel when the event is already set), nor a
                # task of Event.wait under asyncio.wait: that made three more callbacks at every pick's wake-up
                try:
                    async with asyncio.timeout(self._heartbeat_s):
                        await self._dirty.wait()
                except TimeoutError:
                    pass
            if self._closing:
                return
            delay = self._down_until - time.monotonic()
            if delay > 0:
                await asyncio.sleep(min(delay, self._heartbeat_s))
                if time.monotonic() < self._down_until:
                    continue
            self._dirty.clear()
            want_view, self._want_view = self._want_view, False
            if self._local == self._written and time.monotonic() - self._written_at < self._heartbeat_s:
                # back to what Redis holds (requests that began and ended within the interval): nothing to write
                if want_view and time.monotonic() - self._others_at > self._max_age:
                    await self._read_others()
                continue
            await self.flush()

    async def flush(self) -> bool:
        """Publish this gateway's whole local state now, and take the other gateways' counts from the answer;
        False if Redis did not take it. A write already in flight (the background writer's) lands first: the
        state taken here is never overwritten by an older one."""
        async with self._write_lock:
            state = dict(self._local)
            args: list[str | int] = [self._gw_prefix, self.gateway_id, self._ttl_ms, self._channel]
            for pod, n in state.items():
                args += [pod, n]
            heard = self._heard
            try:
                async with asyncio.timeout(self._timeout):  # not wait_for: no task of its own per write
                    reply = await self._sync(keys=[self._key, self._set_key], args=args)
            except Exception as e:
                self._written = None
                self._dirty.set()
                self._failed("write", e)
                return False
            self._written, self._written_at = state, time.monotonic()
            self._take_view(reply, heard)
            self._ok()
            return True

    def _ok(self) -> None:
        if not self.up:
            log.info("running counts: Redis %s reachable, shared counts on", self._url_shown)
        self.up = True
        self._cert_reported = False
        self._down_until = 0.0  # a concurrent op may have failed meanwhile; this success ends the back-off
        self._backoff = self._backoff_min
        self._metrics.redis_up.set(1)

    def _failed(self, op: str, e: Exception) -> None:
        self.failures += 1
        self._metrics.redis_errors.labels(op).inc()
        cert = cert_verification_error(e)
        if cert is not None and not self._cert_reported:  # a configuration error: said once, plainly
            self._cert_reported = True
            log.error("running counts: %s Local counts until it is fixed.", describe_cert_failure(self._url_shown, cert))
        elif self.up or self.failures == 1:
            log.warning("running counts: Redis %s %s failed (%s: %s); local counts for %.1fs",
                        self._url_shown, op, type(e).__name__, e, self._backoff)
        self.up = False
        self._metrics.redis_up.set(0)
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._backoff_max)

    # -- the channel (with `notified`) -------------------------------------------------------------

    async def _listen(self) -> None:
        """Counts the other gateways' writes published on the channel; on any failure stops listening (views
        are read by age meanwhile) and subscribes again a heartbeat later."""
        # a client of its own: the other one's socket timeout would end every wait for a message
        client = shared_state_client(self._url, decode=True, connect_timeout_s=self._timeout * 2)
        try:
            await follow_channel(client, self._channel, self._heard_write, retry_s=self._heartbeat_s,
                                 subscribed=self._listening_now, ended=self._not_listening,
                                 subscribe_timeout_s=max(1.0, self._timeout * 10))
        finally:
            self.listening = False
            try:
                await client.aclose()
            except Exception:  # noqa: BLE001
                pass

    def _heard_write(self, gateway_id: str) -> None:
        if gateway_id != self.gateway_id:
            self._heard += 1

    def _listening_now(self) -> None:
        self.listening = True
        self._heard += 1  # whatever was written before: the next pick reads once

    def _not_listening(self, e: BaseException | None) -> None:
        self.listening = False
        self._heard += 1
        if e is not None:
            log.debug("running counts: listening on %s stopped (%s: %s)", self._channel, type(e).__name__, e)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the heartbeat; does not wait for Redis (a dead Redis only means local counts)."""
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_loop(), name=f"kvgate-counts-{self.gateway_id}")
            self._dirty.set()
        if self._notified and self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name=f"kvgate-counts-heard-{self.gateway_id}")

    async def close(self, *, unregister: bool = True) -> None:
        """Stop the heartbeat; with `unregister`, delete this gateway's counts now instead of at expiry."""
        self._closing = True
        if self._due is not None:
            self._due.cancel()
            self._due = None
        if self._writer is not None:
            self._dirty.set()
            self._writer.cancel()
            await asyncio.wait([self._writer], timeout=self._timeout * 4 + self._heartbeat_s)
            self._writer = None
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait([self._listener], timeout=self._timeout * 4 + self._heartbeat_s)
            self._listener = None
        if unregister and self.up:
            try:
                await asyncio.wait_for(self._redis.delete(self._key), self._timeout)
            except Exception:
                pass
        try:
            await self._redis.aclose()
        except Exception:
            pass

    @property
    def others_read_at(self) -> float | None:
        """time.monotonic() of the last successful read of the other gateways' counts (None: never)."""
        return self._others_at if self._others_at > float("-inf") else None

    def snapshot(self) -> dict:
        return {
            "backend": "redis",
            "redis": self._url_shown,
            "client": "kvgate" if isinstance(self._redis, LeanRedis) else "redis-py",  # routing.state.resp
            "gateway_id": self.gateway_id,
            "redis_up": self.up,
            "other_gateways": self._live_others,
            "listening": self.listening,
            "others_age_s": round(time.monotonic() - self._others_at, 3) if self._others_at > 0 else None,
            "local": self.local(),
            "totals": self.totals(),
        }


def build_counts(redis_url: str, gateway_id: str = "", *, metrics: RoutingMetrics | None = None,
                 **redis_options) -> RunningCounts:
    """Redis-shared counts for a URL, in-process counts for an empty one."""
    if not redis_url:
        return LocalCounts()
    return RedisCounts(redis_url, gateway_id, metrics=metrics, **redis_options)
