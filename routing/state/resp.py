"""A lean Redis client for the replicas' shared state: commands pipelined on one connection and channel messages
handed to a callback as they are read, RESP2 parsed by hiredis.

The counts' scripts, the prompt relay's and the watch words' publishes and the channels the replicas listen on are
most of a replica's Redis work, and at load they cost it as much CPU as its routing decisions: through redis-py's asyncio
client a script call took 90-135 us of client CPU besides the loop's wake-up and a channel message 54-59 with it
(its pool, retry and response layers, an async generator per message); here 28-35 and 26-36 (docs/BENCHMARKS.md,
request). Only what those callers use: plain redis:// and unix:// URLs with a password, a user and a db. rediss://
(TLS) and URLs with other options stay on redis-py (`lean_target` says which).

A command's reply comes back in order on its connection: a caller that stops waiting (a timeout, a cancel) closes
the connection, as redis-py does, so no later reply is matched to the wrong caller; the next command connects
again. A connection that closes fails every command waiting on it with ConnectionError.
"""
from __future__ import annotations

import asyncio
import hashlib
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis

DEFAULT_PORT = 6379


class RespError(Exception):
    """Redis answered a command with an error."""


@dataclass(frozen=True)
class Target:
    """Where and as whom to connect: host and port, or a Unix socket's path."""
    host: str = ""
    port: int = DEFAULT_PORT
    path: str = ""
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line
    db: int = 0


def lean_target(url: str) -> Target | None:
    """The Target of a redis:// or unix:// URL this client serves as redis-py would read it; None for anything else
    (rediss://, or options other than db: left to redis-py)."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query, keep_blank_values=True)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("redis", "unix") or set(query) - {"db"} or any(len(v) != 1 for v in query.values()):
        return None
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    db_text = query["db"][0] if "db" in query else ""
    if parts.scheme == "redis":
        if not parts.hostname:
            return None
        path = parts.path.strip("/")
        db_text = db_text or path
    elif not parts.path:
        return None
    try:
        db = int(db_text) if db_text else 0
    except ValueError:
        return None
    if db < 0:
        return None
    if parts.scheme == "unix":
        return Target(path=unquote(parts.path), username=username, password=password, db=db)
    return Target(host=parts.hostname or "", port=port or DEFAULT_PORT, username=username, password=password, db=db)


def shared_state_client(url: str, *, decode: bool = False, connect_timeout_s: float | None = None,
                        **redis_py_options: Any) -> Any:
    """LeanRedis where it serves the URL (connecting within `connect_timeout_s`, else 1 s), else redis-py's asyncio
    client with `redis_py_options` (and `connect_timeout_s` as its socket_connect_timeout: None, its default)."""
    target = lean_target(url)
    if target is not None:
        return LeanRedis(target, decode=decode, connect_timeout_s=connect_timeout_s or 1.0)
    from redis.asyncio import Redis
    return Redis.from_url(url, decode_responses=decode, socket_connect_timeout=connect_timeout_s, **redis_py_options)


def pack(args: tuple) -> bytes:
    """A command as RESP: an array of bulk strings (str as UTF-8, int and float as their text)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            b = a.encode()
        elif isinstance(a, (bytes, bytearray, memoryview)):
            b = bytes(a)
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            b = repr(a).encode()
        else:
            raise TypeError(f"a Redis argument is str, bytes, int or float, not {type(a).__name__}")
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Connection(asyncio.Protocol):
    """One connection: replies to the commands waiting in order, or (subscribed) messages to `on_push`."""

    def __init__(self, encoding: str | None) -> None:
        # text that is not UTF-8 (a stranger's message on a channel) read with replacement characters, not a failure
        self._reader = hiredis.Reader(encoding=encoding, errors="replace") if encoding else hiredis.Reader()
        self.waiting: deque[asyncio.Future] = deque()
        self.transport: asyncio.Transport | None = None
        self.on_push: Callable[[Any], None] | None = None
        self.closed: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            _keepalive(sock)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as e:
                self.abort(ConnectionError(f"Redis sent what is not RESP: {e}"))
                return
            if reply is False or self.closed.done():
                return
            if self.on_push is not None:
                self.on_push(reply)
            elif self.waiting:
                waiter = self.waiting.popleft()
                if not waiter.done():
                    waiter.set_result(reply)
            else:
                self.abort(ConnectionError("Redis sent a reply nothing asked for"))
                return

    def connection_lost(self, exc: Exception | None) -> None:
        error = ConnectionError(f"Redis connection lost: {exc}" if exc else "Redis closed the connection")
        self._fail(error)

    def _fail(self, error: Exception) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        if not self.closed.done():
            self.closed.set_result(error)

    def send(self, args: tuple) -> asyncio.Future:
        data = pack(args)  # before the waiter joins the queue: a command that cannot be sent takes no reply's place
        waiter = asyncio.get_running_loop().create_future()
        if self.closed.done() or self.transport is None:
            waiter.set_exception(ConnectionError("Redis connection closed"))
            return waiter
        self.waiting.append(waiter)
        self.transport.write(data)
        return waiter

    def abort(self, error: Exception | None = None) -> None:
        self._fail(error or ConnectionError("Redis connection closed"))
        if self.transport is not None:
            self.transport.abort()


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive probes after 30 s idle, every 10 s, 3 unanswered closing it: a subscription that a NAT or a
    dead host dropped without a word (an idle fleet's relay channel carries nothing for minutes) ends within a
    minute and is made again, where it would wait for a message that never comes."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    except OSError:  # a socket that takes no such option keeps the system's defaults
        pass


def _check(reply: Any) -> Any:
    if isinstance(reply, hiredis.ReplyError):
        raise RespError(str(reply))
    return reply


class LeanRedis:
    """Commands over one pipelined connection (made on first use and again after a failure), and `subscribed` for a
    channel on a connection of its own (routing.background.follow_channel keeps it subscribed). `decode`: bulk replies and messages as str (UTF-8), else bytes."""

    def __init__(self, target: Target, *, decode: bool = False, connect_timeout_s: float = 1.0) -> None:
        self.target = target
        self._encoding = "utf-8" if decode else None
        self._connect_timeout = connect_timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future | None = None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        t = self.target
        async with asyncio.timeout(self._connect_timeout):
            if t.path:
                _, conn = await loop.create_unix_connection(lambda: _Connection(self._encoding), t.path)
            else:
                _, conn = await loop.create_connection(lambda: _Connection(self._encoding), t.host, t.port)
            try:
                hello: list[asyncio.Future] = []
                if t.password is not None:
                    hello.append(conn.send(("AUTH", t.username, t.password) if t.username else ("AUTH", t.password)))
                if t.db:
                    hello.append(conn.send(("SELECT", t.db)))
                for reply in hello:
                    _check(await reply)
            except BaseException:
                conn.abort()
                raise
        return conn

    async def _connection(self) -> _Connection:
        if self._conn is not None and not self._conn.closed.done():
            return self._conn
        if self._connecting is None:  # one connect shared by the commands that arrive meanwhile
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            conn: _Connection = await asyncio.shield(connecting)
            self._conn = conn
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None
        return conn

    async def call(self, *args: Any) -> Any:
        """One command's reply; RespError if Redis refused it, ConnectionError (or OSError) if it never came."""
        conn = await self._connection()
        waiter = conn.send(args)
        try:
            return _check(await waiter)
        except asyncio.CancelledError:
            if waiter.cancelled():  # its reply would reach whoever asks next: this connection is done with
                conn.abort()
            raise

    async def publish(self, channel: str, data: bytes | str) -> int:
        return await self.call("PUBLISH", channel, data)

    async def delete(self, *keys: str) -> int:
        return await self.call("DEL", *keys)

    def register_script(self, text: str) -> "LeanScript":
        return LeanScript(self, text)

    async def subscribed(self, channel: str, on_message: Callable[[Any], None], *,
                         confirmed: Callable[[], None], timeout_s: float | None = None) -> None:
        """One subscription to `channel` on a connection of its own, each message handed to `on_message` as it
        is read, `confirmed()` once Redis confirmed it; returns never: raises what ended it (ConnectionError
        when Redis closed it, TimeoutError when no confirmation came within `timeout_s`, or what `on_message`
        raised). routing.background.follow_channel subscribes again."""
        conn = await self._open()
        try:
            confirmation = asyncio.get_running_loop().create_future()

            def pushed(reply: Any) -> None:
                if not isinstance(reply, list) or len(reply) != 3:
                    return
                kind = reply[0]
                if kind in (b"message", "message"):
                    try:
                        on_message(reply[2])
                    except Exception as e:  # noqa: BLE001 - as with redis-py: the subscription ends with it
                        conn.abort(e)
                elif kind in (b"subscribe", "subscribe") and not confirmation.done():
                    confirmation.set_result(None)

            conn.on_push = pushed
            assert conn.transport is not None
            conn.transport.write(pack(("SUBSCRIBE", channel)))
            await asyncio.wait([confirmation, conn.closed], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not confirmation.done():
                raise (conn.closed.result() if conn.closed.done()
                       else TimeoutError(f"Redis did not confirm the subscription to {channel}"))
            confirmed()
            raise await conn.closed
        finally:
            conn.abort()

    async def aclose(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self._conn is not None:
            self._conn.abort()
            self._conn = None


class LeanScript:
    """A Lua script called by its SHA1, sent whole once if Redis does not know it (redis-py's Script, lean)."""

    def __init__(self, client: LeanRedis, text: str) -> None:
        self._client = client
        self._text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list) -> Any:
        try:
            return await self._client.call("EVALSHA", self.sha, len(keys), *keys, *args)
        except RespError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
        return await self._client.call("EVAL", self._text, len(keys), *keys, *args)
