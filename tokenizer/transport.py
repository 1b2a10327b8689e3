"""The HTTP transport of the remote tokenizer: httpx's public transport interface over httpcore's public
connection pools, whose connections send each request in one write.

OneWriteTransport is an httpx.AsyncBaseTransport over an httpcore pool (direct, or through one proxy) built
with a network backend that holds a request's headers and body until the client reads, then sends them
together (_OneWrite). environment_mounts() reads HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY the way
httpx does for a client that trusts the environment, and returns them as httpx mounts of such transports:
httpx reads no proxies itself once a client is given a transport. Only public httpx and httpcore names are
used, so a new release of either can change how fast a request goes out, not whether it does.
"""
from __future__ import annotations

import ipaddress
import ssl
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx

# httpcore's exceptions and the httpx ones its callers catch, most specific first: the first match is raised.
_EXCEPTIONS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextmanager
def _as_httpx_errors() -> Iterator[None]:
    """httpcore's exceptions raised as their httpx counterparts, as httpx's own transport does."""
    try:
        yield
    except Exception as e:
        for core, mapped in _EXCEPTIONS:
            if isinstance(e, core):
                raise mapped(str(e)) from e
        raise


class _OneWrite(httpcore.AsyncNetworkStream):
    """Holds what httpcore writes until it next reads (or closes): a request's headers and its body, which
    httpcore writes apart, then go out in one send. On loopback under load each send costs about as much as
    the rest of the call (it runs the engine's receive path), and an HTTP/1.1 client always reads after it
    writes a request."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._pending: list[bytes] = []

    async def _flush(self, timeout: float | None) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            await self._stream.write(data, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        await self._flush(timeout)
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._pending.append(buffer)

    async def aclose(self) -> None:
        self._pending.clear()
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        await self._flush(timeout)  # a proxy's CONNECT has been answered by now: nothing is pending
        return _OneWrite(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _OneWriteBackend(httpcore.AsyncNetworkBackend):
    """`backend`'s connections, each wrapped in _OneWrite."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return _OneWrite(await self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return _OneWrite(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _ResponseStream(httpx.AsyncByteStream):
    """An httpcore response body as an httpx stream, its errors raised as httpx's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors():
            async for chunk in self._stream:
                yield chunk

    async def aclose(self) -> None:
        with _as_httpx_errors():
            await self._stream.aclose()


def _core_url(url: httpx.URL) -> httpcore.URL:
    return httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path)


class OneWriteTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over an httpcore pool, direct or through `proxy`, whose connections send each request in one
    write. `network_backend` is the one under the pool (anyio's by default: kvgate runs on asyncio)."""

    def __init__(self, limits: httpx.Limits, *, ssl_context: ssl.SSLContext | None = None,
                 proxy: httpx.Proxy | None = None, network_backend: httpcore.AsyncNetworkBackend | None = None) -> None:
        backend = _OneWriteBackend(network_backend if network_backend is not None else httpcore.AnyIOBackend())
        ssl_context = ssl_context if ssl_context is not None else httpx.create_ssl_context()
        pool: dict[str, Any] = dict(
            ssl_context=ssl_context, max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
            http1=True, http2=False, network_backend=backend,
        )
        self._pool: httpcore.AsyncConnectionPool
        if proxy is None:
            self._pool = httpcore.AsyncConnectionPool(**pool)
        elif proxy.url.scheme in ("http", "https"):
            self._pool = httpcore.AsyncHTTPProxy(
                proxy_url=_core_url(proxy.url), proxy_auth=proxy.raw_auth, proxy_headers=proxy.headers.raw,
                proxy_ssl_context=proxy.ssl_context, **pool,
            )
        else:  # socks5, socks5h: httpx.Proxy accepts no other scheme
            self._pool = httpcore.AsyncSOCKSProxy(proxy_url=_core_url(proxy.url), proxy_auth=proxy.raw_auth, **pool)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        core_request = httpcore.Request(
            method=request.method, url=_core_url(request.url), headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,  # "timeout" among them, read by httpcore as httpx's own transport has it
        )
        with _as_httpx_errors():
            response = await self._pool.handle_async_request(core_request)
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_ResponseStream(response.stream), extensions=response.extensions)

    async def aclose(self) -> None:
        with _as_httpx_errors():
            await self._pool.aclose()


def _bypass_pattern(host: str) -> str:
    """The httpx mount pattern of one NO_PROXY entry, by curl's rules: an address or `localhost` exactly, a
    name with every subdomain (`example.com` and `.example.com` both cover www.example.com), or a URL as it is."""
    if "://" in host:
        return host
    address = host.split("/")[0]  # 10.0.0.0/8 is kept whole, as httpx keeps it
    for kind, pattern in ((ipaddress.IPv4Address, "all://{}"), (ipaddress.IPv6Address, "all://[{}]")):
        try:
            kind(address)
        except ValueError:
            continue
        return pattern.format(host)
    return f"all://{host}" if host.lower() == "localhost" else f"all://*{host}"


def environment_proxies() -> dict[str, httpx.Proxy | None]:
    """HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY (read by urllib, as httpx reads them) as httpx mount
    patterns: a proxy per scheme, None where NO_PROXY exempts a host; none at all if NO_PROXY is `*`."""
    found = urllib.request.getproxies()
    proxies: dict[str, httpx.Proxy | None] = {}
    for scheme in ("http", "https", "all"):
        url = found.get(scheme)
        if url:
            proxies[f"{scheme}://"] = httpx.Proxy(url if "://" in url else f"http://{url}")
    for host in (h.strip() for h in found.get("no", "").split(",")):
        if host == "*":
            return {}
        if host:
            proxies[_bypass_pattern(host)] = None
    return proxies


def environment_mounts(limits: httpx.Limits, ssl_context: ssl.SSLContext) -> dict[str, httpx.AsyncBaseTransport | None]:
    """environment_proxies() as the `mounts` of an httpx client: a OneWriteTransport per proxy; None sends a
    host the NO_PROXY exempts through the client's own transport."""
    return {
        pattern: None if proxy is None else OneWriteTransport(limits, ssl_context=ssl_context, proxy=proxy)
        for pattern, proxy in environment_proxies().items()
    }
