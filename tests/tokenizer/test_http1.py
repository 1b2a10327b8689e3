"""Http1Client, the engines' HTTP (scrapes, /tokenize): GETs and POSTs over kept-alive connections to a real HTTP
server (aiohttp: plain, chunked, gzip; several at once), and to raw loopback servers that misbehave as engines and
proxies can: closing a kept-alive connection while idle, closing before a reply, never answering, an HTTP/1.0 reply
read to its close, a reply too large, one that is not HTTP. Each failure is an error that says so, and the next
request works again."""
from __future__ import annotations

import asyncio
import gzip

import pytest
from aiohttp import web

from helpers import serve_app
from tokenizer.http1 import MAX_BODY, ConnectFailed, Http1Client, HttpError


class PageClient:
    """GETs of /metrics as the scrapes make them: the body of a 200, HttpError for another status."""

    def __init__(self, host: str, port: int, path: str = "/metrics") -> None:
        self.client = Http1Client(host, port)
        self.head = self.client.head("GET", path, accept="text/plain")

    async def get(self, timeout_s: float) -> str:
        reply = await self.client.request(self.head, timeout_s=timeout_s)
        if reply.status != 200:
            raise HttpError(f"HTTP {reply.status}")
        return reply.body.decode()

    def close(self) -> None:
        self.client.close()

PAGE = "vllm:num_requests_waiting 3\n" + "".join(f"line_{i} {i}\n" for i in range(300))


async def test_a_real_server_plain_chunked_and_gzip_over_one_kept_connection():
    peers: set = set()

    async def page(request: web.Request) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername"))
        kind = request.query.get("kind", "plain")
        if kind == "plain":
            return web.Response(text=PAGE)
        resp = web.StreamResponse()
        if kind == "gzip":
            resp.headers["Content-Encoding"] = "gzip"
            body = gzip.compress(PAGE.encode())
        else:
            resp.enable_chunked_encoding()
            body = PAGE.encode()
        await resp.prepare(request)
        for i in range(0, len(body), 1000):
            await resp.write(body[i:i + 1000])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner, port = await serve_app(app, shutdown_timeout=0.1)
    try:
        for kind in ("plain", "chunked", "gzip"):
            client = PageClient("127.0.0.1", port, f"/metrics?kind={kind}")
            try:
                assert [await client.get(2.0) for _ in range(3)] == [PAGE] * 3, kind
            finally:
                client.close()
        assert len(peers) == 3  # one connection per client, kept for its three GETs
    finally:
        await runner.cleanup()


class RawServer:
    """A loopback server answering each request line with `reply(n)` (n: the request's number, from 0), then doing
    `after(n)`: "keep", "close" (the connection) or "hang" (never answer: for the timeout)."""

    def __init__(self, reply, after=lambda n: "keep") -> None:
        self.reply, self.after = reply, after
        self.requests = 0
        self.connections = 0

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:")
                n, self.requests = self.requests, self.requests + 1
                what = self.after(n)
                if what == "hang":
                    await asyncio.sleep(30)
                if what != "close-first":
                    writer.write(self.reply(n))
                    await writer.drain()
                if what in ("close", "close-first"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes = b"page\n") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_a_connection_the_server_closed_while_idle_is_opened_again():
    async with RawServer(lambda n: ok(b"page %d\n" % n), after=lambda n: "close") as srv:
        client = PageClient("127.0.0.1", srv.port)
        for n in range(3):
            assert await client.get(2.0) == f"page {n}\n"
            await asyncio.sleep(0.05)  # the server's close arrives while the client is idle
        assert srv.connections == 3
        client.close()


async def test_a_close_as_the_request_goes_out_is_retried_once_on_a_new_connection():
    # the first connection answers once, then closes at the next request without a reply
    async with RawServer(lambda n: ok(b"page %d\n" % n), after=lambda n: "close-first" if n == 1 else "keep") as srv:
        client = PageClient("127.0.0.1", srv.port)
        assert await client.get(2.0) == "page 0\n"
        assert await client.get(2.0) == "page 2\n"  # request 1 got no reply; 2 went on a new connection
        assert srv.connections == 2
        client.close()


async def test_a_fresh_connection_closed_before_a_reply_is_an_error():
    async with RawServer(ok, after=lambda n: "close-first") as srv:
        client = PageClient("127.0.0.1", srv.port)
        with pytest.raises(HttpError, match="closed before a reply"):
            await client.get(2.0)
        assert srv.connections == 1  # not retried: a fresh connection that closes is the server's answer


async def test_nothing_listening_is_connect_failed():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectFailed):
        await PageClient("127.0.0.1", port).get(2.0)


async def test_a_server_that_never_answers_times_out_and_the_next_get_works():
    async with RawServer(lambda n: ok(b"late\n"), after=lambda n: "hang" if n == 0 else "keep") as srv:
        client = PageClient("127.0.0.1", srv.port)
        with pytest.raises(TimeoutError):
            await client.get(0.2)
        assert await client.get(2.0) == "late\n"
        assert srv.connections == 2
        client.close()


@pytest.mark.parametrize("reply, error", [
    (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops", "HTTP 500"),
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1), "bytes"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx", "encoding"),
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc", "gzip"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
])
async def test_a_bad_reply_is_an_error_that_says_what_and_the_next_get_works(reply, error):
    async with RawServer(lambda n: reply if n == 0 else ok(b"fine\n")) as srv:
        client = PageClient("127.0.0.1", srv.port)
        with pytest.raises(HttpError, match=error):
            await client.get(2.0)
        assert await client.get(2.0) == "fine\n"
        client.close()


async def test_an_http_1_0_reply_without_a_length_is_read_to_its_close():
    async with RawServer(lambda n: b"HTTP/1.0 200 OK\r\n\r\nold server\n", after=lambda n: "close") as srv:
        client = PageClient("127.0.0.1", srv.port)
        assert await client.get(2.0) == "old server\n"
        assert await client.get(2.0) == "old server\n"
        assert srv.connections == 2
        client.close()


async def test_posts_at_once_share_at_most_max_connections_and_keep_them():
    peers: list = []

    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        await asyncio.sleep(0.02)
        return web.Response(body=await request.read(), headers={"Retry-After": "3"}, status=429 if
                            request.query.get("busy") else 200)

    app = web.Application()
    app.router.add_post("/tokenize", echo)
    runner, port = await serve_app(app, shutdown_timeout=0.1)
    client = Http1Client("127.0.0.1", port, max_connections=3)
    try:
        bodies = [b'{"prompt": "%d"}' % i for i in range(12)]
        replies = await asyncio.gather(*(client.request(client.head("POST", "/tokenize", "application/json", len(b)), b,
                                                        timeout_s=5.0) for b in bodies))
        assert [r.body for r in replies] == bodies and {r.status for r in replies} == {200}
        assert len(set(peers)) == 3  # three at a time, each connection kept for the next
        busy = await client.request(client.head("POST", "/tokenize?busy=1", "application/json", 2), b"{}", timeout_s=5.0)
        assert busy.status == 429 and busy.headers[b"retry-after"] == b"3" and busy.body == b"{}"
        assert len(set(peers)) == 3
    finally:
        client.close()
        await runner.cleanup()


async def test_a_connection_idle_longer_than_idle_s_is_not_used_again():
    async with RawServer(lambda n: ok(b"page %d\n" % n)) as srv:
        client = Http1Client("127.0.0.1", srv.port, idle_s=0.05)
        head = client.head("GET", "/metrics")
        assert (await client.request(head, timeout_s=2.0)).body == b"page 0\n"
        assert (await client.request(head, timeout_s=2.0)).body == b"page 1\n"
        await asyncio.sleep(0.1)
        assert (await client.request(head, timeout_s=2.0)).body == b"page 2\n"
        assert srv.connections == 2
        client.close()


def test_a_header_or_path_that_would_end_a_line_is_refused_before_anything_is_sent():
    client = Http1Client("127.0.0.1", 1)
    assert client.head("POST", "/v1/completions", "application/json", 2, extra=[("X-Request-Id", "r-1")]).endswith(
        b"Content-Length: 2\r\nX-Request-Id: r-1\r\n\r\n")
    for bad in ([("X-Request-Id", "r\r\nHost: elsewhere")], [("Authorization", "Bearer a\nb")]):
        with pytest.raises(ValueError):
            client.head("POST", "/v1/completions", extra=bad)
    with pytest.raises(ValueError):
        client.head("GET", "/metrics HTTP/1.1\r\nX: y")
    with pytest.raises(ValueError):  # not latin-1
        client.head("POST", "/x", extra=[("Authorization", "Bearer \u2603")])
