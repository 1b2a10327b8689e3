"""GET one page from one engine over a kept-alive HTTP/1.1 connection: what a metrics scrape needs of HTTP.

Why not httpx: a GET of a simulated engine's 2.7 KB /metrics page cost ~600 us of the client's CPU with httpx and
~45 us over a bare connection (in process, warm; docs/BENCHMARKS.md, request). Every replica scrapes every engine
every second, so at 1,000 engines httpx alone was most of a core per replica, and in the bake-off a tenth of a
replica's CPU.

What it speaks: a GET with Host, to an `http://` engine (routing.pods.Pod.base_url: pods are never TLS); a reply
of HTTP/1.0 or 1.1 whose body is Content-Length bytes, chunked, or all until the close; gzip if the server sends it
anyway (the request does not ask for it). The connection stays open between scrapes and is opened again when the
server has closed it meanwhile (a reply that never began, once per call). No redirects, proxies or cookies.
"""
from __future__ import annotations

import asyncio
import zlib

MAX_BODY = 32 << 20  # a page larger than this is refused (a misdirected URL, a runaway exporter)
_HEAD_LIMIT = 64 << 10  # the longest reply head (status line and headers) read


class PageError(Exception):
    """The page was not fetched: the reason says what the server did."""


class ConnectFailed(PageError):
    """Nothing accepted the connection (or not within the timeout): the engine is down or not there yet."""


class _ClosedBeforeReply(Exception):
    """The server closed a kept-alive connection before answering (its idle timeout): open another, once."""


class PageClient:
    """GETs of `path` from `host:port`, one at a time, over one connection kept between them."""

    def __init__(self, host: str, port: int, path: str = "/metrics") -> None:
        self.host, self.port = host, port
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._request = (f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\n"
                         f"User-Agent: kvgate\r\n\r\n").encode("ascii")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def get(self, timeout_s: float) -> str:
        """The page's text (UTF-8; a bad byte replaced); PageError (ConnectFailed when nothing accepted the
        connection within the timeout) or TimeoutError otherwise, after which the connection is closed."""
        connecting = False
        try:
            async with asyncio.timeout(timeout_s), self._lock:
                reader, writer = self._reader, self._writer
                if reader is not None and writer is not None and (reader.at_eof() or writer.is_closing()):
                    self.close()  # the server closed it while idle: known before writing
                reused = self._writer is not None
                try:
                    if not reused:
                        connecting = True
                        await self._connect()
                        connecting = False
                    try:
                        return await self._exchange()
                    except _ClosedBeforeReply:
                        self.close()
                        if not reused:
                            raise PageError("the connection closed before a reply") from None
                    connecting = True  # closed by the server as the request went out: once more, on a new one
                    await self._connect()
                    connecting = False
                    try:
                        return await self._exchange()
                    except _ClosedBeforeReply:
                        raise PageError("the connection closed before a reply") from None
                except BaseException:
                    self.close()
                    raise
        except TimeoutError:
            if connecting:
                raise ConnectFailed(f"connecting to {self.host}:{self.port}: timed out") from None
            raise

    async def _connect(self) -> None:
        try:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=_HEAD_LIMIT)
        except OSError as e:
            raise ConnectFailed(f"connecting to {self.host}:{self.port}: {e}") from e

    async def _exchange(self) -> str:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        try:
            writer.write(self._request)
            head = await reader.readuntil(b"\r\n\r\n")
        except ConnectionError:
            raise _ClosedBeforeReply() from None
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _ClosedBeforeReply() from None
            raise PageError("the connection closed in the reply's headers") from None
        except asyncio.LimitOverrunError:
            raise PageError(f"a reply's headers over {_HEAD_LIMIT} bytes") from None
        status, *lines = head[:-4].split(b"\r\n")
        try:
            version, code_text = status.split(None, 2)[:2]
            code = int(code_text)
        except ValueError:
            raise PageError(f"not an HTTP reply: {status[:80]!r}") from None
        if version not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise PageError(f"not an HTTP/1 reply: {status[:80]!r}")
        length, chunked, gzipped = None, False, False
        close = version == b"HTTP/1.0"
        for line in lines:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise PageError(f"bad Content-Length {value[:40]!r}") from None
                if not 0 <= length <= MAX_BODY:
                    raise PageError(f"a page of {length} bytes (at most {MAX_BODY})")
            elif name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif name == b"connection":
                close = b"close" in value if version == b"HTTP/1.1" else b"keep-alive" not in value
            elif name == b"content-encoding" and value not in (b"", b"identity"):
                if value not in (b"gzip", b"x-gzip"):
                    raise PageError(f"a page in {value[:40]!r} encoding")
                gzipped = True
        try:
            if code in (204, 304) or 100 <= code < 200:
                body = b""
            elif chunked:
                body = await self._chunked(reader)
            elif length is not None:
                body = await reader.readexactly(length)
            else:
                body = await reader.read(MAX_BODY + 1)
                while len(body) <= MAX_BODY:
                    more = await reader.read(MAX_BODY + 1 - len(body))
                    if not more:
                        break
                    body += more
                if len(body) > MAX_BODY:
                    raise PageError(f"a page over {MAX_BODY} bytes")
                close = True
        except asyncio.IncompleteReadError:
            raise PageError("the connection closed in the reply's body") from None
        if close:
            self.close()
        if code != 200:
            raise PageError(f"HTTP {code}")
        if gzipped:
            inflate = zlib.decompressobj(wbits=31)
            try:
                body = inflate.decompress(body, MAX_BODY)
            except zlib.error as e:
                raise PageError(f"a gzip page that is not one: {e}") from None
            if inflate.unconsumed_tail:
                raise PageError(f"a page over {MAX_BODY} bytes once inflated")
        return body.decode("utf-8", "replace")

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            try:
                size_line = await reader.readline()
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise PageError("a bad chunk size") from None
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers, unread
                    pass
                return b"".join(parts)
            total += size
            if size < 0 or total > MAX_BODY:
                raise PageError(f"a page over {MAX_BODY} bytes")
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)  # the chunk's CRLF

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
