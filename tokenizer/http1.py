"""A small HTTP/1.1 client over kept-alive connections to one engine: the engine's `/tokenize` (tokenizer.remote),
its `/metrics` (routing.state.engine_metrics) and a disaggregated request's prefill leg (plugin.pd), where httpx
cost ten times the work.

Why: in process, warm, httpx took ~600 us of the client's CPU for a GET of a simulated engine's 2.7 KB /metrics
page and ~900 us for a POST to its /tokenize (the answer's JSON parse aside); a request over a bare connection,
~45-60 us (docs/BENCHMARKS.md, request). Every replica scrapes every engine every second, and a model without
local tokenizer files is tokenized remotely on every request's path.

What it speaks: one request at a time per connection, Host and Content-Length sent, to `http://` engines only
(TLS, proxies and credentials stay httpx's: tokenizer.remote uses this only where none applies); a reply of
HTTP/1.0 or 1.1 whose body is Content-Length bytes, chunked, or all until the close; gzip if the server sends it
anyway (no request asks for it). A connection is kept open between requests (at most `max_connections` at once,
one idle longer than `idle_s` closed), and a request is sent once more on a new connection when a kept one turns out
closed before any reply began (the server's idle timeout). No redirects or cookies.
"""
from __future__ import annotations

import asyncio
import time
import zlib
from typing import NamedTuple, Sequence

MAX_BODY = 32 << 20  # a reply larger than this is refused (a misdirected URL, a runaway exporter)
HEAD_LIMIT = 64 << 10  # the longest reply head (status line and headers) read


class HttpError(Exception):
    """No reply was read: the reason says what the server did."""


class ConnectFailed(HttpError):
    """Nothing accepted the connection (or not within the timeout): the engine is down or not there yet."""


class _ClosedBeforeReply(Exception):
    """The server closed a kept-alive connection before answering (its idle timeout): open another, once."""


class Reply(NamedTuple):
    status: int
    headers: dict[bytes, bytes]  # names lowercased; a repeated header, its last value
    body: bytes


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def closed(self) -> bool:
        return self.reader.at_eof() or self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class Http1Client:
    """Requests to `host:port` over at most `max_connections` kept-alive connections."""

    def __init__(self, host: str, port: int, *, max_connections: int = 1, idle_s: float = 4.0) -> None:
        self.host, self.port = host, port
        self._authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._idle_s = idle_s

    def head(self, method: str, path: str, content_type: str = "", length: int | None = None,
             accept: str = "*/*", extra: Sequence[tuple[str, str]] = ()) -> bytes:
        """A request's head, to be made once and sent with every request of its kind (`extra`: more headers).
        ValueError for a path or header that would end a line (CR, LF) or is not latin-1."""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self._authority}", f"Accept: {accept}", "User-Agent: kvgate"]
        if content_type:
            lines.append(f"Content-Type: {content_type}")
        if length is not None:
            lines.append(f"Content-Length: {length}")
        lines += [f"{name}: {value}" for name, value in extra]
        if any("\r" in line or "\n" in line for line in lines):
            raise ValueError("a request line or header with CR or LF in it")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def request(self, head: bytes, body: bytes = b"", *, timeout_s: float) -> Reply:
        """`head` (see `head`; its Content-Length `body`'s) and `body` in one write, and the whole reply, whatever
        its status; HttpError (ConnectFailed when nothing accepted a connection within the timeout) or
        TimeoutError otherwise."""
        connecting = False
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(timeout_s), self._slots:
                conn = self._take_idle()
                reused = conn is not None
                if conn is None:
                    connecting = True
                    conn = await self._connect()
                    connecting = False
                try:
                    reply, keep = await _exchange(conn, head + body)
                except _ClosedBeforeReply:
                    conn.close()
                    if not reused:
                        raise HttpError("the connection closed before a reply") from None
                    connecting = True  # closed by the server as the request went out: once more, on a new one
                    conn = await self._connect()
                    connecting = False
                    try:
                        reply, keep = await _exchange(conn, head + body)
                    except _ClosedBeforeReply:
                        raise HttpError("the connection closed before a reply") from None
                if keep:
                    conn.idle_since = time.monotonic()
                    self._idle.append(conn)
                else:
                    conn.close()
                conn = None
                return reply
        except TimeoutError:
            if connecting:
                raise ConnectFailed(f"connecting to {self._authority}: timed out") from None
            raise
        finally:
            if conn is not None:  # failed or cancelled midway: its state unknown
                conn.close()

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to have been closed meanwhile
            if now - conn.idle_since < self._idle_s and not conn.closed():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=HEAD_LIMIT)
        except OSError as e:
            raise ConnectFailed(f"connecting to {self._authority}: {e}") from e
        return _Connection(reader, writer)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


async def _exchange(conn: _Connection, data: bytes) -> tuple[Reply, bool]:
    """The request sent, its reply read: (the reply, whether the connection may carry another)."""
    reader = conn.reader
    try:
        conn.writer.write(data)
        head = await reader.readuntil(b"\r\n\r\n")
    except ConnectionError:
        raise _ClosedBeforeReply() from None
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise _ClosedBeforeReply() from None
        raise HttpError("the connection closed in the reply's headers") from None
    except asyncio.LimitOverrunError:
        raise HttpError(f"a reply's headers over {HEAD_LIMIT} bytes") from None
    status, *lines = head[:-4].split(b"\r\n")
    try:
        version, code_text = status.split(None, 2)[:2]
        code = int(code_text)
    except ValueError:
        raise HttpError(f"not an HTTP reply: {status[:80]!r}") from None
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HttpError(f"not an HTTP/1 reply: {status[:80]!r}")
    headers: dict[bytes, bytes] = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    length, chunked = None, headers.get(b"transfer-encoding", b"").lower().endswith(b"chunked")
    if b"content-length" in headers and not chunked:
        try:
            length = int(headers[b"content-length"])
        except ValueError:
            raise HttpError(f"bad Content-Length {headers[b'content-length'][:40]!r}") from None
        if not 0 <= length <= MAX_BODY:
            raise HttpError(f"a reply of {length} bytes (at most {MAX_BODY})")
    connection = headers.get(b"connection", b"").lower()
    keep = b"keep-alive" in connection if version == b"HTTP/1.0" else b"close" not in connection
    encoding = headers.get(b"content-encoding", b"").lower()
    if encoding not in (b"", b"identity", b"gzip", b"x-gzip"):
        raise HttpError(f"a reply in {encoding[:40]!r} encoding")
    try:
        if code in (204, 304) or 100 <= code < 200:
            body = b""
        elif chunked:
            body = await _chunked(reader)
        elif length is not None:
            body = await reader.readexactly(length)
        else:
            body = await _to_close(reader)
            keep = False
    except asyncio.IncompleteReadError:
        raise HttpError("the connection closed in the reply's body") from None
    if encoding in (b"gzip", b"x-gzip"):
        inflate = zlib.decompressobj(wbits=31)
        try:
            body = inflate.decompress(body, MAX_BODY)
        except zlib.error as e:
            raise HttpError(f"a gzip reply that is not one: {e}") from None
        if inflate.unconsumed_tail:
            raise HttpError(f"a reply over {MAX_BODY} bytes once inflated")
    return Reply(code, headers, body), keep


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        try:
            size = int((await reader.readline()).split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise HttpError("a bad chunk size") from None
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers, unread
                pass
            return b"".join(parts)
        total += size
        if size < 0 or total > MAX_BODY:
            raise HttpError(f"a reply over {MAX_BODY} bytes")
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)  # the chunk's CRLF


async def _to_close(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while len(body) <= MAX_BODY:
        more = await reader.read(MAX_BODY + 1 - len(body))
        if not more:
            return body
        body += more
    raise HttpError(f"a reply over {MAX_BODY} bytes")
